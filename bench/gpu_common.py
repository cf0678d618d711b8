"""Shared bits of the GPU checks (bench/gpu_*.py): the skip on machines without CUDA, timing, result lines.

Every gpu_*.py prints `SKIP: ...` and exits 0 where torch sees no CUDA device, so `bash bench/gpu_check.sh` and the
CPU test of these scripts run anywhere; on a GPU each prints `PASS`/`FAIL` lines and figures.

`--cpu-dry-run` (gpu_kernels.py, gpu_decode.py): the same code on the CPU with the Triton interpreter and tiny
shapes, so the script's own logic is checked before it spends GPU minutes; its figures mean nothing.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


DRY_RUN = "--cpu-dry-run" in sys.argv
DEVICE = "cpu" if DRY_RUN else "cuda"


def require_cuda(what: str):
    """torch with a CUDA device, or print SKIP and exit 0. The interpreter must be off for real kernels."""
    if DRY_RUN:
        os.environ["TRITON_INTERPRET"] = "1"  # before the first kernel module is imported (they load lazily)
        import torch
        print(f"DRY RUN {what} on the CPU (Triton interpreter, tiny shapes): the figures mean nothing")
        return torch
    if os.environ.get("TRITON_INTERPRET") == "1":
        print(f"SKIP {what}: TRITON_INTERPRET=1 is set (the GPU checks run compiled kernels)")
        sys.exit(0)
    import torch
    if not torch.cuda.is_available():
        print(f"SKIP {what}: torch sees no CUDA device")
        sys.exit(0)
    return torch


def sync() -> None:
    if not DRY_RUN:
        import torch
        torch.cuda.synchronize()


def free_memory() -> None:
    if not DRY_RUN:
        import torch
        torch.cuda.empty_cache()


def cuda_ms(fn, warmup: int = 5, reps: int = 50) -> float:
    """Median milliseconds per call, timed with CUDA events around each call."""
    import torch
    if DRY_RUN:
        import time
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def peak_bandwidth_bytes_s() -> tuple[float, str]:
    """The GPU's peak memory bandwidth: from the device properties when torch exposes clock and bus width, else
    from a table of known boards, else measured copy bandwidth (said so in the returned source)."""
    import torch
    if DRY_RUN:
        return 1e10, "dry run: a made-up 10 GB/s"
    props = torch.cuda.get_device_properties(0)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2.0 * clock_khz * 1e3 * bus_bits / 8, f"device properties ({clock_khz / 1e6:.2f} GHz x {bus_bits} bit)"
    known = {"H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "H200": 4.8e12, "A100-SXM4-80GB": 2.04e12,
             "A100-SXM4-40GB": 1.56e12, "L4": 0.3e12, "A10": 0.6e12}
    for name, bw in known.items():
        if name in props.name:
            return bw, f"datasheet value for {name}"
    return measured_copy_bandwidth(), "measured device-to-device copy (no datasheet value known)"


def measured_copy_bandwidth(nbytes: int = 1 << 30) -> float:
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_ms(lambda: dst.copy_(src), warmup=3, reps=10)
    return 2 * nbytes / (ms / 1e3)  # read + write


class Results:
    """PASS/FAIL lines and figures, printed as they come; exit status 1 if anything failed."""

    def __init__(self, title: str):
        self.failed = 0
        print(f"== {title}", flush=True)

    def check(self, ok: bool, what: str, detail: str = "") -> bool:
        self.failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} {what}{(': ' + detail) if detail else ''}", flush=True)
        return ok

    def figure(self, what: str, value: str) -> None:
        print(f"FIGURE {what}: {value}", flush=True)

    def finish(self) -> None:
        sys.exit(1 if self.failed else 0)
