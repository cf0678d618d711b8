"""Our quantized matmuls (kernels/cpu/quant_*.c, each ISA this CPU runs, int8 and float32 activations) against
torch's fp32 matmul on the same dequantised weights and torch's int4 op, in the same run: SmolLM2-135M's shapes in
Q4_1 / Q5_0 / Q8_0 and a Llama-3.2-1B's in Q4_K / Q6_K (the K-quants need inputs in multiples of 256), 1 to 64
activation rows, random blocks.

    python bench/cpu_kernels.py [--threads 2] [--rows 1,4,16,64] [--types Q4_1,Q8_0,Q4_K,Q6_K]

Prints ms per call (the fastest of several), GB/s of weights read (at one row the product is a pass over the
weights) and each path's ratio to torch fp32 (> 1: faster). The CPU is shared: only ratios within one run mean
anything.

    python bench/cpu_kernels.py --step [--model smollm2-q4_1|llama1b-q4_k_m] [--isa avx2] [--before REF] [--rows 1,16]

One decode step's matmuls, every layer's own weights (random blocks; a pass over them is a pass over memory, as in
the model, not over one layer kept in cache), int8 mode, at each row count: ms per step for our kernels of --isa
(default: each ISA this CPU runs, APPLIANCE_CPU_ISA caps it) and, with --before, the same ISA's kernels as they
were at git REF, built aside, in the same run; the weights' GB/s, this CPU's read bandwidth (numpy summing 1 GiB in
--threads slices at once) and the fraction of it reached (the bound at one row); the multiply-adds a second and the
fraction reached of the ISA's ceiling: its GEMM's inner loop alone, products into sums held in registers, on
--threads threads (bench/isa_ceiling.c; the bound at many rows). APPLIANCE_CPU_ISA caps the ISAs as in the engine.

    python bench/cpu_kernels.py --micro [--isa avx2] [--before REF] [--rows 16] [--types Q4_1,Q6_K,Q8_0]

The many-row micro-kernel alone, robust to a loaded host: one matrix of each format (the shapes of a step's
layers: SmolLM2's Q4_x/Q5_0 layers and its Q8_0 head slice, the 1B's Q4_K gate-up and Q6_K down), --rows rows
(default 16), one thread, weights in cache, timed by the thread's CPU time (the fastest of --trials, the libraries
interleaved); G multiply-adds a second and the fraction of the ISA's ceiling by CPU time on one thread
(bench/isa_ceiling.c); with --before, the same ISA's kernels at git REF in the same run and the ratio now / before.

    python bench/cpu_kernels.py --attention [--isa avx2] [--before REF]

The decode attention operator (kernels/cpu/quant_attention.h) for one step of every layer: SmolLM2-135M's heads
(9 query / 3 kv, 30 layers) and a Llama-3.2-1B's (32 / 8, 16 layers), head size 64, a bfloat16 cache, 1 and 16 rows
at positions 60 and 100: ms per step, and with --before the same ISA's operator at git REF in the same run.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels import cpu_build, cpu_isa, cpu_layout, cpu_quant, cpu_torch_ops  # noqa: E402
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


# (n, k, type) of one layer's fused matmuls, the layer count, and the head (n, k, type): the demo's SmolLM2-135M
# Q4_1 (its head is the Q8_0 embedding matrix) and a Llama-3.2-1B-shaped Q4_K_M (Q6_K for down and the head).
STEP_MODELS = {
    "smollm2-q4_1": ([(960, 576, "Q4_1"), (576, 576, "Q4_1"), (3072, 576, "Q4_1"), (576, 1536, "Q4_1")], 30,
                     (49152, 576, "Q8_0")),
    "llama1b-q4_k_m": ([(3072, 2048, "Q4_K"), (2048, 2048, "Q4_K"), (16384, 2048, "Q4_K"), (2048, 8192, "Q6_K")], 16,
                       (128256, 2048, "Q6_K")),
}
HEAD_SLICE = 8192  # head rows multiplied (scaled to the whole head): the full 1B head would take 215 MB of blocks


def read_bandwidth(threads: int) -> float:
    """GB/s read summing 1 GiB of float32 in `threads` slices at once (numpy's sum, which releases the GIL), the
    fastest of 5. torch's own sum read 4.8 GB/s on the Zen 4 EPYC where numpy's read 24 and our 1-row kernels 23-30
    over 96 MB: its figure is no read limit."""
    from concurrent.futures import ThreadPoolExecutor
    x = np.ones(256 * 1024 * 1024, np.float32)
    parts = np.array_split(x, threads)
    with ThreadPoolExecutor(threads) as pool:
        def read() -> None:
            list(pool.map(np.sum, parts))
        read()
        best = min(_timed(read) for _ in range(5))
    return x.nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def isa_flags(isa: str) -> list[str]:
    """The compiler flags of our `isa` library as the engine builds it here: avxvnni on a CPU without AVX-VNNI is the
    EVEX stand-in (its VEX form would stop this CPU with an illegal instruction)."""
    return cpu_build.AVXVNNI_EVEX_FLAGS if cpu_isa.cpu_info().stands_in(isa) else cpu_build.ISA_FLAGS[isa]


def isa_ceiling(isa: str, threads: int, directory: Path, cpu_time: bool = False) -> float | None:
    """G multiply-adds a second of `isa`'s int8 GEMM inner loop alone on `threads` threads (bench/isa_ceiling.c,
    built with the library's flags), by the wall clock or (cpu_time) by each thread's CPU time; None for amx, whose
    tiles are another loop."""
    if isa == "amx":
        return None
    out = directory / f"isa_ceiling_{isa}.so"
    if not out.exists():
        subprocess.run([cpu_build.compiler(), str(Path(__file__).with_name("isa_ceiling.c")), "-o", str(out),
                        *cpu_build.COMMON, *isa_flags(isa)], check=True)
    fn = getattr(ctypes.CDLL(str(out)), "isa_ceiling_cpu_gmacs" if cpu_time else "isa_ceiling_gmacs")
    fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_long, ctypes.c_int]
    return fn(50_000_000, threads)


def build_before(ref: str, isa: str, directory: Path) -> str:
    """Our kernels of `isa` as they were at git `ref`, built into directory: the library's path."""
    root = Path(__file__).resolve().parents[1]
    src = directory / "src"
    src.mkdir(parents=True, exist_ok=True)
    names = subprocess.run(["git", "-C", str(root), "ls-tree", "--name-only", f"{ref}:kernels/cpu"],
                           capture_output=True, text=True, check=True).stdout.split()
    for name in names:
        (src / name).write_bytes(subprocess.run(["git", "-C", str(root), "show", f"{ref}:kernels/cpu/{name}"],
                                                capture_output=True, check=True).stdout)
    out = directory / f"quant_{isa}-before.so"
    subprocess.run([cpu_build.compiler(), str(src / f"quant_{isa}.c"), "-o", str(out),
                    *cpu_build.COMMON, *isa_flags(isa)], check=True)
    return str(out)


def attention_main(args) -> None:
    import tempfile
    info = cpu_isa.cpu_info()
    if not cpu_torch_ops.torch_ops():
        raise SystemExit("our kernels' torch operators cannot be built here")
    isa = args.isa or info.isas[0]
    op = torch.ops.quant_cpu.decode_attention.default
    print(f"{info.described}, {args.threads} threads, decode attention ({isa}), bfloat16 cache, head size 64")
    with tempfile.TemporaryDirectory() as tmp:
        libs = {isa: cpu_quant.kernels(isa, "int8").path}
        if args.before:
            libs[f"{isa} at {args.before}"] = build_before(args.before, isa, Path(tmp))
        print("| model | rows | position | " + " | ".join(f"{name} ms/step" for name in libs)
              + (" | now / before |" if args.before else " |"))
        print("|" + "---|" * (3 + len(libs) + (1 if args.before else 0)))
        for model, heads, kv_heads, layers in (("smollm2", 9, 3, 30), ("llama1b", 32, 8, 16)):
            for rows in (1, 16):
                for pos in (60, 100):
                    torch.manual_seed(rows + pos)
                    kc = torch.randn(16, kv_heads, 257, 64).bfloat16()
                    vc = torch.randn(16, kv_heads, 257, 64).bfloat16()
                    q, slots, positions = torch.randn(rows, heads, 64), torch.arange(rows), torch.full((rows,), pos)
                    ms = {name: layers * min(best_ms(lambda: op(q, kc, vc, slots, positions, path, isa))
                                             for _ in range(args.trials)) for name, path in libs.items()}
                    cells = [f"{v:.3f}" for v in ms.values()]
                    if args.before:
                        cells.append(f"{ms[f'{isa} at {args.before}'] / ms[isa]:.2f}x")
                    print(f"| {model} | {rows} | {pos} | " + " | ".join(cells) + " |", flush=True)


MICRO_SHAPES = [("Q4_1", 3072, 576), ("Q4_0", 3072, 576), ("Q5_0", 3072, 576), ("Q4_K", 3072, 2048),
                ("Q6_K", 2048, 8192), ("Q8_0", 8192, 576)]


def micro_main(args) -> None:
    import tempfile
    info = cpu_isa.cpu_info()
    isas = [args.isa] if args.isa else [i for i in info.isas if i != "amx"]
    torch.set_num_threads(1)
    rows = int(args.rows or "16")
    types = args.types.split(",") if args.types_given else [t for t, _, _ in MICRO_SHAPES]
    print(f"{info.described}, 1 thread, {rows} rows, int8 activations, weights in cache, CPU time "
          f"(load average {os.getloadavg()[0]:.1f})")
    with tempfile.TemporaryDirectory() as tmp:
        libs = {}
        for isa in isas:
            libs[isa] = (cpu_quant.kernels(isa, "int8").path, isa)
            if args.before:
                libs[f"{isa} at {args.before}"] = (build_before(args.before, isa, Path(tmp)), isa)
        ceiling = {isa: isa_ceiling(isa, 1, Path(tmp), cpu_time=True) for isa in isas}
        print("ceiling by CPU time, 1 thread: " + ", ".join(f"{isa} {c:.0f}" for isa, c in ceiling.items())
              + " G multiply-adds/s (bench/isa_ceiling.c)")
        print("| format, shape | " + " | ".join(f"{name} G MAC/s (of ceiling)" for name in libs)
              + (" | now / before |" if args.before else " |"))
        print("|" + "---|" * (1 + len(libs) + (1 if args.before else 0)))
        for t, n, k in MICRO_SHAPES:
            if t not in types:
                continue
            m = quant.BlockMatrix.from_layout(t, (n, k), cpu_layout.from_gguf(
                cpu_layout.random_blocks(t, n, k, seed=n + k, scale=0.002), t, n, k))
            x = torch.randn(rows, k)
            best = {name: float("inf") for name in libs}
            for name, (path, isa) in libs.items():  # warm: the weights into cache, the library loaded
                cpu_quant.matmul(path, isa, False, x, m.data, t, n)
            for _trial in range(args.trials):  # interleaved: a burst of load elsewhere falls on every library alike
                for name, (path, isa) in libs.items():
                    t0 = time.thread_time()
                    for _ in range(3):
                        cpu_quant.matmul(path, isa, False, x, m.data, t, n)
                    best[name] = min(best[name], (time.thread_time() - t0) / 3)
            cells = []
            for name, (_path, isa) in libs.items():
                g = rows * n * k / best[name] / 1e9
                cells.append(f"{g:.0f} G ({g / ceiling[isa]:.2f})")
            if args.before:
                cells.append(" ".join(f"{best[f'{isa} at {args.before}'] / best[isa]:.2f}x" for isa in isas))
            print(f"| {t} {n}x{k} | " + " | ".join(cells) + " |", flush=True)


def step_main(args) -> None:
    import tempfile
    info = cpu_isa.cpu_info()
    isas = [args.isa] if args.isa else info.isas
    for isa in isas:
        if isa not in info.isas:
            raise SystemExit(f"our {isa} kernels cannot run here ({info.described}: {', '.join(info.isas)})")
    layer, layers, (hn, hk, htype) = STEP_MODELS[args.model]
    print(f"{info.described}, {args.threads} threads, {args.model}: {layers} layers, int8 activations")
    bw = read_bandwidth(args.threads)
    print(f"read bandwidth: {bw:.1f} GB/s (numpy sum over 1 GiB in {args.threads} threads)")
    mats = []
    for i in range(layers):
        for n, k, t in layer:
            if i == 0:
                data = torch.from_numpy(cpu_layout.from_gguf(cpu_layout.random_blocks(t, n, k, seed=n + k, scale=0.002),
                                                             t, n, k))
            else:
                data = next(m for m in mats[:len(layer)] if m.shape == (n, k)).data.clone()  # its own memory
            mats.append(quant.BlockMatrix.from_layout(t, (n, k), data))
    rows_h = min(hn, HEAD_SLICE)
    head = quant.BlockMatrix.from_layout(htype, (rows_h, hk), cpu_layout.from_gguf(
        cpu_layout.random_blocks(htype, rows_h, hk, seed=7, scale=0.002), htype, rows_h, hk))
    head_scale = hn / rows_h
    step_bytes = sum(m.nbytes for m in mats) + head_scale * head.nbytes
    row_macs = sum(m.shape[0] * m.shape[1] for m in mats) + hn * hk  # one row's multiply-adds in a step
    libs = {}
    with tempfile.TemporaryDirectory() as tmp:
        ceiling = {isa: isa_ceiling(isa, args.threads, Path(tmp)) for isa in isas}
        print("ceiling: " + ", ".join(f"{isa} {c:.0f} G multiply-adds/s" if c else f"{isa} - (not this loop)"
                                      for isa, c in ceiling.items())
              + f" (the int8 GEMM's inner loop alone, {args.threads} threads: bench/isa_ceiling.c)")
        # the same loop by each thread's CPU time: on a loaded host the wall-clock ceiling falls (here 92 against
        # 188 per thread at a load average of 6 on 2 cores) and the fractions below against it flatter
        by_cpu = {isa: isa_ceiling(isa, args.threads, Path(tmp), cpu_time=True) for isa in isas}
        print("ceiling by the threads' CPU time: " + ", ".join(f"{isa} {c:.0f}" for isa, c in by_cpu.items() if c)
              + f" G multiply-adds/s (load average {os.getloadavg()[0]:.1f}: where it is well above the wall-clock "
              "ceiling, the host was busy and the fractions of the table against the wall-clock one flatter)")
        for isa in isas:
            libs[f"{isa}"] = (cpu_quant.kernels(isa, "int8").path, isa)
            if args.before:
                libs[f"{isa} at {args.before}"] = (build_before(args.before, isa, Path(tmp)), isa)
        print(f"| rows | " + " | ".join(f"{name} ms/step" for name in libs) + " | weights MB/step | "
              + " | ".join(f"{name} GB/s (of {bw:.1f})" for name in libs) + " | "
              + " | ".join(f"{name} G MAC/s (of ceiling)" for name in libs)
              + (" | now / before |" if args.before else " |"))
        print("|" + "---|" * (2 + 3 * len(libs) + (1 if args.before else 0)))
        for rows in [int(r) for r in args.rows.split(",")]:
            xs = {k: torch.randn(rows, k) for k in {m.shape[1] for m in mats + [head]}}
            calls = {}
            for name, (path, isa) in libs.items():
                def step(path=path, isa=isa):
                    for m in mats:
                        cpu_quant.matmul(path, isa, False, xs[m.shape[1]], m.data, m.type_name, m.shape[0])

                def head_call(path=path, isa=isa):
                    cpu_quant.matmul(path, isa, False, xs[hk], head.data, head.type_name, rows_h)
                calls[name] = (step, head_call)
            best = {name: [float("inf"), float("inf")] for name in libs}
            for trial in range(args.trials):  # interleaved: a burst of load elsewhere falls on every library alike
                for name, (step, head_call) in calls.items():
                    best[name][0] = min(best[name][0], _timed(step))
                    best[name][1] = min(best[name][1], _timed(head_call))
            ms = {name: (b[0] + head_scale * b[1]) * 1e3 for name, b in best.items()}
            cells = [f"{ms[name]:.2f}" for name in libs] + [f"{step_bytes / 1e6:.0f}"]
            cells += [f"{step_bytes / ms[name] / 1e6:.1f} ({step_bytes / ms[name] / 1e6 / bw:.2f})" for name in libs]
            for name, (_path, isa) in libs.items():
                gmacs = rows * row_macs / ms[name] / 1e6
                cells.append(f"{gmacs:.0f} ({gmacs / ceiling[isa]:.2f})" if ceiling[isa] else f"{gmacs:.0f}")
            if args.before:
                cells += [" ".join(f"{ms[f'{isa} at {args.before}'] / ms[isa]:.2f}x" for isa in isas)]
            print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default=None, help="activation rows (default 1,4,16,64; --step: 1,16)")
    ap.add_argument("--types", default=None, help="default Q4_1,Q5_0,Q8_0,Q4_K,Q6_K (--micro: its six)")
    ap.add_argument("--step", action="store_true", help="one decode step's matmuls (see above)")
    ap.add_argument("--model", default="smollm2-q4_1", choices=sorted(STEP_MODELS))
    ap.add_argument("--isa", default=None, help="--step, --attention: one ISA of ours (default: every one this CPU runs; --attention: the best)")
    ap.add_argument("--before", default=None, help="--step, --attention: also the kernels at this git ref, same run")
    ap.add_argument("--attention", action="store_true", help="the decode attention of one step (see above)")
    ap.add_argument("--micro", action="store_true", help="the many-row micro-kernel per format (see above)")
    ap.add_argument("--trials", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.types_given = args.types is not None
    args.types = args.types or "Q4_1,Q5_0,Q8_0,Q4_K,Q6_K"
    if args.micro:
        micro_main(args)
        return
    if args.step:
        args.rows = args.rows or "1,16"
        step_main(args)
        return
    if args.attention:
        attention_main(args)
        return
    args.rows = args.rows or "1,4,16,64"
    info = cpu_isa.cpu_info()
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
