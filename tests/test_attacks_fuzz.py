"""Malformed traffic against a real appliance on loopback: a few hundred seeded raw-socket cases (truncated,
oversized and zero-size headers, wrong message types, random bytes after a valid Hello, mangled
OpenSecureChannel requests), and hypothesis-generated method arguments through one real session. The server
never crashes or hangs (a legitimate call succeeds within a short timeout after each batch), and every method
answer carries one of the contract's status codes, never BadUnexpectedError."""
from __future__ import annotations

import asyncio
import collections
import random

import pytest
from asyncua import ua
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.client import connect
from attack_tools import (
    close, error_status, hello_bytes, legit_infer, open_none_channel_bytes, report, run_node_client, send_raw,
    start_appliance,
)
from uaclient import arg_statuses, call, run, status_name

V = ua.VariantType
SEED = 20240611
CONTRACT_CODES = {"Good", "BadArgumentsMissing", "BadTooManyArguments", "BadInvalidArgument", "BadUserAccessDenied",
                  "BadInvalidState", "BadResourceUnavailable", "BadTimeout", "BadInternalError"}
TCP_TYPES = [b"HEL", b"ACK", b"ERR", b"RHE", b"OPN", b"CLO", b"MSG"]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from tiny_llm import make_model_dir  # a tiny random Llama, saved as an HF directory
    d = tmp_path_factory.mktemp("attacks_fuzz")
    make_model_dir(d / "tiny")
    a = start_appliance(d, {"models": {"gen": {"kind": "generative", "path": str(d / "tiny")}},
                            "engine": {"kv_slots": 2, "max_seq_len": 256, "max_new_tokens": 16}})
    yield a
    a.stop()


def header(message_type: bytes, chunk_type: bytes, size: int) -> bytes:
    return message_type + chunk_type + size.to_bytes(4, "little")


