"""Alarms as OPC UA Alarms & Conditions (Part 9) over a real server: a classifier alarm class is debounced per source
(alarm_on_results / alarm_off_results), raises and clears its `Alarms/<source>/<label>` Boolean, `Alarms/<label>` and
its complete OffNormalAlarm condition together; sources never clear each other; Acknowledge is for engineers (an
operator gets BadUserAccessDenied), names the condition's latest EventId, is audited as alarm_acknowledged;
ConditionRefresh resends what is retained to the one subscription it names; node-opcua reads a condition."""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
from pathlib import Path

import pytest
from asyncua import ua

from core.password_hash import hash_password
from harness import RunningAppliance
from onnx_models import affine_model
from uaclient import Events, call, field, floats, read, run, session, status_name

V = ua.VariantType
ACK = ua.NodeId(ua.ObjectIds.AcknowledgeableConditionType_Acknowledge)
REFRESH = ua.NodeId(ua.ObjectIds.ConditionType_ConditionRefresh)


PASSWORD = "correct horse battery"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    d = tmp_path_factory.mktemp("alarms")
    models = {"cls": {"kind": "tensor", "path": str(affine_model(d / "cls.onnx")), "labels": ["a", "b", "c", "d"],
                      "alarm_classes": ["d"], "alarm_confidence": 0.5, "alarm_on_results": 3,
                      "alarm_off_results": 3, "alarm_sources": {"line4": "user:line4"}}}
    users = [{"name": "line4", "role": "operator", "password_hash": hash_password(PASSWORD)}]
    a = RunningAppliance(d / "state", models, {"users": users})
    a.operator, a.engineer = a.issue("plc1", "operator"), a.issue("eng1", "engineer")
    yield a
    a.stop()


D = [0, 0, 0, 5]  # a sample the affine model (2x + 1) classifies as class d with confidence > 0.5
A = [5, 0, 0, 0]  # ... as class a


def samples(*rows) -> ua.Variant:
    return floats([v for row in rows for v in row])


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


def test_a_class_alarm_is_debounced_and_a_condition_raised_cleared_and_acknowledged_by_engineers(app):
    name = "cls.default.d"
    async def go():
        async with session(app, *app.operator) as op, session(app, *app.engineer) as eng:
            seen = await alarm_events(eng)
            # two results of class d in a row raise nothing (alarm_on_results 3), the third does
            assert status_name(await call(op, "cls", "Classify", [samples(D, D)])) == "Good"
            await asyncio.sleep(0.3)
            assert not [e for e in seen.events if field(e, "ConditionName") == name]
            assert await read(op, "Alarms", "d") is False
            assert status_name(await call(op, "cls", "Classify", [samples(D)])) == "Good"
            raised = await seen.next(is_condition(name, True, False))
            assert await read(op, "Alarms", "d") is True  # the Booleans with it: any source, and this source's
            assert await read(op, "Alarms", "default", "d") is True
            assert field(raised, "Retain") is True and field(raised, "Severity") == 700
            assert field(raised, "SourceName") == "cls"
            condition = field(raised, "NodeId")
            assert condition.Identifier == "Appliance/Conditions/cls/default/d"
            event_id = field(raised, "EventId")
            state = await condition_state(op, condition)
            assert state == {"ActiveState.Id": True, "AckedState.Id": False, "EnabledState.Id": True,
                             "Retain": True, "Severity": 700, "SourceName": "cls"}, state

            r = await acknowledge(op, condition, event_id, "seen")
            assert status_name(r) == "BadUserAccessDenied"  # operators do not acknowledge
            r = await acknowledge(eng, condition, b"not-an-event", "seen")
            assert status_name(r) == "BadEventIdUnknown"
            r = await acknowledge(eng, condition, event_id, "valve checked")
            assert status_name(r) == "Good"
            acked = await seen.next(is_condition(name, True, True))
            assert field(acked, "Retain") is True and field(acked, "Comment").Text == "valve checked"
            assert (await condition_state(op, condition))["AckedState.Id"] is True
            r = await acknowledge(eng, condition, event_id, "again")
            assert status_name(r) == "BadConditionBranchAlreadyAcked"

            # an isolated other result does not clear it (alarm_off_results 3); three in a row do
            await call(op, "cls", "Classify", [samples(A, A, D, A, A)])
            await asyncio.sleep(0.3)
            assert await read(op, "Alarms", "d") is True
            await call(op, "cls", "Classify", [samples(A)])
            cleared = await seen.next(is_condition(name, False, True))
            assert field(cleared, "Retain") is False and await read(op, "Alarms", "d") is False
    run(go())
    app.run(asyncio.sleep(0.3))
    records = [json.loads(line) for line in (app.state_dir / "audit" / "audit.jsonl").read_text().splitlines()]
    acks = [r for r in records if r.get("action") == "Acknowledge"]
    assert [r["status"] for r in acks] == ["BadUserAccessDenied", "BadEventIdUnknown", "Good",
                                           "BadConditionBranchAlreadyAcked"]
    assert acks[2]["detail"] == "condition cls.default.d: valve checked" and acks[2]["role"] == "engineer"
    assert {r["event"] for r in acks[1:]} == {"alarm_acknowledged"}


