"""The CPU quantized matmuls of kernels/cpu/quant_matmul.c (AVX2 + FMA), built with the system C compiler and called
through ctypes.

torch's `_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm` have vectorised kernels for AVX-512 only; on an
AVX2 CPU they ran a gate_up projection (3072 x 576, one row) in 8.0 and 5.0 ms against 0.24 ms in fp32. These
kernels keep the activations fp32 and widen the weights in registers (the C file says why, and how).

The library is plain C (no torch headers), so building it takes about a second: it is built on first use into a
cache directory (the state directory's, or the user's cache) keyed by the source's digest and the compiler flags,
and reused after; the Debian package ships it prebuilt beside the source (`python -m kernels.cpu_quant DIR`). Where
there is no compiler, no AVX2, or the build fails, `library()` returns None and the callers keep torch's ops.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu") / "quant_matmul.c"
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
QK = 32

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}  # by build directory
_by_path_lock = threading.Lock()
_by_path: dict[str, ctypes.CDLL] = {}


def cpu_has_avx2() -> bool:
    """AVX2 and FMA, which every capability torch reports from AVX2 up (AVX512*, AMX*) includes."""
    return torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512", "AMX"))


def default_build_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "opcua-appliance" / "kernels"


def library(build_dir: Path | None = None) -> ctypes.CDLL | None:
    """The built library, or None where it cannot be had (the reason is logged once)."""
    if os.environ.get("APPLIANCE_CPU_KERNELS", "1") == "0":
        return None
    build_dir = Path(build_dir) if build_dir is not None else default_build_dir()
    with _lock:
        key = str(build_dir)
        if key not in _loaded:
            _loaded[key] = _load(build_dir)
        return _loaded[key]


def library_name() -> str:
    """The built file's name: the source's digest and the flags, so an edited source is never run stale."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return f"quant_matmul-{digest}.so"


def build(directory: Path) -> Path:
    """Compile the library into directory (atomically); raises OSError / SubprocessError where it cannot."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc/gcc) on PATH")
    target = Path(directory) / library_name()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, renamed: a reader never sees half
        out = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, "-o", str(out), str(SOURCE)], check=True, capture_output=True, timeout=120)
        os.replace(out, target)
    return target


def _load(build_dir: Path) -> ctypes.CDLL | None:
    if not cpu_has_avx2():
        log.info("CPU quantized kernels not used: the CPU has no AVX2")
        return None
    # A package build (image/build-deb.sh) ships the library beside its source: no compiler needed on the box.
    target = next((p for p in (SOURCE.parent / library_name(), build_dir / library_name()) if p.exists()), None)
    if target is None:
        try:
            target = build(build_dir)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            log.warning("CPU quantized kernels not built (%s %s); torch's ops serve instead", exc,
                        detail.decode(errors="replace")[:500])
            return None
    try:
        return library_at(str(target))
    except OSError as exc:
        log.warning("CPU quantized kernels not loaded from %s (%s); torch's ops serve instead", target, exc)
        return None


def library_at(path: str) -> ctypes.CDLL:
    """The built library at path, loaded once per process (the compiled decode step's ops name it by its path,
    which, unlike its address, is the same in the next process: Inductor's cache keys stay stable)."""
    with _by_path_lock:
        lib = _by_path.get(path)
        if lib is None:
            lib = ctypes.CDLL(path)
            ptr, i32 = ctypes.c_void_p, ctypes.c_int
            lib.q4_linear.argtypes = [ptr, i32, i32, ptr, i32, ptr, i32]
            lib.q8_linear.argtypes = [ptr, i32, i32, ptr, ptr, i32, ptr, i32]
            lib.q4_linear.restype = lib.q8_linear.restype = i32
            _by_path[path] = lib
        return lib


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Int4Groups (q 0..15 one per byte, w = (q - 8) * scale + zero) as the kernel's panels: (ceil(N / 8), K / 32,
    192) uint8, each {d[8] = scale, m[8] = zero - 8 * scale, nibbles[16][8]} for 8 output rows x 32 inputs, byte
    [g][o] holding input g of output o low and input g + 16 high. Rows past N (to a multiple of 8) are zeros."""
    n, k = q.shape
    pad = -n % 8
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        scale, zero = torch.cat([scale, scale.new_zeros(pad, k // QK)]), torch.cat([zero, zero.new_zeros(pad, k // QK)])
    panels, nb = q.shape[0] // 8, k // QK
    groups = q.view(panels, 8, nb, QK)
    nibbles = (groups[..., :16] | (groups[..., 16:] << 4)).to(torch.uint8).permute(0, 2, 3, 1)  # panel, block, g, o
    d = scale.float().view(panels, 8, nb).permute(0, 2, 1)
    m = (zero.float() - 8.0 * scale.float()).view(panels, 8, nb).permute(0, 2, 1)
    dm = torch.cat([d, m], dim=-1).contiguous().view(torch.uint8)  # panel, block, 64 bytes
    return torch.cat([dm, nibbles.reshape(panels, nb, 128)], dim=-1).contiguous()


def q4_linear(lib: ctypes.CDLL, x: torch.Tensor, blocks: torch.Tensor, out_features: int) -> torch.Tensor:
    """x (rows, K) float32 contiguous @ the int4 panels' (pack_int4) matrix^T -> (rows, out_features)."""
    rows, k = x.shape
    y = torch.empty(rows, out_features, dtype=torch.float32)
    rc = lib.q4_linear(x.data_ptr(), rows, k, blocks.data_ptr(), out_features, y.data_ptr(),
                       torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"q4_linear failed ({rc}) for a ({rows}, {k}) input")
    return y


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8Rows (w = q * scale[:, None]) as the kernel's panels: ((ceil(N / 8), K / 32, 256) int8 with byte [i][o]
    input i of output o, and the scales padded to 8 ceil(N / 8)). Rows past N are zeros."""
    n, k = q.shape
    pad = -n % 8
    if pad:
        q, scale = torch.cat([q, q.new_zeros(pad, k)]), torch.cat([scale, scale.new_zeros(pad)])
    panels, nb = q.shape[0] // 8, k // QK
    packed = q.view(panels, 8, nb, QK).permute(0, 2, 3, 1).reshape(panels, nb, QK * 8).contiguous()
    return packed, scale.float().contiguous()


def q8_linear(lib: ctypes.CDLL, x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor,
              out_features: int) -> torch.Tensor:
    """x (rows, K) float32 contiguous @ the int8 panels' (pack_int8) matrix^T -> (rows, out_features)."""
    rows, k = x.shape
    y = torch.empty(rows, out_features, dtype=torch.float32)
    rc = lib.q8_linear(x.data_ptr(), rows, k, panels.data_ptr(), scale.data_ptr(), out_features, y.data_ptr(),
                       torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"q8_linear failed ({rc}) for a ({rows}, {k}) input")
    return y


if __name__ == "__main__":  # python -m kernels.cpu_quant [DIR]: build the library (default: beside the source)
    import sys
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else SOURCE.parent))
