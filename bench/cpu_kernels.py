"""Our AVX2 quantized matmuls (kernels/cpu/quant_matmul.c) against torch's fp32 matmul on the same dequantised
weights, in the same run: SmolLM2-135M's matrix shapes, 1 to 256 activation rows.

    python bench/cpu_kernels.py [--threads 2] [--formats int4,int8]

Prints ms per call, multiply-accumulates per second and the ratio ours / fp32 (> 1: ours faster), with the largest
relative error against a float64 product of the dequantised weights. The matrices are 0.4-1.8 MB quantized, so a
large last-level cache may hold them here; in the model the weights stream from memory at one row.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kernels import cpu_quant  # noqa: E402
from models import quant  # noqa: E402

SHAPES = [(960, 576, "qkv"), (576, 576, "o"), (3072, 576, "gate_up"), (576, 1536, "down")]
ROWS = [1, 2, 4, 8, 16, 64, 256]


def best_ms(fn, rows: int) -> float:
    fn()
    reps, best = max(5, 300 // rows), float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", default="int4,int8")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = cpu_quant.library()
    if lib is None:
        raise SystemExit("our AVX2 kernels are not available here (no AVX2 or no C compiler)")
    torch.manual_seed(0)
    print(f"{args.threads} threads, CPU {torch.backends.cpu.get_cpu_capability()}")
    print("| format | matrix | rows | ours ms | fp32 ms | ours GMAC/s | fp32 GMAC/s | ours/fp32 | max rel. error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for fmt in args.formats.split(","):
        for n, k, name in SHAPES:
            m = quant.quantize(torch.randn(n, k), fmt)
            ours = quant.linear_for(m, lib)
            w = quant.dequantize(m)
            wt = w.t().contiguous()
            for rows in ROWS:
                x = torch.randn(rows, k)
                exact = x.double() @ w.double().t()
                err = ((ours(x).double() - exact).abs().max() / exact.abs().max()).item()
                a, b = best_ms(lambda: ours(x), rows), best_ms(lambda: x @ wt, rows)
                mac = rows * n * k / 1e6
                print(f"| {fmt} | {name} {n}x{k} | {rows} | {a:.3f} | {b:.3f} | {mac / a:.1f} | {mac / b:.1f} | "
                      f"{b / a:.2f} | {err:.0e} |", flush=True)


if __name__ == "__main__":
    main()
