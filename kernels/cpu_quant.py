"""Our CPU quantized matmuls as callables: one ISA's library in one activation mode (`CpuKernels`), loaded through
ctypes (`library_at`) or, where its operators are built, through torch's dispatcher (kernels/cpu_torch_ops.py). The
libraries come from kernels/cpu_build.py; which ISAs this CPU runs from kernels/cpu_isa.py.

Each library has two modes (`activations`): int8 (activations quantized per block of 32, llama.cpp's scheme) and
float32 (the exact path: weights widened to fp32 in registers). See kernels/cpu/quant_kernels.h. Where a library
cannot be had, `KernelsUnavailable` says why (no compiler, the CPU lacks the instructions, the build failed), and
the caller says so in the model's Backend.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels import cpu_build, cpu_layout
from kernels.cpu_build import KernelsUnavailable
from kernels.cpu_isa import ISA_CAP_ENV, NEEDS, cpu_info
from kernels.cpu_torch_ops import torch_ops

log = logging.getLogger(__name__)

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL] = {}  # by path
_logged: set[str] = set()

ACTIVATIONS = ("int8", "float32")


def library_at(path: str) -> ctypes.CDLL:
    """The library at path, loaded once per process (the compiled decode step's ops name it by its path, which,
    unlike its address, is the same in the next process, which loads the step's package)."""
    with _lock:
        lib = _libs.get(path)
        if lib is None:
            lib = ctypes.CDLL(path)
            p, i32 = ctypes.c_void_p, ctypes.c_int
            for isa in cpu_build.ISAS:
                if Path(path).name.startswith(f"quant_{isa}-"):
                    getattr(lib, f"{isa}_matmul").argtypes = [i32, i32, p, i32, i32, p, i32, p, i32]
                    getattr(lib, f"{isa}_rows").argtypes = [i32, p, i32, i32, p, i32, p]
                    getattr(lib, f"{isa}_quantize").argtypes = [p, i32, i32, p, p, p]
            _libs[path] = lib
        return lib


@dataclass(frozen=True)
class CpuKernels:
    """One ISA's library in one activation mode: what a quantized linear layer multiplies with."""
    isa: str
    activations: str  # "int8" | "float32"
    path: str  # the built library (the compiled decode step's custom op names it)
    lib: ctypes.CDLL = field(compare=False, repr=False)
    op: bool = False  # torch.ops.quant_cpu is loaded: calls go through torch's dispatcher, not ctypes

    @property
    def label(self) -> str:
        return f"{self.isa}/{self.activations}"

    def with_activations(self, activations: str) -> "CpuKernels":
        return CpuKernels(self.isa, activations, self.path, self.lib, self.op)

    def matmul(self, x: torch.Tensor, data: torch.Tensor, fmt: str, n: int) -> torch.Tensor:
        """x (rows, K) float32 contiguous @ W^T, W (n, K) in format fmt laid out in `data` -> (rows, n)."""
        if self.op:
            return torch.ops.quant_cpu.block_matmul.default(x, data, cpu_layout.FORMATS[fmt].code, n, self.path,
                                                            self.isa, self.activations == "float32")
        return matmul(self.path, self.isa, self.activations == "float32", x, data, fmt, n)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
        """(N, n_heads * head_dim) float32: each query row of q (N, n_heads, head_dim) over its slot's cached positions
        0..positions[r] (kernels/cpu/quant_attention.h; caches (slots, n_kv, positions, head_dim) float32 or bfloat16).
        Through the C++ operator only (`op`)."""
        return torch.ops.quant_cpu.decode_attention.default(q, k_cache, v_cache, slot_ids, positions, self.path,
                                                            self.isa)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """h (rows, dim) float32 += delta (in place, where given); returns RMSNorm(h) * weight (kernels/cpu/
        quant_eltwise.h). Through the C++ operator only (`op`)."""
        return torch.ops.quant_cpu.add_rms_norm.default(h, delta, weight, eps, self.path, self.isa)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(rows, inter) float32: SiLU(gate) * up of gate_up (rows, 2 * inter). Through the C++ operator only."""
        return torch.ops.quant_cpu.silu_mul.default(gate_up, self.path, self.isa)

    def rows(self, data: torch.Tensor, fmt: str, n: int, k: int, ids: torch.Tensor) -> torch.Tensor:
        """float32 (len(ids), k): rows ids of W, gguf's numbers exactly."""
        if self.op:
            return torch.ops.quant_cpu.block_rows.default(data, cpu_layout.FORMATS[fmt].code, n, k, ids, self.path,
                                                          self.isa)
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), k, dtype=torch.float32)
        rc = getattr(self.lib, f"{self.isa}_rows")(cpu_layout.FORMATS[fmt].code, data.data_ptr(), n, k,
                                                   ids.data_ptr(), ids.numel(), out.data_ptr())
        if rc != 0:
            raise ValueError(f"rows of a {fmt} ({n}, {k}) matrix: bad ids or shape ({rc})")
        return out


