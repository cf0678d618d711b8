"""Speculation on PLC-shaped work: ours with prompt lookup (and with a draft model, --draft-model) against ours
without, against llama.cpp's default and llama.cpp with its prompt-lookup decoding, in one run.

    python bench/speculative.py [--model GGUF] [--draft-model GGUF] [--new-tokens 96] [--repeats 2] [--threads N]
                                [--workloads extraction,free] [--no-llama-cpp] [--isa avx2|avxvnni|native]

Workloads (greedy chat turns on the demo model unless --model says otherwise):
  extraction  alarm texts with fields to copy out (tag, limit, value, unit) into a fixed line format;
  shift-log   a shift log restated entry by entry;
  task-json   the demo's typed task alarm-triage (appliance/demo.yaml): its prompt and its output schema's grammar;
  free        open questions whose answers have little to copy.
For each: tokens/s at 1 sequence (the prompts one after the other) and at 4 (four at once), ours through
GenerativeModelService (engine thread, chat template, tokenizer) with `speculation: off` and `lookup` (the same
settings otherwise), the acceptance rate (drafted tokens the model agreed with) and the ratio on/off; at 1 sequence
also llama-cpp-python's create_chat_completion on the same GGUF file with its default decoding and with
`draft_model=LlamaPromptLookupDecoding()` (its defaults), greedy, the same prompts and token bound (llama-cpp-python
answers one call at a time, so it has no 4-sequence figure). tokens/s = tokens generated / wall seconds of the
whole workload (prefill included). Each figure is the best of --repeats runs (the CPU is shared). Every ours-on
answer is compared with ours-off's: greedy speculation must not change a token.
--draft-model: a third service of ours with `speculation: draft` and that file as the draft model (its tokenizer
must be --model's); its rows say the pair. The pair measurable here is SmolLM2-135M Q8_0 drafted by SmolLM2-135M
Q4_0 (bench/make_gguf.py smollm2-q8_0 / smollm2-q4_0): the same weights quantized harder, so the drafts are
mostly accepted and the draft's cost per token is what bounds the gain.
llama.cpp comes from bench/.llama-cpp/native (scripts/setup-bench.sh), as in bench/generate.py.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# first: --isa's environment is set before torch loads (as bench/ttft.py: generate.py reads --isa from argv)
from generate import isa_banner  # noqa: E402

from appliance.engine.llm.service import GenerativeModelService  # noqa: E402
from appliance.engine.llm.settings import GenerativeSettings  # noqa: E402

LLAMA_CPP_DIR = Path(__file__).resolve().parent / ".llama-cpp" / "native"

ALARMS = [
    "2026-03-14 06:12:41 ALM-4711 PUMP_P101 discharge pressure HIGH 8.7 bar (limit 8.0 bar) line 3 station B",
    "2026-03-14 06:15:02 ALM-4720 TANK_T204 level LOW 12.5 % (limit 15.0 %) line 2 station A",
    "2026-03-14 06:31:57 ALM-4733 MOTOR_M12 winding temperature HIGH 131.2 degC (limit 120.0 degC) line 1 station C",
    "2026-03-14 07:02:19 ALM-4741 CONVEYOR_C7 belt speed LOW 0.42 m/s (limit 0.50 m/s) line 4 station D",
]
EXTRACTION = ("Copy the fields of this alarm into one line of the form "
              "'time: <time> | id: <id> | tag: <tag> | what: <what> | value: <value> | limit: <limit> | where: <where>'."
              "\nAlarm: {alarm}")
SHIFT_LOGS = [
    "06:00 shift A started, 3 operators on line 2.\n06:40 pump P101 restarted after a pressure trip.\n"
    "07:15 filter F3 changed on line 2.\n08:05 tank T204 refilled to 80 %.\n09:30 conveyor C7 belt tension adjusted.",
    "14:00 shift B started, 2 operators on line 1.\n14:25 motor M12 cooled down after a temperature alarm.\n"
    "15:10 sensor TT-12 recalibrated.\n16:45 valve V8 replaced on line 1.\n17:20 batch 4471 released to packing.",
]
SHIFT = "Restate this shift log entry by entry, keeping every time, name and number:\n{log}"
FREE = ["What is a centrifugal pump?", "Why do electric motors overheat?", "What does a PLC do in a factory?",
        "How does a safety relay work?"]


def default_model() -> Path:
    from core.config.builtin import resolve_builtin
    return resolve_builtin("smollm2")


def workloads() -> dict[str, list[tuple[str, str | None]]]:
    """name -> [(prompt, grammar or None)]; four prompts each (the 4-sequence figure runs them at once)."""
    from core.config import demo_config
    from core.task_answers import schema_text
    task = demo_config().models["assistant"].tasks["alarm-triage"]
    grammar = schema_text(task)
    return {
        "extraction": [(EXTRACTION.format(alarm=a), None) for a in ALARMS],
        "shift-log": [(SHIFT.format(log=SHIFT_LOGS[i % 2]), None) for i in range(4)],
        "task-json": [(task.prompt_for({"AlarmText": a}), grammar) for a in ALARMS],
        "free": [(q, None) for q in FREE],
    }


async def start(model: Path, args, speculation: str) -> GenerativeModelService:
    draft = str(Path(args.draft_model).resolve()) if speculation == "draft" else None
    cache = Path(args.cache)
    settings = GenerativeSettings(kv_slots=4, max_seq_len=1024, max_new_tokens=args.new_tokens, threads=args.threads,
                                  compile=args.compile, compile_cache_dir=str(cache / "compile"),
                                  weight_cache_dir=str(cache / "weights"), cpu_kernel_dir=str(cache / "kernels"),
                                  speculation=speculation, speculation_draft_model=draft, seed=1)
    svc = GenerativeModelService("bench", model, settings, version_label="bench")
    await svc.start()
    if svc.state != "Ready":
        raise SystemExit(f"our engine failed to load: {svc.failure_reason}")
    for prompt, grammar in [(FREE[0], None), *[(p, g) for p, g in workloads()["task-json"][:1]]]:  # warm-up
        await svc.generate("", prompt, 8, 0.0, time.monotonic() + 600, grammar=grammar)
    return svc


async def ours_once(svc: GenerativeModelService, items, concurrent: bool, args) -> tuple:
    """(tokens/s, the answers, tokens drafted, drafted tokens accepted, ms per engine step, draft model forwards,
    ms per draft forward) of one run of the workload."""
    loop = svc._engine_loop
    before = loop.speculation_counts()
    steps0, (forwards0, seconds0) = loop.step_counts()[0], loop.draft_counts()

    def call(prompt, grammar):
        return svc.generate("", prompt, args.new_tokens, 0.0, time.monotonic() + 600, grammar=grammar)

    t0 = time.perf_counter()
    if concurrent:
        results = await asyncio.gather(*(call(p, g) for p, g in items))
    else:
        results = [await call(p, g) for p, g in items]
    wall = time.perf_counter() - t0
    after = loop.speculation_counts()
    steps, (forwards, seconds) = loop.step_counts()[0] - steps0, loop.draft_counts()
    forwards, seconds = forwards - forwards0, seconds - seconds0
    return (sum(r.token_count for r in results) / wall, [r.text for r in results], after[1] - before[1],
            after[2] - before[2], 1000 * (wall - seconds) / max(1, steps), forwards,
            1000 * seconds / max(1, forwards))


class LlamaCppChat:
    """llama-cpp-python's chat completion on the file, default decoding or with its prompt-lookup drafts."""

    def __init__(self, model: Path, args, lookup: bool):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        threads = args.threads or os.cpu_count()
        self.args = args
        self.llm = Llama(model_path=str(model), n_ctx=1024, n_threads=threads, n_threads_batch=threads,
                         verbose=False, seed=1, draft_model=LlamaPromptLookupDecoding() if lookup else None)

    def rate(self, items) -> float:
        tokens, t0 = 0, time.perf_counter()
        for prompt, grammar in items:
            kw = {"response_format": {"type": "json_object", "schema": json.loads(grammar)}} if grammar else {}
            out = self.llm.create_chat_completion(messages=[{"role": "user", "content": prompt}], temperature=0.0,
                                                  max_tokens=self.args.new_tokens, **kw)
            tokens += out["usage"]["completion_tokens"]
        return tokens / (time.perf_counter() - t0)


