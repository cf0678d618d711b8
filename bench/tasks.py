"""Typed answers on the demo model: what constrained decoding costs, and how it compares with llama.cpp's.

    python bench/tasks.py [--model GGUF] [--repeats 2] [--compile on|off] [--threads N] [--no-llama-cpp]

One run, each figure printed as it is measured:
  1. the grammar engine (llguidance): its tokenizer built from ours, the extraction schema's compile time, and
     (where xgrammar is importable, e.g. `pip install --target DIR xgrammar==0.2.8` and PYTHONPATH=DIR: never a
     dependency of the appliance) the same figures for xgrammar, with both engines' mask time per token replayed
     over the same answers;
  2. the mask's cost per token at 1 and 16 constrained sequences on the demo model, in microseconds and as a share
     of the engine step it rides in (goal <= 10 %);
  3. a 4-field extraction task (an enum, a Boolean, a Double with bounds, a String with maxLength): time per answer,
     ours (GenerativeModelService, one-shot turns, greedy) with jump-forward and without, vs llama.cpp with the same
     schema as its JSON-schema grammar (llama-cpp-python's create_chat_completion with response_format
     {"type": "json_object", "schema": ...}, same GGUF file, same prompt, greedy), at 1 and 16 concurrent answers
     (llama-cpp-python's Llama answers one call at a time: its 16 run back to back, the time per answer is the
     total / 16); every answer is checked against the schema;
  4. Choose over 8 options against 8 Generate calls (each option's question answered in one token).
Each figure is the best of --repeats runs: the CPU is shared, and the least disturbed run is the one to compare.
llama.cpp comes from bench/.llama-cpp/native (scripts/setup-bench.sh), as in bench/generate.py.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.engine.llm.service import GenerativeModelService  # noqa: E402
from appliance.engine.llm.settings import GenerativeSettings  # noqa: E402

LLAMA_CPP_DIR = Path(__file__).resolve().parent / ".llama-cpp" / "native"

SCHEMA = {"type": "object", "properties": {
    "Severity": {"type": "string", "enum": ["low", "medium", "high"]},
    "StopLine": {"type": "boolean"},
    "Pressure": {"type": "number", "minimum": 0, "maximum": 400},
    "Reason": {"type": "string", "maxLength": 60}},
    "required": ["Severity", "StopLine", "Pressure", "Reason"], "additionalProperties": False}
ALARMS = ["Line 4 pump P-101: discharge pressure 87 bar, above its limit of 80 bar. Operator reports a leak.",
          "Tank T-3 level sensor: level at 12 %, low-level warning, filling pump running.",
          "Conveyor 2 motor temperature 95 C, overheat trip in 5 minutes.",
          "Valve V-17 did not open on command; flow on line 1 is zero.",
          "Compressor C-1 vibration 7.1 mm/s, above the 4.5 mm/s alarm limit.",
          "Boiler B-2 steam pressure 3.2 bar, normal range 3 to 4 bar; routine check.",
          "Filter F-5 differential pressure 1.9 bar, replace the cartridge this shift.",
          "Emergency stop pressed at station 6; line 2 halted."]
PROMPT = ("Extract from this alarm text: the severity (low, medium or high), whether to stop the line, the pressure "
          "in bar (0 if none), and a short reason.\nAlarm: {alarm}")
MAX_TOKENS = 96
LABELS = ["pump", "valve", "motor", "tank", "compressor", "boiler", "filter", "conveyor"]
CHOOSE_PROMPT = "Which equipment is this alarm about? Answer with one word.\nAlarm: {alarm}"


def default_model() -> Path:
    from core.config.builtin import resolve_builtin
    return resolve_builtin("smollm2")


def valid(text: str) -> bool:
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def grammar_engines(model: Path, repeats: int) -> None:
    import llguidance
    import numpy as np

    from appliance.engine.llm.grammar import GrammarBook, MaskFiller
    from models.gguf_loader import gguf_header
    config, tok = gguf_header(model)
    vocab = config.vocab_size
    t0 = time.perf_counter()
    book = GrammarBook(tok, vocab, set(tok.eos_token_ids) | tok.end_of_turn_ids())
    print(f"llguidance {llguidance.__version__}: tokenizer from ours ({vocab} tokens) {time.perf_counter() - t0:.2f} s")
    text = json.dumps(SCHEMA)
    t0 = time.perf_counter()
    book.constraint(text)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    book.constraint(text)
    print(f"llguidance: the extraction schema compiled in {first * 1e3:.1f} ms; a sequence's matcher from the cache "
          f"{(time.perf_counter() - t0) * 1e3:.2f} ms", flush=True)
    # answers to replay: random walks through the mask (every kind of token the grammar allows, long strings too)
    rng = np.random.default_rng(0)
    filler = MaskFiller(vocab)
    walks = []
    for _ in range(20):
        c, out = book.constraint(text), []
        while not c.complete:
            bits = filler.fill([c])
            allowed = np.nonzero(np.unpackbits(bits[0].view(np.uint8), bitorder="little")[:vocab])[0]
            token = int(rng.choice(allowed))
            c.consume(token)
            out.append(token)
        walks.append(out)
    best_llg = float("inf")
    for _ in range(repeats):
        times = []
        for out in walks:
            c = book.constraint(text)
            for token in out:
                t0 = time.perf_counter()
                filler.fill([c])
                times.append(time.perf_counter() - t0)
                c.consume(token)
        best_llg = min(best_llg, sum(times) / len(times))
    print(f"llguidance: mask per token {best_llg * 1e6:.1f} us (mean over {len(times)} tokens of 20 random answers)",
          flush=True)
    try:
        import transformers
        import xgrammar
    except ImportError:
        print("xgrammar: not importable here (install it aside to compare: see this file's docstring)")
        return
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.tokenizer)
    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=sorted(tok.eos_token_ids))
    print(f"xgrammar {importlib.metadata.version('xgrammar')}: tokenizer {time.perf_counter() - t0:.2f} s")
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"))
    print(f"xgrammar: the extraction schema compiled in {(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
    best_xgr, refused = float("inf"), 0
    for _ in range(repeats):
        times, refused = [], 0
        for out in walks:
            m = xgrammar.GrammarMatcher(compiled)
            bits = xgrammar.allocate_token_bitmask(1, vocab)
            for token in out:
                t0 = time.perf_counter()
                m.fill_next_token_bitmask(bits)
                times.append(time.perf_counter() - t0)
                if not m.accept_token(token):
                    refused += 1
                    break
        best_xgr = min(best_xgr, sum(times) / len(times))
    print(f"xgrammar: mask per token {best_xgr * 1e6:.1f} us over the same answers ({refused} of 20 refused where "
          f"llguidance allowed them); llguidance / xgrammar = {best_llg / best_xgr:.2f}", flush=True)


async def start_service(model: Path, args, *, jump_forward: bool, slots: int = 16) -> GenerativeModelService:
    cache = Path(args.cache)
    settings = GenerativeSettings(kv_slots=slots, max_seq_len=1024, max_new_tokens=MAX_TOKENS, threads=args.threads,
                                  compile=args.compile, compile_cache_dir=str(cache / "compile"),
                                  weight_cache_dir=str(cache / "weights"), cpu_kernel_dir=str(cache / "kernels"),
                                  max_queue_size=256, jump_forward=jump_forward, seed=1)
    svc = GenerativeModelService("bench", model, settings, version_label="bench")
    await svc.start()
    if svc.state != "Ready":
        raise SystemExit(f"our engine failed to load: {svc.failure_reason}")
    # warm-up: the first forwards of each shape, the grammar engine's tokenizer, the schema's compilation
    await svc.generate("", PROMPT.format(alarm=ALARMS[0]), MAX_TOKENS, 0.0, time.monotonic() + 600,
                       grammar=json.dumps(SCHEMA))
    return svc


async def ours_answers(svc: GenerativeModelService, n: int, repeats: int) -> tuple[float, dict]:
    """Best seconds per answer for n concurrent answers (n distinct alarms), and the engine's counters of that run."""
    best, counters = float("inf"), {}
    text = json.dumps(SCHEMA)
    for _ in range(repeats):
        before = svc._engine_loop.step_counts()
        t0 = time.perf_counter()
        results = await asyncio.gather(*(svc.generate("", PROMPT.format(alarm=ALARMS[i % len(ALARMS)]), MAX_TOKENS,
                                                      0.0, time.monotonic() + 600, grammar=text) for i in range(n)))
        wall = time.perf_counter() - t0
        after = svc._engine_loop.step_counts()
        bad = [r.text for r in results if r.finish_reason != "stop" or not valid(r.text)]
        if bad:
            print(f"  ours: {len(bad)} of {n} answers invalid, e.g. {bad[0]!r}")
        if wall / n < best:
            best = wall / n
            counters = {"wall": wall, "steps": after[0] - before[0], "mask_s": after[1] - before[1],
                        "rows": after[2] - before[2], "tokens": sum(r.token_count for r in results),
                        "example": results[0].text}
    return best, counters