def matmul(path: str, isa: str, exact: bool, x: torch.Tensor, data: torch.Tensor, fmt: str, n: int) -> torch.Tensor:
    """The library call (also what the compiled step's custom op runs)."""
    lib = library_at(path)
    rows, k = x.shape
    y = torch.empty(rows, n, dtype=torch.float32)
    rc = getattr(lib, f"{isa}_matmul")(cpu_layout.FORMATS[fmt].code, 1 if exact else 0, x.data_ptr(), rows, k,
                                       data.data_ptr(), n, y.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"{isa} matmul failed ({rc}) for a ({rows}, {k}) input and a {fmt} ({n}, {k}) matrix")
    return y


def kernels(isa: str, activations: str = "int8", build_dir: Path | None = None) -> CpuKernels:
    """The library of one ISA in one activation mode; KernelsUnavailable (with the reason) where it cannot run."""
    if os.environ.get("APPLIANCE_CPU_KERNELS", "1") == "0":
        raise KernelsUnavailable("our CPU kernels are switched off (APPLIANCE_CPU_KERNELS=0)")
    if isa not in cpu_build.ISA_FLAGS:
        raise KernelsUnavailable(f"no kernels for ISA {isa!r} (ours: {', '.join(cpu_build.ISAS)})")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}")
    build_dir = Path(build_dir) if build_dir else cpu_build.default_build_dir()
    info = cpu_info(build_dir)
    if isa not in info.isas and not info.stands_in(isa):
        missing = sorted(NEEDS[isa] - info.features)
        masked = f" or hidden by {ISA_CAP_ENV}={info.cap}" if info.cap else ""
        raise KernelsUnavailable(f"the CPU lacks {isa} ({', '.join(missing)} not reported by cpuid{masked})")
    if info.stands_in(isa):
        with _lock:
            first = isa not in _logged
            _logged.add(isa)
        if first:
            log.info("%s, the same instruction and bits", info.stand_in_text(isa))
    path = str(cpu_build.find_or_build(info.library_stem(isa), build_dir))
    try:
        lib = library_at(path)
    except OSError as exc:
        raise KernelsUnavailable(f"loading {Path(path).name} failed: {exc}") from exc
    return CpuKernels(isa, activations, path, lib, torch_ops(build_dir))


def best(activations: str = "int8", build_dir: Path | None = None) -> CpuKernels:
    """The first ISA of ISAS this CPU runs (tests and benchmarks; the engine measures, see loader/path_choice)."""
    reasons = []
    for isa in cpu_build.ISAS:
        try:
            return kernels(isa, activations, build_dir)
        except KernelsUnavailable as exc:
            reasons.append(f"{isa}: {exc}")
            if "compiler" in str(exc) or "x86-64" in str(exc):
                break
    raise KernelsUnavailable("; ".join(reasons))


def library(build_dir: Path | None = None, activations: str = "float32") -> CpuKernels | None:
    """The best of our kernels here (`best`), by default in the exact mode (fp32 activations: what the kernels
    before the integer ones computed), or None with the reason logged once: where callers (tests, benchmarks) only
    need to know whether our kernels run."""
    try:
        return best(activations, build_dir)
    except KernelsUnavailable as exc:
        with _lock:
            first = str(exc) not in _logged
            _logged.add(str(exc))
        if first:
            log.warning("our CPU quantized kernels are not available: %s", exc)
        return None


def quantize_activations(k: CpuKernels, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int8 (rows, K), d (rows, K / 32), half sums (rows, K / 16)) as the kernels quantize x (tests)."""
    rows, kk = x.shape
    x = x.float().contiguous()
    q = torch.empty(rows, kk, dtype=torch.int8)
    d = torch.empty(rows, kk // 32, dtype=torch.float32)
    s = torch.empty(rows, kk // 16, dtype=torch.int32)
    rc = getattr(k.lib, f"{k.isa}_quantize")(x.data_ptr(), rows, kk, q.data_ptr(), d.data_ptr(), s.data_ptr())
    if rc != 0:
        raise ValueError(f"cannot quantize a ({rows}, {kk}) input")
    return q, d, s
