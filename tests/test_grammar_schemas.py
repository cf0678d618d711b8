"""1,000 answers under randomly generated schemas of the task subset all validate: the generative service end to end
(real loading, the engine thread, forward passes, masks, jump-forward) on the tiny random Llama, sampled at
temperature 1 so that the answers wander wherever the masks let them.

The subset is what a task's `output` compiles to (core/config's task schema): an object of fields in order,
each an enum of strings, a Boolean, an Int32 or a Double with minimum and maximum, or a String with maxLength;
some required, some optional; no other properties.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import jsonschema
import pytest

from appliance.engine.llm.service import GenerativeModelService
from appliance.engine.llm.settings import GenerativeSettings

from tiny_llm import make_model_dir

ANSWERS = 1000
CONCURRENT = 16
NAMES = ["Severity", "StopLine", "Count", "Temperature", "Reason", "Area", "Pump", "Level", "Ok", "Code"]
WORDS = ["low", "medium", "high", "pump", "valve", "tank", "open", "closed", "line four", "reactor two", "ok",
         "Störung", "x"]


def random_schema(rng: random.Random) -> dict:
    fields = rng.sample(NAMES, rng.randint(1, 5))
    properties, required = {}, []
    for name in fields:
        kind = rng.choice(["enum", "boolean", "int32", "double", "string"])
        if kind == "enum":
            prop = {"type": "string", "enum": rng.sample(WORDS, rng.randint(1, 5))}
        elif kind == "boolean":
            prop = {"type": "boolean"}
        elif kind == "int32":
            low = rng.randint(-1000, 1000)
            prop = {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
        elif kind == "double":
            low = round(rng.uniform(-500, 500), rng.randint(0, 3))
            prop = {"type": "number", "minimum": low, "maximum": round(low + rng.uniform(0.5, 1000), 2)}
        else:
            prop = {"type": "string", "maxLength": rng.randint(1, 16)}
        properties[name] = prop
        if rng.random() < 0.7:
            required.append(name)
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    make_model_dir(d, seed=3)
    return d


def test_a_thousand_answers_under_random_schemas_all_validate(model_dir):
    rng = random.Random(46)
    schemas = [random_schema(rng) for _ in range(ANSWERS // 10)]  # each schema answered 10 times

    async def main():
        settings = GenerativeSettings(kv_slots=CONCURRENT, max_seq_len=512, max_new_tokens=384, dtype="float32",
                                      device="cpu", seed=5, max_queue_size=ANSWERS, prefill_chunk=64)
        svc = GenerativeModelService("llm", model_dir, settings)
        await svc.start()
        assert svc.state == "Ready", svc.failure_reason
        gate = asyncio.Semaphore(CONCURRENT)

        async def answer(i: int):
            schema = schemas[i % len(schemas)]
            async with gate:
                r = await svc.generate("", f"Alarm {i}: pressure high in line four. Classify it.", 384, 1.0,
                                       time.monotonic() + 600, grammar=json.dumps(schema))
            return schema, r
        try:
            return await asyncio.gather(*[answer(i) for i in range(ANSWERS)]), svc.slots_in_use
        finally:
            await svc.stop()

    results, slots_left = asyncio.run(main())
    # one validator per schema, its schema checked once (jsonschema.validate checks it again at every call)
    validators = {id(schema): jsonschema.validators.validator_for(schema)(schema) for schema in schemas}
    for validator in validators.values():
        validator.check_schema(validator.schema)
    invalid = []
    seen_optional_left_out = 0
    for schema, r in results:
        try:
            assert r.finish_reason == "stop", r.finish_reason
            doc = json.loads(r.text)
            validators[id(schema)].validate(doc)
            seen_optional_left_out += len(set(schema["properties"]) - set(doc))
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            invalid.append((r.text, schema, str(exc)[:200]))
    assert not invalid, f"{len(invalid)} of {ANSWERS} invalid, e.g. {invalid[:3]}"
    assert len({r.text for _s, r in results}) > ANSWERS // 2  # sampled answers, not one answer again and again
    assert seen_optional_left_out > 0  # the sampler also took the paths that leave optional fields out
    assert slots_left == 0  # one-shot turns keep no slot
