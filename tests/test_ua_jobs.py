"""Jobs and conversations over a real server: a job belongs to the caller's identity across sessions, partial text
grows, cancel, release, expiry and the per-identity bound answer the contract's codes, JobResultReady is raised on
the model object; Converse continues a conversation across sessions, per identity."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from asyncua import ua

from harness import RunningAppliance
from onnx_models import affine_model
from uaclient import call, floats, run, session, status_name

pytest.importorskip("transformers")
from tiny_llm import make_model_dir  # noqa: E402

V = ua.VariantType
REPLY = list(range(40, 100))  # the scripted model's reply: 60 distinct tokens, then end of turn


def u32(value: int) -> ua.Variant:
    return ua.Variant(value, V.UInt32)


def gen_args(prompt: str, max_tokens: int = 200):
    return [ua.Variant(prompt, V.String), u32(max_tokens), ua.Variant(0.0, V.Float)]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    d = tmp_path_factory.mktemp("jobs")
    make_model_dir(d / "chat", scripted=REPLY)
    models = {"affine": {"kind": "tensor", "path": str(affine_model(d / "affine.onnx"))},
              "chat": {"kind": "generative", "path": str(d / "chat"), "max_text_chars": 16000}}
    a = RunningAppliance(d / "state", models, {"jobs": {"max_per_client": 3, "result_ttl_s": 2},
                                               "engine": {"max_seq_len": 2048, "max_new_tokens": 400}})
    a.plc1, a.plc2 = a.issue("plc1", "operator"), a.issue("plc2", "operator")
    yield a
    a.stop()


def test_infer_job_across_sessions_of_one_identity(app):
    async def go():
        async with session(app, *app.plc1) as c:
            r = await call(c, "affine", "StartInfer", [floats([1, 2, 3, 4])])
            assert status_name(r) == "Good"
            job = r.OutputArguments[0].Value
            assert r.OutputArguments[0].VariantType == V.UInt32
        async with session(app, *app.plc1) as c:  # the next session of the same PLC
            r = await call(c, "affine", "GetInferResult", [u32(job), u32(2000)])
            done, output, version = [v.Value for v in r.OutputArguments]
            assert status_name(r) == "Good" and done is True and np.allclose(output, [3, 5, 7, 9]) and version
        async with session(app, *app.plc2) as c:  # another identity
            assert status_name(await call(c, "affine", "GetInferResult", [u32(job), u32(0)])) == "BadNotFound"
            assert status_name(await call(c, "affine", "ReleaseJob", [u32(job)])) == "BadNotFound"
        async with session(app, *app.plc1) as c:
            assert status_name(await call(c, "affine", "ReleaseJob", [u32(job)])) == "Good"
            assert status_name(await call(c, "affine", "GetInferResult", [u32(job), u32(0)])) == "BadNotFound"
            assert status_name(await call(c, "affine", "GetInferResult", [u32(12345), u32(0)])) == "BadNotFound"
    run(go())


def test_bound_per_identity_and_expiry(app):
    async def go():
        async with session(app, *app.plc1) as c:
            jobs = []
            for _ in range(3):
                r = await call(c, "affine", "StartInfer", [floats([1, 1, 1, 1])])
                jobs.append(r.OutputArguments[0].Value)
            r = await call(c, "affine", "StartInfer", [floats([1, 1, 1, 1])])
            assert status_name(r) == "BadResourceUnavailable"
            async with session(app, *app.plc2) as c2:  # the bound is per identity
                assert status_name(await call(c2, "affine", "StartInfer", [floats([1, 1, 1, 1])])) == "Good"
            await asyncio.sleep(2.6)  # result_ttl_s 2: kept results expire unreleased
            assert status_name(await call(c, "affine", "GetInferResult", [u32(jobs[0]), u32(0)])) == "BadNotFound"
            assert status_name(await call(c, "affine", "StartInfer", [floats([1, 1, 1, 1])])) == "Good"
    run(go())


def test_generate_job_text_grows_and_the_event_arrives(app):
    events = []

    class Handler:
        def event_notification(self, event):
            events.append(event)

    async def go():
        async with session(app, *app.plc1) as c:
            ns = await c.get_namespace_index("urn:opcua-inference-appliance")
            model = await c.nodes.objects.get_child([f"{ns}:Appliance", f"{ns}:Models", f"{ns}:chat"])
            etype = await c.nodes.base_event_type.get_child(f"{ns}:JobResultReadyEventType")
            sub = await c.create_subscription(50, Handler())
            await sub.subscribe_events(model, etype)
            r = await call(c, "chat", "StartGenerate", [ua.Variant("", V.String), *gen_args("Tell me")])
            job = r.OutputArguments[0].Value
            seen = []
            while True:
                r = await call(c, "chat", "GetGenerateResult", [u32(job), u32(0)])
                assert status_name(r) == "Good"
                done, text, tokens = [v.Value for v in r.OutputArguments[:3]]
                seen.append((done, len(text), tokens))
                if done:
                    break
                await asyncio.sleep(0.005)
            assert seen[-1][2] == len(REPLY)
            partial = [s for s in seen if not s[0] and s[2] > 0]
            assert partial, seen  # the text was seen growing before it was done
            assert all(a[2] <= b[2] for a, b in zip(partial, partial[1:]))  # never shrinks
            for _ in range(40):
                if events:
                    break
                await asyncio.sleep(0.05)
            assert events and events[0].JobId == job and events[0].Model == "chat"
    run(go())


def test_cancelled_job_answers_cancelled(app):
    async def go():
        async with session(app, *app.plc1) as c:
            r = await call(c, "chat", "StartGenerate", [ua.Variant("", V.String), *gen_args("Go on", 400)])
            job = r.OutputArguments[0].Value
            assert status_name(await call(c, "chat", "CancelJob", [u32(job)])) == "Good"
            r = await call(c, "chat", "GetGenerateResult", [u32(job), u32(1000)])
            assert status_name(r) == "BadRequestCancelledByClient"
            assert status_name(await call(c, "chat", "ReleaseJob", [u32(job)])) == "Good"
    run(go())


def test_converse_continues_across_sessions_per_identity(app):
    async def go():
        contexts = []
        for turn in range(5):  # a PLC that opens a session per call (MaintainSession=FALSE)
            async with session(app, *app.plc1) as c:
                r = await call(c, "chat", "Converse", [ua.Variant("line3", V.String), *gen_args(f"turn {turn}", 5)])
                assert status_name(r) == "Good"
                contexts.append(r.OutputArguments[3].Value)
                assert r.OutputArguments[4].Value is False  # ContextLost
        assert contexts == sorted(contexts) and len(set(contexts)) == 5, contexts  # one growing conversation
        async with session(app, *app.plc2) as c:  # the same id from another identity: its own conversation
            r = await call(c, "chat", "Converse", [ua.Variant("line3", V.String), *gen_args("turn 0", 5)])
            assert r.OutputArguments[3].Value == contexts[0]
        async with session(app, *app.plc1) as c:
            assert status_name(await call(c, "chat", "EndConversation", [ua.Variant("line3", V.String)])) == "Good"
            r = await call(c, "chat", "Converse", [ua.Variant("line3", V.String), *gen_args("turn 0", 5)])
            assert r.OutputArguments[3].Value == contexts[0]  # started over
            r = await call(c, "chat", "Converse", [ua.Variant("", V.String), *gen_args("x", 5)])
            assert status_name(r) == "BadInvalidArgument"
    run(go())


def test_converse_survives_a_killed_worker_and_a_restarted_appliance(tmp_path):
    """Each turn in a new session; between turns the model's worker is killed, then the whole appliance restarts
    on the same state directory: the conversation goes on growing, never ContextLost."""
    import os
    import signal
    import time

    make_model_dir(tmp_path / "chat", scripted=REPLY)
    models = {"chat": {"kind": "generative", "path": str(tmp_path / "chat"), "max_text_chars": 16000}}

    def turn(app, plc, n: int) -> tuple[int, bool]:
        async def go():
            async with session(app, *plc) as c:
                r = await call(c, "chat", "Converse", [ua.Variant("line3", V.String), *gen_args(f"turn {n}", 5)])
                assert status_name(r) == "Good"
                return r.OutputArguments[3].Value, r.OutputArguments[4].Value
        return run(go())

    def ready(app) -> None:
        deadline = time.monotonic() + 60
        while app.app.services["chat"].status().state != "Ready":
            assert time.monotonic() < deadline, "chat not Ready again"
            time.sleep(0.1)

    app = RunningAppliance(tmp_path / "state", models, {})
    plc = app.issue("plc1", "operator")
    contexts = []
    try:
        contexts.append(turn(app, plc, 0))
        os.kill(app.app.services["chat"].supervisor.process.pid, signal.SIGKILL)
        time.sleep(0.5)
        ready(app)
        contexts.append(turn(app, plc, 1))
    finally:
        app.stop()
    app = RunningAppliance(tmp_path / "state", models, {})
    try:
        contexts.append(turn(app, plc, 2))
    finally:
        app.stop()
    assert [lost for _n, lost in contexts] == [False, False, False]
    lengths = [n for n, _lost in contexts]
    assert lengths[0] < lengths[1] < lengths[2], lengths  # one conversation, three turns long
    assert list((tmp_path / "state" / "conversations" / "chat").glob("*.json"))
