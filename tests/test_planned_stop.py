"""A planned stop is not a crash: `systemctl stop` (and a reboot) sends SIGTERM to every process of the unit's cgroup
(KillMode=control-group, the default), workers included. Here `appliance serve` runs as its own process group with a
tensor and a generative worker, a SCADA client subscribes to WorkerRestarting and the Part 9 conditions, calls are in
flight, and SIGTERM (with SIGCONT, as systemd sends) goes to the whole group. The calls in flight are answered Good,
no alarm is raised, no ERROR logged, no worker started, and serve exits 0 within the unit's TimeoutStopSec.

And during the first start's background compile of the decode step (a process the generative worker forks, with
the worker's command line): the group's SIGTERM leaves nothing of the group within the drain time, and a kill -9 of
serve takes the worker and its compiler with it."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import pytest
from asyncua import ua

from onnx_models import heavy_model
from serve_process import ROOT, Serve, children, command_line, group_members, wait_for_gone, worker_pids
from uaclient import Events, call, field, floats, session, status_name
from worker_probes import DataChanges

V = ua.VariantType


def timeout_stop_s() -> float:
    """TimeoutStopSec of the unit we ship: how long systemd waits after SIGTERM before SIGKILL."""
    text = (ROOT / "systemd" / "appliance.service").read_text()
    (value,) = re.findall(r"^TimeoutStopSec=(\d+)s?$", text, re.M)
    return float(value)


def test_sigterm_to_the_whole_group_is_a_planned_stop(tmp_path):
    pytest.importorskip("transformers")
    from tiny_llm import make_model_dir
    make_model_dir(tmp_path / "chat")
    models = {"slow": {"kind": "tensor", "path": str(heavy_model(tmp_path / "h.onnx", size=512, products=4)),
                       "max_batch_size": 1},  # each call a batch of tens of ms: calls queue behind each other
              "chat": {"kind": "generative", "path": str(tmp_path / "chat")}}
    serve = Serve(tmp_path, models, drain_s=10.0)
    try:
        workers = worker_pids(serve.proc.pid)
        assert len(workers) == 2
        scada, plc = serve.issue("scada", "monitor"), serve.issue("plc", "operator")

        async def go():
            async with session(serve, *scada) as s, session(serve, *plc) as c:
                ns = await s.get_namespace_index("urn:opcua-inference-appliance")
                restarting = await s.nodes.objects.get_child([f"{ns}:Appliance", f"{ns}:Alarms",
                                                              f"{ns}:WorkerRestarting"])
                changes, events = DataChanges(), Events()
                changes.names = {restarting: "WorkerRestarting"}
                await (await s.create_subscription(20, changes)).subscribe_data_change([restarting])
                await (await s.create_subscription(20, events)).subscribe_events(s.nodes.server,
                                                                                  ua.ObjectIds.OffNormalAlarmType)
                await asyncio.sleep(1.0)
                calls = [asyncio.create_task(call(c, "slow", "Infer", [floats([1, 1, 1, 1])])) for _ in range(6)]
                calls.append(asyncio.create_task(call(c, "chat", "Generate", [
                    ua.Variant("The pump", V.String), ua.Variant(40, V.UInt32), ua.Variant(0.0, V.Float)])))
                await asyncio.sleep(0.15)
                log_at = serve.log_path.stat().st_size
                signalled = time.monotonic()
                os.killpg(serve.proc.pid, signal.SIGTERM)  # systemd: SIGTERM, then SIGCONT, to every process
                os.killpg(serve.proc.pid, signal.SIGCONT)
                results = await asyncio.gather(*calls, return_exceptions=True)
                await asyncio.sleep(0.5)  # whatever the server still publishes before it closes
                return log_at, signalled, results, changes, events
        log_at, signalled, results, changes, events = asyncio.run(asyncio.wait_for(go(), 120))
        code = serve.proc.wait(timeout_stop_s() + 5)
        took = time.monotonic() - signalled
        print(f"stopped in {took:.2f} s (TimeoutStopSec {timeout_stop_s():g} s), exit status {code}")
        assert code == 0 and took < timeout_stop_s()
        statuses = [status_name(r) if not isinstance(r, BaseException) else type(r).__name__ for r in results]
        assert statuses == ["Good"] * 7, statuses  # drained: every call in flight finished
        assert [v for _, _, v in changes.changes] == [False], changes.changes  # never raised
        assert not [e for e in events.events if field(e, "ConditionName") == "WorkerRestarting"
                    and field(e, "ActiveState/Id")], events.events
        log = serve.log_path.read_text()
        after = log[log_at:]
        assert not re.findall(r"^\S+ \S+ (?:ERROR|CRITICAL) .*$", log, re.M), after
        assert "started (pid" not in after and "restarts in" not in after and "was replaced" not in after, after
        assert wait_for_gone(workers, 5), "a worker outlived serve"
    finally:
        serve.close()


DRAIN_S = 5.0


def compilers_of(worker: int) -> list[int]:
    """The worker's forked children: the decode step's compiler (loader/compiled_decode.py forks it)."""
    line = command_line(worker)
    return [pid for pid in children(worker) if command_line(pid) == line]


def serve_while_compiling(tmp_path) -> tuple[Serve, int, list[int]]:
    """serve with a generative model on its first start (engine.compile: auto, no package yet): Ready, then the
    worker forks the compiler of the decode step; answered once the compiler runs."""
    pytest.importorskip("transformers")
    from tiny_llm import make_model_dir
    make_model_dir(tmp_path / "chat")
    serve = Serve(tmp_path, {"chat": {"kind": "generative", "path": str(tmp_path / "chat")}}, drain_s=DRAIN_S,
                  engine={"compile": "auto"})
    (worker,) = worker_pids(serve.proc.pid)
    end = time.monotonic() + 60
    while not (compilers := compilers_of(worker)) and time.monotonic() < end:
        time.sleep(0.05)
    assert compilers, "the worker forked no compiler:\n" + serve.log_path.read_text()[-3000:]
    time.sleep(1.0)  # the compile under way (tracing, or Inductor's g++)
    assert set(compilers) <= set(group_members(serve.proc.pid))  # what systemd's stop signals
    return serve, worker, compilers


def test_sigterm_to_the_group_during_a_background_compile_leaves_nothing(tmp_path):
    serve, worker, compilers = serve_while_compiling(tmp_path)
    try:
        pgid = serve.proc.pid
        signalled = time.monotonic()
        os.killpg(pgid, signal.SIGTERM)  # systemd: SIGTERM, then SIGCONT, to every process of the unit
        os.killpg(pgid, signal.SIGCONT)
        code = serve.proc.wait(DRAIN_S + 5)
        while group_members(pgid) and time.monotonic() < signalled + DRAIN_S:
            time.sleep(0.05)
        left = {pid: command_line(pid) for pid in group_members(pgid)}
        print(f"serve exited {code} after {time.monotonic() - signalled:.2f} s; left: {left}")
        assert not left, left  # the compiler (and its g++) ended with the stop, not TimeoutStopSec later
        assert code == 0
        assert not re.findall(r"^\S+ \S+ (?:ERROR|CRITICAL) .*$", serve.log_path.read_text(), re.M)
    finally:
        serve.close()


def test_kill_9_of_serve_during_a_background_compile_takes_the_worker_and_its_compiler(tmp_path):
    serve, worker, compilers = serve_while_compiling(tmp_path)
    try:
        pgid = serve.proc.pid
        os.kill(serve.proc.pid, signal.SIGKILL)
        serve.proc.wait(5)
        assert wait_for_gone([worker, *compilers], 3), {p: command_line(p) for p in [worker, *compilers]}
        end = time.monotonic() + 30  # a g++ the compiler had started finishes its file (it is no child of ours)
        while group_members(pgid) and time.monotonic() < end:
            time.sleep(0.1)
        assert not group_members(pgid), {pid: command_line(pid) for pid in group_members(pgid)}
    finally:
        serve.close()
