"""Choose: each option's score is the sum of its tokens' log-probabilities after the prompt, equal to what
`transformers` computes on the same weights (the oracle); all options in batched forwards over the prompt's cache
(more options than free slots go in groups); deterministic; limits refused as InvalidArgument. Then the same through
the worker process (RemoteModel -> protocol -> worker -> service), with a grammar-constrained one-shot Generate."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from appliance.engine.llm.choose import best  # noqa: E402
from appliance.engine.llm.service import GenerativeModelService  # noqa: E402
from appliance.engine.llm.settings import GenerativeSettings  # noqa: E402
from core.errors import InvalidArgument  # noqa: E402
from core.model_port import CHOOSE_MAX_OPTION_CHARS, CHOOSE_MAX_OPTIONS  # noqa: E402

from tiny_llm import make_model_dir  # noqa: E402

PROMPT = "Alarm: pressure high in line four. Which part failed?"
OPTIONS = ["pump", "valve", "the pump runs", "Temperature of reactor two", "tank level", "x",
           "line four", "<|im_end|>", "Störung", "pressure high in line four and rising"]  # 10 > 4 slots
TOLERANCE = 1e-3  # fp32 sums of up to ~10 log-probabilities (measured differences ~1e-5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    make_model_dir(d, seed=1)
    return d


def oracle_scores(model_dir, prompt: str, options: list[str]) -> list[float]:
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    head = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)
    scores = []
    for option in options:
        ids = tok(option, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        with torch.no_grad():
            logits = hf(torch.tensor([head + ids])).logits[0].double()
        logp = torch.log_softmax(logits, dim=-1)
        scores.append(float(sum(logp[len(head) - 1 + j, t] for j, t in enumerate(ids))))
    return scores


def settings(**kw) -> GenerativeSettings:
    return GenerativeSettings(**{**dict(kv_slots=4, max_seq_len=256, max_new_tokens=64, dtype="float32",
                                        device="cpu", seed=7), **kw})


def test_scores_equal_the_oracles_log_probabilities_and_are_deterministic(model_dir):
    expected = oracle_scores(model_dir, PROMPT, OPTIONS)

    async def main():
        svc = GenerativeModelService("llm", model_dir, settings())
        await svc.start()
        try:
            # a conversation holds one slot: the options go in groups over the three others
            await svc.generate("s1", "hello", 4, 0.0, time.monotonic() + 60)
            first = await svc.choose(PROMPT, OPTIONS, time.monotonic() + 60)
            again = await svc.choose(PROMPT, OPTIONS, time.monotonic() + 60)
            alone = await svc.choose(PROMPT, OPTIONS[2:3], time.monotonic() + 60)
            return first, again, alone, svc.slots_in_use
        finally:
            await svc.stop()

    first, again, alone, slots_left = asyncio.run(main())
    assert len(first.scores) == len(OPTIONS)
    for got, want, option in zip(first.scores, expected, OPTIONS):
        assert abs(got - want) < TOLERANCE, (option, got, want)
    assert first.scores == again.scores  # deterministic, to the bit
    assert abs(alone.scores[0] - first.scores[2]) < 1e-4  # an option's score does not depend on its group
    assert first.index == best(first.scores) == max(range(len(expected)), key=expected.__getitem__)
    assert slots_left == 1  # the conversation's; Choose keeps none


def test_best_takes_the_first_of_equal_scores():
    assert best([-1.0, -0.5, -0.5]) == 1


@pytest.mark.parametrize("options", [[], ["a"] * (CHOOSE_MAX_OPTIONS + 1), ["yes", ""],
                                     ["x" * (CHOOSE_MAX_OPTION_CHARS + 1)], ["ok", "\u202eevil"], "yes", [1, 2]])
def test_options_outside_the_limits_are_invalid_arguments(model_dir, options):
    async def main():
        svc = GenerativeModelService("llm", model_dir, settings())
        await svc.start()
        try:
            await svc.choose(PROMPT, options, time.monotonic() + 60)
        finally:
            await svc.stop()

    with pytest.raises(InvalidArgument) as info:
        asyncio.run(main())
    assert info.value.index == 1  # Options is the argument marked


def test_choose_and_a_constrained_one_shot_generate_through_the_worker_process(model_dir, tmp_path):
    from harness import RunningAppliance
    schema = json.dumps({"type": "object", "properties": {"Severity": {"enum": ["low", "medium", "high"]},
                                                          "StopLine": {"type": "boolean"}},
                         "required": ["Severity", "StopLine"], "additionalProperties": False})
    expected = oracle_scores(model_dir, PROMPT, OPTIONS[:3])
    app = RunningAppliance(tmp_path, {"chat": {"kind": "generative", "path": str(model_dir)}})
    try:
        model = app.app.services["chat"]

        async def calls():
            chosen = await model.choose(PROMPT, OPTIONS[:3], time.monotonic() + 60)
            answers = await asyncio.gather(*[model.generate("", "Classify: pressure high", 48, t,
                                                            time.monotonic() + 60, grammar=schema)
                                             for t in (0.0, 1.0, 1.0, 1.0)])
            with pytest.raises(InvalidArgument):
                await model.generate("", "Classify", 48, 0.0, time.monotonic() + 60, grammar="{not json")
            end = time.monotonic() + 10  # the worker's snapshot is at most a second old
            while model.status().slots_in_use and time.monotonic() < end:
                await asyncio.sleep(0.1)
            return chosen, answers, model.status().slots_in_use

        chosen, answers, slots = app.run(calls(), timeout=180)
    finally:
        app.stop()
    assert all(abs(a - b) < TOLERANCE for a, b in zip(chosen.scores, expected))
    for r in answers:
        assert r.finish_reason == "stop" and r.context_tokens == 0
        doc = json.loads(r.text)
        assert doc["Severity"] in ("low", "medium", "high") and isinstance(doc["StopLine"], bool)
    assert slots == 0
