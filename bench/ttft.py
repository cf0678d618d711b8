"""Time to first token of long prompts: our engine against llama.cpp on the same GGUF file, the same prompt tokens,
one sequence, in one run, per instruction set (--isa, as bench/generate.py: ours, torch and llama.cpp's build).

    python bench/ttft.py [--model GGUF] [--isa avx2|avxvnni|avx512vnni|native] [--lengths 128,512,2000]
                         [--prefill-chunk 256] [--repeats 3] [--llama-cpp-build ISA]

The prompt: the first N tokens of a fixed text (this project's README as of commit d344bd4, as bench/generate.py's
accuracy text), after the file's BOS token. Ours: the engine's Scheduler + ModelRunner driven directly, as the
service runs them (one sequence, `--prefill-chunk` prompt tokens a step: the demo's `engine.prefill_chunk` 256),
from the sequence's arrival to its first sampled token (greedy). llama.cpp (bench/llama_cpp_baseline.py): the prompt
in `n_batch` 512 tokens a decode (its default), to the arg-max of the last logits. Each figure is the best of
--repeats runs, interleaved (the CPU is shared); each row prints as it is measured with the ratio llama.cpp / ours
(> 1: ours first).

--cpu-time (with --threads 1): each figure is the CPU time of the one thread that computes it (ours: the engine
driven in this thread; llama.cpp: its one compute thread is this one), not the wall clock: on a host loaded by other
work the wall-clock figures of both engines swing by several times, their CPU time far less.

llama.cpp's build is bench/.llama-cpp/<--isa> (`bash scripts/setup-bench.sh --isa ISA`); where this ISA has none,
`--llama-cpp-build native` (for instance) runs another build, named in the table, instead of leaving it out.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

# first: --isa's environment is set before torch loads
from generate import LLAMA_CPP_DIR, build, default_model, isa_banner, kl_text_ids, load

import torch  # noqa: E402

from kernels import cpu_quant  # noqa: E402
from models.llama import KVCache  # noqa: E402

LLAMA_CPP_BATCH = 512  # llama.cpp's default n_batch


def llama_cpp_for(isa: str, build_name: str | None):
    """(LlamaCpp class, system_info(), the build's label) of the llama.cpp build for `isa`, or None."""
    name = build_name or isa
    directory = LLAMA_CPP_DIR / name
    if not directory.is_dir():
        print(f"llama.cpp: no build in {directory} (bash scripts/setup-bench.sh --isa {name}); column left out")
        return None
    sys.path.insert(0, str(directory))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))
    from llama_cpp_baseline import LlamaCpp, available, system_info
    if not available():
        print("llama.cpp: not importable; column left out")
        return None
    return LlamaCpp, system_info(), name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the demo's SmolLM2 Q4_1)")
    ap.add_argument("--isa", default="native", help="emulate a CPU whose best is this ISA (as bench/generate.py)")
    ap.add_argument("--weights", default=None, help="our path (default blocks/int8/<best ISA under --isa>)")
    ap.add_argument("--lengths", default="128,512,2000", help="prompt tokens, comma-separated")
    ap.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens a step (engine.prefill_chunk)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-cpp-build", default=None,
                    help="llama.cpp's build to run (a directory name under bench/.llama-cpp; default --isa's)")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--cpu-time", action="store_true", help="with --threads 1: the computing thread's CPU time")
    args = ap.parse_args()
    if args.cpu_time and args.threads != 1:
        raise SystemExit("--cpu-time: with --threads 1 (one thread's CPU time is the whole computation's)")
    torch.set_num_threads(args.threads)
    banner = isa_banner(args.isa)
    print(banner, flush=True)
    path = args.model or default_model()
    if path is None or path.suffix != ".gguf":
        raise SystemExit("--model: a GGUF file")
    lengths = [int(n) for n in args.lengths.split(",")]
    weights = args.weights or f"blocks/int8/{cpu_quant.best('int8').isa}"
    cfg, tensors, _prompts, label, tokenizer = load(path, torch.float32)
    model, kv_dtype, name = build(path, weights, cfg, tensors, 1, Path(tempfile.mkdtemp(prefix="bench-ttft-")))
    del tensors
    bos = [cfg.bos_token_id] if cfg.bos_token_id is not None else []
    text = kl_text_ids(tokenizer, max(lengths))
    prompts = {n: bos + text[:n - len(bos)] for n in lengths}
    cache = KVCache(model.config, 1, max(lengths) + 8, kv_dtype)
    lcpp, lcpp_label = None, "-"
    if not args.no_llama_cpp:
        found = llama_cpp_for(args.isa, args.llama_cpp_build)
        if found is not None:
            cls, info, build_name = found
            lcpp = cls(path, args.threads, max(lengths) + 8, 1, n_batch=LLAMA_CPP_BATCH)
            lcpp_label = f"llama.cpp [{build_name} build]"
            print(f"llama.cpp ({build_name} build): {info}")
    print(f"model: {label}, ours {name} (prefill {args.prefill_chunk} tokens a step), {args.threads} threads, "
          f"llama.cpp n_batch {LLAMA_CPP_BATCH}; seconds to the first token ({'CPU time' if args.cpu_time else 'wall'}),"
          f" best of {args.repeats}")
    _ours_once(model, cache, prompts[lengths[0]], args.prefill_chunk)  # warm-up
    if lcpp is not None:
        lcpp.generate([prompts[lengths[0]]], 1)
    print(f"| prompt tokens | ours [{args.isa}] s | {lcpp_label} s | llama.cpp / ours | same first token |")
    print("|---|---|---|---|---|")
    for n in lengths:
        ours, theirs, same = float("inf"), float("inf"), "-"
        for _ in range(args.repeats):
            t0 = time.thread_time()
            ttft, tokens = _ours_once(model, cache, prompts[n], args.prefill_chunk)
            ours = min(ours, time.thread_time() - t0 if args.cpu_time else ttft)
            if lcpp is not None:
                t0 = time.thread_time()
                _tps, l_ttft, l_tokens = lcpp.generate([prompts[n]], 1)
                theirs = min(theirs, time.thread_time() - t0 if args.cpu_time else l_ttft)
                same = "yes" if l_tokens[0][:1] == tokens[:1] else "no"
        cells = [f"{ours:.3f}", f"{theirs:.3f}" if lcpp else "-", f"{theirs / ours:.2f}" if lcpp else "-", same]
        print(f"| {n} | " + " | ".join(cells) + " |", flush=True)
    if lcpp is not None:
        lcpp.close()
    print(f"under {banner}; load average {os.getloadavg()[0]:.1f}")


def _ours_once(model, cache: KVCache, prompt: list[int], chunk: int) -> tuple[float, list[int]]:
    """(seconds from arrival to the first token, the tokens) of one sequence through Scheduler + ModelRunner."""
    from appliance.engine.llm.runner import ModelRunner
    from appliance.engine.llm.scheduler import Scheduler
    from appliance.engine.llm.sequence import Sequence
    from appliance.engine.llm.slots import SlotManager
    from appliance.engine.llm.token_turns import TokenTurns, run_to_end
    sched = Scheduler(SlotManager(cache.n_slots, cache.max_seq_len), TokenTurns({"0": prompt}), prefill_chunk=chunk)
    seq = Sequence(session_key="s0", prompt="0", max_tokens=1)
    seq.arrival = time.monotonic()
    sched.add(seq)
    run_to_end(sched, ModelRunner(model, cache))
    return seq.first_token_at - seq.arrival, seq.generated


if __name__ == "__main__":
    sys.exit(main())
