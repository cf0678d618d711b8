"""Decode on a GPU: same greedy tokens through the kernels (eager and CUDA graphs) as the torch path and HF, then
decode tokens/s at 1, 8 and 32 slots and decode attention's achieved bandwidth against the GPU's peak.

    python bench/gpu_decode.py [--quick] [--cpu-dry-run]     (prints SKIP and exits 0 without a CUDA device)

Models (random weights, built offline by transformers): "smollm2" has SmolLM2-135M's shape (576 hidden, 30 layers,
9/3 heads, 49152 vocab), "llama1b" about 1.1B parameters (2048 hidden, 16 layers, 32/8 heads, 8192 inter., 32000
vocab). Paths, all bf16 for speed, one decode step per generated token, 64 steps after a 32-token context:
  torch eager   models.llama.LlamaModel.forward with torch's ops (the one forward, models/forward.py)
  twins         LlamaModel.decode_kernels with the kernels' torch twins (KernelOps backend "torch")
  triton        LlamaModel.decode_kernels with the Triton kernels, eager launches
  triton+graphs the same step captured per batch bucket (LlamaModel.decode_graphs, models/cuda_graphs.py)
  HF generate   LlamaForCausalLM.generate(); decode time = t(65 new tokens) - t(1 new token)
Goals of issue 12: at 8 slots triton+graphs >= 3x HF; decode attention >= 50% of peak bandwidth.
"""
from __future__ import annotations

import argparse
import time

from gpu_common import (DEVICE, DRY_RUN, Results, cuda_ms, free_memory, peak_bandwidth_bytes_s, require_cuda,  # noqa: I001
                        sync)

torch = require_cuda("decode")

import transformers  # noqa: E402

from kernels.decode_attention import decode_attention  # noqa: E402
from models.llama import KVCache, LlamaModel  # noqa: E402
from models.llama_config import LlamaConfig  # noqa: E402

SHAPES = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3),
    "llama1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8),
}
CONTEXT, STEPS, MAX_SEQ = 32, 64, 512
ATTENTION_CASES = ((8, 2048), (32, 2048), (32, 4096))
if DRY_RUN:
    SHAPES = {"tiny": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=1)}
    CONTEXT, STEPS, MAX_SEQ = 4, 3, 32
    ATTENTION_CASES = ((2, 40),)


