"""Supervised worker processes, end to end on loopback: a worker that hangs, is stopped, dies, or allocates past
its memory limit is replaced; every call is answered exactly once; other models and the appliance carry on.

Real processes (the workers are `python -m appliance.workers.worker`), real signals, a real OPC UA client over
SignAndEncrypt. Timings are bounded generously: these machines are shared and noisy."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest

from appliance.workers.os_setup import WORKER_NICE
from harness import RunningAppliance
from onnx_models import affine_model, hang_model, memory_hog_model
from uaclient import call, floats, read, run, session, status_name
from worker_probes import process_gone, wait_for

TIMEOUT_S = 2.0  # engine.worker_timeout_s in these tests


def worker_pid(app, model: str) -> int:
    return app.app.services[model].supervisor.process.pid


def state(app, model: str) -> str:
    return app.app.services[model].status().state


def audit_records(app) -> list[dict]:
    path = app.state_dir / "audit" / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    d = tmp_path_factory.mktemp("workers")
    models = {
        "affine": {"kind": "tensor", "path": str(affine_model(d / "affine.onnx"))},
        "spare": {"kind": "tensor", "path": str(affine_model(d / "spare.onnx", scale=3.0))},
        "hang": {"kind": "tensor", "path": str(hang_model(d / "hang.onnx"))},
        "hog": {"kind": "tensor", "path": str(memory_hog_model(d / "hog.onnx"))},
    }
    a = RunningAppliance(d / "state", models, {"engine": {
        "worker_timeout_s": TIMEOUT_S, "worker_memory_mb": 600, "worker_restart_backoff_s": 0.1,
        "worker_max_restarts": 20, "request_timeout_s": 20}})
    a.operator = a.issue("plc1", "operator")
    yield a
    a.stop()


def test_each_model_has_its_own_worker_process_below_serve_in_cpu_priority(app):
    pids = {name: worker_pid(app, name) for name in app.app.services}
    assert len(set(pids.values())) == len(pids)
    assert os.getpid() not in pids.values()
    serve_nice = os.getpriority(os.PRIO_PROCESS, 0)  # the appliance serves from this process
    for pid in pids.values():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert b"appliance.workers.worker" in f.read()
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, serve_nice + WORKER_NICE) > serve_nice


def test_hung_forward_pass_is_answered_and_the_worker_replaced(app):
    async def go():
        async with session(app, *app.operator) as c:
            beats_before = await read(c, "Heartbeat"), await read(c, "Models", "affine", "Heartbeat")
            started = time.monotonic()
            r = await call(c, "hang", "Infer", [floats([1, 1, 1, 1])])
            answered = time.monotonic() - started
            assert status_name(r) == "BadInternalError"
            # killed once its forward pass ran longer than worker_timeout_s; the caller hears at once
            assert TIMEOUT_S - 0.3 <= answered <= TIMEOUT_S + 1.0, answered  # one timeout after the hang began
            # the other model and the appliance never stopped
            r = await call(c, "affine", "Infer", [floats([1, 1, 1, 1])])
            assert status_name(r) == "Good"
            beats_after = await read(c, "Heartbeat"), await read(c, "Models", "affine", "Heartbeat")
            assert beats_after[0] > beats_before[0] and beats_after[1] > beats_before[1]
            await asyncio.to_thread(wait_for, lambda: state(app, "hang") == "Ready", 20, "hang Ready again")
            r = await call(c, "hang", "Infer", [floats([0, 0, 0, 0])])
            assert status_name(r) == "Good"
            assert await read(c, "Models", "hang", "WorkerRestarts") >= 1
    run(go())
    # the audit writer hands records to its thread in batches: the last call's record follows within moments
    wait_for(lambda: {("hang", "BadInternalError"), ("hang", "Good")} <= {
        (r["model"], r["status"]) for r in audit_records(app) if r.get("action") == "Infer"}, 5, "the audit records")


def test_memory_hog_is_replaced(app):
    async def go():
        async with session(app, *app.operator) as c:
            restarts = await read(c, "Models", "hog", "WorkerRestarts")
            r = await call(c, "hog", "Infer", [floats([1, 1, 1, 1])])  # fills 3 GiB; the limit is 600 MB
            assert status_name(r) == "BadInternalError"
            await asyncio.to_thread(wait_for, lambda: state(app, "hog") == "Ready", 20, "hog Ready again")
            r = await call(c, "hog", "Infer", [floats([0, 0, 0, 0])])
            assert status_name(r) == "Good"
            assert await read(c, "Models", "hog", "WorkerRestarts") == restarts + 1
    run(go())
    wait_for(lambda: ("hog", "BadInternalError") in [(r["model"], r["status"]) for r in audit_records(app)
                                                     if r.get("action") == "Infer"], 5, "the audit record")


# The stopped-worker test's engine.worker_timeout_s: room to see a frozen Heartbeat first. Its reads end ~3.3 s after
# SIGSTOP and the replacement comes at 7.75-8 s: a 2-core CI runner busy with the suite once took the 0.45 s that
# a 4 s timeout left between the two (CI of 05bd5af).
STOP_TIMEOUT_S = 8.0


def test_stopped_worker_stops_its_heartbeat_only_and_is_replaced(tmp_path):
    # Its own appliance with a longer liveness timeout: the Heartbeat stops at most ~1 s (the health window) plus
    # one 1 Hz tick after SIGSTOP, and the supervisor replaces the worker not before timeout - one ping (0.25 s);
    # with the module's 2 s the two overlap and a replacement can tick the Heartbeat between the reads.
    models = {"affine": {"kind": "tensor", "path": str(affine_model(tmp_path / "affine.onnx"))},
              "spare": {"kind": "tensor", "path": str(affine_model(tmp_path / "spare.onnx", scale=3.0))}}
    app = RunningAppliance(tmp_path / "state", models, {"engine": {
        "worker_timeout_s": STOP_TIMEOUT_S, "worker_restart_backoff_s": 0.1}})
    try:
        operator = app.issue("plc1", "operator")
        pid = worker_pid(app, "spare")

        async def go():
            async with session(app, *operator) as c:
                os.kill(pid, signal.SIGSTOP)
                stopped_at = time.monotonic()
                try:
                    # within 2 s this model's Heartbeat no longer moves ...
                    await asyncio.sleep(2.2)
                    seen = await read(c, "Models", "spare", "Heartbeat")
                    await asyncio.sleep(1.1)
                    later = await read(c, "Models", "spare", "Heartbeat")
                    assert worker_pid(app, "spare") == pid and time.monotonic() - stopped_at < STOP_TIMEOUT_S - 0.25, \
                        "the test itself ran too slowly to see the stopped worker before its replacement"
                    assert later == seen
                    # ... while the others' and the appliance's do
                    a0, h0 = await read(c, "Models", "affine", "Heartbeat"), await read(c, "Heartbeat")
                    await asyncio.sleep(1.3)
                    assert await read(c, "Models", "affine", "Heartbeat") > a0 and await read(c, "Heartbeat") > h0
                finally:
                    await asyncio.to_thread(wait_for, lambda: worker_pid(app, "spare") != pid, 15, "a new worker")
                await asyncio.to_thread(wait_for, lambda: state(app, "spare") == "Ready", 20, "spare Ready again")
                r = await call(c, "spare", "Infer", [floats([1, 1, 1, 1])])
                assert status_name(r) == "Good"
                b0 = await read(c, "Models", "spare", "Heartbeat")
                await asyncio.sleep(1.3)
                assert await read(c, "Models", "spare", "Heartbeat") > b0
        run(go())
        assert wait_for(lambda: process_gone(pid), 5, "the stopped worker to be gone")
    finally:
        app.stop()


def test_too_many_restarts_leave_the_model_failed_until_reloaded(tmp_path):
    models = {"affine": {"kind": "tensor", "path": str(affine_model(tmp_path / "a.onnx"))}}
    app = RunningAppliance(tmp_path / "state", models, {"engine": {
        "worker_max_restarts": 2, "worker_restart_window_s": 120, "worker_restart_backoff_s": 0.2}})
    try:
        engineer = app.issue("eng", "engineer")
        gaps = []
        for _ in range(3):
            pid = worker_pid(app, "affine")
            died = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: worker_pid(app, "affine") != pid or state(app, "affine") == "Failed", 20, "restart")
            if state(app, "affine") == "Failed":
                break
            wait_for(lambda: state(app, "affine") == "Ready", 20, "Ready")
            gaps.append(time.monotonic() - died)
        assert len(gaps) == 2 and gaps[1] > gaps[0], gaps  # the back-off doubles
        wait_for(lambda: state(app, "affine") == "Failed", 10, "Failed")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(app.metrics_url + "/readyz", timeout=5)
        body = json.loads(err.value.read())
        assert err.value.code == 503 and any("affine" in r and "Failed" in r for r in body["reasons"]), body

        async def go():
            async with session(app, *engineer) as c:
                await asyncio.sleep(0.6)  # published within 0.25 s
                assert await read(c, "State") == "Degraded"
                assert await read(c, "Alarms", "ModelFailed") is True
                assert status_name(await call(c, "affine", "Infer", [floats([1] * 4)])) == "BadInvalidState"
                r = await call(c, "", "ReloadModel", [__import__("asyncua").ua.Variant("affine")])
                assert status_name(r) == "Good"
                assert status_name(await call(c, "affine", "Infer", [floats([1] * 4)])) == "Good"
                await asyncio.sleep(1.1)
                assert await read(c, "Alarms", "ModelFailed") is False
        run(go())
        text = urllib.request.urlopen(app.metrics_url + "/metrics", timeout=5).read().decode()
        assert 'appliance_worker_restarts_total{model="affine"} 2.0' in text
        assert 'appliance_worker_up{model="affine"} 1.0' in text
    finally:
        app.stop()


def test_a_big_serve_process_does_not_make_its_workers_look_big(tmp_path):
    """A worker's memory is its own: getrusage's ru_maxrss would carry the parent's high-water mark over exec."""
    ballast = bytearray(1200 * 2**20)
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1  # resident
    app = RunningAppliance(tmp_path / "state", {"a": {"kind": "tensor", "path": str(affine_model(tmp_path / "a.onnx"))}},
                           {"engine": {"worker_memory_mb": 600}})
    try:
        del ballast
        time.sleep(1.0)  # a few liveness checks, each of which checks the worker's memory
        st = app.app.services["a"].status()
        assert st.state == "Ready" and st.worker_restarts == 0
    finally:
        app.stop()