def llama_cpp_pair(model: Path, args):
    if LLAMA_CPP_DIR.is_dir():
        sys.path.insert(0, str(LLAMA_CPP_DIR))
    try:
        return LlamaCppChat(model, args, False), LlamaCppChat(model, args, True)
    except ImportError:
        return None


async def main_async(args) -> None:
    model = Path(args.model) if args.model else default_model()
    work = workloads()
    if args.workloads:
        work = {k: v for k, v in work.items() if k in args.workloads.split(",")}
    modes = ("off", "lookup", "draft") if args.draft_model else ("off", "lookup")
    if args.draft_model:
        print(f"draft model: {Path(args.draft_model).name} drafting for {model.name}")
    print(isa_banner(args.isa))
    print(f"model: {model.name}; {args.new_tokens} new tokens at most per answer; threads {args.threads or 'all'}; "
          f"best of {args.repeats}, on and off interleaved")
    figures: dict[tuple[str, str], float] = {}
    services = {mode: await start(model, args, mode) for mode in modes}
    print(f"ours: weights on {services['off']._engine.backend}")
    try:
        for name, items in work.items():
            for n in (1, 4):
                best = {mode: (0.0, [], 0, 0, 0.0, 0, 0.0) for mode in modes}
                for _ in range(args.repeats):
                    for mode, svc in services.items():
                        got = await ours_once(svc, items, n == 4, args)
                        if got[0] > best[mode][0]:
                            best[mode] = got
                off, on = best["off"], best["lookup"]
                figures[(name, f"off{n}")], figures[(name, f"lookup{n}")] = off[0], on[0]
                acc = on[3] / on[2] if on[2] else float("nan")
                figures[(name, f"acc{n}")] = acc
                print(f"  {name:10s} {n} seq: off {off[0]:7.1f} tokens/s, lookup {on[0]:7.1f} tokens/s "
                      f"({on[0] / off[0]:.2f}x), acceptance {acc:.2f} ({on[3]} of {on[2]} drafted); answers "
                      f"{'identical' if on[1] == off[1] else 'DIFFER'}", flush=True)
                if "draft" in best:
                    dr = best["draft"]
                    figures[(name, f"draft{n}")] = dr[0]
                    figures[(name, f"dacc{n}")] = dacc = dr[3] / dr[2] if dr[2] else float("nan")
                    print(f"  {name:10s} {n} seq: draft model {dr[0]:7.1f} tokens/s ({dr[0] / off[0]:.2f}x off), "
                          f"acceptance {dacc:.2f} ({dr[3]} of {dr[2]} drafted); answers "
                          f"{'identical' if dr[1] == off[1] else 'DIFFER'}; {dr[5]} draft forwards of "
                          f"{dr[6]:.1f} ms, the rest {dr[4]:.1f} ms a step (off: {off[4]:.1f} ms a step)",
                          flush=True)
    finally:
        for svc in services.values():
            await svc.stop()
    pair = None if args.no_llama_cpp else llama_cpp_pair(model, args)
    if pair is None and not args.no_llama_cpp:
        print("llama.cpp: not installed (bash scripts/setup-bench.sh)")
    if pair is not None:
        for name, items in work.items():
            rates = [0.0, 0.0]
            for _ in range(args.repeats):
                for i, chat in enumerate(pair):
                    rates[i] = max(rates[i], chat.rate(items))
            figures[(name, "llama.cpp")], figures[(name, "llama.cpp+lookup")] = rates
            print(f"  {name:10s} 1 seq: llama.cpp {rates[0]:7.1f} tokens/s, llama.cpp+lookup {rates[1]:7.1f} "
                  f"tokens/s", flush=True)
    print("\n| workload | ours off 1 | ours lookup 1 | on/off | acceptance | llama.cpp 1 | ours/it | "
          "llama.cpp+lookup 1 | ours/it | ours off 4 | ours lookup 4 | on/off |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in work:
        f = lambda k: figures.get((name, k))  # noqa: E731
        on1, off1, lc, lcl = f("lookup1"), f("off1"), f("llama.cpp"), f("llama.cpp+lookup")
        cells = [f"{off1:.1f}", f"{on1:.1f}", f"{on1 / off1:.2f}x", f"{f('acc1'):.2f}",
                 f"{lc:.1f}" if lc else "-", f"{on1 / lc:.2f}x" if lc else "-",
                 f"{lcl:.1f}" if lcl else "-", f"{on1 / lcl:.2f}x" if lcl else "-",
                 f"{f('off4'):.1f}", f"{f('lookup4'):.1f}", f"{f('lookup4') / f('off4'):.2f}x"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.draft_model:
        print(f"\n| workload | ours off 1 | ours draft 1 | draft/off | acceptance | ours off 4 | ours draft 4 | "
              f"draft/off | acceptance |  (draft {Path(args.draft_model).name} for {model.name})")
        print("|---|---|---|---|---|---|---|---|---|")
        for name in work:
            f = lambda k: figures.get((name, k))  # noqa: E731
            print(f"| {name} | {f('off1'):.1f} | {f('draft1'):.1f} | {f('draft1') / f('off1'):.2f}x | "
                  f"{f('dacc1'):.2f} | {f('off4'):.1f} | {f('draft4'):.1f} | {f('draft4') / f('off4'):.2f}x | "
                  f"{f('dacc4'):.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file (default: the demo model)")
    ap.add_argument("--draft-model", help="GGUF file drafting for --model (speculation: draft), measured too")
    ap.add_argument("--workloads", help="comma-separated names to run (default: all)")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--compile", default="off", choices=("off", "on", "auto"))
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "appliance-bench"))
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--isa", default="native", help="emulate a CPU whose best is this ISA (as bench/generate.py: "
                    "ours and torch; llama.cpp stays its native build)")
    args = ap.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