def hf_model(shape: dict, dtype):
    cfg = transformers.LlamaConfig(**shape, max_position_embeddings=4096, rope_theta=10000.0, bos_token_id=1,
                                   eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def engine_model(hf, dtype, kernels: str = "auto"):
    cfg = LlamaConfig.from_hf_dict(hf.config.to_dict())
    return LlamaModel(cfg, dict(hf.state_dict()), dtype=dtype, device=DEVICE, kernels=kernels)


def greedy_runner(model, prompts, new_tokens) -> list[list[int]]:
    """The serving path: Scheduler + ModelRunner, decode through the kernels as CUDA graphs (the runner's default on
    CUDA with the kernels; eager buffers in the CPU dry run)."""
    from appliance.engine.llm.runner import ModelRunner
    from appliance.engine.llm.scheduler import Scheduler
    from appliance.engine.llm.sequence import Sequence
    from appliance.engine.llm.slots import SlotManager
    from appliance.engine.llm.token_turns import TokenTurns, run_to_end

    b = len(prompts)
    sched = Scheduler(SlotManager(b, MAX_SEQ), TokenTurns({str(i): p for i, p in enumerate(prompts)}),
                      prefill_chunk=256)
    runner = ModelRunner(model, KVCache(model.config, b, MAX_SEQ, model.dtype, DEVICE), graphs=True)
    seqs = [Sequence(session_key=f"s{i}", prompt=str(i), max_tokens=new_tokens) for i in range(b)]
    for s in seqs:
        sched.add(s)
    run_to_end(sched, runner)
    return [s.generated for s in seqs]


def kernel_step(model: LlamaModel, cache: KVCache, backend: str, graphs: bool):
    """(token_ids, slot_ids, positions) -> logits through the one forward's kernel ops: the Triton kernels or their
    torch twins, eager or captured per batch bucket (graphs)."""
    if graphs:
        runner = model.decode_graphs(cache)
        cache.kv.zero_()  # capture-time runs of the pad rows touched only scratch cells
        return lambda t, s, p: runner.run(token_ids=t, slot_ids=s, positions=p, lengths=p + 1)
    ops = model.kernel_ops(cache, backend)
    return lambda t, s, p: model.decode_kernels(cache, t, s, p, ops=ops)


def greedy_kernel(model: LlamaModel, prompts, new_tokens, backend: str, graphs: bool) -> list[list[int]]:
    """All prompts the same length here: prompt fed token by token, then greedy, every step one token per row."""
    b = len(prompts)
    step = kernel_step(model, KVCache(model.config, b, MAX_SEQ, model.dtype, DEVICE), backend, graphs)
    slot_ids = torch.arange(b, device=DEVICE)
    seqs = [list(p) for p in prompts]
    for pos in range(len(prompts[0]) + new_tokens - 1):
        tokens = torch.tensor([s[pos] for s in seqs], device=DEVICE)
        logits = step(tokens, slot_ids, torch.full((b,), pos, device=DEVICE))
        if pos >= len(prompts[0]) - 1:
            for s, t in zip(seqs, logits.argmax(-1).tolist()):
                s.append(t)
    return [s[len(prompts[0]):] for s in seqs]


def greedy_engine(model, prompts, new_tokens) -> list[list[int]]:
    b, n = len(prompts), len(prompts[0])
    cache = KVCache(model.config, b, MAX_SEQ, model.dtype, DEVICE)
    slots = torch.arange(b, device=DEVICE)
    logits = model.forward(cache, torch.tensor(prompts, device=DEVICE), slots, torch.zeros(b, dtype=torch.long),
                           torch.full((b,), n))
    out = [[t] for t in logits.argmax(-1).tolist()]
    for i in range(new_tokens - 1):
        tokens = torch.tensor([[o[-1]] for o in out], device=DEVICE)
        logits = model.forward(cache, tokens, slots, torch.full((b,), n + i), torch.ones(b, dtype=torch.long))
        for o, t in zip(out, logits.argmax(-1).tolist()):
            o.append(t)
    return out


def greedy_hf(hf, prompts, new_tokens) -> list[list[int]]:
    ids = torch.tensor(prompts, device=DEVICE)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def prompts_for(batch, vocab, length=CONTEXT):
    g = torch.Generator().manual_seed(batch)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def check_tokens(res: Results, name: str, quick: bool):
    """fp32 everywhere: on random weights bf16 rounding alone can flip near-tied argmaxes."""
    hf = hf_model(SHAPES[name], torch.float32)
    prompts = prompts_for(2, SHAPES[name]["vocab_size"], 12)
    n = 4 if DRY_RUN else 8 if quick else 16
    want = greedy_hf(hf, prompts, n)
    res.check(greedy_engine(engine_model(hf, torch.float32), prompts, n) == want, f"{name} fp32 engine == HF")
    res.check(greedy_runner(engine_model(hf, torch.float32, "triton"), prompts, n) == want,
              f"{name} fp32 engine runner (kernels + CUDA graphs) == HF")
    for backend, graphs in (("torch", False), ("triton", False), ("triton", True)):
        got = greedy_kernel(engine_model(hf, torch.float32, "triton"), prompts, n, backend, graphs)
        agree = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
        res.check(got == want, f"{name} fp32 kernels[{backend}{'+graphs' if graphs else ''}] == HF greedy",
                  f"{agree}/{len(prompts) * n} tokens agree")
    del hf
    free_memory()


def decode_rate(step, batch: int) -> float:
    slot_ids = torch.arange(batch, device=DEVICE)
    tokens = torch.ones(batch, dtype=torch.long, device=DEVICE)
    for i in range(3):
        tokens = step(tokens, slot_ids, torch.full((batch,), CONTEXT + i, device=DEVICE)).argmax(-1)
    sync()
    t0 = time.perf_counter()
    for i in range(STEPS):
        tokens = step(tokens, slot_ids, torch.full((batch,), CONTEXT + i, device=DEVICE)).argmax(-1)
    sync()
    return batch * STEPS / (time.perf_counter() - t0)


def throughput(res: Results, name: str, batches):
    hf = hf_model(SHAPES[name], torch.bfloat16)
    prompt_len = CONTEXT
    for batch in batches:
        rates = {}
        try:
            eng = engine_model(hf, torch.bfloat16)
            cache = KVCache(eng.config, batch, MAX_SEQ, torch.bfloat16, DEVICE)
            rates["torch eager"] = decode_rate(lambda t, s, p: eng.forward(
                cache, t.view(-1, 1), s, p, torch.ones_like(p)), batch)
            del eng, cache
        except Exception as exc:  # noqa: BLE001 - the engine's API may move; the other paths still count
            res.check(False, f"{name} torch eager path", repr(exc)[:200])
        km = engine_model(hf, torch.bfloat16, "triton")
        for label, backend, graphs in (("twins", "torch", False), ("triton", "triton", False),
                                       ("triton+graphs", "triton", True)):
            rates[label] = decode_rate(kernel_step(km, KVCache(km.config, batch, MAX_SEQ, torch.bfloat16, DEVICE),
                                                   backend, graphs), batch)
            free_memory()
        del km
        ids = torch.tensor(prompts_for(batch, SHAPES[name]["vocab_size"], prompt_len), device=DEVICE)
        gen = lambda n: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,  # noqa: E731
                                    min_new_tokens=n, do_sample=False, pad_token_id=0)
        gen(2)
        timed = {}
        for n in (1, STEPS + 1):
            sync()
            t0 = time.perf_counter()
            gen(n)
            sync()
            timed[n] = time.perf_counter() - t0
        rates["HF generate"] = batch * STEPS / (timed[STEPS + 1] - timed[1])
        line = ", ".join(f"{k} {v:,.0f}" for k, v in rates.items())
        res.figure(f"{name} bf16 decode tokens/s at {batch} slots", line)
        if "triton+graphs" in rates:
            ratio = rates["triton+graphs"] / rates["HF generate"]
            res.figure(f"{name} {batch} slots triton+graphs / HF", f"{ratio:.2f}x (goal at 8 slots: >= 3x)")
    del hf
    free_memory()


