"""The generative service end to end on tiny models saved as HF directories (config.json, model.safetensors, a
byte-level BPE tokenizer.json trained here, a ChatML template in tokenizer_config.json): real loading, real engine
thread, real forward passes."""
from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from appliance.engine.llm.service import GenerativeModelService  # noqa: E402
from appliance.engine.llm.settings import GenerativeSettings  # noqa: E402
from core.errors import (INVALID, OUT_OF_RANGE, DeadlineExceeded, EngineFailure, InvalidArgument, NotReady,  # noqa: E402
                              ResourceUnavailable)
from appliance.metrics import Metrics  # noqa: E402
from models.llama import Linear  # noqa: E402

from tiny_llm import FAR, _tokenizer, make_model_dir  # noqa: E402


def settings(**kw) -> GenerativeSettings:
    base = dict(kv_slots=4, max_seq_len=256, max_new_tokens=64, slot_policy="evict_lru", prefill_chunk=32,
                dtype="float32", device="cpu", threads=0, seed=7, max_text_chars=1024, system_prompt=None,
                top_p=0.9, max_queue_size=16)
    base.update(kw)
    return GenerativeSettings(**base)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    make_model_dir(d, seed=0)
    return d


@pytest.fixture(scope="module")
def scripted_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("scripted-llama")
    tok = _tokenizer(d)  # to find ids of the reply " pump runs"
    reply = tok.encode(" pump runs", add_special_tokens=False).ids
    make_model_dir(d, seed=0, scripted=reply)
    return d


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def started(path, metrics=None, **kw) -> GenerativeModelService:
    svc = GenerativeModelService("llm", path, settings(**kw), version_label=None, metrics=metrics)
    await svc.start()
    assert svc.state == "Ready", svc.failure_reason
    return svc


def test_sessions_are_independent_and_follow_ups_cost_only_new_tokens(model_dir):
    async def alone():
        svc = await started(model_dir)
        a1 = await svc.generate("A", "Is the pump running?", 12, 0.0, FAR)
        a2 = await svc.generate("A", "And valve 3?", 12, 0.0, FAR)
        await svc.stop()
        return a1, a2

    async def interleaved():
        metrics = Metrics()
        svc = await started(model_dir, metrics=metrics)
        a1, b1 = await asyncio.gather(svc.generate("A", "Is the pump running?", 12, 0.0, FAR),
                                      svc.generate("B", "Alarm in line four.", 20, 0.0, FAR))
        prompt_before = metrics.tokens_total.labels("llm", "prompt")._value.get()
        a2, b2 = await asyncio.gather(svc.generate("A", "And valve 3?", 12, 0.0, FAR),
                                      svc.generate("B", "Tank level?", 5, 0.0, FAR))
        prompt_added = metrics.tokens_total.labels("llm", "prompt")._value.get() - prompt_before
        assert svc.slots_in_use == 2
        await svc.stop()
        return a1, a2, b1, b2, prompt_added

    ref1, ref2 = run(alone())
    a1, a2, b1, b2, prompt_added = run(interleaved())
    assert (a1.text, a2.text) == (ref1.text, ref2.text)
    assert a1.token_count == 12 and a1.finish_reason == "length" and a2.finish_reason == "length"
    assert a2.context_tokens > a1.context_tokens and not a2.context_lost
    assert b1.text != a1.text
    # the second turns re-read only their new tokens, not the cached conversations
    new_tokens = (a2.context_tokens - a1.context_tokens - a2.token_count) + \
                 (b2.context_tokens - b1.context_tokens - b2.token_count)
    assert prompt_added <= new_tokens + 2 * 2  # + the last reply token and suffix of each, written on the next turn
    assert prompt_added < a1.context_tokens + b1.context_tokens