def test_sources_keep_their_own_alarms_and_last(app):
    """Two lines calling one model: line4 (a named identity) and everyone else (default) never clear each other."""
    async def go():
        async with session(app, *app.operator) as op, \
                session(app, *app.operator, username="line4", password=PASSWORD) as line4:
            await call(line4, "cls", "Classify", [samples(D, D, D)])
            assert await read(op, "Alarms", "line4", "d") is True and await read(op, "Alarms", "d") is True
            assert await read(op, "Models", "cls", "Last", "line4", "Label") == "d"
            for _ in range(3):  # the other line's normal results, three in a row and more
                await call(op, "cls", "Classify", [samples(A, A)])
            assert await read(op, "Alarms", "line4", "d") is True, "another source cleared line4's alarm"
            assert await read(op, "Alarms", "default", "d") is False and await read(op, "Alarms", "d") is True
            assert await read(op, "Models", "cls", "Last", "default", "Label") == "a"
            assert await read(op, "Models", "cls", "Last", "line4", "Label") == "d"
            assert await read(op, "Models", "cls", "Last", "Label") == "a"  # the model's latest, any source
            await call(line4, "cls", "Classify", [samples(A, A, A)])
            assert await read(op, "Alarms", "line4", "d") is False and await read(op, "Alarms", "d") is False
    run(go())


def test_condition_refresh_answers_only_the_subscription_it_names(app):
    async def go():
        async with session(app, *app.engineer) as one, session(app, *app.engineer) as two, \
                session(app, *app.operator) as op:
            first, second = Events(), Events()
            types = [ua.ObjectIds.OffNormalAlarmType, ua.ObjectIds.RefreshStartEventType,
                     ua.ObjectIds.RefreshEndEventType]
            sub1 = await one.create_subscription(20, first)
            await sub1.subscribe_events(one.nodes.server, types)
            sub2 = await two.create_subscription(20, second)
            await sub2.subscribe_events(two.nodes.server, types)
            await call(op, "cls", "Classify", [samples(D, D, D)])  # raised and retained
            await first.next(is_condition("cls.default.d", True, False))
            await second.next(is_condition("cls.default.d", True, False))
            second.events.clear()

            r = await refresh(one, sub2.subscription_id)  # not one of this session's subscriptions
            assert status_name(r) == "BadSubscriptionIdInvalid"
            r = await refresh(one, sub1.subscription_id)
            assert status_name(r) == "Good"
            start = await first.next(lambda e: field(e, "EventType") == ua.NodeId(ua.ObjectIds.RefreshStartEventType))
            again = await first.next(is_condition("cls.default.d", True, False))
            await first.next(lambda e: field(e, "EventType") == ua.NodeId(ua.ObjectIds.RefreshEndEventType))
            assert start is not None and again is not None
            await asyncio.sleep(0.5)
            assert second.events == [], "ConditionRefresh reached a subscription it did not name"
            await call(op, "cls", "Classify", [samples(A, A, A)])
            await first.next(is_condition("cls.default.d", False, False))
    run(go())


def test_the_appliance_alarms_are_complete_conditions_with_browse_names_without_slashes(app):
    async def go():
        async with session(app, *app.operator) as c:
            ns = await c.get_namespace_index("urn:opcua-inference-appliance")
            children = {(await n.read_browse_name()).Name: n for n in await c.nodes.server.get_children()
                        if n.nodeid.NamespaceIndex == ns}
            assert {"EngineFault", "WorkerRestarting", "ModelFailed", "GpuWarning", "GpuCritical", "cls.default.d",
                    "cls.line4.d"} <= set(children)
            assert not [name for name in children if "/" in name]
            node = children["ModelFailed"]
            assert (await node.read_type_definition()) == ua.NodeId(ua.ObjectIds.OffNormalAlarmType)
            kids = {(await k.read_browse_name()).Name for k in await node.get_children()}
            assert {"ActiveState", "AckedState", "EnabledState", "Severity", "Message", "Retain", "SourceName",
                    "ConditionName", "Acknowledge", "Enable", "Disable", "AddComment"} <= kids
            state = await condition_state(c, node.nodeid)
            assert state["ActiveState.Id"] is False and state["EnabledState.Id"] is True
            assert state["SourceName"] == "Appliance"
    run(go())


