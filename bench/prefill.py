"""The eager prefill on a CPU (LlamaModel.forward, as the engine runs a step's prompts) with our kernels: prompts
packed to their own tokens, attention, add+RMSNorm and SiLU-gate through our kernels (the engine's way), against the
same prompts padded to the longest (`pad=True`: every padded token multiplied, the same numbers), and against
padding with torch's ops (sdpa over the widened cache views, torch's RMSNorm and SiLU: the eager forward before
6fbf8df), in one process, interleaved.

    python bench/prefill.py [--model GGUF] [--isa avx2|avxvnni|native] [--weights blocks/int8/avx2] [--repeats 8]

Shapes: the 16 chat prompts of bench/generate.py (35-39 tokens; its 16-sequence runs prefill them in one step), one
200-token prompt beside five 10-token ones (a step's default prefill budget is 256 tokens), one 36-token prompt.
Prints ms per prefill (best and median of --repeats) and each baseline's ratio to ours (> 1: ours faster).
"""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

from generate import build, default_model, isa_banner, load  # first: --isa's environment is set before torch loads

import torch  # noqa: E402

from kernels import cpu_quant  # noqa: E402
from models.forward_ops import TorchOps  # noqa: E402
from models.llama import KVCache  # noqa: E402


def shapes(prompts: list[list[int]], vocab: int) -> dict[str, list[list[int]]]:
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    return {"16 chat prompts": [prompts[i % len(prompts)] for i in range(16)],
            "200 + 5 x 10 tokens": [rand(200)] + [rand(10) for _ in range(5)],
            "1 chat prompt": [prompts[0]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the demo's SmolLM2 Q4_1)")
    ap.add_argument("--isa", default="native", help="emulate a CPU whose best is this ISA (as bench/generate.py)")
    ap.add_argument("--weights", default=None, help="our path (default blocks/int8/<best ISA here>)")
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    path = args.model or default_model()
    if path is None or path.suffix != ".gguf":
        raise SystemExit("--model: a GGUF file")
    weights = args.weights or f"blocks/int8/{cpu_quant.best('int8').isa}"
    print(isa_banner(args.isa))
    cfg, tensors, prompts, label, _tok = load(path, torch.float32)
    model, kv_dtype, name = build(path, weights, cfg, tensors, 16, Path(tempfile.mkdtemp(prefix="bench-prefill-")))
    if not model.torch_ops.packs(model.dtype, kv_dtype):
        raise SystemExit(f"{name}: this path does not prefill through our kernels (nothing to compare)")
    torch_ops = copy.copy(model)  # the same weights; torch's ops for everything but the matmuls
    torch_ops.torch_ops = TorchOps(cfg.rms_norm_eps)
    print(f"{label}, {name}, {torch.get_num_threads()} threads; ms per prefill, best / median of {args.repeats}")
    for shape, rows in shapes(prompts, cfg.vocab_size).items():
        lens = torch.tensor([len(r) for r in rows])
        ids = torch.zeros(len(rows), int(lens.max()), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
        cache = KVCache(cfg, len(rows), int(lens.max()) + 8, kv_dtype)
        call = (cache, ids, torch.arange(len(rows)), torch.zeros(len(rows), dtype=torch.long), lens)
        runs = {"ours (packed)": lambda: model.forward(*call),
                "padded": lambda: model.forward(*call, pad=True),
                "padded, torch's ops": lambda: torch_ops.forward(*call)}
        times = {k: [] for k in runs}
        for f in runs.values():  # warm-up
            f()
        for _ in range(args.repeats):
            for k, f in runs.items():
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        cells = [f"{k} {min(v) * 1e3:.0f} / {med[k] * 1e3:.0f}" for k, v in times.items()]
        ratios = ", ".join(f"{k} {med[k] / med['ours (packed)']:.2f}x" for k in list(runs)[1:])
        print(f"{shape} ({int(lens.sum())} tokens, {ids.numel()} padded): {'; '.join(cells)} ms; medians' ratios: "
              f"{ratios}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