def test_release_returns_slots_and_gauges(model_dir):
    async def body():
        metrics = Metrics()
        svc = await started(model_dir, metrics=metrics)
        assert metrics.kv_slots_total._value.get() == 4
        await asyncio.gather(*(svc.generate(f"s{i}", "Valve?", 3, 0.0, FAR) for i in range(3)))
        assert svc.slots_in_use == 3 and metrics.kv_slots_used._value.get() == 3
        for i in range(3):
            svc.release(f"s{i}")
            svc.release(f"s{i}")  # idempotent
        for _ in range(500):  # release() is fire-and-forget: the engine thread frees the slots
            if svc.slots_in_use == 0:
                break
            await asyncio.sleep(0.01)
        assert svc.slots_in_use == 0 and metrics.kv_slots_used._value.get() == 0
        assert metrics.batch_size.labels("llm")._sum.get() > 0
        assert metrics.time_to_first_token.labels("llm")._sum.get() > 0
        assert metrics.tokens_total.labels("llm", "generated")._value.get() >= 9
        await svc.stop()
        assert metrics.kv_slots_total._value.get() == 0
    run(body())


def test_eviction_takes_least_recently_used_idle_slot(model_dir):
    async def body():
        svc = await started(model_dir, kv_slots=2, park_memory_mb=0)  # no parking: the evicted session loses it
        await svc.generate("a", "Pump?", 3, 0.0, FAR)
        await svc.generate("b", "Pump?", 3, 0.0, FAR)
        await svc.generate("a", "Again?", 3, 0.0, FAR)  # b is now the least recently used
        c = await svc.generate("c", "Pump?", 3, 0.0, FAR)
        assert not c.context_lost
        a = await svc.generate("a", "Still there?", 3, 0.0, FAR)
        b = await svc.generate("b", "Still there?", 3, 0.0, FAR)
        assert not a.context_lost and b.context_lost
        b_again = await svc.generate("b", "Now?", 3, 0.0, FAR)
        assert not b_again.context_lost  # reported once
        await svc.stop()
    run(body())


def test_reject_policy_refuses_when_every_slot_is_owned(model_dir):
    async def body():
        svc = await started(model_dir, kv_slots=1, slot_policy="reject")
        await svc.generate("a", "Pump?", 3, 0.0, FAR)
        with pytest.raises(ResourceUnavailable):
            await svc.generate("b", "Pump?", 3, 0.0, FAR)
        await svc.reset("a")
        assert svc.slots_in_use == 0
        r = await svc.generate("b", "Pump?", 3, 0.0, FAR)
        assert r.token_count == 3
        await svc.stop()
    run(body())


def test_reset_forgets_the_conversation(model_dir):
    async def body():
        svc = await started(model_dir)
        first = await svc.generate("a", "Is the pump running?", 8, 0.0, FAR)
        second = await svc.generate("a", "Is the pump running?", 8, 0.0, FAR)
        assert second.context_tokens > first.context_tokens
        await svc.reset("a")
        again = await svc.generate("a", "Is the pump running?", 8, 0.0, FAR)
        assert (again.text, again.context_tokens, again.context_lost) == (first.text, first.context_tokens, False)
        await svc.stop()
    run(body())


def test_bad_inputs_are_rejected_with_their_argument(model_dir):
    async def body():
        svc = await started(model_dir, max_seq_len=48)
        cases = [(("", 5, 0.0), 0, INVALID), (("x" * (16 * 1024 + 1), 5, 0.0), 0, OUT_OF_RANGE),
                 (("\ud800", 5, 0.0), 0, INVALID), (("hi", 0, 0.0), 1, OUT_OF_RANGE),
                 (("hi", 65, 0.0), 1, OUT_OF_RANGE), (("hi", 5, -0.1), 2, OUT_OF_RANGE),
                 (("hi", 5, 2.5), 2, OUT_OF_RANGE), (("hi", 5, math.nan), 2, OUT_OF_RANGE),
                 (("The pump runs at nominal speed. " * 8, 5, 0.0), 0, OUT_OF_RANGE)]  # > 48 tokens
        for args, index, status in cases:
            with pytest.raises(InvalidArgument) as err:
                await svc.generate("s", *args, FAR)
            assert (err.value.index, err.value.kind) == (index, status), args
            assert "/" not in str(err.value)
        assert svc.slots_in_use == 0  # the prompt that did not fit holds no slot
        ok = await svc.generate("s", "hi", 5, 2.0, FAR)  # the session is still usable
        assert ok.token_count >= 1
        await svc.stop()
        with pytest.raises(NotReady):
            await svc.generate("s", "hi", 5, 0.0, FAR)
    run(body())


