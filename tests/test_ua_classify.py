"""Classify, Last and the classifier's alarm classes over a real server, on the demo Tennessee Eastman classifier
and held-out windows it never saw."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from asyncua import ua

from harness import RunningAppliance
from models.te_classifier import load_te_test_windows
from uaclient import call, floats, read, run, session, status_name


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    d = tmp_path_factory.mktemp("classify")
    models = {"te": {"kind": "tensor", "path": "builtin:te-classifier", "labels": "labels.txt",
                     "alarm_classes": [1, "IDV2 B composition step"], "alarm_confidence": 0.5}}
    a = RunningAppliance(d / "state", models)
    a.operator = a.issue("plc1", "operator")
    yield a
    a.stop()


def windows(fault: int, n: int, start: int) -> np.ndarray:
    x, _ = load_te_test_windows(fault)
    return x[start:start + n]


def test_classify_equals_argmax_of_infer_and_sets_last(app):
    x = np.concatenate([windows(0, 4, 0), windows(1, 4, 600), windows(6, 4, 600)])

    async def go():
        async with session(app, *app.operator) as c:
            r = await call(c, "te", "Infer", [floats(x.ravel())])
            assert status_name(r) == "Good"
            probs = np.array(r.OutputArguments[0].Value).reshape(len(x), 22)
            r = await call(c, "te", "Classify", [floats(x.ravel())])
            assert status_name(r) == "Good"
            index, label, confidence, version = [v.Value for v in r.OutputArguments]
            assert r.OutputArguments[0].VariantType == ua.VariantType.Int32
            assert index == probs.argmax(axis=1).tolist()
            assert np.allclose(confidence, probs.max(axis=1), atol=1e-6)
            assert label[0] == "normal" and all(lbl.startswith(("IDV", "normal")) for lbl in label)
            assert version == await read(c, "Models", "te", "Version")
            assert await read(c, "Models", "te", "Last", "ClassIndex") == index[-1]
            assert await read(c, "Models", "te", "Last", "Label") == label[-1]
            assert await read(c, "Models", "te", "Last", "Time") is not None
    run(go())


def test_an_alarm_class_raises_and_clears(app):
    fault1 = windows(1, 3, 700)  # three results in a row: alarm_on_results (3, the default)
    normal = windows(0, 3, 50)

    async def go():
        async with session(app, *app.operator) as c:
            r = await call(c, "te", "Classify", [floats(fault1.ravel())])
            assert r.OutputArguments[0].Value == [1, 1, 1], "held-out IDV(1) windows are classified as fault 1"
            assert await read(c, "Alarms", "IDV1 A-C feed ratio step") is True
            assert await read(c, "Alarms", "IDV2 B composition step") is False
            r = await call(c, "te", "Infer", [floats(normal.ravel())])  # Infer results drive alarms too
            assert status_name(r) == "Good"
            assert await read(c, "Alarms", "IDV1 A-C feed ratio step") is False
    run(go())


def test_drift_on_a_fault_file_raises_the_drift_alarm(tmp_path):
    models = {"te": {"kind": "tensor", "path": "builtin:te-classifier", "labels": "labels.txt",
                     "drift": {"window": 100}}}
    app = RunningAppliance(tmp_path / "state", models)
    try:
        operator = app.issue("plc", "operator")
        x = windows(6, 192, 400)  # IDV(6), A feed loss: far from normal operation

        async def go():
            async with session(app, *operator) as c:
                assert await read(c, "Models", "te", "Drift", "State") == "Ok"
                for chunk in np.split(x, 3):
                    assert status_name(await call(c, "te", "Infer", [floats(chunk.ravel())])) == "Good"
                await asyncio.sleep(0.6)  # published within 0.25 s
                assert await read(c, "Models", "te", "Drift", "State") == "Drifting"
                assert await read(c, "Models", "te", "Drift", "Score") > 2.0
                assert await read(c, "Models", "te", "Drift", "Feature")
                assert await read(c, "Models", "te", "Drift", "Since") is not None
                assert await read(c, "Alarms", "Drift", "te") is True
        run(go())
        import urllib.request
        text = urllib.request.urlopen(app.metrics_url + "/metrics", timeout=5).read().decode()
        assert 'appliance_drift_state{model="te"} 1.0' in text
        assert 'appliance_alarm_active{alarm="Drift/te"} 1.0' in text
    finally:
        app.stop()
