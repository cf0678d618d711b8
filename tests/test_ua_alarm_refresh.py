"""A SCADA that (re)connects acknowledges what ConditionRefresh showed it, as a control room does after a restart.

The demo's Tennessee Eastman classifier is fed the held-out IDV2 fault run by a PLC's Classify calls until its class
alarm is raised. The SCADA that saw the raise restarts: a new session and subscription, ConditionRefresh on it, and
Acknowledge with the EventId the refresh showed (asyncua gives every event, refreshed ones too, an EventId of its
own). The contract: Acknowledge (and AddComment) accept the EventId of a refreshed event as well as the original's.
"""
from __future__ import annotations


import numpy as np
import pytest
from asyncua import ua

from harness import RunningAppliance
from test_alarm_sources_te import ALARM_CLASSES, _labels, require_te_data
from test_ua_alarms import acknowledge, is_condition, refresh
from uaclient import Events, call, field, floats, run, session, status_name

te = pytest.importorskip("models.te_classifier")
V = ua.VariantType
FAULT = 2
LABEL = "IDV2 B composition step"
CONDITION = f"te.default.{LABEL}"
ADD_COMMENT = ua.NodeId(ua.ObjectIds.ConditionType_AddComment)
REFRESH_TYPES = [ua.ObjectIds.OffNormalAlarmType, ua.ObjectIds.RefreshStartEventType,
                 ua.ObjectIds.RefreshEndEventType]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    require_te_data()
    d = tmp_path_factory.mktemp("te-refresh")
    models = {"te": {"kind": "tensor", "path": "builtin:te-classifier", "labels": _labels(),
                     "alarm_classes": ALARM_CLASSES}}
    a = RunningAppliance(d / "state", models)
    a.plc, a.scada = a.issue("plc1", "operator"), a.issue("scada", "engineer")
    yield a
    a.stop()


async def add_comment(client, condition: ua.NodeId, event_id: bytes, comment: str) -> ua.CallMethodResult:
    request = ua.CallMethodRequest()
    request.ObjectId, request.MethodId = condition, ADD_COMMENT
    request.InputArguments = [ua.Variant(event_id, V.ByteString),
                              ua.Variant(ua.LocalizedText(comment), V.LocalizedText)]
    return (await client.uaclient.call([request]))[0]


async def classify_fault_run_until_raised(plc, seen: Events):
    """The PLC sends the fault run, 20 windows per Classify, until the SCADA sees the class alarm raised."""
    windows = te.sliding_windows(te.load_te_rows(FAULT, test=True)).astype(np.float32)
    for start in range(0, len(windows), 20):
        r = await call(plc, "te", "Classify", [floats(windows[start:start + 20].reshape(-1))])
        assert status_name(r) == "Good"
        if any(is_condition(CONDITION, True, False)(e) for e in seen.events):
            return await seen.next(is_condition(CONDITION, True, False))
    raise AssertionError("the IDV2 fault run never raised its class alarm")


async def refreshed_conditions(client, seen: Events, subscription_id: int) -> list:
    """ConditionRefresh on the SCADA's subscription: the condition events between RefreshStart and RefreshEnd."""
    def kind(e) -> int | None:
        event_type = field(e, "EventType")
        return event_type.Identifier if isinstance(event_type, ua.NodeId) else None

    assert status_name(await refresh(client, subscription_id)) == "Good"
    end = await seen.next(lambda e: kind(e) == ua.ObjectIds.RefreshEndEventType)
    start = next(i for i, e in enumerate(seen.events) if kind(e) == ua.ObjectIds.RefreshStartEventType)
    between = seen.events[start + 1:]  # RefreshEnd was taken out of the list by next(): the rest came before it
    seen.events.clear()
    assert end is not None
    return [e for e in between if field(e, "ConditionName")]


def test_a_scada_acknowledges_with_the_event_id_its_condition_refresh_showed(app):
    async def go():
        async with session(app, *app.plc) as plc:
            async with session(app, *app.scada) as first_scada:  # it sees the raise, then restarts
                seen = Events()
                sub = await first_scada.create_subscription(20, seen)
                await sub.subscribe_events(first_scada.nodes.server, ua.ObjectIds.OffNormalAlarmType)
                raised = await classify_fault_run_until_raised(plc, seen)
                original_id, condition = field(raised, "EventId"), field(raised, "NodeId")

            async with session(app, *app.scada) as scada:  # after the restart: it knows only what the refresh shows
                seen = Events()
                sub = await scada.create_subscription(20, seen)
                await sub.subscribe_events(scada.nodes.server, REFRESH_TYPES)
                shown = [e for e in await refreshed_conditions(scada, seen, sub.subscription_id)
                         if is_condition(CONDITION, True, False)(e)]
                assert len(shown) == 1, [field(e, "Message") for e in shown]
                refreshed_id = field(shown[0], "EventId")
                assert field(shown[0], "NodeId") == condition and refreshed_id != original_id

                r = await acknowledge(scada, condition, refreshed_id, "IDV2 seen after the SCADA restart")
                assert status_name(r) == "Good", "Acknowledge with the refreshed event's EventId was refused"
                acked = await seen.next(is_condition(CONDITION, True, True))
                assert field(acked, "Comment").Text == "IDV2 seen after the SCADA restart"

                # AddComment too, with the refreshed EventId and with the original's; an unknown one stays refused
                assert status_name(await add_comment(scada, condition, refreshed_id, "feed valve")) == "Good"
                assert status_name(await add_comment(scada, condition, original_id, "shift log")) == "Good"
                r = await add_comment(scada, condition, b"0" * 32, "made up")
                assert status_name(r) == "BadEventIdUnknown"
                for comment in ("feed valve", "shift log"):  # each comment's event, before the next refresh
                    await seen.next(lambda e, c=comment: getattr(field(e, "Comment"), "Text", None) == c)

                # a second refresh shows it acknowledged, and still active: the fault goes on
                again = [e for e in await refreshed_conditions(scada, seen, sub.subscription_id)
                         if field(e, "ConditionName") == CONDITION]
                assert len(again) == 1 and field(again[0], "AckedState/Id") is True
                assert field(again[0], "ActiveState/Id") is True
    run(go(), timeout=300)
