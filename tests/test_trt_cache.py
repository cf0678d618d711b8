"""TensorRT engine cache: keys, reuse, invalidation, corrupt plans; the fp16 ONNX conversion that replaces TensorRT
11's removed FP16 flag. The builder is a stand-in (no TensorRT here); the cache and the conversion are real."""
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from appliance.engine.tensor.tensorrt_backend import fp16_onnx
from appliance.engine.tensor.trt_cache import EngineCache, EngineKey, onnx_digest

ROOT = Path(__file__).resolve().parents[1]
TE_ONNX = ROOT / "models" / "te_classifier" / "te_classifier.onnx"
KEY = EngineKey(onnx_sha256=onnx_digest(b"model v1"), tensorrt_version="11.4.0.106", gpu_name="NVIDIA H100 80GB HBM3",
                fp16=True, max_batch_size=64)


class Builder:
    """Counts builds; a plan is b"PLAN:" + what it was built for, and only such bytes deserialise."""

    def __init__(self, key: EngineKey):
        self.key, self.builds = key, 0

    def build(self) -> bytes:
        self.builds += 1
        return b"PLAN:" + self.key.digest.encode()

    @staticmethod
    def deserialize(plan: bytes):
        if not plan.startswith(b"PLAN:"):
            raise RuntimeError("not a plan")
        return {"engine": plan[5:].decode()}


def test_key_changes_with_every_part_and_only_then():
    assert KEY.digest == replace(KEY).digest
    for change in [{"onnx_sha256": onnx_digest(b"model v2")}, {"tensorrt_version": "11.5.0"},
                   {"gpu_name": "NVIDIA H200"}, {"fp16": False}, {"max_batch_size": 32}]:
        assert replace(KEY, **change).digest != KEY.digest, change


def test_first_load_builds_next_start_reuses(tmp_path):
    cache, builder = EngineCache(tmp_path / "tensorrt"), Builder(KEY)
    engine, built = cache.get_or_build("te-classifier", KEY, builder.build, builder.deserialize)
    assert built and builder.builds == 1 and engine == {"engine": KEY.digest}
    plan = cache.plan_path("te-classifier", KEY)
    assert plan.read_bytes() == b"PLAN:" + KEY.digest.encode()
    assert json.loads(plan.with_suffix(".json").read_text())["gpu_name"] == "NVIDIA H100 80GB HBM3"
    assert (plan.parent.stat().st_mode & 0o777) == 0o700  # plans are executable code: owner only
    restarted = EngineCache(tmp_path / "tensorrt")  # a new process: only the files remain
    engine, built = restarted.get_or_build("te-classifier", KEY, builder.build, builder.deserialize)
    assert not built and builder.builds == 1 and engine == {"engine": KEY.digest}


def test_a_new_onnx_invalidates_and_replaces_the_old_engine(tmp_path):
    cache = EngineCache(tmp_path)
    old = Builder(KEY)
    cache.get_or_build("te-classifier", KEY, old.build, old.deserialize)
    other_model = Builder(KEY)
    cache.get_or_build("other", KEY, other_model.build, other_model.deserialize)
    new_key = replace(KEY, onnx_sha256=onnx_digest(b"model v2"))
    new = Builder(new_key)
    engine, built = cache.get_or_build("te-classifier", new_key, new.build, new.deserialize)
    assert built and engine == {"engine": new_key.digest}
    assert cache.entries("te-classifier") == [cache.plan_path("te-classifier", new_key)]
    assert not cache.plan_path("te-classifier", KEY).with_suffix(".json").exists()
    assert cache.entries("other") == [cache.plan_path("other", KEY)]  # another model's engine stays


def test_a_corrupt_plan_is_rebuilt_and_overwritten(tmp_path):
    cache, builder = EngineCache(tmp_path), Builder(KEY)
    cache.get_or_build("m", KEY, builder.build, builder.deserialize)
    cache.plan_path("m", KEY).write_bytes(b"PL")  # truncated by a power cut before atomic writes, or a bad disk
    engine, built = cache.get_or_build("m", KEY, builder.build, builder.deserialize)
    assert built and builder.builds == 2 and cache.plan_path("m", KEY).read_bytes().startswith(b"PLAN:")


def test_an_engine_that_does_not_load_after_building_is_an_error(tmp_path):
    cache = EngineCache(tmp_path)
    with pytest.raises(RuntimeError, match="just built"):
        cache.get_or_build("m", KEY, lambda: b"PLAN:x", lambda plan: None)
    assert cache.entries("m") == []  # nothing unusable is cached


def test_model_names_become_safe_file_names(tmp_path):
    cache = EngineCache(tmp_path)
    path = cache.plan_path("../../etc/passwd", KEY)
    assert path.parent == tmp_path and "/" not in path.name


def test_fp16_conversion_keeps_fp32_io_and_the_answers():
    import onnx
    import onnxruntime as ort
    converted = fp16_onnx(TE_ONNX.read_bytes())
    model = onnx.load_from_string(converted)
    float_types = {i.data_type for i in model.graph.initializer if i.data_type in (1, 10)}
    assert float_types == {onnx.TensorProto.FLOAT16}
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    x = np.random.default_rng(0).normal(size=(8, 20, 52)).astype(np.float32)
    ref = ort.InferenceSession(str(TE_ONNX), providers=["CPUExecutionProvider"])
    half = ort.InferenceSession(converted, providers=["CPUExecutionProvider"])
    want = ref.run(None, {ref.get_inputs()[0].name: x})[0]
    got = half.run(None, {half.get_inputs()[0].name: x})[0]
    assert got.dtype == np.float32 and np.abs(got - want).max() < 1e-2
    assert (got.argmax(1) == want.argmax(1)).all()


def test_tensorrt_modules_import_without_tensorrt():
    code = ("import sys, appliance.engine.tensor.tensorrt_backend, appliance.engine.tensor.backends;"
            "print('tensorrt' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