def test_deadline_cancels_cleanly_and_the_slot_stays_consistent(model_dir):
    async def body():
        svc = await started(model_dir, max_new_tokens=512, max_seq_len=512, prefill_chunk=4)
        first = await svc.generate("a", "Is the pump running?", 6, 0.0, FAR)
        with pytest.raises(DeadlineExceeded):
            await svc.generate("a", "Tell me more " * 20, 500, 0.0, time.monotonic() + 0.02)
        with pytest.raises(DeadlineExceeded):
            await svc.generate("a", "Late", 5, 0.0, time.monotonic() - 1)
        after = await svc.generate("a", "And valve 3?", 6, 0.0, FAR)
        # same answer as a session that never saw the cancelled turn
        other = await svc.generate("b", "Is the pump running?", 6, 0.0, FAR)
        other2 = await svc.generate("b", "And valve 3?", 6, 0.0, FAR)
        assert (first.text, after.text, after.context_tokens) == (other.text, other2.text, other2.context_tokens)
        await svc.stop()
    run(body())


def test_text_never_exceeds_max_text_chars(model_dir):
    async def body():
        svc = await started(model_dir, max_text_chars=10)
        r = await svc.generate("a", "Talk", 64, 0.0, FAR)
        assert len(r.text) <= 10 and r.finish_reason == "length" and r.token_count < 64
        await svc.stop()
    run(body())


def test_greedy_is_deterministic_and_sampling_is_reproducible_by_seed(model_dir):
    async def texts(seed: int, temperature: float):
        svc = await started(model_dir, seed=seed)
        out = [(await svc.generate(f"s{i}", "Is the pump running?", 16, temperature, FAR)).text for i in range(3)]
        await svc.stop()
        return out

    greedy = run(texts(1, 0.0))
    assert greedy[0] == greedy[1] == greedy[2]
    sampled = run(texts(1, 1.0))
    assert sampled == run(texts(1, 1.0))
    assert len(set(sampled)) > 1  # a stream per request, not one replayed
    assert sampled != run(texts(2, 1.0))


def test_stop_token_ends_the_reply_and_closes_the_turn(scripted_dir):
    async def body():
        svc = await started(scripted_dir)
        tok = svc._engine.tokenizer
        r1 = await svc.generate("a", "Is the pump running?", 20, 0.0, FAR)
        assert (r1.text, r1.finish_reason) == (" pump runs", "stop")
        turn = tok.turn_tokens([], "Is the pump running?", None)
        suffix = tok.assistant_suffix_tokens()
        assert r1.context_tokens == len(turn) + r1.token_count + len(suffix)
        r2 = await svc.generate("a", "Again?", 20, 0.0, FAR)
        history = [{"role": "user", "content": "Is the pump running?"}, {"role": "assistant", "content": " pump runs"}]
        assert r2.context_tokens == len(tok.encode(tok.render(history + [
            {"role": "user", "content": "Again?"}, {"role": "assistant", "content": " pump runs"}],
            add_generation_prompt=False)))
        r3 = await svc.generate("b", "x", 1, 0.0, FAR)
        assert (r3.token_count, r3.finish_reason) == (1, "length")
        await svc.stop()
    run(body())


def test_context_full_finishes_the_reply(model_dir):
    async def body():
        svc = await started(model_dir, max_seq_len=32, max_new_tokens=64)
        r = await svc.generate("a", "Pump?", 64, 0.0, FAR)
        assert r.finish_reason == "context_full" and r.context_tokens >= 32
        with pytest.raises(InvalidArgument):  # nothing more fits: the PLC must reset
            await svc.generate("a", "More?", 5, 0.0, FAR)
        await svc.reset("a")
        assert (await svc.generate("a", "Pump?", 3, 0.0, FAR)).token_count == 3
        await svc.stop()
    run(body())


