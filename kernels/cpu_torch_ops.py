"""kernels/cpu/quant_op.cpp's operators (torch.ops.quant_cpu.*): our kernels called through torch's dispatcher, which
the compiled decode step can trace (their fake shapes are registered here). A new operator: its C++ in quant_op.cpp,
its fake here, its method on kernels/cpu_quant.py's CpuKernels."""
from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from kernels import cpu_build
from kernels.cpu_build import KernelsUnavailable

log = logging.getLogger(__name__)

_lock = threading.Lock()
_ops: list[bool] = []  # [whether torch.ops.quant_cpu is loaded], once per process


def torch_ops(build_dir: Path | None = None) -> bool:
    """Load kernels/cpu/quant_op.cpp's operators (torch.ops.quant_cpu.*) once per process; False (the reason logged
    once) where they cannot be built: the callers then reach the kernels through ctypes (slower per call)."""
    with _lock:
        if _ops:
            return _ops[0]
    try:
        path = cpu_build.find_or_build("quant_op", Path(build_dir or cpu_build.default_build_dir()))
        torch.ops.load_library(str(path))
        _register_fakes()
        ok = True
    except (KernelsUnavailable, OSError, RuntimeError) as exc:
        log.warning("our kernels' torch operators are not available (%s); calls go through ctypes", exc)
        ok = False
    with _lock:
        _ops[:] = [ok]
    return ok


def _register_fakes() -> None:
    """Shapes for tracing the compiled decode step (torch.export)."""
    @torch.library.register_fake("quant_cpu::block_matmul")
    def _(x, data, fmt, n, library, isa, exact):
        return x.new_empty(x.shape[0], n, dtype=torch.float32)

    @torch.library.register_fake("quant_cpu::block_rows")
    def _(data, fmt, n, k, ids, library, isa):
        return data.new_empty(ids.numel(), k, dtype=torch.float32)

    @torch.library.register_fake("quant_cpu::decode_attention")
    def _(q, k_cache, v_cache, slot_ids, positions, library, isa):
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2], dtype=torch.float32)
