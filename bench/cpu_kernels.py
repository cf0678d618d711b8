"""Our quantized matmuls (kernels/cpu/quant_*.c, each ISA this CPU runs, int8 and float32 activations) against
torch's fp32 matmul on the same dequantised weights and torch's int4 op, in the same run: SmolLM2-135M's shapes in
Q4_1 / Q5_0 / Q8_0 and a Llama-3.2-1B's in Q4_K / Q6_K (the K-quants need inputs in multiples of 256), 1 to 64
activation rows, random blocks.

    python bench/cpu_kernels.py [--threads 2] [--rows 1,4,16,64] [--types Q4_1,Q8_0,Q4_K,Q6_K]

Prints ms per call (the fastest of several), GB/s of weights read (at one row the product is a pass over the
weights) and each path's ratio to torch fp32 (> 1: faster). The CPU is shared: only ratios within one run mean
anything.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels import cpu_layout, cpu_quant  # noqa: E402
from models import quant  # noqa: E402

SHAPES = {"smollm2": [(960, 576, "qkv"), (3072, 576, "gate_up"), (576, 1536, "down")],
          "llama1b": [(3072, 2048, "qkv"), (16384, 2048, "gate_up"), (2048, 8192, "down")]}


def best_ms(fn, budget_s: float = 0.3) -> float:
    fn()
    best, spent = float("inf"), 0.0
    while spent < budget_s:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--types", default="Q4_1,Q5_0,Q8_0,Q4_K,Q6_K")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    info = cpu_quant.cpu_info()
    kernels = {isa: cpu_quant.kernels(isa, "int8") for isa in info.isas}
    print(f"{info.brand}, {args.threads} threads, our ISAs: {', '.join(info.isas)}")
    paths = [f"{isa}/{act}" for isa in kernels for act in ("int8", "float32")]
    print("| type | matrix | rows | torch fp32 ms | " + " | ".join(f"{p} ms" for p in paths)
          + " | torch int4 ms | best of ours GB/s | best ours / fp32 |")
    print("|" + "---|" * (6 + len(paths)))
    for name in args.types.split(","):
        for n, k, label in SHAPES["llama1b" if name.endswith("_K") else "smollm2"]:
            m = quant.BlockMatrix.from_layout(name, (n, k), cpu_layout.from_gguf(
                cpu_layout.random_blocks(name, n, k, seed=n + k, scale=0.002), name, n, k))
            w = m.dequantize()
            torch_int4 = quant.linear_for(m) if name in quant.FOUR_BIT else None
            for rows in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(rows, k)
                fp32 = best_ms(lambda: F.linear(x, w))
                ours = []
                for p in paths:
                    isa, act = p.split("/")
                    lin = quant.linear_for(m, kernels[isa].with_activations(act))
                    ours.append(best_ms(lambda: lin(x)))
                t4 = best_ms(lambda: torch_int4(x)) if torch_int4 is not None else None
                top = min(ours)
                cells = [f"{fp32:.3f}", *(f"{o:.3f}" for o in ours), f"{t4:.3f}" if t4 is not None else "-",
                         f"{m.nbytes / top / 1e6:.1f}", f"{fp32 / top:.2f}"]
                print(f"| {name} | {label} {n}x{k} | {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