def attention_bandwidth(res: Results):
    peak, source = peak_bandwidth_bytes_s()
    res.figure("peak memory bandwidth", f"{peak / 1e9:,.0f} GB/s ({source})")
    for batch, length in ATTENTION_CASES:
        n_kv, hd, heads = 8, 64, 32
        kv = torch.randn(2, batch, n_kv, length + 1, hd, device=DEVICE, dtype=torch.bfloat16)
        q = torch.randn(batch, heads, hd, device=DEVICE, dtype=torch.bfloat16)
        slots = torch.randperm(batch, device=DEVICE)
        lengths = torch.full((batch,), length, device=DEVICE)
        nbytes = 2 * batch * n_kv * length * hd * 2
        ms = cuda_ms(lambda: decode_attention(q, kv[0], kv[1], slots, lengths, backend="triton"))
        ms_twin = cuda_ms(lambda: decode_attention(q, kv[0], kv[1], slots, lengths, backend="torch"))
        achieved = nbytes / (ms / 1e3)
        res.figure(f"decode attention bf16 {batch} rows x {length} positions (llama1b heads)",
                   f"{ms * 1e3:.1f} us, {achieved / 1e9:,.0f} GB/s = {achieved / peak:.0%} of peak "
                   f"(goal >= 50%); torch twin {ms_twin * 1e3:.1f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer tokens and batch sizes")
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny model on the CPU through the interpreter")
    args = ap.parse_args()
    res = Results("decode on " + (DEVICE if DRY_RUN else torch.cuda.get_device_name(0)))
    for name in SHAPES:
        try:
            check_tokens(res, name, args.quick)
        except Exception as exc:  # noqa: BLE001
            res.check(False, f"{name} greedy check", repr(exc)[:300])
    try:
        attention_bandwidth(res)
    except Exception as exc:  # noqa: BLE001
        res.check(False, "decode attention bandwidth", repr(exc)[:300])
    for name in SHAPES:
        try:
            throughput(res, name, (2,) if DRY_RUN else (1, 8) if args.quick else (1, 8, 32))
        except Exception as exc:  # noqa: BLE001
            res.check(False, f"{name} throughput", repr(exc)[:300])
    res.finish()


if __name__ == "__main__":
    main()
