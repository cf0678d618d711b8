"""Resource attacks against a real appliance on loopback, configured with small limits: unfinished multi-chunk
messages, secure channels and sessions past the limits, messages nesting Variants deeper than
security.limits.max_nesting_depth, oversized arrays and strings. Each is refused with a status code or a closed
connection, and the server keeps answering a legitimate client; the last test runs the floods together while a
PLC calls Infer and reports RSS before/after and the PLC's p99 latency."""
from __future__ import annotations

import asyncio
import time

import pytest
from asyncua import ua

from appliance.client import connect
from attack_tools import (
    RawPeer, close, deep_variant_bytes, error_status, hello_bytes, infer_once, legit_infer, percentile,
    raw_argument, refusal, report, rss_mb, run_node_client, start_appliance, status_of, unfinished_message,
)
from uaclient import arg_statuses, call, floats, run, status_name

V = ua.VariantType
MAX_CHANNELS, MAX_SESSIONS, ACTIVATION_S, MAX_ARRAY, DEPTH = 6, 3, 1.5, 1024, 8
RSS_GROWTH_BOUND_MB = 50
CASES: dict[str, int] = {}  # attack cases sent, by kind, for the report


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    a = start_appliance(tmp_path_factory.mktemp("attacks_flood"), {"security": {"limits": {
        "max_secure_channels": MAX_CHANNELS, "max_sessions": MAX_SESSIONS,
        "session_activation_timeout_s": ACTIVATION_S, "max_array_length": MAX_ARRAY,
        "max_nesting_depth": DEPTH}}})
    a.others = [a.issue(f"plc{i}", "operator") for i in range(2, 2 + MAX_SESSIONS)]
    yield a
    a.stop()


def count(kind: str, n: int = 1) -> None:
    CASES[kind] = CASES.get(kind, 0) + n


async def chunk_flood(app, connections: int, rounds: int) -> tuple[int, int]:
    """`connections` attackers in parallel, each `rounds` times sending a 4 MiB message without its last chunk."""
    async def attacker():
        sent = closed = 0
        for _ in range(rounds):
            n, was_closed = await unfinished_message(app.endpoint, 4 << 20)
            sent += n
            closed += was_closed
        return sent, closed
    results = await asyncio.gather(*[attacker() for _ in range(connections)])
    count("unfinished multi-chunk messages", connections * rounds)
    return sum(r[0] for r in results), sum(r[1] for r in results)


def test_unfinished_chunk_flood_is_bounded(app):
    async def go():
        await chunk_flood(app, connections=4, rounds=1)  # warm-up: the attackers' own buffers, first-use caches
        before = rss_mb()
        sent, closed = await chunk_flood(app, connections=4, rounds=5)
        await asyncio.sleep(0.5)
        after = rss_mb()
        # every attacker was cut off (max_chunk_count of a 1 MiB max message) and memory stayed put
        assert closed == 20, closed
        assert sent >= 20 * (1 << 20), sent
        assert after - before < RSS_GROWTH_BOUND_MB, (before, after, sent)
        await legit_infer(app)
        return before, after, sent
    before, after, sent = run(go(), timeout=120)
    print(f"\nchunk flood: {sent / 1e6:.0f} MB sent, RSS {before:.0f} -> {after:.0f} MB")


def test_oversized_chunk_header_is_refused_before_buffering(app):
    peer = RawPeer(app.port)
    try:
        assert peer.send(hello_bytes(app.endpoint))
        # a chunk announcing 2 GB: asyncua alone would buffer until that much arrived
        assert peer.send(b"MSGF" + (2_000_000_000).to_bytes(4, "little") + b"\x00" * 4096)
        data, closed = peer.read_until_closed(3)
        assert closed and error_status(data) == "BadTcpMessageTooLarge", (data[:64], closed)
    finally:
        peer.close()
    count("oversized chunk headers")
    run(legit_infer(app))


def test_secure_channels_past_the_limit(app):
    peers = [RawPeer(app.port) for _ in range(MAX_CHANNELS)]
    try:
        for p in peers:
            assert p.send(hello_bytes(app.endpoint))
            assert b"ACKF" in p.sock.recv(4096)
        extra = RawPeer(app.port)
        extra.send(hello_bytes(app.endpoint))
        data, closed = extra.read_until_closed(2)
        assert closed and b"ACKF" not in data, "a connection past max_secure_channels was served"
        extra.close()
        count("connections past max_secure_channels", MAX_CHANNELS + 1)
        # idle connections that never activate a session are dropped after session_activation_timeout_s
        closed_by_server = [p.read_until_closed(ACTIVATION_S + 2)[1] for p in peers]
        assert all(closed_by_server), closed_by_server
    finally:
        for p in peers:
            p.close()
    run(legit_infer(app))


def test_sessions_past_the_limit(app):
    async def go():
        clients = [await connect(app.endpoint, *creds) for creds in app.others[:MAX_SESSIONS]]
        try:
            exc = await refusal(legit_infer(app))
            assert status_of(exc) == "BadTooManySessions", exc
            count("sessions past max_sessions")
            for c in clients:  # the sessions that got in still work
                assert status_name(await infer_once(c)) == "Good"
        finally:
            await close(clients.pop())
        await legit_infer(app)  # one freed: a new client gets in
        for c in clients:
            await close(c)
    run(go())


