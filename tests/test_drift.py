"""Drift detection: ADWIN, PSI/KS against reference statistics, the detector's states, the committed TE reference
(reproducible from the training data) and its behaviour on held-out Tennessee Eastman files."""
from __future__ import annotations

import datetime
import importlib.util
import json

import numpy as np
import onnxruntime as ort
import pytest

from appliance.drift import Adwin, DriftDetector, DriftReferenceError, load_reference, psi, sample_features
from appliance.drift_reference import build_reference
from models import te_classifier as te

needs_data = pytest.mark.skipif(importlib.util.find_spec("bibmon") is None,
                                reason="Tennessee Eastman data (bibmon==1.2.0) not installed")
REFERENCE = te.ONNX_PATH.with_name("te_classifier.drift.json")


def test_adwin_stays_quiet_on_a_stationary_stream_and_cuts_after_a_change_in_the_mean():
    rng = np.random.default_rng(0)
    adwin = Adwin(delta=0.002)
    assert not any(adwin.update(v) for v in rng.normal(0.9, 0.03, 2000).clip(0, 1))
    changes = [i for i, v in enumerate(rng.normal(0.6, 0.03, 300).clip(0, 1)) if adwin.update(v)]
    assert changes and changes[0] < 30  # detected within 30 values of a 10-sigma drop
    assert abs(adwin.mean - 0.6) < 0.05  # the old part was dropped


def test_psi_is_zero_for_equal_proportions_and_grows_with_the_shift():
    ref = np.full((1, 10), 0.1)
    assert psi(ref, ref)[0] == pytest.approx(0.0)
    small = np.array([[0.12, 0.08] + [0.1] * 8])
    large = np.array([[0.5, 0.5] + [0.0] * 8])
    assert 0 < psi(small, ref)[0] < 0.1 < psi(large, ref)[0]


def synthetic_reference(rng, n=1000, window=50):
    features = rng.normal(0, 1, (n, 3))
    probs = np.tile([0.9, 0.1], (n, 1))
    return build_reference(features, ["a", "b", "c"], probs, [3], window=window)


@pytest.mark.parametrize("test, window", [("psi", 200), ("ks", 50)])  # PSI needs more samples (10 bins)
def test_the_detector_warms_up_stays_ok_on_reference_like_data_and_names_the_shifted_feature(test, window):
    rng = np.random.default_rng(1)
    clock_value = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    detector = DriftDetector(synthetic_reference(rng, window=window), window=window, test=test, threshold=2.0,
                             clock=lambda: clock_value)
    probs = np.tile([0.9, 0.1], (1, 1))
    for _ in range(window - 1):
        status = detector.update(rng.normal(0, 1, (1, 3)), probs)
    assert not detector.warm and (status.state, status.score) == ("Ok", 0.0)
    states = [detector.update(rng.normal(0, 1, (1, 3)), probs).state for _ in range(200)]
    assert detector.warm and states.count("Drifting") == 0
    shifted = np.column_stack([rng.normal(0, 1, window), rng.normal(3, 1, window), rng.normal(0, 1, window)])
    status = detector.update(shifted, np.tile([0.9, 0.1], (window, 1)))  # one call with `window` samples
    assert status.state == "Drifting" and status.feature == "b" and status.score > 2.0
    assert status.since == clock_value
    clock_value = clock_value + datetime.timedelta(hours=1)
    assert detector.update(shifted[:1], probs).since == datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    for _ in range(window + 20):  # back to reference-like data: Ok again once the shifted samples left the window
        status = detector.update(rng.normal(0, 1, (1, 3)), probs)
    assert status.state == "Ok" and status.since is None


def test_a_falling_confidence_alone_raises_drift_through_adwin():
    rng = np.random.default_rng(2)
    detector = DriftDetector(synthetic_reference(rng), window=50, threshold=1e9)  # inputs can never drift here
    for _ in range(300):
        detector.update(rng.normal(0, 1, (1, 3)), [[0.95, 0.05]])
    assert detector.status.state == "Ok"
    for _ in range(40):
        status = detector.update(rng.normal(0, 1, (1, 3)), [[0.55, 0.45]])
    assert status.state == "Drifting" and status.feature == "prediction confidence"


