"""Fallback models: a model that is not Ready or whose worker restarts is answered by its YAML `fallback`, the
answer's ModelVersion names the fallback's weights, the metric counts by reason and the audit record names who
answered; fallbacks that loop are refused by the configuration check."""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest

from harness import RunningAppliance
from onnx_models import affine_model
from uaclient import call, floats, run, session, status_name

from core.config import ConfigError, load_config_text


def test_fallback_answers_for_a_failed_and_for_a_restarting_model(tmp_path):
    (tmp_path / "broken.onnx").write_bytes(b"not a model")
    models = {
        "main": {"kind": "tensor", "path": str(tmp_path / "broken.onnx"), "fallback": "simple"},
        "line": {"kind": "tensor", "path": str(affine_model(tmp_path / "line.onnx")), "fallback": "simple"},
        "simple": {"kind": "tensor", "path": str(affine_model(tmp_path / "s.onnx", scale=5.0)), "version": "fb-1"},
    }
    app = RunningAppliance(tmp_path / "state", models, {"engine": {"worker_restart_backoff_s": 3.0}})
    try:
        plc = app.issue("plc", "operator")

        async def go():
            async with session(app, *plc) as c:
                r = await call(c, "main", "Infer", [floats([1, 1, 1, 1])])  # main is Failed
                assert status_name(r) == "Good"
                assert r.OutputArguments[0].Value == [6.0] * 4 and r.OutputArguments[1].Value == "fb-1"
                r = await call(c, "line", "Infer", [floats([1, 1, 1, 1])])  # line itself answers while Ready
                assert r.OutputArguments[0].Value == [3.0] * 4 and r.OutputArguments[1].Value != "fb-1"
                os.kill(app.app.services["line"].supervisor.process.pid, signal.SIGKILL)
                for _ in range(100):  # the death is seen at once; the restart waits 3 s
                    if app.app.services["line"].status().restarting:
                        break
                    time.sleep(0.01)
                r = await call(c, "line", "Infer", [floats([1, 1, 1, 1])])
                assert status_name(r) == "Good" and r.OutputArguments[1].Value == "fb-1"
        run(go())
        text = urllib.request.urlopen(app.metrics_url + "/metrics", timeout=5).read().decode()
        assert 'appliance_fallback_total{model="main",reason="not_ready"} 1.0' in text
        assert 'appliance_fallback_total{model="line",reason="restarting"} 1.0' in text
        time.sleep(0.5)  # the audit writer
        records = [json.loads(x) for x in (app.state_dir / "audit" / "audit.jsonl").read_text().splitlines()]
        infer = [r for r in records if r.get("action") == "Infer"]
        assert infer[0]["model"] == "main" and infer[0]["version"] == "fb-1"
        assert infer[0]["detail"] == "answered by fallback simple"
    finally:
        app.stop()


@pytest.mark.parametrize("models, message", [
    ("  a: {kind: tensor, path: builtin:te-classifier, fallback: b}\n"
     "  b: {kind: tensor, path: builtin:te-classifier, fallback: a}\n", "t.yaml:2: models.a.fallback: the fallbacks loop: a -> b -> a"),
    ("  a: {kind: tensor, path: builtin:te-classifier, fallback: a}\n", "t.yaml:2: models.a.fallback: expected the name of another model"),
    ("  a: {kind: tensor, path: builtin:te-classifier, fallback: c}\n"
     "  c: {kind: generative, path: builtin:smollm2}\n", "t.yaml:2: models.a.fallback: model 'c' is generative"),
])
def test_bad_fallbacks_are_refused(models, message):
    with pytest.raises(ConfigError) as err:
        load_config_text("models:\n" + models, source="t.yaml")
    assert any(e.startswith(message) for e in err.value.errors), err.value.errors