def test_the_node_opcua_peer_reads_a_condition(app):
    async def go():
        async with session(app, *app.operator) as op:
            await call(op, "cls", "Classify", [samples(D, D, D)])
    run(go())
    root = Path(__file__).resolve().parent
    assert (root / "node" / "node_modules" / "node-opcua-client").exists(), "run `bash scripts/setup.sh --test`"
    cert_der, key = app.engineer
    uri = f"urn:{socket.gethostname()}:appliance:client:eng1"
    proc = subprocess.run(["node", str(root / "node" / "condition.js"), app.endpoint,
                           str(cert_der.with_suffix(".pem")), str(key), uri, str(app.state_dir / "node-pki"),
                           "cls.default.d"], capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, (proc.stdout[-2000:], proc.stderr[-2000:])
    out = json.loads(lines[-1])
    assert out["typeDefinition"] == "ns=0;i=10637", out  # OffNormalAlarmType
    assert out["ActiveState/Id"] is True and out["AckedState/Id"] is False and out["EnabledState/Id"] is True
    assert out["Retain"] is True and out["Severity"] == 700 and out["SourceName"] == "cls" and out["ActiveState"]
    async def clear():
        async with session(app, *app.operator) as op:
            await call(op, "cls", "Classify", [samples(A, A, A)])
    run(clear())


async def condition_state(client, condition: ua.NodeId) -> dict:
    out = {}
    for path in ("ActiveState.Id", "AckedState.Id", "EnabledState.Id", "Retain", "Severity", "SourceName"):
        node = client.get_node(ua.NodeId(f"{condition.Identifier}.{path}", condition.NamespaceIndex))
        out[path] = await node.read_value()
    return out


async def refresh(client, subscription_id: int) -> ua.CallMethodResult:
    request = ua.CallMethodRequest()
    request.ObjectId = ua.NodeId(ua.ObjectIds.ConditionType)
    request.MethodId = REFRESH
    request.InputArguments = [ua.Variant(subscription_id, V.UInt32)]
    return (await client.uaclient.call([request]))[0]


REFRESH2 = ua.NodeId(ua.ObjectIds.ConditionType_ConditionRefresh2)
REFRESH_TYPES = [ua.ObjectIds.OffNormalAlarmType, ua.ObjectIds.RefreshStartEventType,
                 ua.ObjectIds.RefreshEndEventType]


def is_type(object_id: int):
    return lambda e: field(e, "EventType") == ua.NodeId(object_id)


async def refresh2(client, subscription_id: int, monitored_item_id: int) -> ua.CallMethodResult:
    request = ua.CallMethodRequest()
    request.ObjectId = ua.NodeId(ua.ObjectIds.ConditionType)
    request.MethodId = REFRESH2
    request.InputArguments = [ua.Variant(subscription_id, V.UInt32), ua.Variant(monitored_item_id, V.UInt32)]
    return (await client.uaclient.call([request]))[0]


async def refreshed_event(seen: Events, name: str):
    """The condition's event between RefreshStart and RefreshEnd."""
    await seen.next(is_type(ua.ObjectIds.RefreshStartEventType))
    event = await seen.next(lambda e: field(e, "ConditionName") == name)
    await seen.next(is_type(ua.ObjectIds.RefreshEndEventType))
    return event


def test_an_event_id_acknowledges_only_the_occurrence_it_belongs_to(app):
    """A SCADA's alarm list keeps the first occurrence's entry (and the refresh of it); the alarm is acknowledged,
    clears, and is raised again: acknowledging with the old entry's EventId must not acknowledge the new
    occurrence the operator has not seen (BadEventIdUnknown); the new occurrence's own EventId does."""
    name = "cls.default.d"

    async def go():
        async with session(app, *app.operator) as op, session(app, *app.engineer) as scada:
            seen = Events()
            sub = await scada.create_subscription(20, seen)
            await sub.subscribe_events(scada.nodes.server, REFRESH_TYPES)
            await call(op, "cls", "Classify", [samples(D, D, D)])
            first = await seen.next(is_condition(name, True, False))
            condition, first_id = field(first, "NodeId"), field(first, "EventId")
            assert status_name(await refresh(scada, sub.subscription_id)) == "Good"
            first_refreshed_id = field(await refreshed_event(seen, name), "EventId")
            assert status_name(await acknowledge(scada, condition, first_id, "first seen")) == "Good"
            await seen.next(is_condition(name, True, True))
            await call(op, "cls", "Classify", [samples(A, A, A)])
            await seen.next(is_condition(name, False, True))

            await call(op, "cls", "Classify", [samples(D, D, D)])  # the second occurrence
            second = await seen.next(is_condition(name, True, False))
            for old in (first_id, first_refreshed_id):
                r = await acknowledge(scada, condition, old, "an old list entry")
                assert status_name(r) == "BadEventIdUnknown", "an earlier occurrence's EventId acknowledged a new one"
            assert (await condition_state(scada, condition))["AckedState.Id"] is False
            assert status_name(await acknowledge(scada, condition, field(second, "EventId"), "second seen")) == "Good"
            await seen.next(is_condition(name, True, True))
            await call(op, "cls", "Classify", [samples(A, A, A)])
            await seen.next(is_condition(name, False, True))
    run(go())


def test_condition_refresh2_answers_only_the_monitored_item_it_names(app):
    """ConditionRefresh2 (Part 9, i=12912): a SCADA with two event monitored items in one subscription refreshes
    one; only that item gets RefreshStart, the retained condition and RefreshEnd, and the refreshed EventId
    acknowledges the condition."""
    name = "cls.default.d"

    async def go():
        async with session(app, *app.operator) as op, session(app, *app.engineer) as scada, \
                session(app, *app.engineer) as other:
            seen = Events()
            sub = await scada.create_subscription(20, seen)
            item = await sub.subscribe_events(scada.nodes.server, REFRESH_TYPES)
            also = await sub.subscribe_events(scada.nodes.server, REFRESH_TYPES)
            other_sub = await other.create_subscription(20, Events())
            await call(op, "cls", "Classify", [samples(D, D, D)])
            raised = await seen.next(lambda e: is_condition(name, True, False)(e) and e.server_handle == item)
            await seen.next(lambda e: is_condition(name, True, False)(e) and e.server_handle == also)
            seen.events.clear()
            condition = field(raised, "NodeId")

            assert status_name(await refresh2(scada, sub.subscription_id, 999999)) == "BadMonitoredItemIdInvalid"
            r = await refresh2(scada, other_sub.subscription_id, item)  # another session's subscription
            assert status_name(r) == "BadSubscriptionIdInvalid"
            assert status_name(await refresh2(scada, sub.subscription_id, item)) == "Good"
            refreshed = await refreshed_event(seen, name)
            assert refreshed.server_handle == item
            assert field(refreshed, "ActiveState/Id") is True and field(refreshed, "AckedState/Id") is False
            await asyncio.sleep(0.5)
            assert [e for e in seen.events if e.server_handle == also] == [], \
                "ConditionRefresh2 reached a monitored item it did not name"
            r = await acknowledge(scada, condition, field(refreshed, "EventId"), "seen after refresh2")
            assert status_name(r) == "Good"
            await seen.next(is_condition(name, True, True))
            await call(op, "cls", "Classify", [samples(A, A, A)])
            await seen.next(is_condition(name, False, True))
    run(go())


def test_a_node_opcua_scada_refreshes_one_monitored_item_and_acknowledges_what_it_showed(app):
    """node-opcua as the SCADA: ConditionRefresh2 for one of its two event monitored items; only that item gets
    RefreshStart, the retained condition and RefreshEnd; Acknowledge with the refreshed EventId is Good."""
    name = "cls.default.d"

    async def raise_it():
        async with session(app, *app.operator) as op:
            await call(op, "cls", "Classify", [samples(D, D, D)])
            ns = await op.get_namespace_index("urn:opcua-inference-appliance")
            return f"ns={ns};s=Appliance/Conditions/cls/default/d"
    condition = run(raise_it())
    root = Path(__file__).resolve().parent
    cert_der, key = app.engineer
    uri = f"urn:{socket.gethostname()}:appliance:client:eng1"
    try:
        proc = subprocess.run(["node", str(root / "node" / "condition_refresh2.js"), app.endpoint,
                               str(cert_der.with_suffix(".pem")), str(key), uri, str(app.state_dir / "node-pki"),
                               name, condition], capture_output=True, text=True, timeout=120)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        assert proc.returncode == 0 and lines, (proc.stdout[-2000:], proc.stderr[-2000:])
        out = json.loads(lines[-1])
        assert out["refresh2"] == "Good", out
        types = [e["type"] for e in out["first"]]
        assert types[0] == "RefreshStart" and types[-1] == "RefreshEnd", out  # every retained condition between
        assert set(types[1:-1]) == {"OffNormalAlarm"}, out
        shown = [e for e in out["first"] if e["conditionName"] == name]
        assert len(shown) == 1 and shown[0]["active"] is True and shown[0]["acked"] is False, out
        assert [e for e in out["second"] if e["type"] != "OffNormalAlarm"] == [], out  # no refresh reached it
        assert out["ack"] == "Good", out
    finally:
        async def clear():
            async with session(app, *app.operator) as op:
                await call(op, "cls", "Classify", [samples(A, A, A)])
        run(clear())