def test_same_session_calls_queue_and_a_full_queue_refuses(model_dir):
    async def body():
        svc = await started(model_dir, max_queue_size=2)
        results = await asyncio.gather(*(svc.generate("a", "Pump?", 4, 0.0, FAR) for _ in range(3)),
                                       return_exceptions=True)
        assert isinstance(results[2], ResourceUnavailable)
        assert results[1].context_tokens > results[0].context_tokens  # ran after the first, in the same slot
        await svc.stop()
    run(body())


def test_engine_failure_answers_the_request_and_the_engine_survives(model_dir):
    async def body():
        svc = await started(model_dir)
        layer = svc._engine.model.layers[0]
        good = layer.qkv
        layer.qkv = Linear.build(torch.zeros(10, 10), pack=False)  # a wrong shape: the forward pass raises
        with pytest.raises(EngineFailure) as err:
            await svc.generate("a", "Pump?", 4, 0.0, FAR)
        assert "Traceback" not in str(err.value) and "/" not in str(err.value)
        layer.qkv = good
        r = await svc.generate("a", "Pump?", 4, 0.0, FAR)
        assert r.token_count == 4 and not r.context_lost
        await svc.stop()
    run(body())


def test_reload_swaps_weights_and_marks_context_lost(model_dir, tmp_path):
    events = []

    async def body():
        d = tmp_path / "m"
        make_model_dir(d, seed=0)
        svc = GenerativeModelService("llm", d, settings(), version_label=None, metrics=Metrics(),
                                     on_event=lambda kind, msg: events.append((kind, msg)))
        await svc.start()
        v1 = svc.version
        before = await svc.generate("a", "Pump?", 6, 0.0, FAR)
        make_model_dir(d, seed=1)  # retrained weights
        v2 = await svc.reload()
        assert v2 == svc.version != v1
        after = await svc.generate("a", "Pump?", 6, 0.0, FAR)
        assert after.context_lost and after.model_version == v2 and after.text != before.text
        (d / "model.safetensors").write_bytes(b"broken")
        with pytest.raises(EngineFailure):
            await svc.reload()
        assert svc.state == "Ready" and svc.version == v2  # the old weights keep serving
        assert (await svc.generate("a", "Pump?", 2, 0.0, FAR)).model_version == v2
        assert events and events[-1][0] == "ModelReloadFailed" and str(tmp_path) not in events[-1][1]
        await svc.stop()
    run(body())


def test_a_cache_that_does_not_fit_fails_clearly(model_dir):
    async def body():
        svc = GenerativeModelService("llm", model_dir, settings(kv_slots=1_000_000, max_seq_len=512),
                                     version_label="v1", metrics=None)
        await svc.start()
        assert svc.state == "Failed"
        assert "KV cache" in svc.failure_reason and str(model_dir) not in svc.failure_reason
        with pytest.raises(NotReady):
            await svc.generate("a", "Pump?", 2, 0.0, FAR)
    run(body())


def test_stop_answers_running_and_waiting_requests_not_ready(model_dir):
    async def body():
        svc = await started(model_dir, max_new_tokens=512, max_seq_len=512, prefill_chunk=2)
        assert svc.engine_alive
        calls = [asyncio.create_task(svc.generate(f"s{i}", "Tell me more " * 10, 500, 0.0, FAR)) for i in range(6)]
        await asyncio.sleep(0.05)  # 4 run in the 4 slots, 2 wait
        await svc.stop()
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(r, NotReady) for r in results), results
        assert not svc.engine_alive and svc.slots_in_use == 0
    run(body())


