"""Alarms as OPC UA Alarms & Conditions (Part 9) over a real server: a classifier alarm class raises and clears its
`Alarms/<label>` Boolean and its OffNormalAlarm condition together; Acknowledge is for engineers (an operator gets
BadUserAccessDenied), names the condition's latest EventId, is audited; ConditionRefresh resends what is retained."""
from __future__ import annotations

import asyncio
import json

import pytest
from asyncua import ua

from harness import RunningAppliance
from onnx_models import affine_model
from uaclient import call, floats, read, run, session, status_name

V = ua.VariantType
ACK = ua.NodeId(ua.ObjectIds.AcknowledgeableConditionType_Acknowledge)
REFRESH = ua.NodeId(ua.ObjectIds.ConditionType_ConditionRefresh)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    d = tmp_path_factory.mktemp("alarms")
    models = {"cls": {"kind": "tensor", "path": str(affine_model(d / "cls.onnx")), "labels": ["a", "b", "c", "d"],
                      "alarm_classes": ["d"], "alarm_confidence": 0.5}}
    a = RunningAppliance(d / "state", models)
    a.operator, a.engineer = a.issue("plc1", "operator"), a.issue("eng1", "engineer")
    yield a
    a.stop()


class Events:
    def __init__(self):
        self.events = []
        self.arrived = asyncio.Event()

    def event_notification(self, event):
        self.events.append(event)
        self.arrived.set()

    async def next(self, predicate, timeout: float = 10.0):
        async def wait():
            while True:
                for e in self.events:
                    if predicate(e):
                        self.events.remove(e)
                        return e
                self.arrived.clear()
                await self.arrived.wait()
        return await asyncio.wait_for(wait(), timeout)


def field(event, name):
    return getattr(event, name, None)


async def acknowledge(client, condition: ua.NodeId, event_id: bytes, comment: str) -> ua.CallMethodResult:
    request = ua.CallMethodRequest()
    request.ObjectId = condition
    request.MethodId = ACK
    request.InputArguments = [ua.Variant(event_id, V.ByteString), ua.Variant(ua.LocalizedText(comment),
                                                                            V.LocalizedText)]
    return (await client.uaclient.call([request]))[0]


async def alarm_events(client) -> Events:
    handler = Events()
    sub = await client.create_subscription(20, handler)
    await sub.subscribe_events(client.nodes.server, ua.ObjectIds.OffNormalAlarmType)
    return handler


def is_condition(name: str, active: bool, acked: bool):
    return lambda e: (field(e, "ConditionName") == name and field(e, "ActiveState/Id") is active
                      and field(e, "AckedState/Id") is acked)


def test_a_class_alarm_is_a_condition_raised_cleared_and_acknowledged_by_engineers(app):
    async def go():
        async with session(app, *app.operator) as op, session(app, *app.engineer) as eng:
            seen = await alarm_events(eng)
            assert status_name(await call(op, "cls", "Classify", [floats([0, 0, 0, 5])])) == "Good"
            raised = await seen.next(is_condition("cls/d", True, False))
            assert await read(op, "Alarms", "d") is True  # the Boolean with it
            assert field(raised, "Retain") is True and field(raised, "Severity") == 700
            condition = field(raised, "NodeId")
            assert condition.Identifier == "Appliance/Conditions/cls/d"
            event_id = field(raised, "EventId")

            r = await acknowledge(op, condition, event_id, "seen")
            assert status_name(r) == "BadUserAccessDenied"  # operators do not acknowledge
            r = await acknowledge(eng, condition, b"not-an-event", "seen")
            assert status_name(r) == "BadEventIdUnknown"
            r = await acknowledge(eng, condition, event_id, "valve checked")
            assert status_name(r) == "Good"
            acked = await seen.next(is_condition("cls/d", True, True))
            assert field(acked, "Retain") is True and field(acked, "Comment").Text == "valve checked"
            r = await acknowledge(eng, condition, event_id, "again")
            assert status_name(r) == "BadConditionBranchAlreadyAcked"

            assert status_name(await call(op, "cls", "Classify", [floats([5, 0, 0, 0])])) == "Good"
            cleared = await seen.next(is_condition("cls/d", False, True))
            assert field(cleared, "Retain") is False and await read(op, "Alarms", "d") is False

            # raised again and not acknowledged: ConditionRefresh sends it again
            await call(op, "cls", "Classify", [floats([0, 0, 0, 5])])
            await seen.next(is_condition("cls/d", True, False))
            request = ua.CallMethodRequest()
            request.ObjectId = ua.NodeId(ua.ObjectIds.ConditionType)
            request.MethodId = REFRESH
            request.InputArguments = [ua.Variant(1, V.UInt32)]
            assert (await eng.uaclient.call([request]))[0].StatusCode.is_good()
            await seen.next(is_condition("cls/d", True, False))
            await call(op, "cls", "Classify", [floats([5, 0, 0, 0])])
            await seen.next(is_condition("cls/d", False, False))
    run(go())
    app.run(asyncio.sleep(0.3))
    records = [json.loads(line) for line in (app.state_dir / "audit" / "audit.jsonl").read_text().splitlines()]
    acks = [r for r in records if r.get("action") == "Acknowledge"]
    assert [r["status"] for r in acks] == ["BadUserAccessDenied", "BadEventIdUnknown", "Good",
                                           "BadConditionBranchAlreadyAcked"]
    assert acks[2]["detail"] == "condition cls/d: valve checked" and acks[2]["role"] == "engineer"


def test_the_appliance_alarms_are_conditions_too(app):
    async def go():
        async with session(app, *app.operator) as c:
            children = {(await n.read_browse_name()).Name for n in await c.nodes.server.get_children()}
            assert {"EngineFault", "WorkerRestarting", "ModelFailed", "GpuWarning", "GpuCritical",
                    "cls/d"} <= children
            ns = await c.get_namespace_index("urn:opcua-inference-appliance")
            node = c.get_node(ua.NodeId("Appliance/Conditions/ModelFailed", ns))
            assert (await node.read_type_definition()) == ua.NodeId(ua.ObjectIds.OffNormalAlarmType)
    run(go())


def test_a_raised_appliance_alarm_raises_its_condition(app):
    """The daemon's alarms (watchdog, worker supervision, model failures) pass through the same hook."""
    async def go():
        async with session(app, *app.engineer) as c:
            seen = await alarm_events(c)
            app.run(app.app.ua.set_alarm("ModelFailed", True, "Model cls failed"))
            e = await seen.next(is_condition("ModelFailed", True, False))
            assert field(e, "Severity") == 800
            # the daemon's own state (no model failed) clears it within 0.25 s, Boolean and condition together
            await seen.next(is_condition("ModelFailed", False, False))
            assert await read(c, "Alarms", "ModelFailed") is False
    run(go())