def test_nesting_deeper_than_the_limit_is_a_decoding_error(app):
    async def go():
        client = await connect(app.endpoint, *app.operator)
        try:
            for depth, expected in ((DEPTH, "BadInvalidArgument"), (DEPTH + 1, "BadDecodingError"),
                                    (3000, "BadDecodingError")):
                with raw_argument(deep_variant_bytes(depth)) as placeholder:
                    exc = await refusal(call(client, "affine", "Infer", [placeholder]))
                    result = None
                    if exc is None:
                        result = await call(client, "affine", "Infer", [placeholder])
                if expected == "BadInvalidArgument":  # decodes; a Variant[] is no Float[]
                    assert exc is None and status_name(result) == expected and arg_statuses(result) == [
                        "BadTypeMismatch"], (depth, exc)
                else:
                    assert status_of(exc) == expected, (depth, exc)
                count("deeply nested variants")
                assert status_name(await infer_once(client)) == "Good"  # the session survives
        finally:
            await close(client)
    run(go())


def test_oversized_and_lying_arrays_and_strings(app):
    async def go():
        client = await connect(app.endpoint, *app.operator)
        try:
            # more elements than max_array_length
            r = await call(client, "affine", "Infer", [floats([1.0] * (MAX_ARRAY + 4))])
            assert status_name(r) == "BadInvalidArgument" and arg_statuses(r) == ["BadOutOfRange"]
            # a string where a Float[] belongs, as long as a message may carry
            r = await call(client, "affine", "Infer", [ua.Variant("x" * 500_000, V.String)])
            assert status_name(r) == "BadInvalidArgument" and arg_statuses(r) == ["BadTypeMismatch"]
            # an array length that lies (2^31-1 floats announced, 4 sent): undecodable, not a crash
            lying = bytes([0x80 | V.Float.value]) + (2**31 - 1).to_bytes(4, "little") + b"\x00\x00\x80\x3f"
            with raw_argument(lying) as placeholder:
                exc = await refusal(call(client, "affine", "Infer", [placeholder]))
            assert status_of(exc) == "BadDecodingError", exc
            # ArrayDimensions declaring far more elements than sent (asyncua pads with empty lists)
            dims = bytes([0xC0 | V.Float.value]) + (1).to_bytes(4, "little") + b"\x00\x00\x80\x3f" + \
                (1).to_bytes(4, "little") + (10_000_000).to_bytes(4, "little")
            with raw_argument(dims) as placeholder:
                exc = await refusal(call(client, "affine", "Infer", [placeholder]))
            assert status_of(exc) == "BadDecodingError", ("a 10-million-element ArrayDimensions", exc)
            count("oversized or lying arrays and strings", 4)
            assert status_name(await infer_once(client)) == "Good"
        finally:
            await close(client)
        # a message larger than max_message_size (1 MiB): the server answers an ErrorMessage and closes
        client = await connect(app.endpoint, *app.operator)
        try:
            exc = await refusal(call(client, "affine", "Infer", [floats([1.0] * 400_000)]))
            assert status_of(exc) == "BadRequestTooLarge", exc  # the server's ErrorMessage
            count("messages over max_message_size")
        finally:
            await close(client)
        await legit_infer(app)
    run(go())


def test_floods_together_while_a_plc_calls(app, tmp_path):
    async def go():
        plc = await connect(app.endpoint, *app.operator)
        latencies: list[float] = []
        stop = asyncio.Event()

        async def plc_loop():
            while not stop.is_set():
                t = time.perf_counter()
                r = await asyncio.wait_for(infer_once(plc), 10)
                assert status_name(r) == "Good"
                latencies.append(time.perf_counter() - t)
                await asyncio.sleep(0.02)

        # The nesting attacker's session is opened before the floods: the channel flood fills every connection
        # the server takes (max_connections), and a connect racing it is refused, as it should be.
        attacker = await connect(app.endpoint, *app.others[0])

        async def nesting_flood():
            try:
                for _ in range(100):
                    with raw_argument(deep_variant_bytes(2000)) as placeholder:
                        exc = await refusal(call(attacker, "affine", "Infer", [placeholder]))
                    assert status_of(exc) == "BadDecodingError", exc
                    count("deeply nested variants")
            finally:
                await close(attacker)

        async def channel_flood():
            loop = asyncio.get_running_loop()
            for _ in range(5):
                peers = await loop.run_in_executor(None, lambda: [RawPeer(app.port) for _ in range(MAX_CHANNELS)])
                count("connections past max_secure_channels", MAX_CHANNELS)
                await asyncio.sleep(0.3)
                for p in peers:
                    p.close()

        before = rss_mb()
        plc_task = asyncio.create_task(plc_loop())
        await asyncio.sleep(0.5)
        started = time.perf_counter()
        await asyncio.gather(chunk_flood(app, connections=3, rounds=6), nesting_flood(), channel_flood())
        flood_s = time.perf_counter() - started
        stop.set()
        await plc_task
        await close(plc)
        after = rss_mb()
        return before, after, latencies, flood_s

    before, after, latencies, flood_s = run(go(), timeout=170)
    figures = report(tmp_path, "floods", {
        "attack_cases": dict(CASES), "attack_cases_total": sum(CASES.values()),
        "rss_before_mb": round(before, 1), "rss_after_mb": round(after, 1),
        "rss_growth_bound_mb": RSS_GROWTH_BOUND_MB, "flood_seconds": round(flood_s, 2),
        "legit_calls_during_floods": len(latencies),
        "legit_p50_ms": round(percentile(latencies, 50) * 1000, 1),
        "legit_p99_ms": round(percentile(latencies, 99) * 1000, 1),
        "legit_max_ms": round(max(latencies) * 1000, 1)})
    assert after - before < RSS_GROWTH_BOUND_MB, figures
    assert len(latencies) >= 10, figures
    assert figures["legit_p99_ms"] < 2000, figures
    run(legit_infer(app))


def test_independent_client_after_the_attacks(app):
    run_node_client(app)
