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
from uaclient import Events, call, floats, read, run, session, status_name

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
    recorder = Events()
    events = recorder.events

    async def go():
        async with session(app, *app.plc1) as c:
            ns = await c.get_namespace_index("urn:opcua-inference-appliance")
            model = await c.nodes.objects.get_child([f"{ns}:Appliance", f"{ns}:Models", f"{ns}:chat"])
            etype = await c.nodes.base_event_type.get_child(f"{ns}:JobResultReadyEventType")
            sub = await c.create_subscription(50, recorder)
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


# ---- Start checks its arguments as the synchronous call does; JobIds belong to their model; sessions; bounds ----

def arg_marks(result) -> list[str]:
    return [s.name for s in result.InputArgumentResults]


def test_start_refuses_what_the_synchronous_call_refuses_with_the_same_code_and_argument(app):
    async def go():
        async with session(app, *app.plc2) as c:
            for bad in ([1.0, 2.0, 3.0], [1.0] * 5, [float("nan")] * 4):  # wrong length, NaN
                sync = await call(c, "affine", "Infer", [floats(bad)])
                start = await call(c, "affine", "StartInfer", [floats(bad)])
                assert status_name(sync) == status_name(start) == "BadInvalidArgument", bad
                assert arg_marks(sync) == arg_marks(start) == ["BadOutOfRange"], bad
                assert not start.OutputArguments  # no JobId for a call that could not run
            cases = [  # (Prompt, MaxTokens, Temperature) -> the argument marked
                (ua.Variant("hi", V.String), u32(0), ua.Variant(0.0, V.Float)),  # MaxTokens 0
                (ua.Variant("hi", V.String), u32(401), ua.Variant(0.0, V.Float)),  # above engine.max_new_tokens
                (ua.Variant("a\x07b", V.String), u32(5), ua.Variant(0.0, V.Float)),  # a control character
                (ua.Variant("", V.String), u32(5), ua.Variant(0.0, V.Float)),  # empty prompt
                (ua.Variant("hi", V.String), u32(5), ua.Variant(2.5, V.Float)),  # temperature out of range
                (ua.Variant("hi", V.String), ua.Variant(5, V.Int32), ua.Variant(0.0, V.Float)),  # wrong type
            ]
            for args in cases:
                sync = await call(c, "chat", "Generate", list(args))
                start = await call(c, "chat", "StartGenerate", [ua.Variant("", V.String), *args])
                assert status_name(sync) == status_name(start) == "BadInvalidArgument", args
                assert ["Good", *arg_marks(sync)] == arg_marks(start), (args, arg_marks(sync), arg_marks(start))
                assert not start.OutputArguments
            # none of the refused Starts holds one of the identity's max_per_client (3) jobs
            jobs = []
            for _ in range(3):
                r = await call(c, "affine", "StartInfer", [floats([1, 1, 1, 1])])
                assert status_name(r) == "Good"
                jobs.append(r.OutputArguments[0].Value)
            for job in jobs:
                assert status_name(await call(c, "affine", "ReleaseJob", [u32(job)])) == "Good"
    run(go())


def test_a_job_id_belongs_to_its_model(app):
    async def go():
        async with session(app, *app.plc2) as c:
            r = await call(c, "affine", "StartInfer", [floats([1, 2, 3, 4])])
            job = r.OutputArguments[0].Value
            for method, args in (("GetGenerateResult", [u32(job), u32(500)]), ("CancelJob", [u32(job)]),
                                 ("ReleaseJob", [u32(job)])):
                assert status_name(await call(c, "chat", method, args)) == "BadNotFound", method
            r = await call(c, "affine", "GetInferResult", [u32(job), u32(2000)])  # untouched on its own model
            assert status_name(r) == "Good" and r.OutputArguments[0].Value is True
            assert np.allclose(r.OutputArguments[1].Value, [3, 5, 7, 9])
            assert status_name(await call(c, "affine", "ReleaseJob", [u32(job)])) == "Good"
    run(go())


