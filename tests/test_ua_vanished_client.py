"""A client that vanishes: its TCP connection aborted mid-Generate, as a PLC loses its cable or is switched off.

The contract: the abandoned call's generation stops within 1 s of the channel closing (no one can receive it), the
session keeps its KV slot until its timeout (`server.session_timeout_s`), then it is closed and the slot freed; a
client that re-activates its session on a new channel before then keeps its conversation. Everything here is seen
from outside: the socket is really aborted, tokens and slots are scraped from /metrics over HTTP.
"""
from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest
from asyncua import ua

from appliance.client import connect
from harness import RunningAppliance
from uaclient import call, status_name

pytest.importorskip("transformers")
from tiny_llm import make_model_dir  # noqa: E402

V = ua.VariantType
SESSION_TIMEOUT_S = 4.0
CYCLE = list(range(40, 60))  # the scripted reply, over and over: a generation that runs until MaxTokens


def gen_args(prompt: str, max_tokens: int):
    return [ua.Variant(prompt, V.String), ua.Variant(max_tokens, V.UInt32), ua.Variant(0.0, V.Float)]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    d = tmp_path_factory.mktemp("vanished")
    make_model_dir(d / "chat", scripted=CYCLE, endless=True, max_positions=16384)
    models = {"chat": {"kind": "generative", "path": str(d / "chat"), "max_text_chars": 16000}}
    a = RunningAppliance(d / "state", models, {
        "server": {"session_timeout_s": SESSION_TIMEOUT_S},
        "engine": {"max_seq_len": 16384, "max_new_tokens": 12000, "kv_slots": 2, "request_timeout_s": 120}})
    a.plc = a.issue("plc1", "operator")
    yield a
    a.stop()


def scrape(app) -> str:
    with urllib.request.urlopen(f"{app.metrics_url}/metrics", timeout=10) as r:
        return r.read().decode()


def metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def generated(app) -> float:
    return metric(scrape(app), "appliance_tokens_total", model="chat", kind="generated")


def slots_used(app) -> float:
    return metric(scrape(app), "appliance_kv_slots_used")


def abort_transport(client) -> None:
    """Drop the client's TCP connection without CloseSession or CloseSecureChannel (a pulled cable, a crash)."""
    client.uaclient.protocol.transport.abort()