def test_no_reference_file_gives_noreference_and_a_broken_one_a_clear_error(tmp_path):
    detector = DriftDetector.from_file(tmp_path / "none.drift.json")
    assert detector.update(np.zeros((1, 3)), [[1.0]]).state == "NoReference"
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DriftReferenceError, match="cannot read the drift reference"):
        DriftDetector.from_file(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(DriftReferenceError, match="not a drift reference file"):
        load_reference(tmp_path / "other.json")


def test_sample_features_take_the_newest_row_of_a_window():
    x = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    assert sample_features(x.ravel(), [3, 4]).tolist() == [x[0, -1].tolist(), x[1, -1].tolist()]
    assert sample_features(x.ravel(), [12]).shape == (2, 12)


def test_the_committed_reference_matches_the_shipped_model_and_its_names(tmp_path):
    from appliance.drift import reference_mismatch
    reference = load_reference(REFERENCE)
    assert reference_mismatch(reference, te.ONNX_PATH) is None
    other = tmp_path / "other.onnx"
    other.write_bytes(te.ONNX_PATH.read_bytes() + b"\0")
    assert "made for other weights (te_classifier.onnx sha256 " in reference_mismatch(reference, other)
    assert reference["model_file"] == "te_classifier.onnx"
    import hashlib
    assert reference["model_sha256"] == hashlib.sha256(te.ONNX_PATH.read_bytes()).hexdigest()
    assert reference["features"][0] == "XMEAS(1)" and reference["features"][-1] == "XMV(11)"
    assert reference["sample_shape"] == list(te.INPUT_SHAPE) and len(reference["features"]) == te.N_VARIABLES
    assert sum(reference["predicted_class_distribution"]) == pytest.approx(1.0)


@needs_data
def test_the_committed_reference_is_reproduced_from_the_training_data(tmp_path):
    from tools.te_classifier.drift_reference import write_drift_reference
    written = json.loads(write_drift_reference(te.ONNX_PATH, tmp_path).read_text())
    assert_close(written, json.loads(REFERENCE.read_text()))


def assert_close(a, b, where: str = "") -> None:
    """Equal structure and text; floats equal to 1e-5 (the last digit may differ on another CPU)."""
    if isinstance(b, dict):
        assert isinstance(a, dict) and a.keys() == b.keys(), where
        for key in b:
            assert_close(a[key], b[key], f"{where}.{key}")
    elif isinstance(b, list):
        assert isinstance(a, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close(x, y, f"{where}[{i}]")
    elif isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), where
    else:
        assert a == b, where


@needs_data
def test_drift_is_raised_on_a_fault_file_and_rarely_on_normal_operation():
    """The README's figures in small: fault 1 (A/C feed ratio step) drifts within 60 samples of its onset; the
    held-out normal run drifts in under 10 % of decisions (measured 5.9 %)."""
    session = ort.InferenceSession(str(te.ONNX_PATH), providers=["CPUExecutionProvider"])

    def states(fault):
        x = te.sliding_windows(te.load_te_rows(fault, test=True))
        probs = session.run(["probabilities"], {"input": x})[0]
        detector = DriftDetector.from_file(REFERENCE)  # the defaults: ks, window 100, threshold 2
        out = []
        for i in range(len(x)):
            status = detector.update(x[i].ravel(), probs[i])  # one Infer call per process sample, flat floats
            out.append(status.state if detector.warm else "Warmup")
        return np.array(out), np.arange(te.WINDOW - 1, te.WINDOW - 1 + len(x))

    s, last_row = states(1)
    drifting_rows = last_row[s == "Drifting"]
    assert not (drifting_rows < te.FAULT_ONSET_ROW).any()
    assert drifting_rows.min() - te.FAULT_ONSET_ROW <= 60
    s, _ = states(0)
    decided = s != "Warmup"
    assert (s[decided] == "Drifting").mean() < 0.10


def test_the_vectorised_per_feature_search_equals_searchsorted_per_feature():
    from appliance.drift import PerFeatureTables
    rng = np.random.default_rng(3)
    tables = [np.sort(rng.normal(i, 1 + i, 9)) for i in range(6)] + [np.array([5.0]), np.round(np.sort(
        rng.normal(0, 1, 11)), 1)]  # one constant feature, one quantized with repeated edges
    search = PerFeatureTables([t.tolist() for t in tables])
    on_edges = np.array([t[3] for t in tables[:6]] + [5.0, 0.0])  # values equal to an edge
    for row in [rng.normal(0, 5, len(tables)) for _ in range(500)] + [on_edges]:
        expected = [np.searchsorted(t, v, side="right") for t, v in zip(tables, row)]
        assert search.searchsorted_right(row).tolist() == expected


def test_a_detector_is_built_from_the_models_yaml_and_refuses_a_reference_of_other_weights(tmp_path):
    import shutil

    from core.config import demo_config, load_config_text
    model = demo_config().models["te-classifier"]
    detector = DriftDetector.for_model(model)
    assert (detector.window, detector.test, detector.threshold) == (100, "ks", 2.0)
    assert detector.status.state == "Ok" and detector.mismatch is None
    assert DriftDetector.for_model(load_config_text(
        "models:\n  te: {kind: tensor, path: builtin:te-classifier}\n").models["te"]) is None  # drift off
    (tmp_path / "m.onnx").write_bytes(te.ONNX_PATH.read_bytes() + b"\0")  # other weights, the old reference
    shutil.copy(REFERENCE, tmp_path / "m.drift.json")
    other = load_config_text("models:\n  te: {kind: tensor, path: m.onnx, drift: {window: 50}}\n",
                             base_dir=tmp_path).models["te"]
    detector = DriftDetector.for_model(other)
    assert detector.status.state == "NoReference" and "made for other weights" in detector.mismatch