def llama_cpp_answers(model: Path, threads: int, n: int, repeats: int) -> float | None:
    if LLAMA_CPP_DIR.is_dir():
        sys.path.insert(0, str(LLAMA_CPP_DIR))
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = getattr(llama_cpp_answers, "llm", None)
    if llm is None:
        llm = llama_cpp_answers.llm = Llama(model_path=str(model), n_ctx=1024, n_threads=threads or os.cpu_count(),
                                            n_threads_batch=threads or os.cpu_count(), verbose=False, seed=1)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        texts = []
        for i in range(n):
            out = llm.create_chat_completion(
                messages=[{"role": "user", "content": PROMPT.format(alarm=ALARMS[i % len(ALARMS)])}],
                response_format={"type": "json_object", "schema": SCHEMA}, temperature=0.0, max_tokens=MAX_TOKENS)
            texts.append(out["choices"][0]["message"]["content"])
        best = min(best, (time.perf_counter() - t0) / n)
        bad = [t for t in texts if not valid(t)]
        if bad:
            print(f"  llama.cpp: {len(bad)} of {n} answers invalid, e.g. {bad[0]!r}")
    llama_cpp_answers.example = texts[0]
    return best


async def choose_vs_generate(svc: GenerativeModelService, repeats: int) -> None:
    alarm = ALARMS[4]
    best_choose = best_gen = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        chosen = await svc.choose(CHOOSE_PROMPT.format(alarm=alarm), LABELS, time.monotonic() + 600)
        best_choose = min(best_choose, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for label in LABELS:  # what a client does without Choose: one yes/no question per label
            await svc.generate("", f"Is this alarm about a {label}? Answer yes or no.\nAlarm: {alarm}", 1, 0.0,
                               time.monotonic() + 600)
        best_gen = min(best_gen, time.perf_counter() - t0)
    print(f"Choose over 8 options: {best_choose * 1e3:.0f} ms (picked {LABELS[chosen.index]!r}); 8 Generate calls "
          f"of one token, one after another: {best_gen * 1e3:.0f} ms; ratio {best_gen / best_choose:.1f}x",
          flush=True)
    t0 = time.perf_counter()
    await asyncio.gather(*(svc.generate("", f"Is this alarm about a {label}? Answer yes or no.\nAlarm: {alarm}", 1,
                                        0.0, time.monotonic() + 600) for label in LABELS))
    together = time.perf_counter() - t0
    print(f"  the 8 Generate calls concurrent (batched by the engine): {together * 1e3:.0f} ms; ratio "
          f"{together / best_choose:.1f}x", flush=True)


async def ours_section(model: Path, args) -> dict:
    """Ours with jump-forward and without, two services side by side, their runs interleaved (the machine's load
    drifts: a run of one and then of the other would compare two different machines)."""
    services = {jf: await start_service(model, args, jump_forward=jf) for jf in (True, False)}
    print(f"our engine: {services[True].backend_name}", flush=True)
    figures = {}
    for n in (1, 16):
        runs = {jf: [] for jf in services}
        for _ in range(args.repeats):
            for jf, svc in services.items():
                runs[jf].append(await ours_answers(svc, n, 1))
        for jf in (True, False):
            per_answer, c = min(runs[jf], key=lambda r: r[0])
            figures[(jf, n)] = per_answer
            label = "ours" if jf else "ours without jump-forward"
            print(f"{label}, {n:2d} concurrent: {per_answer * 1e3:.0f} ms per answer ({c['tokens'] / n:.1f} tokens, "
                  f"{c['steps']} engine steps for {n} answers)", flush=True)
            step_ms = c["wall"] / c["steps"] * 1e3
            mask_step_ms = c["mask_s"] / c["steps"] * 1e3
            print(f"  mask at {n:2d} sequences: {c['mask_s'] / max(1, c['rows']) * 1e6:.0f} us per token-row, "
                  f"{mask_step_ms:.2f} ms per step of {step_ms:.1f} ms = {mask_step_ms / step_ms:.1%} of a step",
                  flush=True)
            if n == 1 and jf:
                print(f"  e.g. {c['example']}")
    await choose_vs_generate(services[True], args.repeats)
    for svc in services.values():
        await svc.stop()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="ours: torch threads; llama.cpp: n_threads "
                                                                 "(0: all cores)")
    parser.add_argument("--compile", default="on", choices=("on", "off"), help="our compiled decode step")
    parser.add_argument("--cache", default=".appliance/bench-tasks", help="our weights, kernels and compiled step")
    parser.add_argument("--no-llama-cpp", action="store_true")
    args = parser.parse_args()
    model = args.model or default_model()
    print(f"model: {model.name}; CPU cores: {os.cpu_count()}; repeats: {args.repeats}", flush=True)
    grammar_engines(model, args.repeats)
    figures = asyncio.run(ours_section(model, args))
    if args.no_llama_cpp:
        return
    for n in (1, 16):
        lcpp = llama_cpp_answers(model, args.threads, n, args.repeats)
        if lcpp is None:
            print("llama.cpp: llama-cpp-python is not installed (bash scripts/setup-bench.sh): column left out")
            return
        print(f"llama.cpp, {n:2d} answers: {lcpp * 1e3:.0f} ms per answer; ours {lcpp / figures[(True, n)]:.2f}x "
              f"its speed with jump-forward, {lcpp / figures[(False, n)]:.2f}x without", flush=True)
        if n == 1:
            print(f"  e.g. {llama_cpp_answers.example}")


if __name__ == "__main__":
    main()
