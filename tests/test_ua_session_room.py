"""Orphaned sessions lock no one out: a client on a flaky link breaks its channel again and again, opening a new
session each time, and each broken channel leaves an activated session behind until its timeout (the vanished-client
behaviour). The contract: one client identity holds at most `security.limits.max_sessions_per_client` sessions; at
that bound, or with the table full (`security.limits.max_sessions`), the oldest session without a live channel (that
identity's first) is closed to make room, audited; a client is refused (BadTooManySessions) only when every session
in its way has a live channel. Real clients over SignAndEncrypt; channels really aborted (no CloseSession).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request

import pytest
from asyncua import ua

from appliance.client import connect
from certs.x509io import thumbprint
from harness import RunningAppliance
from onnx_models import affine_model
from uaclient import call, floats, run, status_name

PER_CLIENT = 10  # the default of security.limits.max_sessions_per_client


def infer_args(i: int) -> list[ua.Variant]:
    return [floats([float(i % 7), 1.0, 2.0, 3.0])]


async def break_channel(client) -> None:
    """The flaky link: the TCP connection aborted, no CloseSession, no CloseSecureChannel; the session stays."""
    client.uaclient.protocol.transport.abort()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.disconnect(), 5)  # the client's own objects; nothing reaches the server


async def close(client) -> None:
    with contextlib.suppress(Exception):
        await client.disconnect()


async def refused(app, creds) -> str:
    """The status a new client meets: "" when it got a session, else the refusal's status name."""
    try:
        client = await connect(app.endpoint, *creds)
    except Exception as exc:  # noqa: BLE001 - the refusal is what is looked at
        code = getattr(exc, "code", None)
        return ua.StatusCode(code).name if isinstance(code, int) else type(exc).__name__
    await close(client)
    return ""


def audit_records(app) -> list[dict]:
    app.run(asyncio.sleep(0.5))  # the audit writer's queue reaches the file
    return [json.loads(line) for line in (app.state_dir / "audit" / "audit.jsonl").read_text().splitlines()]


