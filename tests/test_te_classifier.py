"""The shipped Tennessee Eastman classifier: its ONNX and torch.export (.pt2) files, its data readers and its reported metrics,
checked against the real held-out TE test files."""
from __future__ import annotations

import importlib.util
import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from models import te_classifier as te
from tools.te_classifier import train as te_train

pytestmark = pytest.mark.skipif(importlib.util.find_spec("bibmon") is None,
                                reason="the TE data wheel bibmon==1.2.0 is not installed")


@pytest.fixture(scope="module")
def metrics() -> dict:
    return json.loads(te.METRICS_PATH.read_text())


@pytest.fixture(scope="module")
def session() -> ort.InferenceSession:
    return ort.InferenceSession(str(te.ONNX_PATH), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def test_windows() -> dict[int, tuple[np.ndarray, np.ndarray]]:
    return {fault: te.load_te_test_windows(fault) for fault in range(te.N_CLASSES)}


def onnx_probs(session: ort.InferenceSession, x: np.ndarray) -> np.ndarray:
    return session.run(["probabilities"], {"input": x})[0]


def test_constants_match_the_shipped_files(metrics):
    assert len(te.CLASS_NAMES) == te.N_CLASSES == 22 and len(set(te.CLASS_NAMES)) == 22
    assert te.CLASS_NAMES[0] == "normal" and te.CLASS_NAMES[1].startswith("fault01")
    assert all(name.isascii() for name in te.CLASS_NAMES)
    assert list(te.INPUT_SHAPE) == metrics["input_shape"] and list(te.OUTPUT_SHAPE) == metrics["output_shape"]
    assert metrics["class_names"] == te.CLASS_NAMES
    assert te.ONNX_PATH.stat().st_size < 2_000_000 and te.EXPORTED_PATH.stat().st_size < 2_000_000


def test_data_files_are_read_with_their_layouts():
    assert te.load_te_rows(0, test=False).shape == (500, 52)  # stored transposed on disk
    assert te.load_te_rows(7, test=False).shape == (480, 52)
    assert te.load_te_rows(7, test=True).shape == (960, 52)
    x, y = te.load_te_train_windows(4)
    assert x.shape == (480 - te.WINDOW + 1, *te.INPUT_SHAPE) and (y == 4).all()


def test_test_windows_label_by_onset_and_drop_straddlers():
    rows = te.load_te_rows(5, test=True)
    x, y = te.load_te_test_windows(5)
    n_normal = te.FAULT_ONSET_ROW - te.WINDOW + 1  # windows ending before the onset
    assert len(x) == 960 - te.WINDOW + 1 - (te.WINDOW - 1)
    assert (y[:n_normal] == 0).all() and (y[n_normal:] == 5).all()
    np.testing.assert_array_equal(x[0], rows[:te.WINDOW])  # oldest row first
    np.testing.assert_array_equal(x[n_normal], rows[te.FAULT_ONSET_ROW:te.FAULT_ONSET_ROW + te.WINDOW])
    np.testing.assert_array_equal(x[-1], rows[-te.WINDOW:])
    _, y0 = te.load_te_test_windows(0)
    assert len(y0) == 960 - te.WINDOW + 1 and (y0 == 0).all()


def test_missing_data_wheel_gives_a_clear_error(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bibmon" else real_find_spec(name, *a))
    with pytest.raises(te.TEDataMissing, match="bibmon==1.2.0"):
        te.load_te_test_windows(1)


def test_onnx_signature(session):
    (inp,), (out,) = session.get_inputs(), session.get_outputs()
    assert inp.name == "input" and inp.type == "tensor(float)"
    assert isinstance(inp.shape[0], str) and inp.shape[1:] == list(te.INPUT_SHAPE)  # dynamic batch
    assert out.name == "probabilities" and out.type == "tensor(float)" and out.shape[1:] == [te.N_CLASSES]


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_outputs_are_probabilities(session, test_windows, batch):
    x = test_windows[13][0][-batch:]
    p = onnx_probs(session, x)
    assert p.shape == (batch, te.N_CLASSES) and p.dtype == np.float32
    assert np.isfinite(p).all() and (p >= 0).all()
    np.testing.assert_allclose(p.sum(axis=1), 1.0, atol=1e-5)


def test_onnx_and_the_exported_program_agree_on_real_windows(session, test_windows):
    x = np.concatenate([test_windows[f][0][::25] for f in range(te.N_CLASSES)])
    scripted = torch.export.load(str(te.EXPORTED_PATH)).module()
    with torch.no_grad():
        ts = scripted(torch.from_numpy(x)).numpy()
    onnx_p = onnx_probs(session, x)
    assert np.abs(ts - onnx_p).max() < 1e-5
    assert (ts.argmax(axis=1) == onnx_p.argmax(axis=1)).all()


def test_accuracy_matches_metrics_json(session, test_windows, metrics):
    predicted = {f: onnx_probs(session, x).argmax(axis=1) for f, (x, _) in test_windows.items()}
    for fault, (_, y) in test_windows.items():  # every held-out file
        reported = metrics["per_test_file"][f"d{fault:02d}_te"]
        assert reported["windows"] == len(y)
        assert abs((predicted[fault] == y).mean() - reported["accuracy"]) <= 0.005, fault
    y_all = np.concatenate([y for _, y in test_windows.values()])
    p_all = np.concatenate(list(predicted.values()))
    accuracy = (p_all == y_all).mean()
    assert abs(accuracy - metrics["accuracy"]) <= 0.005
    assert accuracy > 0.5  # chance is ~1/22; the majority class (normal) alone is ~0.2
    assert (p_all[y_all == 0] != 0).mean() <= 0.05  # few false alarms on normal operation
    for fault in (1, 2, 6, 7, 14):  # step / sticking faults the literature finds easy
        assert (predicted[fault][test_windows[fault][1] == fault] == fault).mean() > 0.9, fault


def test_normalisation_is_inside_the_graph(session, test_windows):
    # Raw process values (pressures in kPa, flows in kscmh...) span several orders of magnitude.
    x, y = test_windows[6]
    assert x.max() > 1000 and x[..., 0].max() < 10
    assert (onnx_probs(session, x).argmax(axis=1) == y).mean() > 0.95
    # Feeding the same windows z-scored outside breaks the model: it expects raw values.
    z = ((x - x.mean(axis=(0, 1))) / (x.std(axis=(0, 1)) + 1e-6)).astype(np.float32)
    assert (onnx_probs(session, z).argmax(axis=1) == y).mean() < 0.5


def test_a_short_training_run_exports_agreeing_graphs(tmp_path):
    torch.set_num_threads(1)
    cfg = te_train.TrainConfig(epochs=1)
    model, info = te_train.train(cfg)
    assert model.class_bias[0].item() == info["normal_bias"] >= 0 and (model.class_bias[1:] == 0).all()
    onnx_path, ts_path = te_train.export(model, tmp_path, cfg.window)
    x = te.load_te_test_windows(8)[0][::30]
    assert te_train.export_max_diff(model, onnx_path, ts_path, x) < 1e-5


def test_the_shipped_example_window_is_a_fault_1_window(session):
    """`appliance call te-classifier --example` sends this file: one window of held-out data that the shipped
    classifier names as its fault, so a commissioning engineer sees a real answer without data of their own."""
    from appliance.cli.call import EXAMPLE_WINDOW, parse_floats
    window = np.array(parse_floats(EXAMPLE_WINDOW.read_text()), dtype=np.float32).reshape(1, *te.INPUT_SHAPE)
    held_out = te.load_te_rows(1, test=True)[te.FAULT_ONSET_ROW + 40:te.FAULT_ONSET_ROW + 40 + te.WINDOW]
    np.testing.assert_allclose(window[0], held_out, rtol=1e-5)
    assert int(onnx_probs(session, window).argmax()) == 1