def malformed_cases(rng: random.Random, endpoint: str) -> list[tuple[str, bytes]]:
    hello, opn = hello_bytes(endpoint), open_none_channel_bytes()
    cases = []
    for _ in range(40):
        cases.append(("truncated header", hello[:rng.randint(1, 7)]))
        cases.append(("oversized header", header(rng.choice(TCP_TYPES), rng.choice(b"FCA").to_bytes(1, "big"),
                                                 rng.randint(65536, 2**32 - 1)) + rng.randbytes(rng.randint(0, 64))))
        cases.append(("zero-size header", header(rng.choice(TCP_TYPES), b"F", rng.randint(0, 7))
                      + rng.randbytes(rng.randint(0, 16))))
        body = rng.randbytes(rng.randint(0, 200))
        kind = bytes(rng.choice(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(3))
        cases.append(("wrong message type", header(kind, b"F", 8 + len(body)) + body))
        first = rng.choice([b"OPN", b"MSG", b"CLO", b"ACK", b"ERR"])  # a valid type, but not Hello, first
        cases.append(("no Hello first", header(first, b"F", 8 + len(body)) + body))
        cases.append(("random bytes after Hello", hello + rng.randbytes(rng.randint(1, 2000))))
        mangled = bytearray(opn)
        for _ in range(rng.randint(1, 6)):
            at = rng.randrange(12, len(mangled))  # keep the TCP header intact: fuzz what is behind it
            mangled[at] = rng.randrange(256)
        cases.append(("mangled OpenSecureChannel", hello + bytes(mangled)))
        noise = rng.randbytes(rng.randint(0, 300))
        cases.append(("MSG with random body", hello + opn + header(b"MSG", rng.choice(b"FCA").to_bytes(1, "big"),
                                                                    8 + len(noise)) + noise))
    return cases


def test_malformed_messages_never_crash_or_hang_the_server(app, tmp_path):
    rng = random.Random(SEED)
    cases = malformed_cases(rng, app.endpoint)
    outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    async def go():
        limit = asyncio.Semaphore(8)

        async def one(label, data):
            async with limit:
                got, closed = await send_raw(app.port, data, wait=0.4)
            outcome = "closed" if closed else "still open"
            status = error_status(got)
            outcomes[label][f"{outcome}, {status}" if status else outcome] += 1

        batch = 80
        for start in range(0, len(cases), batch):
            await asyncio.gather(*[one(label, data) for label, data in cases[start:start + batch]])
            await asyncio.wait_for(legit_infer(app), 10)  # the server still answers, promptly
        return outcomes

    run(go(), timeout=170)
    figures = report(tmp_path, "malformed", {"seed": SEED, "cases": len(cases),
                                             "outcomes": {k: dict(v) for k, v in outcomes.items()}})
    assert figures["cases"] >= 300
    # a message that cannot be valid gets the connection closed, never a silent wait
    for label in ("oversized header", "zero-size header", "wrong message type", "no Hello first"):
        assert set(outcomes[label]) <= {"closed", "closed, BadTcpMessageTooLarge", "closed, BadDecodingError",
                                        "closed, BadTcpMessageTypeInvalid"}, (label, outcomes[label])
        assert sum(outcomes[label].values()) == 40


def variants():
    scalars = {
        V.Float: st.floats(width=32), V.Double: st.floats(), V.Int32: st.integers(-2**31, 2**31 - 1),
        V.UInt32: st.integers(0, 2**32 - 1), V.Boolean: st.booleans(), V.String: st.text(max_size=300),
        V.ByteString: st.binary(max_size=64), V.Byte: st.integers(0, 255), V.Int64: st.integers(-2**63, 2**63 - 1),
    }
    scalar = st.sampled_from(list(scalars)).flatmap(lambda t: scalars[t].map(lambda v, t=t: ua.Variant(v, t)))
    array = st.sampled_from(list(scalars)).flatmap(
        lambda t: st.lists(scalars[t], max_size=40).map(lambda v, t=t: ua.Variant(v, t, is_array=True)))
    # nearly valid Infer inputs: Float[] of whole and broken samples, NaN and Inf included
    samples = st.lists(st.floats(width=32), min_size=0, max_size=40).map(lambda v: ua.Variant(v, V.Float))
    return st.one_of(scalar, array, samples)


def well_typed(method: str):
    """The right count and types, with values anywhere in (and beyond) their ranges."""
    text = st.one_of(st.text(max_size=200), st.text(alphabet="pump valve ?", min_size=1, max_size=40))
    if method == "Generate":
        tokens = st.one_of(st.integers(0, 20), st.integers(0, 2**32 - 1))
        temperature = st.one_of(st.floats(0, 2, width=32), st.floats(width=32))
        return st.tuples(text.map(lambda v: ua.Variant(v, V.String)), tokens.map(lambda v: ua.Variant(v, V.UInt32)),
                         temperature.map(lambda v: ua.Variant(v, V.Float))).map(list)
    if method == "Infer":
        return st.lists(st.floats(width=32), max_size=40).map(lambda v: [ua.Variant(v, V.Float)])
    if method == "ReloadModel":
        return text.map(lambda v: [ua.Variant(v, V.String)])
    return st.just([])


def test_method_argument_fuzzing_answers_only_contract_codes(app, tmp_path):
    seen: collections.Counter = collections.Counter()
    loop = asyncio.new_event_loop()
    try:
        client = loop.run_until_complete(connect(app.endpoint, *app.operator, timeout=30))

        async def nodes():
            ns = await client.get_namespace_index("urn:opcua-inference-appliance")
            models = await client.nodes.objects.get_child([f"{ns}:Appliance", f"{ns}:Models"])
            out = {}
            for model, method in (("affine", "Infer"), ("gen", "Generate"), ("gen", "ResetContext")):
                parent = await models.get_child(f"{ns}:{model}")
                out[method] = (parent.nodeid, (await parent.get_child(f"{ns}:{method}")).nodeid)
            admin = await client.nodes.objects.get_child([f"{ns}:Appliance", f"{ns}:Admin"])
            out["ReloadModel"] = (admin.nodeid, (await admin.get_child(f"{ns}:ReloadModel")).nodeid)
            return out
        methods = loop.run_until_complete(nodes())

        @settings(max_examples=150, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
        @given(st.sampled_from(sorted(methods)).flatmap(
            lambda m: st.tuples(st.just(m), st.one_of(st.lists(variants(), max_size=4), well_typed(m)))))
        def check(case):
            method, args = case
            request = ua.CallMethodRequest(ObjectId=methods[method][0], MethodId=methods[method][1],
                                           InputArguments=args)
            result = loop.run_until_complete(asyncio.wait_for(client.uaclient.call([request]), 30))[0]
            name = status_name(result)
            seen[f"{method}: {name}"] += 1
            assert name != "BadUnexpectedError"
            assert name in CONTRACT_CODES, (method, args, name)
            for s in result.InputArgumentResults:
                assert s.name in {"Good", "BadTypeMismatch", "BadOutOfRange", "BadInvalidArgument"}, s.name

        check()
        # the fuzzed session is still usable
        r = loop.run_until_complete(call(client, "affine", "Infer", [ua.Variant([1.0, 2.0, 3.0, 4.0], V.Float)]))
        assert status_name(r) == "Good"
        loop.run_until_complete(close(client))
    finally:
        loop.close()
    report(tmp_path, "method_fuzz", {"examples": sum(seen.values()), "answers": dict(seen)})
    assert sum(seen.values()) >= 100
    run(legit_infer(app))


def test_oversized_prompt_is_refused(app):
    async def go():
        client = await connect(app.endpoint, *app.operator)
        try:
            args = [ua.Variant("x" * 20_000, V.String), ua.Variant(4, V.UInt32), ua.Variant(0.0, V.Float)]
            r = await call(client, "gen", "Generate", args)
            assert status_name(r) == "BadInvalidArgument" and arg_statuses(r) == ["BadOutOfRange", "Good", "Good"]
            r = await call(client, "gen", "Generate", [ua.Variant("pump?", V.String), *args[1:]])
            assert status_name(r) == "Good"
        finally:
            await close(client)
        await legit_infer(app)
    run(go())


def test_independent_client_after_the_attacks(app):
    run_node_client(app)