def sessions_open(app) -> float:
    with urllib.request.urlopen(f"{app.metrics_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith("appliance_ua_sessions "))


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """The defaults: max_sessions 64, max_sessions_per_client 10, sessions kept 60 s after their channel broke."""
    d = tmp_path_factory.mktemp("session-room")
    a = RunningAppliance(d / "state", {"cls": {"kind": "tensor", "path": str(affine_model(d / "cls.onnx"))}})
    a.flaky, a.plc = a.issue("flaky", "operator"), a.issue("plc2", "operator")
    yield a
    a.stop()


def test_a_client_that_breaks_its_channel_100_times_locks_no_one_out(app):
    async def flaky_client() -> int:
        answered = 0
        for i in range(100):
            client = await connect(app.endpoint, *app.flaky)  # a new session each time
            r = await call(client, "cls", "Infer", infer_args(i))
            assert status_name(r) == "Good", f"session {i + 1}: {status_name(r)}"
            answered += 1
            await break_channel(client)
        return answered

    async def second_plc(stop: asyncio.Event) -> tuple[int, int]:
        sessions = calls = 0
        while not stop.is_set():
            client = await connect(app.endpoint, *app.plc)
            sessions += 1
            try:
                for i in range(5):
                    r = await call(client, "cls", "Infer", infer_args(i))
                    assert status_name(r) == "Good", f"the second PLC's call: {status_name(r)}"
                    calls += 1
                    await asyncio.sleep(0.05)
            finally:
                await close(client)
        return sessions, calls

    async def go():
        stop = asyncio.Event()
        plc = asyncio.create_task(second_plc(stop))
        try:
            answered = await flaky_client()
        finally:
            stop.set()
        sessions, calls = await plc
        assert answered == 100
        assert sessions >= 5 and calls >= 25, (sessions, calls)
        # after all that, a PLC still gets in
        assert await refused(app, app.plc) == ""
    started = time.monotonic()
    run(go(), timeout=600)
    print(f"100 broken channels in {time.monotonic() - started:.1f} s")

    # the flaky client holds its bound of orphans, no more; the other 90 were closed to make room, audited
    app.run(app.app.ua.publish_values())
    assert 1 <= sessions_open(app) <= PER_CLIENT
    closes = [r for r in audit_records(app) if r.get("event") == "session_close"
              and "closed to make room" in r.get("detail", "")]
    assert len(closes) == 100 - PER_CLIENT, [r["detail"] for r in closes[:3]]
    assert {r["user"] for r in closes} == {closes[0]["user"]} and "max_sessions_per_client" in closes[0]["detail"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A table of 5 sessions; 3 per client identity before its orphans are closed."""
    d = tmp_path_factory.mktemp("session-room-small")
    a = RunningAppliance(d / "state", {"cls": {"kind": "tensor", "path": str(affine_model(d / "cls.onnx"))}},
                         {"security": {"limits": {"max_sessions": 5, "max_sessions_per_client": 3}}})
    a.clients = [a.issue(f"plc{n}", "operator") for n in range(7)]
    yield a
    a.stop()


def test_a_full_table_closes_its_oldest_orphan_and_refuses_only_when_every_channel_is_live(small):
    earlier = len(audit_records(small))

    async def go():
        flaky, *plcs = small.clients
        for _ in range(3):  # three orphans
            await break_channel(await connect(small.endpoint, *flaky))
        live = []
        for creds in plcs[:5]:  # each new client gets in: an orphan closed for each once the table is full
            live.append(await connect(small.endpoint, *creds))
            assert status_name(await call(live[-1], "cls", "Infer", infer_args(1))) == "Good"
        assert await refused(small, plcs[5]) == "BadTooManySessions"  # five live channels: no room
        for c in live:  # the refusal took nothing from those that got in
            assert status_name(await call(c, "cls", "Infer", infer_args(2))) == "Good"
        await close(live.pop(0))
        assert await refused(small, plcs[5]) == ""  # room again
        for c in live:
            await close(c)
    run(go())
    closes = [r for r in audit_records(small)[earlier:] if "session table" in r.get("detail", "")]
    assert len(closes) == 3, closes  # the three orphans, each when the table was full
    assert {r["client"] for r in closes} == {thumbprint(small.clients[0][0].read_bytes())}


def test_an_identity_at_its_bound_makes_room_from_its_own_orphans_only(small):
    """Past its bound an identity's own oldest orphan goes, not another PLC's older one (that PLC may come back);
    an identity whose sessions all have live channels is not refused while the table has room."""
    earlier = len(audit_records(small))

    async def go():
        other, plc, late = small.clients[0], small.clients[5], small.clients[6]
        await break_channel(await connect(small.endpoint, *other))  # another PLC's orphan, the oldest session
        a = await connect(small.endpoint, *plc)
        await break_channel(await connect(small.endpoint, *plc))  # the identity's orphan
        c = await connect(small.endpoint, *plc)
        live = [a, c]
        try:
            live.append(await connect(small.endpoint, *plc))  # its 4th: its own orphan is closed for it
            live.append(await connect(small.endpoint, *plc))  # its 5th, all live: not refused, the table has room
            for client in live:
                assert status_name(await call(client, "cls", "Infer", infer_args(3))) == "Good"
            # the table is full now: the other PLC's orphan is closed for a newcomer; then nothing is left to close
            live.append(await connect(small.endpoint, *late))
            assert await refused(small, late) == "BadTooManySessions"
        finally:
            for client in live:
                await close(client)
    run(go())
    records = audit_records(small)[earlier:]
    by_bound = [r["client"] for r in records if "max_sessions_per_client (3)" in r.get("detail", "")]
    by_table = [r["client"] for r in records if "session table" in r.get("detail", "")]
    # the identity's own orphan for its bound; the other PLC's only for the full table
    assert by_bound == [thumbprint(small.clients[5][0].read_bytes())], by_bound
    assert by_table == [thumbprint(small.clients[0][0].read_bytes())], by_table
