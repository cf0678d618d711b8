"""Generate over a real server: session-bound KV slots, continuous conversations, eviction and reject modes,
ResetContext, slots freed on every close path, and bad input answered with the contract's codes."""
from __future__ import annotations

import asyncio
import time

import pytest
from asyncua import ua

from harness import RunningAppliance
from uaclient import arg_statuses, call, read, run, session, status_name

pytest.importorskip("transformers")
from tiny_llm import make_model_dir  # noqa: E402

V = ua.VariantType


def gen_args(prompt, max_tokens=8, temperature=0.0):
    return [ua.Variant(prompt, V.String), ua.Variant(max_tokens, V.UInt32), ua.Variant(temperature, V.Float)]


def outputs(r):
    names = ["Text", "TokenCount", "FinishReason", "ContextTokens", "ContextLost", "ModelVersion"]
    return dict(zip(names, [v.Value for v in r.OutputArguments]))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llm")
    make_model_dir(d, seed=1)
    return d


def start(tmp, model_dir, policy: str, slots: int = 2):
    return RunningAppliance(tmp, {"chat": {"kind": "generative", "path": str(model_dir), "max_text_chars": 200}},
                            {"engine": {"kv_slots": slots, "max_seq_len": 256, "max_new_tokens": 32,
                                        "slot_policy": policy, "prefill_chunk": 16}})


@pytest.fixture(scope="module")
def app(tmp_path_factory, model_dir):
    a = start(tmp_path_factory.mktemp("ua_gen"), model_dir, "evict_lru")
    a.operator = a.issue("plc1", "operator")
    yield a
    a.stop()


async def slots_in_use(client, want: int, timeout: float = 10.0) -> int:
    end = time.monotonic() + timeout
    value = await read(client, "Engine", "SlotsInUse")
    while value != want and time.monotonic() < end:
        await asyncio.sleep(0.1)
        value = await read(client, "Engine", "SlotsInUse")
    return value


def test_conversations_continue_and_never_see_each_other(app):
    async def turns(c, prompts):
        out = []
        for p in prompts:
            r = await call(c, "chat", "Generate", gen_args(p))
            assert status_name(r) == "Good"
            out.append(outputs(r))
        return out

    async def go():
        async with session(app, *app.operator) as a:
            alone = await turns(a, ["pump one", "and valve two"])
        assert alone[1]["ContextTokens"] > alone[0]["ContextTokens"] + alone[0]["TokenCount"]
        assert not alone[0]["ContextLost"] and not alone[1]["ContextLost"]
        async with session(app, *app.operator) as a, session(app, *app.operator) as b:
            a1 = await turns(a, ["pump one"])
            b1 = await turns(b, ["tank level rising high"])
            a2 = await turns(a, ["and valve two"])
            b2 = await turns(b, ["what next"])
        # the same conversation gives the same text whether or not another session talked in between
        assert [x["Text"] for x in a1 + a2] == [x["Text"] for x in alone]
        assert a2[0]["ContextTokens"] == alone[1]["ContextTokens"]
        assert b2[0]["ContextTokens"] > b1[0]["ContextTokens"]
    run(go())


def test_reset_context_forgets(app):
    async def go():
        async with session(app, *app.operator) as c:
            first = outputs(await call(c, "chat", "Generate", gen_args("pump one")))
            await call(c, "chat", "Generate", gen_args("more"))
            r = await call(c, "chat", "ResetContext", [])
            assert status_name(r) == "Good"
            again = outputs(await call(c, "chat", "Generate", gen_args("pump one")))
            assert again["ContextTokens"] == first["ContextTokens"] and again["Text"] == first["Text"]
    run(go())


def test_slots_freed_on_close_and_after_many_cycles(app):
    async def go():
        async with session(app, *app.operator) as watcher:
            for _ in range(200):
                async with session(app, *app.operator) as c:
                    r = await call(c, "chat", "Generate", gen_args("hi", max_tokens=1))
                    assert status_name(r) == "Good"
            assert await slots_in_use(watcher, 0) == 0
            assert await read(watcher, "Engine", "SlotsTotal") == 2
    run(go(), timeout=600)


def test_dropped_connection_frees_its_slot_after_the_session_timeout(app):
    async def go():
        async with session(app, *app.operator) as watcher:
            c = await __import__("appliance.client", fromlist=["connect"]).connect(
                app.endpoint, *app.operator, session_timeout_ms=5000)
            # a subscription keeps the session alive past its connection until the session timeout
            sub = await c.create_subscription(1000, None)
            assert sub is not None
            assert status_name(await call(c, "chat", "Generate", gen_args("hello"))) == "Good"
            assert await slots_in_use(watcher, 1) == 1
            c.uaclient.protocol.transport.abort()  # the cable is pulled
            await asyncio.sleep(1.0)
            assert await read(watcher, "Engine", "SlotsInUse") == 1  # still within the session timeout
            assert await slots_in_use(watcher, 0, timeout=15) == 0
    run(go())