def test_shared_prompt_heads_are_copied_not_recomputed_and_give_the_same_tokens(model_dir):
    """Sessions whose first turn starts with the same head (here a long system prompt) reuse its KV."""
    standing = "You assist operators of line four. Answer briefly, name valves by their tag, never guess a reading."

    async def answers(entries: int):
        metrics = Metrics()
        svc = await started(model_dir, metrics=metrics, system_prompt=standing, prefix_cache_entries=entries)
        out = []
        for i, prompt in enumerate(["Is the pump running?", "Tank level?", "Is the pump running?"]):
            out.append((await svc.generate(f"s{i}", prompt, 10, 0.0, FAR)).text)
        out.append((await svc.generate("s0", "And valve 3?", 10, 0.0, FAR)).text)  # a second turn: no head
        prompt_tokens = metrics.tokens_total.labels("llm", "prompt")._value.get()
        hits = metrics.prefix_cache_hits_total.labels("llm")._value.get()
        await svc.stop()
        return out, prompt_tokens, hits

    recomputed, tokens_recomputed, no_hits = run(answers(0))
    shared, tokens_shared, hits = run(answers(8))
    assert shared == recomputed
    assert no_hits == 0 and hits == 2
    head = tokens_recomputed - tokens_shared
    assert head > 0 and head % 2 == 0 and head // 2 >= len(standing) // 8  # two sessions skipped the whole head


def test_evicted_sessions_are_parked_and_continue_as_if_never_evicted(model_dir):
    """12 sessions on 4 slots take turns: every evicted conversation is parked in host memory and restored at the
    session's next call, with the same answers as on a cache big enough for all (no ContextLost)."""
    turns = ["Is the pump running?", "And valve 3?", "Tank level?"]

    async def answers(kv_slots: int, park_mb: int):
        svc = await started(model_dir, kv_slots=kv_slots, park_memory_mb=park_mb)
        out = []
        for turn in turns:
            for i in range(12):
                r = await svc.generate(f"s{i}", turn, 4, 0.0, FAR)
                out.append((r.text, r.context_tokens, r.context_lost))
        held = svc.conversations_parked
        await svc.stop()
        return out, held

    roomy, none_parked = run(answers(12, 0))
    parked, held = run(answers(4, 64))
    assert none_parked == 0 and held == 8  # 12 conversations: 4 in slots, 8 parked
    assert parked == roomy
    assert not any(lost for _t, _n, lost in parked)
    dropped, _ = run(answers(4, 0))
    assert sum(lost for _t, _n, lost in dropped) == 12 * (len(turns) - 1)  # without parking: every second call


def test_conversations_in_the_state_directory_end_by_ttl_with_context_lost(model_dir, tmp_path):
    """A Converse conversation's file lets a new engine continue it; the TTL ending it (the serve process's
    release, or a file too old at start) makes its next call say ContextLost; EndConversation does not."""
    import os

    key = "conv:" + "ab12" * 8
    conv_dir = str(tmp_path / "conversations")

    async def body():
        svc = await started(model_dir, conversation_dir=conv_dir, conversation_ttl_s=3600)
        first = await svc.generate(key, "Is the pump running?", 3, 0.0, FAR)
        await svc.stop()
        svc = await started(model_dir, conversation_dir=conv_dir, conversation_ttl_s=3600)
        again = await svc.generate(key, "And valve 3?", 3, 0.0, FAR)  # a new engine recalls it from its file
        assert not again.context_lost and again.context_tokens > first.context_tokens
        svc.release(key)  # what the serve process's conversation TTL sends
        after_ttl = await svc.generate(key, "Still there?", 3, 0.0, FAR)
        assert after_ttl.context_lost and after_ttl.context_tokens < again.context_tokens
        await svc.reset(key)  # EndConversation
        fresh = await svc.generate(key, "New start.", 3, 0.0, FAR)
        assert not fresh.context_lost
        await svc.stop()
        (path,) = (tmp_path / "conversations").glob("*.json")
        os.utime(path, (0, 0))  # unused far longer than the TTL while no engine ran
        svc = await started(model_dir, conversation_dir=conv_dir, conversation_ttl_s=3600)
        late = await svc.generate(key, "Hello again.", 3, 0.0, FAR)
        assert late.context_lost and late.context_tokens < fresh.context_tokens + 10
        await svc.stop()
    run(body())
