"""A job is routed like its call: StartGenerate meets the A/B variant (and fallback) that Generate meets, so a PLC
that switches from the synchronous call to a job stays on its variant. A real appliance with a generative model
split 50/50 between its main weights (version v-main) and a variant (v-b), callers with real certificates over
SignAndEncrypt: each caller's Generate and StartGenerate + GetGenerateResult answer the same ModelVersion, the one
its identity hashes to."""
from __future__ import annotations

import hashlib

import pytest
from asyncua import ua

from appliance.variants import choose
from harness import RunningAppliance
from uaclient import call, run, session, status_name

pytest.importorskip("transformers")
from tiny_llm import make_model_dir  # noqa: E402

V = ua.VariantType


def gen_args(prompt: str) -> list[ua.Variant]:
    return [ua.Variant(prompt, V.String), ua.Variant(4, V.UInt32), ua.Variant(0.0, V.Float)]


def arm_of(cert) -> str:
    thumb = hashlib.sha1(cert.read_bytes()).hexdigest()
    return "v-b" if choose(f"{thumb}/x509:{thumb}", "chat", {"b": 50}) == "b" else "v-main"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    d = tmp_path_factory.mktemp("job-routing")
    make_model_dir(d / "chat", seed=0)
    make_model_dir(d / "chat-b", seed=1)
    a = RunningAppliance(d / "state", {"chat": {"kind": "generative", "path": str(d / "chat"), "version": "v-main",
                                                "variants": {"b": {"path": str(d / "chat-b"), "weight": 50,
                                                                   "version": "v-b"}}}})
    # certificates are fresh each run, so their arms are random: issue callers until both arms have one
    a.callers = []
    while {arm_of(c) for c, _ in a.callers} != {"v-b", "v-main"}:
        assert len(a.callers) < 30, "thirty identities all hashed into one arm of a 50/50 split"
        a.callers.append(a.issue(f"plc{len(a.callers) + 1}", "operator"))
    yield a
    a.stop()


async def versions_met(app, cert, key) -> tuple[str, str, str]:
    """The ModelVersion this caller meets through Generate, through a session job and through a conversation job."""
    async with session(app, cert, key) as c:
        r = await call(c, "chat", "Generate", gen_args("hello"))
        assert status_name(r) == "Good"
        sync = r.OutputArguments[5].Value
        jobs = []
        for conversation in ("", "line-7"):
            r = await call(c, "chat", "StartGenerate", [ua.Variant(conversation, V.String), *gen_args("hello")])
            assert status_name(r) == "Good"
            job = r.OutputArguments[0]
            r = await call(c, "chat", "GetGenerateResult", [job, ua.Variant(2000, V.UInt32)])
            while status_name(r) == "Good" and not r.OutputArguments[0].Value:
                r = await call(c, "chat", "GetGenerateResult", [job, ua.Variant(2000, V.UInt32)])
            assert status_name(r) == "Good"
            jobs.append(r.OutputArguments[6].Value)
        return sync, *jobs


def test_start_generate_meets_the_variant_that_generate_meets(app):
    for cert, key in app.callers:
        expected = arm_of(cert)
        assert run(versions_met(app, cert, key)) == (expected, expected, expected), cert.name


async def context_after_reset(app, cert, key) -> tuple[int, int, int, int]:
    """ContextTokens of two turns, then after ResetContext, then of a Converse turn after EndConversation: a reset
    forgets the conversation on the arm the caller's Generate was routed to."""
    async with session(app, cert, key) as c:
        first = (await call(c, "chat", "Generate", gen_args("hello"))).OutputArguments[3].Value
        second = (await call(c, "chat", "Generate", gen_args("hello")))
        assert second.OutputArguments[3].Value > first
        r = await call(c, "chat", "ResetContext", [])
        assert status_name(r) == "Good"
        after = (await call(c, "chat", "Generate", gen_args("hello"))).OutputArguments[3].Value
        line = ua.Variant("line-9", V.String)
        once = (await call(c, "chat", "Converse", [line, *gen_args("hello")])).OutputArguments[3].Value
        await call(c, "chat", "Converse", [line, *gen_args("hello")])
        assert status_name(await call(c, "chat", "EndConversation", [line])) == "Good"
        again = (await call(c, "chat", "Converse", [line, *gen_args("hello")])).OutputArguments[3].Value
        return first, after, once, again


def test_reset_context_and_end_conversation_forget_the_variant_s_conversation(app):
    for cert, key in app.callers:
        first, after, once, again = run(context_after_reset(app, cert, key))
        assert after == first and again == once, (arm_of(cert), first, after, once, again)