def test_a_session_conversation_job_runs_to_its_end_after_its_session_closes(app):
    """An S7 with MaintainSession FALSE: StartGenerate on its session's conversation, then the session closes."""
    async def go():
        async with session(app, *app.plc1) as c:
            slots_before = await read(c, "Engine", "SlotsInUse")
            r = await call(c, "chat", "StartGenerate", [ua.Variant("", V.String), *gen_args("Tell me", 200)])
            assert status_name(r) == "Good"
            job = r.OutputArguments[0].Value
        # the session is closed now; the next session of the same PLC fetches the whole result
        async with session(app, *app.plc1) as c:
            for _ in range(20):
                r = await call(c, "chat", "GetGenerateResult", [u32(job), u32(2000)])
                assert status_name(r) == "Good", status_name(r)
                if r.OutputArguments[0].Value:
                    break
            done, text, tokens, finish = [v.Value for v in r.OutputArguments[:4]]
            assert done is True and tokens == len(REPLY) and finish == "stop" and text
            assert status_name(await call(c, "chat", "ReleaseJob", [u32(job)])) == "Good"
            for _ in range(40):  # the closed session's slot is given back once its job ended
                if await read(c, "Engine", "SlotsInUse") <= slots_before:
                    break
                await asyncio.sleep(0.1)
            assert await read(c, "Engine", "SlotsInUse") <= slots_before
    run(go())


def test_a_failed_job_answers_the_code_of_the_call_without_marking_get_arguments(app):
    async def go():
        async with session(app, *app.plc2) as c:
            long_prompt = " ".join(f"w{i}" for i in range(2500))  # valid, but longer than the 2048-token context
            r = await call(c, "chat", "StartGenerate", [ua.Variant("", V.String), *gen_args(long_prompt, 5)])
            assert status_name(r) == "Good"
            job = r.OutputArguments[0].Value
            r = await call(c, "chat", "GetGenerateResult", [u32(job), u32(2000)])
            assert status_name(r) == "BadInvalidArgument"
            assert set(arg_marks(r)) <= {"Good"}, arg_marks(r)  # JobId and WaitMs were fine
            assert status_name(await call(c, "chat", "ReleaseJob", [u32(job)])) == "Good"
    run(go())


def test_a_generation_job_is_bounded_by_jobs_timeout_not_by_the_request_deadline(tmp_path):
    make_model_dir(tmp_path / "chat", scripted=list(range(40, 60)), endless=True, max_positions=16384)
    models = {"chat": {"kind": "generative", "path": str(tmp_path / "chat"), "max_text_chars": 16000}}
    app = RunningAppliance(tmp_path / "state", models, {
        "jobs": {"timeout_s": 2}, "engine": {"max_seq_len": 16384, "max_new_tokens": 12000,
                                             "request_timeout_s": 1}})
    plc = app.issue("plc1", "operator")

    async def go():
        async with session(app, *plc) as c:
            started = asyncio.get_running_loop().time()
            r = await call(c, "chat", "StartGenerate", [ua.Variant("line3", V.String), *gen_args("Pump", 12000)])
            assert status_name(r) == "Good"
            job = r.OutputArguments[0].Value
            while True:
                r = await call(c, "chat", "GetGenerateResult", [u32(job), u32(2000)])
                assert status_name(r) == "Good", status_name(r)  # not BadTimeout at the 1 s request deadline
                if r.OutputArguments[0].Value:
                    break
            elapsed = asyncio.get_running_loop().time() - started
            done, text, tokens, finish, context, lost = [v.Value for v in r.OutputArguments[:6]]
            assert finish == "deadline" and 0 < tokens < 12000 and len(text) > 0
            assert 1.9 < elapsed < 15, elapsed
            # the reply so far stays in the conversation: the next turn continues after it
            r = await call(c, "chat", "Converse", [ua.Variant("line3", V.String), *gen_args("Next", 3)])
            assert status_name(r) == "Good" and r.OutputArguments[4].Value is False
            assert r.OutputArguments[3].Value > context
    try:
        run(go())
    finally:
        app.stop()