def test_eviction_takes_the_least_recently_used_idle_slot_and_parks_its_conversation(app):
    async def go():
        async with session(app, *app.operator) as a, session(app, *app.operator) as b, \
                session(app, *app.operator) as c:
            first = outputs(await call(a, "chat", "Generate", gen_args("first")))
            assert status_name(await call(b, "chat", "Generate", gen_args("second"))) == "Good"
            r = outputs(await call(c, "chat", "Generate", gen_args("third")))  # evicts a (least recently used)
            assert r["ContextLost"] is False
            r = outputs(await call(b, "chat", "Generate", gen_args("again")))  # b keeps its slot
            assert r["ContextLost"] is False
            # a's conversation was parked in host memory, not dropped: it comes back whole
            r = outputs(await call(a, "chat", "Generate", gen_args("back")))
            assert r["ContextLost"] is False and r["ContextTokens"] > first["ContextTokens"] + first["TokenCount"]
    run(go())


def test_eviction_without_parking_answers_context_lost(tmp_path, model_dir):
    a = RunningAppliance(tmp_path, {"chat": {"kind": "generative", "path": str(model_dir), "max_text_chars": 200}},
                         {"engine": {"kv_slots": 2, "max_seq_len": 256, "max_new_tokens": 32, "prefill_chunk": 16,
                                     "park_memory_mb": 0}})
    try:
        cert = a.issue("plc", "operator")

        async def go():
            async with session(a, *cert) as s1, session(a, *cert) as s2, session(a, *cert) as s3:
                for s, text in ((s1, "first"), (s2, "second"), (s3, "third")):  # the third evicts s1
                    assert outputs(await call(s, "chat", "Generate", gen_args(text)))["ContextLost"] is False
                assert outputs(await call(s1, "chat", "Generate", gen_args("back")))["ContextLost"] is True
        run(go())
    finally:
        a.stop()


def test_reject_mode_answers_resource_unavailable(tmp_path, model_dir):
    a = start(tmp_path, model_dir, "reject", slots=1)
    try:
        cert = a.issue("plc", "operator")

        async def go():
            async with session(a, *cert) as s1, session(a, *cert) as s2:
                assert status_name(await call(s1, "chat", "Generate", gen_args("first"))) == "Good"
                r = await call(s2, "chat", "Generate", gen_args("second"))
                assert status_name(r) == "BadResourceUnavailable"
                await call(s1, "chat", "ResetContext", [])
                assert status_name(await call(s2, "chat", "Generate", gen_args("second"))) == "Good"
        run(go())
    finally:
        a.stop()


@pytest.mark.parametrize("args, index, arg_status", [
    (gen_args(""), 0, "BadInvalidArgument"),
    (gen_args("x" * (16 * 1024 + 1)), 0, "BadOutOfRange"),
    (gen_args("\udcff\udcfe broken utf-8"), 0, "BadInvalidArgument"),
    (gen_args("open valve\x1b[2J now"), 0, "BadInvalidArgument"),  # a control character (prompt hygiene)
    (gen_args("pump \u202eevil"), 0, "BadInvalidArgument"),  # a bidi override
    (gen_args("hi", max_tokens=0), 1, "BadOutOfRange"),
    (gen_args("hi", max_tokens=33), 1, "BadOutOfRange"),
    (gen_args("hi", temperature=2.5), 2, "BadOutOfRange"),
    (gen_args("hi", temperature=-0.1), 2, "BadOutOfRange"),
    ([ua.Variant("hi", V.String), ua.Variant(5, V.Int32), ua.Variant(0.0, V.Float)], 1, "BadTypeMismatch"),
    ([ua.Variant(b"hi", V.ByteString), ua.Variant(5, V.UInt32), ua.Variant(0.0, V.Float)], 0, "BadTypeMismatch"),
])
def test_bad_generate_arguments(app, args, index, arg_status):
    async def go():
        async with session(app, *app.operator) as c:
            r = await call(c, "chat", "Generate", args)
            assert status_name(r) == "BadInvalidArgument"
            expected = ["Good"] * 3
            expected[index] = arg_status
            assert arg_statuses(r) == expected
            assert status_name(await call(c, "chat", "Generate", gen_args("ok"))) == "Good"
    run(go())


def test_generate_argument_count(app):
    async def go():
        async with session(app, *app.operator) as c:
            assert status_name(await call(c, "chat", "Generate", gen_args("x")[:2])) == "BadArgumentsMissing"
            assert status_name(await call(c, "chat", "Generate", gen_args("x") + [ua.Variant(1, V.UInt32)])) \
                == "BadTooManyArguments"
    run(go())
