"""Draft-model speculation (`speculation: draft`, appliance/engine/llm/draft_model.py): a draft that is the target
itself (it proposes what the target says: nearly everything accepted) and a different random model of the same
vocabulary (little accepted) both give plain decoding's greedy tokens on every architecture, with speculating and
plain rows in one step; the draft's KV cache holds exactly the tokens it says it holds after its rollbacks; sampling
keeps the target distribution; the YAML keys and check-config's refusals; a Generate over OPC UA with a draft model
configured answers as without."""
from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from appliance.engine.llm.draft_model import DraftModel, common_prefix
from appliance.engine.llm.speculation import ModelDrafter, SpeculationSettings

DRAFT = SpeculationSettings("draft", draft_min=1, draft_max=8)


def test_common_prefix():
    assert common_prefix([1, 2, 3, 4], [1, 2, 3, 4, 5]) == 4
    assert common_prefix([1, 2, 9, 4], [1, 2, 3, 4]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([7], [1]) == 0
    long = list(range(1000))
    assert common_prefix(long, long[:617] + [-1] + long[618:]) == 617


def test_the_draft_model_length_follows_the_lookup_policy():
    d = ModelDrafter(DRAFT)
    assert d.wanted(8) == 4 and d.wanted(2) == 2  # from 4, bounded by the room
    d.record(4, 4)
    assert d.wanted(20) == 8  # accepted whole: doubles
    d.record(8, 0)
    assert d.wanted(20) == 0 and d.wanted(20) == 4  # a miss pauses drafting for a step, then halves


def test_the_best_draft_length_is_what_pays_at_the_measured_cost():
    from appliance.engine.llm.speculation import best_draft_length
    assert best_draft_length(0.98, 0.05, 1, 1, 8) == 8  # a cheap draft that is nearly always right: all of it
    assert best_draft_length(0.47, 0.8, 1, 1, 8) == 0  # the measured SmolLM2 Q4_0 / Q8_0 pair on free answers
    assert best_draft_length(1.0, 1.0, 1, 1, 8) == 0  # a draft as dear as the target gains nothing even if right
    assert 0 < best_draft_length(0.9, 0.3, 1, 1, 8) < 8  # the last tokens are too unlikely to be worth their cost
    # with four rows in the step a draft's forwards hold up three other rows' tokens too
    assert best_draft_length(0.9, 0.3, 1, 1, 8) > 0 and best_draft_length(0.9, 0.3, 4, 1, 8) == 0


def test_the_cost_gate_holds_a_draft_model_to_what_pays():
    from appliance.engine.llm.speculation import GATE_PAUSE
    d = ModelDrafter(DRAFT)
    assert d.wanted_at_cost(8, None, 1) == 4  # the cost not measured yet: the acceptance policy alone
    d = ModelDrafter(DRAFT)
    assert d.wanted_at_cost(8, 0.05, 1) == 1  # a sequence's first draft is a short probe
    d.record(1, 1)
    assert d.wanted_at_cost(8, 0.05, 1) == 8  # cheap and accepted: the whole room the length allows
    d.record(8, 8)
    assert d.wanted_at_cost(20, 1.0, 1) == 0  # as dear as a step: nothing, and a pause
    assert [d.wanted_at_cost(20, 0.05, 1) for _ in range(GATE_PAUSE)] == [0] * GATE_PAUSE
    assert d.wanted_at_cost(20, 1.0, 1) == 1  # then one short probe, whatever the gate says
    assert d.wanted_at_cost(20, 1.0, 1) == 0
    ungated = ModelDrafter(SpeculationSettings("draft", draft_min=1, draft_max=8, cost_gate=False))
    assert ungated.wanted_at_cost(8, 5.0, 1) == 4


pytest.importorskip("transformers")

from appliance.engine.llm.runner import ModelRunner  # noqa: E402
from appliance.engine.llm.scheduler import Scheduler  # noqa: E402
from appliance.engine.llm.sequence import Sequence  # noqa: E402
from appliance.engine.llm.slots import SlotManager  # noqa: E402
from appliance.engine.llm.token_turns import TokenTurns  # noqa: E402
from loader.weights import load_weights  # noqa: E402
from models.llama import KVCache, LlamaModel  # noqa: E402
from chi_square import assert_same_distribution  # noqa: E402
from test_speculation import architectures, copying_prompts  # noqa: E402,F401 (a fixture)


@pytest.fixture(scope="module")
def stranger(tmp_path_factory):
    """A random model of another seed with the test vocabulary: its drafts are mostly refused."""
    from arch_models import hf_model
    from tiny_llm import _tokenizer
    d = tmp_path_factory.mktemp("stranger")
    tok = _tokenizer(d)
    hf_model("llama", tok.get_vocab_size(), seed=29).save_pretrained(str(d))
    w = load_weights(d, torch.float32)
    return LlamaModel(w.config, w.tensors)


def random_prompts(vocab: int, n: int, seed: int) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {str(i): [1] + torch.randint(3, vocab, (5 + 4 * i,), generator=g).tolist() for i in range(n)}


def reference_draft(draft_model, context: list[int], k: int) -> list[int]:
    """The draft model's greedy continuation of `context`, computed afresh in a cache of its own."""
    cache = KVCache(draft_model.config, 1, 256, torch.float32)
    one = torch.tensor([0])
    logits = draft_model.forward(cache, torch.tensor([context]), one, torch.tensor([0]), torch.tensor([len(context)]))
    out = [int(logits[0].argmax())]
    while len(out) < k:
        logits = draft_model.forward(cache, torch.tensor([[out[-1]]]), one, torch.tensor([len(context) + len(out) - 1]),
                                     torch.tensor([1]))
        out.append(int(logits[0].argmax()))
    return out


def run(model, prompts, draft_model=None, staggered=False, max_tokens=24, slots=4, temperature=0.0, seed=0,
        settings=DRAFT, check_drafts=False):
    """Every prompt to its end through the scheduler, the draft model (as the engine calls it) and the runner."""
    cache = KVCache(model.config, slots, 256, torch.float32)
    sched = Scheduler(SlotManager(slots, 256), TokenTurns(prompts), prefill_chunk=16, max_prefill_tokens=64,
                      speculation=settings if draft_model is not None else None)
    runner = ModelRunner(model, cache)
    draft = DraftModel(draft_model, KVCache(draft_model.config, slots, 256, torch.float32)) if draft_model else None
    seqs = {name: Sequence(session_key=f"s{name}", prompt=name, max_tokens=max_tokens, one_shot=True,
                           temperature=temperature, seed=seed) for name in prompts}
    queue = list(seqs.values())
    if not staggered:
        for s in queue:
            sched.add(s)
        queue = []
    mixed = 0  # steps with a drafted row and a plain decode row
    while queue or sched.has_work:
        if queue:  # one arrival per step: prefills, drafted rows and plain rows share steps
            sched.add(queue.pop(0))
        plan = sched.schedule()
        assert not plan.failed
        if draft is not None:
            draft.fill(plan, sched.slots)
        for r in plan.decode if check_drafts else []:  # what a draft model with no stale state would say
            if r.draft:
                context = sched.slots.slot(r.slot).tokens[:r.pos + 1]
                assert r.draft == reference_draft(draft_model, context, len(r.draft)), (r.slot, r.pos)
        mixed += any(r.draft for r in plan.decode) and any(not r.draft for r in plan.decode)
        sched.commit(plan, runner.run(plan))
    for s in seqs.values():
        runner.forget(s)
    return {name: s.generated for name, s in seqs.items()}, runner, draft, mixed


def assert_cache_holds_what_it_says(draft: DraftModel) -> None:
    """Each slot of the draft's cache has the keys and values of the tokens `held` names, as a fresh computation of
    them gives: what a refused draft wrote was rolled back before it could count."""
    fresh = DraftModel(draft.model, KVCache(draft.model.config, draft.cache.n_slots, draft.cache.max_seq_len,
                                            torch.float32))
    checked = 0
    for slot, held in enumerate(draft.held):
        if not held:
            continue
        fresh._forward([held], [slot], [0])
        n = len(held)
        got, want = draft.cache.kv[:, :, slot, :, :n], fresh.cache.kv[:, :, slot, :, :n]
        assert torch.allclose(got, want, atol=1e-4), (slot, float((got - want).abs().max()))
        checked += 1
    assert checked


@pytest.mark.parametrize("variant", ["llama", "llama3", "qwen2", "qwen3", "phi3", "phi3-longrope"])
def test_greedy_tokens_are_plain_decodings_with_either_draft(architectures, stranger, variant):
    model = architectures[variant]
    prompts = {**copying_prompts(model.config.vocab_size, 4, seed=3),
               **{f"r{k}": v for k, v in random_prompts(model.config.vocab_size, 4, seed=4).items()}}
    plain, *_ = run(model, prompts)
    itself, runner, draft, mixed = run(model, prompts, draft_model=model, staggered=True)
    assert itself == plain
    assert runner.accepted >= 0.9 * runner.drafted > 0, (runner.drafted, runner.accepted)  # it says what we say
    assert mixed > 0  # drafted rows and plain rows in one step (the step's draft budget leaves some plain)
    other, runner, draft, _ = run(model, prompts, draft_model=stranger, staggered=True, check_drafts=True)
    assert other == plain
    assert runner.verify_rows > 0 and runner.accepted < 0.5 * runner.drafted, (runner.drafted, runner.accepted)
    assert_cache_holds_what_it_says(draft)  # after many refused drafts


def test_a_draft_is_not_asked_past_its_context():
    """A draft model with fewer positions than the target's slots drafts nothing past them (rows stay plain)."""
    from appliance.engine.llm.scheduler import DecodeRow, StepPlan
    slots = SlotManager(1, 256)
    slot = slots.slot(0)
    slot.tokens = list(range(3, 40))
    plan = StepPlan(decode=[DecodeRow(None, 0, 36, 39, draft_wanted=4)])

    class Never:
        def forward(self, *a, **k):
            raise AssertionError("the draft model ran")
    draft = DraftModel(Never(), type("Cache", (), {"n_slots": 1, "max_seq_len": 38})())
    draft.fill(plan, slots)
    assert plan.decode[0].draft == []


def test_sampled_replies_with_a_draft_model_follow_the_plain_distribution(architectures, stranger):
    """The reply's second token (the one a draft proposes: the first comes from the prompt's prefill) over many
    seeds, drafted by a stranger (its greedy token often one the target finds unlikely: refused, the residual draw
    decides) and plain: one distribution (a two-sample chi-square). A verifier that kept every draft fails this by
    far; the residual draw's own exactness is test_speculation.py's per-position test."""
    model = architectures["llama"]
    prompts = random_prompts(model.config.vocab_size, 1, seed=5)

    def draws(draft_model) -> tuple[dict, ModelRunner | None]:
        counts: dict[tuple[int, ...], int] = {}
        runner = None
        for seed in range(240):
            got, runner, _, _ = run(model, prompts, draft_model=draft_model, max_tokens=3, temperature=0.4,
                                    seed=seed, settings=SpeculationSettings("draft", draft_min=1, draft_max=2))
            key = tuple(got["0"][1:2])
            counts[key] = counts.get(key, 0) + 1
        return counts, runner

    plain, _ = draws(None)
    spec, runner = draws(stranger)
    assert runner.verify_rows > 0
    assert_same_distribution(plain, spec)


# ---- the YAML keys and check-config ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A tiny target, a draft of another seed (the same tokenizer), and one whose tokenizer has a token renamed."""
    from tiny_llm import make_model_dir
    root = tmp_path_factory.mktemp("drafts")
    make_model_dir(root / "target", seed=1)
    make_model_dir(root / "draft", seed=2)
    shutil.copytree(root / "draft", root / "other-vocab")
    tok = json.loads((root / "other-vocab" / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    name = next(t for t, i in vocab.items() if i == 100)
    vocab["zzz" + name] = vocab.pop(name)
    (root / "other-vocab" / "tokenizer.json").write_text(json.dumps(tok))
    return root


def config_text(draft: str | None, mode: str = "draft", kind: str = "generative") -> str:
    text = f"models:\n  llm:\n    kind: {kind}\n    path: target\n    speculation: {mode}\n"
    return text + (f"    speculation_draft_model: {draft}\n" if draft else "")


def test_the_yaml_names_a_draft_model_and_check_config_refuses_a_wrong_one(model_dirs, capsys):
    from appliance.cli import main
    from core.config import ConfigError, load_config_text

    cfg = load_config_text(config_text("draft"), source="a.yaml", base_dir=model_dirs)
    assert cfg.models["llm"].speculation == "draft"
    assert cfg.models["llm"].speculation_draft_model == model_dirs / "draft"  # relative to the YAML's directory
    for text, line, key, words in [
            (config_text(None), 5, "speculation", "speculation: draft needs speculation_draft_model"),
            (config_text("missing.gguf"), 6, "speculation_draft_model", "no such file or directory"),
            (config_text("draft", mode="lookup"), 6, "speculation_draft_model", "applies with speculation: draft"),
            (config_text("draft", kind="tensor").replace("    speculation: draft\n", ""), 5,
             "speculation_draft_model", "applies to generative models only")]:
        with pytest.raises(ConfigError) as info:
            load_config_text(text, source="a.yaml", base_dir=model_dirs)
        assert f"a.yaml:{line}: models.llm.{key}: " in str(info.value) and words in str(info.value), str(info.value)

    good = model_dirs / "good.yaml"
    good.write_text(config_text("draft"))
    assert main(["check-config", str(good)]) == 0
    bad = model_dirs / "bad.yaml"
    bad.write_text(config_text("other-vocab"))
    load_config_text(bad.read_text(), source="bad.yaml", base_dir=model_dirs)  # serving leaves it to the engine
    capsys.readouterr()
    assert main(["check-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:6: models.llm.speculation_draft_model: the draft model's tokenizer is not the model's: token 100" \
        in err, err


def test_the_engine_refuses_a_draft_with_another_tokenizer(model_dirs):
    from appliance.engine.llm.loading import load_engine
    from appliance.engine.llm.settings import GenerativeSettings
    from core.errors import EngineFailure
    settings = GenerativeSettings(kv_slots=2, max_seq_len=128, speculation="draft",
                                  speculation_draft_model=str(model_dirs / "other-vocab"))
    with pytest.raises(EngineFailure, match="the draft model's tokenizer is not the target's"):
        load_engine("llm", model_dirs / "target", settings, None, None)
    settings.speculation_draft_model = str(model_dirs / "draft")
    engine = load_engine("llm", model_dirs / "target", settings, None, None)
    assert engine.draft is not None and engine.draft.cache.n_slots == 2 and "draft model" in engine.backend


# ---- over OPC UA -------------------------------------------------------------------------------------------------

def test_generate_over_opc_ua_with_a_draft_model_answers_as_without(tmp_path, model_dirs):
    from asyncua import ua

    from harness import RunningAppliance
    from uaclient import arg_statuses, call, read, session, status_name
    v = ua.VariantType
    target = str(model_dirs / "target")
    app = RunningAppliance(tmp_path, {
        "plain": {"kind": "generative", "path": target, "worker": "llm"},
        "drafted": {"kind": "generative", "path": target, "worker": "llm", "speculation": "draft",
                    "speculation_draft_model": str(model_dirs / "draft")}},
        {"engine": {"kv_slots": 4, "max_seq_len": 256, "max_new_tokens": 24, "prefill_chunk": 32}})
    prompts = ["pump one", "the tank level is rising", "valve 3 is open", "alarm: pressure high in line four",
               "what is a centrifugal pump?", "temperature of reactor two"]
    try:
        plc = app.issue("plc1", "operator")

        async def ask(model, prompt):  # a session of its own: a turn with no conversation before it
            async with session(app, *plc) as c:
                r = await call(c, model, "Generate", [ua.Variant(prompt, v.String), ua.Variant(24, v.UInt32),
                                                      ua.Variant(0.0, v.Float)])
            assert status_name(r) == "Good", (model, prompt, status_name(r), arg_statuses(r))
            return r.OutputArguments[0].Value, r.OutputArguments[1].Value

        async def go():
            async with session(app, *plc) as c:
                assert "draft model" in await read(c, "Models", "drafted", "Backend")
                assert "draft model" not in await read(c, "Models", "plain", "Backend")
            plain = [await ask("plain", p) for p in prompts]
            together = await asyncio.gather(*[ask("drafted", p) for p in prompts])  # batched
            alone = [await ask("drafted", p) for p in prompts]
            return plain, list(together), alone

        plain, together, alone = app.run(go(), timeout=240)
        assert together == plain and alone == plain
        assert any(n > 1 for _, n in plain)
    finally:
        app.stop()
