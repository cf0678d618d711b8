"""Tensor model service with real ONNX Runtime and torch.export (.pt2) models built in tmp_path at test time."""
from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from appliance.engine.tensor.batcher import BatchPolicy
from appliance.engine.tensor.backends import load_tensor_backend, usable_cores
from appliance.engine.tensor.service import TensorModelService
from loader.file_digest import VERSION_CHARS, content_digest
from core.errors import EngineFailure, InvalidArgument, NotReady
from appliance.metrics import Metrics

N_IN, N_OUT = 8, 4


def make_weights(seed: int, hidden: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = {"w1": rng.standard_normal((N_IN, hidden)) / 3, "b1": rng.standard_normal(hidden),
         "wh": rng.standard_normal((hidden, hidden)) / np.sqrt(hidden),
         "w2": rng.standard_normal((hidden, N_OUT)), "b2": rng.standard_normal(N_OUT)}
    return {k: v.astype(np.float32) for k, v in w.items()}


def reference(w: dict[str, np.ndarray], x: np.ndarray, layers: int = 1) -> np.ndarray:
    h = np.tanh(x @ w["w1"] + w["b1"])
    for _ in range(layers):
        h = np.tanh(h @ w["wh"])
    return h @ w["w2"] + w["b2"]


def save_onnx(path: Path, w: dict[str, np.ndarray], layers: int = 1, batch: str | int = "N") -> Path:
    """x -> tanh(x W1 + b1) -> [tanh(h Wh)] * layers -> h W2 + b2, with Wh shared so the file stays small."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["a0"]), helper.make_node("Add", ["a0", "b1"], ["a1"]),
             helper.make_node("Tanh", ["a1"], ["h0"])]
    for i in range(layers):
        nodes += [helper.make_node("MatMul", [f"h{i}", "wh"], [f"m{i}"]),
                  helper.make_node("Tanh", [f"m{i}"], [f"h{i + 1}"])]
    nodes += [helper.make_node("MatMul", [f"h{layers}", "w2"], ["o0"]), helper.make_node("Add", ["o0", "b2"], ["y"])]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, N_IN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, N_OUT])],
        [numpy_helper.from_array(v, k) for k, v in w.items()])
    _write_onnx(path, graph)
    return path


def save_log_onnx(path: Path) -> Path:
    """y = log(x): a negative input gives NaN, a zero gives -Inf."""
    graph = helper.make_graph(
        [helper.make_node("Log", ["x"], ["y"])], "log",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])])
    _write_onnx(path, graph)
    return path


def _write_onnx(path: Path, graph) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    tmp = path.with_name(path.name + ".tmp")
    onnx.save(model, str(tmp))
    os.replace(tmp, path)  # atomic, as an engineer deploying new weights should do


def save_exported(path: Path, w: dict[str, np.ndarray], embed_shapes: bool = True) -> Path:
    """An ExportedProgram (torch.export, dynamic batch); shapes in its extra files, or only in the graph."""
    import torch

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for k, v in w.items():
                self.register_buffer(k, torch.from_numpy(v.copy()))

        def forward(self, x):
            h = torch.tanh(x @ self.w1 + self.b1)
            h = torch.tanh(h @ self.wh)
            return h @ self.w2 + self.b2

    shapes = json.dumps({"input_shape": [N_IN], "output_shape": [N_OUT]})
    program = torch.export.export(Mlp(), (torch.zeros(2, N_IN),),
                                  dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=65536)},))
    torch.export.save(program, str(path), extra_files={"shapes.json": shapes} if embed_shapes else None)
    return path


def make_service(path: Path, metrics: Metrics | None = None, events: list | None = None, **kw) -> TensorModelService:
    args = dict(backend="auto", device="cpu", threads=1, version_label=None, max_samples=8,
                policy=BatchPolicy(16, 0.002, 64), metrics=metrics)
    args.update(kw)
    return TensorModelService("m", path, on_event=(lambda e, r: events.append((e, r))) if events is not None else None,
                              **args)


def later(seconds: float = 10.0) -> float:
    return time.monotonic() + seconds


# ---- backends ----

def test_onnxruntime_and_torch_export_backends_agree(tmp_path):
    w = make_weights(1)
    ort_backend = load_tensor_backend(save_onnx(tmp_path / "m.onnx", w), threads=1)
    torch_backend = load_tensor_backend(save_exported(tmp_path / "m.pt2", w), device="auto", threads=1)
    # no shapes.json: the sample shapes come from the exported graph itself
    sidecar_backend = load_tensor_backend(save_exported(tmp_path / "s.pt2", w, embed_shapes=False), "torch", "cpu")
    assert (ort_backend.name, torch_backend.name, sidecar_backend.name) == ("onnxruntime-cpu", "torch-cpu",
                                                                              "torch-cpu")
    for b in (ort_backend, torch_backend, sidecar_backend):
        assert b.input_shape == (N_IN,) and b.output_shape == (N_OUT,)
    x = np.random.default_rng(2).standard_normal((5, N_IN)).astype(np.float32)
    expected = reference(w, x)
    for b in (ort_backend, torch_backend, sidecar_backend):
        out = b.run(x)
        assert out.dtype == np.float32 and out.shape == (5, N_OUT)
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ort_backend.run(x), torch_backend.run(x), rtol=1e-4, atol=1e-5)


def test_threads_0_takes_the_thread_count_that_ran_a_full_batch_faster(tmp_path, caplog):
    """engine.threads 0 on ONNX Runtime's CPU provider: one intra-op thread or all cores, measured at load on a
    batch of the model's max_batch_size; an explicit count is taken as it is, unmeasured."""
    w = make_weights(3, hidden=64)
    path = save_onnx(tmp_path / "m.onnx", w, layers=4)
    with caplog.at_level("INFO", logger="appliance.engine.tensor.backends"):
        auto = load_tensor_backend(path, threads=0, timing_batch=16)
    x = np.random.default_rng(4).standard_normal((3, N_IN)).astype(np.float32)
    np.testing.assert_allclose(auto.run(x), reference(w, x, layers=4), rtol=1e-4, atol=1e-5)
    if usable_cores() < 2:
        assert auto.threads == 1 and auto.timing == {}
    else:
        t = auto.timing
        assert t["batch"] == 16 and t["one_thread_ms"] > 0 and t["all_cores_ms"] > 0
        assert auto.threads == (1 if t["one_thread_ms"] <= t["all_cores_ms"] else 0)
        assert "ONNX Runtime on" in caplog.text and "a batch of 16" in caplog.text
    fixed = load_tensor_backend(path, threads=2)
    assert fixed.threads == 2 and fixed.timing == {}


def test_onnx_with_batch_fixed_at_one_runs_samples_one_by_one(tmp_path):
    w = make_weights(3)
    backend = load_tensor_backend(save_onnx(tmp_path / "one.onnx", w, batch=1))
    x = np.random.default_rng(4).standard_normal((3, N_IN)).astype(np.float32)
    np.testing.assert_allclose(backend.run(x), reference(w, x), rtol=1e-4, atol=1e-5)


def test_backend_choice_errors_are_clear_and_path_free(tmp_path):
    w = make_weights(1)
    onnx_path = save_onnx(tmp_path / "m.onnx", w)
    pt_path = save_exported(tmp_path / "m.pt2", w)
    import torch
    bare_pt = tmp_path / "bare.pt2"  # a dynamic sample dimension: no fixed sample shape anywhere
    torch.export.save(torch.export.export(torch.nn.Tanh(), (torch.zeros(2, 3),), dynamic_shapes=(
        {0: torch.export.Dim("b"), 1: torch.export.Dim("n")},)), str(bare_pt))
    (tmp_path / "old.pt").write_bytes(b"PK\3\4 a TorchScript archive")
    (tmp_path / "m.bin").write_bytes(b"\0" * 16)
    (tmp_path / "bad.onnx").write_bytes(b"not a protobuf at all")
    cases = [((onnx_path, "torch"), "torch backend cannot load an ONNX model"),
             ((pt_path, "onnxruntime"), "onnxruntime backend cannot load a torch.export model"),
             ((tmp_path / "old.pt", "auto"), "TorchScript (.pt) is retired"),
             ((pt_path, "tensorrt"), "builds its engine from an ONNX model"),
             ((tmp_path / "m.bin", "auto"), "unsupported model file type '.bin'"),
             ((tmp_path / "missing.onnx", "auto"), "does not exist"),
             ((tmp_path / "bad.onnx", "auto"), "ONNX model could not be loaded"),
             ((bare_pt, "auto"), "sample shapes must be positive integers"),
             ((onnx_path, "bogus"), "unknown backend")]
    for (path, backend), expected in cases:
        with pytest.raises(EngineFailure) as info:
            load_tensor_backend(path, backend, "cpu")
        assert expected in str(info.value)
        assert str(tmp_path) not in str(info.value) and path.name not in str(info.value)


def content_version(path):
    """A tensor model's version when the YAML gives no label."""
    return content_digest(path)[:VERSION_CHARS]


def test_content_version_follows_the_bytes(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 3_000_000)
    v1 = content_version(f)
    assert len(v1) == 12 and int(v1, 16) >= 0
    assert content_version(f) == v1
    f.write_bytes(b"a" * 2_999_999 + b"b")
    assert content_version(f) != v1
    d = tmp_path / "dir"
    (d / "sub").mkdir(parents=True)
    (d / "x").write_bytes(b"1")
    (d / "sub" / "y").write_bytes(b"2")
    dv = content_version(d)
    (d / "sub" / "y").rename(d / "sub" / "z")
    assert content_version(d) != dv  # renaming a file changes the version too


# ---- service ----

def test_service_serves_onnx_and_torch_export_alike(tmp_path):
    w = make_weights(5)
    metrics = Metrics()
    x = np.random.default_rng(6).standard_normal((3, N_IN)).astype(np.float32)

    async def main():
        onnx_svc = make_service(save_onnx(tmp_path / "m.onnx", w), metrics)
        torch_svc = make_service(save_exported(tmp_path / "m.pt2", w), None, version_label="2024-06-a")
        assert onnx_svc.state == "Loading"
        await onnx_svc.start()
        await torch_svc.start()
        out_onnx, v_onnx = await onnx_svc.infer(x.reshape(-1), later())
        out_torch, v_torch = await torch_svc.infer(x.reshape(-1).astype(np.float64), later())  # Double[] too
        many = await asyncio.gather(*(onnx_svc.infer(x[i], later()) for i in range(3) for _ in range(4)))
        await onnx_svc.stop()
        await torch_svc.stop()
        return onnx_svc, torch_svc, out_onnx, v_onnx, out_torch, v_torch, many

    onnx_svc, torch_svc, out_onnx, v_onnx, out_torch, v_torch, many = asyncio.run(main())
    assert out_onnx.shape == (3 * N_OUT,) and out_onnx.dtype == np.float32
    np.testing.assert_allclose(out_onnx.reshape(3, N_OUT), reference(w, x), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out_onnx, out_torch, rtol=1e-4, atol=1e-5)
    for i, (out, _) in enumerate(many):
        np.testing.assert_allclose(out, out_onnx.reshape(3, N_OUT)[i // 4], rtol=1e-4, atol=1e-5)
    assert v_onnx == content_version(tmp_path / "m.onnx") == onnx_svc.version
    assert v_torch == "2024-06-a" == torch_svc.version
    assert (onnx_svc.backend_name, torch_svc.backend_name) == ("onnxruntime-cpu", "torch-cpu")
    assert onnx_svc.input_shape == (N_IN,) and onnx_svc.output_shape == (N_OUT,)
    assert onnx_svc.kind == "tensor" and onnx_svc.state == "Ready" and onnx_svc.failure_reason is None
    assert onnx_svc.request_count == 13 and onnx_svc.error_count == 0 and onnx_svc.last_latency_ms > 0
    assert metrics.registry.get_sample_value(
        "appliance_model_info", {"model": "m", "version": v_onnx, "backend": "onnxruntime-cpu",
                                 "weight_format": ""}) == 1
    assert metrics.registry.get_sample_value("appliance_batch_size_count", {"model": "m"}) < 13  # merged


def test_argument_validation(tmp_path):
    w = make_weights(5)

    async def main():
        svc = make_service(save_onnx(tmp_path / "m.onnx", w), max_samples=4)
        await svc.start()
        bad = {"not a multiple": np.zeros(N_IN + 1, np.float32), "empty": np.zeros(0, np.float32),
               "too many samples": np.zeros(5 * N_IN, np.float32),
               "NaN": np.r_[np.zeros(N_IN - 1), np.nan].astype(np.float32),
               "Inf": np.r_[np.zeros(N_IN - 1), np.inf].astype(np.float32),
               "2-D": np.zeros((1, N_IN), np.float32)}
        errors = {}
        with pytest.raises(InvalidArgument) as info:
            await svc.infer(["a"] * N_IN, later())
        assert info.value.kind == "type_mismatch"
        for what, arg in bad.items():
            with pytest.raises(InvalidArgument) as info:
                await svc.infer(arg, later())
            errors[what] = info.value
        ok, _ = await svc.infer(np.zeros(4 * N_IN, np.float32), later())  # exactly max_samples
        await svc.stop()
        return svc, errors, ok

    svc, errors, ok = asyncio.run(main())
    for what, err in errors.items():
        assert (err.index, err.kind, err.reason) == (0, "out_of_range", "invalid_input"), what
    assert ok.shape == (4 * N_OUT,)
    assert svc.request_count == 8 and svc.error_count == 7


def test_non_finite_model_output_is_an_engine_failure(tmp_path):
    async def main():
        svc = make_service(save_log_onnx(tmp_path / "log.onnx"))
        await svc.start()
        good, bad_nan, bad_inf = await asyncio.gather(
            svc.infer(np.array([1.0, np.e], np.float32), later()),
            svc.infer(np.array([1.0, -1.0], np.float32), later()),
            svc.infer(np.array([0.0, 1.0], np.float32), later()), return_exceptions=True)
        await svc.stop()
        return svc, good, bad_nan, bad_inf

    svc, good, bad_nan, bad_inf = asyncio.run(main())
    np.testing.assert_allclose(good[0], [0.0, 1.0], atol=1e-6)
    assert isinstance(bad_nan, EngineFailure) and isinstance(bad_inf, EngineFailure)
    assert svc.error_count == 2


def test_model_that_fails_to_load_is_failed_until_a_good_reload(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(b"\x08\x07garbage")
    events: list = []
    metrics = Metrics()

    async def main():
        svc = make_service(path, metrics, events)
        await svc.start()  # never raises
        assert svc.state == "Failed" and svc.version == ""
        with pytest.raises(NotReady):
            await svc.infer(np.zeros(N_IN, np.float32), later())
        assert metrics.registry.get_sample_value("appliance_model_ready", {"model": "m"}) == 0
        w = make_weights(9)
        save_onnx(path, w)
        version = await svc.reload()  # the engineer fixed the file
        out, v = await svc.infer(np.ones(N_IN, np.float32), later())
        await svc.stop()
        with pytest.raises(NotReady):
            await svc.infer(np.zeros(N_IN, np.float32), later())
        return svc, version, v, out, w

    svc, version, v, out, w = asyncio.run(main())
    assert events and events[0][0] == "ModelLoadFailed"
    assert "could not be loaded" in events[0][1] and str(tmp_path) not in events[0][1]
    assert version == v == content_version(path) and svc.state == "Ready" and svc.failure_reason is None
    np.testing.assert_allclose(out, reference(w, np.ones((1, N_IN), np.float32))[0], rtol=1e-4, atol=1e-5)


def test_a_refused_model_is_failed_with_the_reason_and_an_event(tmp_path):
    """What a worker does with a model it will not load (refuse, public): Failed, the reason, ModelLoadFailed."""
    events: list = []
    svc = make_service(save_onnx(tmp_path / "m.onnx", make_weights(1)), Metrics(), events)
    svc.refuse("device cuda:3 is not on this box")
    assert svc.state == "Failed" and svc.failure_reason == "device cuda:3 is not on this box"
    assert events == [("ModelLoadFailed", "device cuda:3 is not on this box")]


def test_failed_reload_keeps_the_old_weights_serving(tmp_path):
    path = tmp_path / "m.onnx"
    w = make_weights(11)
    save_onnx(path, w)
    events: list = []
    x = np.random.default_rng(12).standard_normal(N_IN).astype(np.float32)

    async def main():
        svc = make_service(path, None, events)
        await svc.start()
        before = await svc.infer(x, later())
        path.write_bytes(b"corrupt weights")  # a bad deployment
        with pytest.raises(EngineFailure) as info:
            await svc.reload()
        after = await svc.infer(x, later())
        # A model of another shape is refused too: a PLC's arrays have a fixed size.
        graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "id",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])])
        _write_onnx(path, graph)
        with pytest.raises(EngineFailure) as shape_info:
            await svc.reload()
        last = await svc.infer(x, later())
        await svc.stop()
        return svc, before, after, last, info.value, shape_info.value

    svc, before, after, last, err, shape_err = asyncio.run(main())
    assert svc.state == "Ready"
    assert before[1] == after[1] == last[1] == svc.version
    np.testing.assert_array_equal(before[0], after[0])
    np.testing.assert_array_equal(before[0], last[0])
    assert "reload failed" in str(err) and str(tmp_path) not in str(err)
    assert "change the sample shapes" in str(shape_err)
    assert [e for e, _ in events] == ["ModelReloadFailed", "ModelReloadFailed"]