async def wait_for(predicate, timeout: float, step: float = 0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(step)
    return predicate()


def test_an_abandoned_generation_stops_and_the_slot_is_freed_at_the_session_timeout(app):
    async def go():
        before = generated(app)
        abandoned_before = metric(scrape(app), "appliance_requests_total", model="chat", method="Generate",
                                  status="BadConnectionClosed")
        client = await connect(app.endpoint, *app.plc, session_timeout_ms=int(SESSION_TIMEOUT_S * 1000))
        # a first turn: the session's conversation, which its slot keeps while the session lives
        assert status_name(await call(client, "chat", "Generate", gen_args("Valve 3", 5))) == "Good"
        before = generated(app)
        call_task = asyncio.create_task(call(client, "chat", "Generate", gen_args("The pump", 12000)))
        # generating: tokens flow and the session holds a slot
        await wait_for(lambda: generated(app) > before + 50 or call_task.done(), 60)
        assert not call_task.done(), f"the long Generate ended early: {call_task.result()}"
        assert generated(app) > before + 50, "the generation never started"
        assert await wait_for(lambda: slots_used(app) == 1, 5)  # the worker's figures reach serve within a second
        abort_transport(client)
        dropped = time.monotonic()
        call_task.cancel()
        await asyncio.gather(call_task, return_exceptions=True)

        # within 1 s of the drop the engine has stopped: nothing more is generated from then on
        await asyncio.sleep(max(0.0, dropped + 1.0 - time.monotonic()))
        at_one_second = generated(app)
        await asyncio.sleep(1.0)
        assert generated(app) == at_one_second, "the abandoned generation went on after the channel closed"
        assert at_one_second < before + 12000, "the generation ran to its end instead of stopping"
        text = scrape(app)
        assert metric(text, "appliance_requests_total", model="chat", method="Generate",
                      status="BadConnectionClosed") == abandoned_before + 1

        # the session (and its slot) outlive the connection until the session times out, then the slot is free
        assert slots_used(app) == 1, "the slot went with the connection, before the session timed out"
        freed = await wait_for(lambda: slots_used(app) == 0, SESSION_TIMEOUT_S + 3)
        assert freed, "the vanished client's slot was never freed"
        assert time.monotonic() - dropped >= SESSION_TIMEOUT_S - 0.5
        with contextlib_suppress():
            await client.disconnect()
    asyncio.run(asyncio.wait_for(go(), 120))


def test_a_client_that_reactivates_its_session_on_a_new_channel_keeps_its_conversation(app):
    async def go():
        client = await connect(app.endpoint, *app.plc, session_timeout_ms=int(SESSION_TIMEOUT_S * 1000),
                               auto_reconnect=True)
        try:
            first = await call(client, "chat", "Generate", gen_args("Valve 3", 5))
            assert status_name(first) == "Good"
            context = first.OutputArguments[3].Value
            token = client.uaclient.session.authentication_token if hasattr(client.uaclient, "session") else None
            abort_transport(client)
            # the client's own reconnect: a new socket and secure channel, ActivateSession of the same session
            second = None
            end = time.monotonic() + 20
            while time.monotonic() < end:
                try:
                    second = await call(client, "chat", "Generate", gen_args("Tank", 5))
                    break
                except (ConnectionError, ua.UaError, asyncio.TimeoutError, TimeoutError):
                    await asyncio.sleep(0.2)
            assert second is not None and status_name(second) == "Good"
            lost, context_after = second.OutputArguments[4].Value, second.OutputArguments[3].Value
            assert lost is False, "the conversation was lost across the reconnect"
            assert context_after > context + 5, "the second turn did not continue the first"
            if token is not None:
                assert client.uaclient.session.authentication_token == token  # the same session, re-activated
        finally:
            with contextlib_suppress():
                await client.disconnect()
    asyncio.run(asyncio.wait_for(go(), 120))


def contextlib_suppress():
    import contextlib
    return contextlib.suppress(Exception)


def test_a_call_longer_than_the_session_timeout_is_answered(app):
    """A session is idle only when nothing of it runs: a Generate that lasts twice the session timeout, with the
    client sending nothing meanwhile, is answered and its session lives on."""
    async def go():
        # the request timeout well above the long call's (a loaded machine may take several times the estimate)
        client = await connect(app.endpoint, *app.plc, session_timeout_ms=int(SESSION_TIMEOUT_S * 1000), timeout=110)
        try:
            started = time.monotonic()
            r = await call(client, "chat", "Generate", gen_args("Rate", 300))
            assert status_name(r) == "Good"
            per_token = (time.monotonic() - started) / r.OutputArguments[1].Value
            # the machine's speed moves (another test process beside this one): a call that came out shorter than
            # the session timeout proves nothing, so it is asked again for twice the tokens until one lasts longer
            tokens = min(11000, int(2 * SESSION_TIMEOUT_S / per_token) + 100)
            for _ in range(4):
                started = time.monotonic()
                r = await call(client, "chat", "Generate", gen_args("Long", tokens))
                took = time.monotonic() - started
                assert status_name(r) == "Good" and r.OutputArguments[1].Value == tokens, status_name(r)
                if took > SESSION_TIMEOUT_S + 1 or tokens == 11000:
                    break
                tokens = min(11000, tokens * 2)
            assert took > SESSION_TIMEOUT_S, f"the call took {took:.1f} s: not longer than the session timeout"
            r = await call(client, "chat", "Generate", gen_args("After", 3))
            assert status_name(r) == "Good" and r.OutputArguments[4].Value is False  # the same conversation
        finally:
            with contextlib_suppress():
                await client.disconnect()
    asyncio.run(asyncio.wait_for(go(), 180))
