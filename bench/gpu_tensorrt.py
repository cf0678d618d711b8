"""TensorRT for the demo classifier: engine built from the ONNX and cached, reused by a second load, same answers
as ONNX Runtime, and TensorRT vs ONNX Runtime CUDA at batch 1 and 64.

    python bench/gpu_tensorrt.py [--cache-dir DIR]     (prints SKIP and exits 0 without a CUDA device)
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from gpu_common import ROOT, Results, require_cuda

require_cuda("TensorRT")

import numpy as np  # noqa: E402

from appliance.engine.tensor.backends import load_tensor_backend, tensorrt_unavailable_reason  # noqa: E402
from appliance.engine.tensor.tensorrt_backend import TensorRtSettings  # noqa: E402

ONNX = ROOT / "models" / "te_classifier" / "te_classifier.onnx"


def per_call_ms(backend, batch: int, reps: int = 200) -> float:
    x = np.random.default_rng(batch).normal(size=(batch, *backend.input_shape)).astype(np.float32)
    for _ in range(10):
        backend.run(x)
    t0 = time.perf_counter()
    for _ in range(reps):
        backend.run(x)
    return (time.perf_counter() - t0) / reps * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-dir", type=Path, default=None)
    args = ap.parse_args()
    res = Results("TensorRT")
    reason = tensorrt_unavailable_reason("auto")
    if not res.check(reason is None, "TensorRT usable here", reason or ""):
        res.finish()
    cache_dir = args.cache_dir or Path(tempfile.mkdtemp(prefix="trt-cache-"))
    settings = TensorRtSettings(cache_dir=cache_dir, max_batch_size=64, fp16=True)
    t0 = time.perf_counter()
    trt = load_tensor_backend(ONNX, "tensorrt", "auto", tensorrt=settings)
    first = time.perf_counter() - t0
    res.check(trt.name.startswith("tensorrt"), "backend is TensorRT", f"{trt.name} {getattr(trt, 'note', '')}")
    res.check(getattr(trt, "built_now", False), "first load built the engine", f"{first:.1f} s")
    plans = sorted(cache_dir.glob("*.plan"))
    res.check(len(plans) == 1, "one engine cached", ", ".join(p.name for p in plans))
    t0 = time.perf_counter()
    again = load_tensor_backend(ONNX, "tensorrt", "auto", tensorrt=settings)
    second = time.perf_counter() - t0
    res.check(not getattr(again, "built_now", True), "second load reused the cached engine", f"{second:.2f} s")
    ort_cuda = load_tensor_backend(ONNX, "onnxruntime", "auto")
    ort_cpu = load_tensor_backend(ONNX, "onnxruntime", "cpu")
    res.check(ort_cuda.name == "onnxruntime-cuda", "ONNX Runtime runs on CUDA", ort_cuda.name)
    x = np.random.default_rng(0).normal(size=(64, 20, 52)).astype(np.float32)
    want = ort_cpu.run(x)
    for label, b in (("tensorrt", trt), ("onnxruntime-cuda", ort_cuda)):
        got = b.run(x)
        err = float(np.abs(got - want).max())
        res.check(err < 2e-2 and (got.argmax(1) == want.argmax(1)).mean() >= 0.98, f"{label} matches ORT CPU",
                  f"max err {err:.3g}, top-1 agreement {(got.argmax(1) == want.argmax(1)).mean():.0%}")
    for batch in (1, 64):
        t_trt, t_ort = per_call_ms(trt, batch), per_call_ms(ort_cuda, batch)
        res.figure(f"classifier batch {batch}", f"tensorrt {t_trt:.3f} ms, onnxruntime-cuda {t_ort:.3f} ms, "
                                               f"speed-up {t_ort / t_trt:.2f}x (host to host, numpy in and out)")
    res.finish()


if __name__ == "__main__":
    main()