def test_reload_while_requests_are_in_flight(tmp_path):
    """Each answer carries the version whose weights computed it; calls after the reload get the new weights."""
    path = tmp_path / "m.onnx"
    layers, hidden = 12, 384  # about a millisecond per batch, so batches are running while the new weights load
    w_old, w_new = make_weights(21, hidden), make_weights(22, hidden)
    save_onnx(path, w_old, layers)
    v_old = content_version(path)
    rng = np.random.default_rng(23)
    xs = [rng.standard_normal((4, N_IN)).astype(np.float32) for _ in range(96)]

    async def main():
        svc = make_service(path, policy=BatchPolicy(8, 0.001, 200))
        await svc.start()
        calls = [asyncio.ensure_future(svc.infer(x.reshape(-1), later(60))) for x in xs]
        await asyncio.wait(calls, return_when=asyncio.FIRST_COMPLETED)
        save_onnx(path, w_new, layers)
        pending_at_reload = [i for i, c in enumerate(calls) if not c.done()]
        v_new = await svc.reload()
        after = [await svc.infer(x.reshape(-1), later()) for x in xs[:4]]
        before = await asyncio.gather(*calls)
        await svc.stop()
        return v_new, pending_at_reload, before, after

    v_new, pending_at_reload, before, after = asyncio.run(main())
    assert v_new == content_version(path) != v_old
    weights = {v_old: w_old, v_new: w_new}
    for x, (out, version) in zip(xs, before):
        np.testing.assert_allclose(out.reshape(4, N_OUT), reference(weights[version], x, layers), rtol=1e-3,
                                   atol=1e-4)
    assert pending_at_reload  # the reload really happened with calls in flight
    versions_in_flight = {before[i][1] for i in pending_at_reload}
    assert v_old in versions_in_flight  # batches running during the load finished on the old weights
    # (calls still queued at the swap may get either version; the check above holds each to its tag's weights)
    for x, (out, version) in zip(xs, after):
        assert version == v_new
        np.testing.assert_allclose(out.reshape(4, N_OUT), reference(w_new, x, layers), rtol=1e-3, atol=1e-4)