def test_models_of_one_worker_group_share_a_process(tmp_path):
    models = {"a": {"kind": "tensor", "path": str(affine_model(tmp_path / "a.onnx")), "worker": "line3"},
              "b": {"kind": "tensor", "path": str(affine_model(tmp_path / "b.onnx", scale=3.0)), "worker": "line3"},
              "c": {"kind": "tensor", "path": str(affine_model(tmp_path / "c.onnx"))}}
    app = RunningAppliance(tmp_path / "state", models)
    try:
        assert worker_pid(app, "a") == worker_pid(app, "b") != worker_pid(app, "c")
        plc = app.issue("plc", "operator")

        async def go():
            async with session(app, *plc) as c:
                ra = await call(c, "a", "Infer", [floats([1, 1, 1, 1])])
                rb = await call(c, "b", "Infer", [floats([1, 1, 1, 1])])
                return ra.OutputArguments[0].Value, rb.OutputArguments[0].Value
        assert run(go()) == ([3.0] * 4, [4.0] * 4)
        # the group lives and dies together: both restart, the model outside it does not
        pid = worker_pid(app, "a")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: state(app, "a") == state(app, "b") == "Ready" and worker_pid(app, "a") != pid, 20,
                 "the group back")
        assert app.app.services["c"].status().worker_restarts == 0
        assert app.app.services["b"].status().worker_restarts == 1
    finally:
        app.stop()
