"""A restart a control room can see: a generative model's worker killed with kill -9 while a SCADA client watches
(a subscription over SignAndEncrypt to `Alarms/WorkerRestarting`, the model's State and Heartbeat, and the Part 9
conditions) and a PLC keeps calling. WorkerRestarting is true, its condition active, `appliance_worker_up` 0,
/readyz 503 and the Heartbeat still from the kill until the replacement has loaded the model, seconds later; the PLC's
calls meanwhile answer BadInvalidState (the model is not Ready) and are Good again only once the alarm is false.

Times are the wall clock of this machine: notifications are stamped on arrival, the condition's events carry the
server's own Time. TOLERANCE_S allows for a notification's trip (the subscription publishes every 20 ms) on a busy
machine."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from asyncua import ua

from harness import RunningAppliance
from uaclient import Events, call, field, read, run, session, status_name
from worker_probes import DataChanges, HttpSampler, wall

V = ua.VariantType
TOLERANCE_S = 0.25


def generate_args(prompt: str) -> list:
    return [ua.Variant(prompt, V.String), ua.Variant(2, V.UInt32), ua.Variant(0.0, V.Float)]


async def appliance_node(client, *path: str):
    ns = await client.get_namespace_index("urn:opcua-inference-appliance")
    return await client.nodes.objects.get_child([f"{ns}:{p}" for p in ("Appliance",) + path])


def test_worker_restarting_lasts_from_the_kill_until_the_model_is_ready_again(tmp_path):
    pytest.importorskip("transformers")
    from tiny_llm import make_model_dir
    make_model_dir(tmp_path / "chat")
    app = RunningAppliance(tmp_path / "state", {"chat": {"kind": "generative", "path": str(tmp_path / "chat")}},
                           {"engine": {"worker_restart_backoff_s": 0.1}})
    try:
        scada, plc = app.issue("scada", "monitor"), app.issue("plc", "operator")

        async def go():
            async with session(app, *scada) as s, session(app, *plc) as c:
                changes = DataChanges()
                nodes = {"WorkerRestarting": await appliance_node(s, "Alarms", "WorkerRestarting"),
                         "State": await appliance_node(s, "Models", "chat", "State"),
                         "Heartbeat": await appliance_node(s, "Models", "chat", "Heartbeat")}
                changes.names = {node: name for name, node in nodes.items()}
                sub = await s.create_subscription(20, changes)
                await sub.subscribe_data_change(list(nodes.values()))
                events = Events()
                esub = await s.create_subscription(20, events)
                await esub.subscribe_events(s.nodes.server, ua.ObjectIds.OffNormalAlarmType)
                await asyncio.sleep(1.5)
                assert changes.of("WorkerRestarting")[-1][1] is False
                assert status_name(await call(c, "chat", "Generate", generate_args("Hello"))) == "Good"

                calls, stop = [], asyncio.Event()

                async def plc_loop():
                    while not stop.is_set():
                        sent = time.time()
                        r = await call(c, "chat", "Generate", generate_args("Hello"))
                        calls.append((sent, time.time(), status_name(r)))
                        if status_name(r) == "Good" and r.OutputArguments[3].Value > 256:
                            await call(c, "chat", "ResetContext", [])  # a PLC's conversation never fills up
                        await asyncio.sleep(0.05)
                caller = asyncio.create_task(plc_loop())
                await asyncio.sleep(0.5)
                killed = time.time()
                os.kill(app.app.services["chat"].supervisor.process.pid, signal.SIGKILL)
                raised = await events.next(lambda e: field(e, "ConditionName") == "WorkerRestarting"
                                           and field(e, "ActiveState/Id") is True, 30)
                cleared = await events.next(lambda e: field(e, "ConditionName") == "WorkerRestarting"
                                            and field(e, "ActiveState/Id") is False, 120)
                await asyncio.sleep(2.5)  # calls answered after the restart; the Heartbeat ticks again
                stop.set()
                await caller
                assert await read(c, "Models", "chat", "WorkerRestarts") == 1
                return killed, raised, cleared, changes, calls
        with HttpSampler(app.metrics_url) as sampler:
            killed, raised, cleared, changes, calls = run(go(), timeout=240)

        alarm = changes.of("WorkerRestarting", since=killed)
        assert [v for _, v in alarm] == [True, False], alarm
        (t_true, _), (t_false, _) = alarm
        raised_at, cleared_at = wall(field(raised, "Time")), wall(field(cleared, "Time"))
        print(f"WorkerRestarting true {t_true - killed:.2f} s after the kill, false {t_false - killed:.2f} s after "
              f"(condition: {raised_at - killed:.2f} s, {cleared_at - killed:.2f} s)")
        # raised at the death, cleared as the model turns Ready: the Boolean and its condition together
        assert -0.01 <= raised_at - killed <= 1.0 and abs(t_true - raised_at) <= TOLERANCE_S
        assert abs(t_false - cleared_at) <= TOLERANCE_S
        states = changes.of("State", since=killed)
        assert [v for _, v in states] == ["Loading", "Ready"], states
        assert abs(states[1][0] - t_false) <= TOLERANCE_S, (states, t_false)
        # the Heartbeat stood still from the kill until Ready, and ticks again after
        beats = changes.of("Heartbeat", since=killed)
        assert not [t for t, _ in beats if killed + TOLERANCE_S < t < t_false - TOLERANCE_S], (beats, t_false)
        assert [t for t, _ in beats if t > t_false], beats
        # monitoring agrees: worker_up 0 and /readyz 503 the whole time, 1 and 200 after
        during = sampler.between(t_true + 0.1, cleared_at - TOLERANCE_S)
        assert during and all(s.worker_up.get("chat") == 0.0 and s.ready == 503 for s in during), during
        assert all("restarting" in " ".join(s.reasons) for s in during), during[0].reasons
        after = sampler.between(cleared_at + TOLERANCE_S, cleared_at + 2.0)
        assert after and all(s.worker_up.get("chat") == 1.0 and s.ready == 200 for s in after), after
        # the PLC: no Good answer while the alarm was true, Good ones once it was false
        meanwhile = [status for sent, got, status in calls if sent > killed and got < cleared_at - TOLERANCE_S]
        assert meanwhile and set(meanwhile) <= {"BadInvalidState", "BadInternalError"}, meanwhile
        assert meanwhile.count("BadInvalidState") >= 1, meanwhile
        later = [status for sent, got, status in calls if sent > cleared_at + TOLERANCE_S]
        assert later and set(later) == {"Good"}, later
    finally:
        app.stop()
