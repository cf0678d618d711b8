"""The `Alarms/...` Booleans as OPC UA Alarms & Conditions (Part 9), for SCADA that handles them.

Each alarm is a complete OffNormalAlarmType instance (an AlarmConditionType: ActiveState, AckedState, EnabledState,
Severity, Message, Retain, SourceName and the type's other mandatory children), a component of the Server object
with NodeId `Appliance/Conditions/<alarm>` and a BrowseName without '/' (`Drift.<model>`,
`<model>.<source>.<label>`). Its variables and an event on the Server object change in one step with its Boolean
(see ApplianceUaServer.set_alarm). The condition methods run through the method handlers (role, audit):
Acknowledge and AddComment (EventId of one of the condition's events, a Comment), Enable and Disable, for
engineers. A disabled condition sends no events and keeps its state; Enable sends it as it is. ConditionRefresh
(i=3875) sends every retained condition again between RefreshStart and RefreshEnd events, to the subscription it
names only, as SCADA clients ask after (re)connecting; ConditionRefresh2 (i=12912) does the same for one monitored
item of it.

An EventId acknowledges (or comments) only the occurrence it belongs to: an occurrence begins when the condition
is raised and lasts until it is raised again; its own events (the raise, the clear, acknowledgements, comments,
enable/disable) and the events a refresh sent of it carry its EventIds. The EventId of an earlier occurrence
answers BadEventIdUnknown: an HMI acknowledging an old list entry never acknowledges a re-raise the operator has not
seen. (asyncua gives every event, refreshed ones too, an EventId of its own.)
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone

from asyncua import Server, ua

from .asyncua_internals import (instantiate_many, monitored_item_of, subscription_of, trigger_for_monitored_item,
                                write_together)

log = logging.getLogger(__name__)
V = ua.VariantType
CONDITION_TYPE = ua.NodeId(ua.ObjectIds.OffNormalAlarmType)
CONDITION_REFRESH = ua.NodeId(ua.ObjectIds.ConditionType_ConditionRefresh)
# (method, the type's own method NodeId, number of input arguments); instance methods have NodeId <condition>.<name>
METHODS = (("Acknowledge", ua.ObjectIds.AcknowledgeableConditionType_Acknowledge, 2),
           ("AddComment", ua.ObjectIds.ConditionType_AddComment, 2),
           ("Enable", ua.ObjectIds.ConditionType_Enable, 0),
           ("Disable", ua.ObjectIds.ConditionType_Disable, 0))
CONDITION_REFRESH2 = ua.NodeId(ua.ObjectIds.ConditionType_ConditionRefresh2)
# The EventIds of the current occurrence that are kept (its own events and refreshed ones, oldest dropped first):
# several SCADA clients refreshing again and again after a restart, while the alarm stays unacknowledged.
OCCURRENCE_IDS_KEPT = 256


class ConditionError(Exception):
    """A refused condition method: its status code name."""

    def __init__(self, status: str):
        super().__init__(status)
        self.status = status


def browse_name(alarm: str) -> str:
    """A condition's BrowseName and ConditionName: the alarm's name with '/' as '.' (BrowseNames hold no '/')."""
    return alarm.replace("/", ".")


@dataclass(frozen=True)
class ConditionSpec:
    alarm: str  # the alarm's name (its Boolean under Alarms/)
    severity: int  # 1..1000 while active
    source_node: ua.NodeId  # the object the alarm is about (a model, or the Appliance object)
    source_name: str
    input_node: ua.NodeId  # its Boolean


@dataclass
class Condition:
    spec: ConditionSpec
    nodeid: ua.NodeId
    active: bool = False
    acked: bool = True
    enabled: bool = True
    event_id: bytes | None = None  # the latest event's EventId (the EventId variable shows it)
    comment: str = ""
    user: str = ""
    message: str = ""
    occurrence: int = 0  # how many times it was raised
    # The EventIds of the current occurrence (its own events and refreshes of it): Acknowledge names one of these
    occurrence_ids: deque[bytes] = field(default_factory=lambda: deque(maxlen=OCCURRENCE_IDS_KEPT))

    @property
    def name(self) -> str:
        return browse_name(self.spec.alarm)

    @property
    def retain(self) -> bool:
        return self.enabled and (self.active or not self.acked)

    def child(self, path: str) -> ua.NodeId:
        return ua.NodeId(f"{self.nodeid.Identifier}.{path}", self.nodeid.NamespaceIndex)


class AlarmConditions:
    def __init__(self, server: Server, ns: int):
        self.server = server
        self.ns = ns
        self.conditions: dict[str, Condition] = {}  # alarm name -> its condition
        self._by_node: dict[ua.NodeId, Condition] = {}
        self._gen = None
        self._refresh = {}
        self._lock = asyncio.Lock()

    async def build(self, specs: list[ConditionSpec]) -> None:
        if not specs:
            return
        items = []
        for spec in specs:
            nodeid = ua.NodeId(f"Appliance/Conditions/{spec.alarm}", self.ns)
            items.append((nodeid, ua.QualifiedName(browse_name(spec.alarm), self.ns)))
            c = Condition(spec, nodeid)
            self.conditions[spec.alarm] = c
            self._by_node[nodeid] = c
        await instantiate_many(self.server, self.server.nodes.server.nodeid, CONDITION_TYPE, items)
        self._gen = await self.server.get_event_generator(CONDITION_TYPE, ua.ObjectIds.Server)
        for key, etype in (("start", ua.ObjectIds.RefreshStartEventType),
                           ("end", ua.ObjectIds.RefreshEndEventType)):
            self._refresh[key] = await self.server.get_event_generator(etype, ua.ObjectIds.Server)
        for c in self.conditions.values():
            await self._write_state(c)

    def instance_methods(self) -> list[tuple[ua.NodeId, str]]:
        """(NodeId, method name) of every condition's own Acknowledge, AddComment, Enable and Disable."""
        return [(c.child(name), name) for c in self.conditions.values() for name, _, _ in METHODS]

    def condition_of(self, nodeid: ua.NodeId) -> Condition:
        c = self._by_node.get(nodeid)
        if c is None:
            raise ConditionError("BadNodeIdUnknown")
        return c

    async def set(self, alarm: str, active: bool, message: str = "") -> None:
        """Raise or clear a condition (an event only when its state changes, and only while it is enabled)."""
        c = self.conditions.get(alarm)
        if c is None or c.active == active:
            return
        c.active = active
        if active:  # a new occurrence: the EventIds of the earlier ones acknowledge nothing from now on
            c.acked, c.comment, c.user = False, "", ""
            c.occurrence += 1
            c.occurrence_ids.clear()
        c.message = message or f"{c.name} {'active' if active else 'cleared'}"
        await self._changed(c)

    async def acknowledge(self, nodeid: ua.NodeId, event_id: bytes | None, comment: str, user: str) -> Condition:
        c = self._known_event(nodeid, event_id)
        if c.acked:
            raise ConditionError("BadConditionBranchAlreadyAcked")
        c.acked, c.comment, c.user = True, comment, user
        c.message = f"{c.name} acknowledged" + (f": {comment}" if comment else "")
        await self._changed(c)
        return c

    async def add_comment(self, nodeid: ua.NodeId, event_id: bytes | None, comment: str, user: str) -> Condition:
        c = self._known_event(nodeid, event_id)
        c.comment, c.user = comment, user
        c.message = f"{c.name}: comment {comment}"
        await self._changed(c)
        return c

    async def enable(self, nodeid: ua.NodeId, enabled: bool) -> Condition:
        c = self.condition_of(nodeid)
        if c.enabled == enabled:
            raise ConditionError("BadConditionAlreadyEnabled" if enabled else "BadConditionAlreadyDisabled")
        c.enabled = enabled
        c.message = f"{c.name} {'enabled' if enabled else 'disabled'}"
        await self._changed(c, force=True)
        return c

    def _known_event(self, nodeid: ua.NodeId, event_id: bytes | None) -> Condition:
        c = self.condition_of(nodeid)
        if not c.enabled:
            raise ConditionError("BadConditionDisabled")
        if not event_id or event_id not in c.occurrence_ids:  # unknown, or of an earlier occurrence
            raise ConditionError("BadEventIdUnknown")
        return c

    def check_refresh(self, session_id: ua.NodeId, subscription_id: int) -> None:
        """ConditionRefresh names one of the calling session's subscriptions."""
        if not subscription_of(self.server, session_id, subscription_id):
            raise ConditionError("BadSubscriptionIdInvalid")

    def check_refresh2(self, session_id: ua.NodeId, subscription_id: int, monitored_item_id: int) -> None:
        """ConditionRefresh2 names one of the calling session's subscriptions and one monitored item of it."""
        self.check_refresh(session_id, subscription_id)
        if not monitored_item_of(self.server, subscription_id, monitored_item_id):
            raise ConditionError("BadMonitoredItemIdInvalid")

    async def refresh(self, subscription_id: int, monitored_item_id: int | None = None) -> None:
        """Every retained condition's state again, between RefreshStart and RefreshEnd, to that subscription (or
        only to that monitored item of it: ConditionRefresh2)."""
        if not self._refresh:
            return
        to = (subscription_id, monitored_item_id)
        await self._send(self._refresh["start"], "ConditionRefresh start", to)
        for c in self.conditions.values():
            if c.retain:
                await self._trigger(c, refresh_to=to)
        await self._send(self._refresh["end"], "ConditionRefresh end", to)

    async def _send(self, generator, message: str, to: tuple[int, int | None] | None) -> None:
        """Trigger generator's event: to every subscriber, to one subscription, or to one monitored item."""
        if to is None:
            await generator.trigger(message=message)
        elif to[1] is None:
            await generator.trigger(message=message, subscription_id=to[0])
        else:
            await trigger_for_monitored_item(self.server, generator, to[0], to[1], message)

    async def _changed(self, c: Condition, force: bool = False) -> None:
        """The condition's variables take its new state, and (while enabled) an event tells subscribers."""
        if c.enabled or force:
            await self._trigger(c)
        await self._write_state(c)

    async def _write_state(self, c: Condition) -> None:
        now = datetime.now(timezone.utc)
        severity = c.spec.severity if c.active else 100
        values = [
            ("ActiveState", ua.Variant(ua.LocalizedText("Active" if c.active else "Inactive"), V.LocalizedText)),
            ("ActiveState.Id", ua.Variant(c.active, V.Boolean)),
            ("AckedState", ua.Variant(ua.LocalizedText("Acknowledged" if c.acked else "Unacknowledged"),
                                      V.LocalizedText)),
            ("AckedState.Id", ua.Variant(c.acked, V.Boolean)),
            ("EnabledState", ua.Variant(ua.LocalizedText("Enabled" if c.enabled else "Disabled"), V.LocalizedText)),
            ("EnabledState.Id", ua.Variant(c.enabled, V.Boolean)),
            ("Retain", ua.Variant(c.retain, V.Boolean)),
            ("Severity", ua.Variant(severity, V.UInt16)),
            ("LastSeverity", ua.Variant(severity, V.UInt16)),
            ("Message", ua.Variant(ua.LocalizedText(c.message or c.name), V.LocalizedText)),
            ("Comment", ua.Variant(ua.LocalizedText(c.comment), V.LocalizedText)),
            ("ClientUserId", ua.Variant(c.user, V.String)),
            ("ConditionName", ua.Variant(c.name, V.String)),
            ("ConditionClassId", ua.Variant(ua.NodeId(ua.ObjectIds.BaseConditionClassType), V.NodeId)),
            ("ConditionClassName", ua.Variant(ua.LocalizedText("BaseConditionClass"), V.LocalizedText)),
            ("BranchId", ua.Variant(ua.NodeId(), V.NodeId)),
            ("Quality", ua.Variant(ua.StatusCode(ua.StatusCodes.Good), V.StatusCode)),
            ("SourceNode", ua.Variant(c.spec.source_node, V.NodeId)),
            ("SourceName", ua.Variant(c.spec.source_name, V.String)),
            ("InputNode", ua.Variant(c.spec.input_node, V.NodeId)),
            ("SuppressedOrShelved", ua.Variant(False, V.Boolean)),
            ("EventType", ua.Variant(CONDITION_TYPE, V.NodeId)),
            ("Time", ua.Variant(now, V.DateTime)),
            ("ReceiveTime", ua.Variant(now, V.DateTime)),
        ]
        if c.event_id is not None:
            values.append(("EventId", ua.Variant(c.event_id, V.ByteString)))
        await write_together(self.server, [(c.child(path), value) for path, value in values])

    async def _trigger(self, c: Condition, refresh_to: tuple[int, int | None] | None = None) -> None:
        """An event of the condition's state: a change, to every subscriber, or a refresh (a subscription, or a
        monitored item of it); either way its EventId belongs to the current occurrence."""
        if self._gen is None:
            return
        async with self._lock:  # one event object: fill it and send it without another condition in between
            e = self._gen.event
            e.NodeId = c.nodeid
            e.SourceNode = c.spec.source_node
            e.SourceName = c.spec.source_name
            e.ConditionName = c.name
            e.ConditionClassId = ua.NodeId(ua.ObjectIds.BaseConditionClassType)
            e.ConditionClassName = ua.LocalizedText("BaseConditionClass")
            e.BranchId = ua.NodeId()
            e.Retain = c.retain
            e.Severity = c.spec.severity if c.active else 100
            e.LastSeverity = e.Severity
            e.Quality = ua.StatusCode(ua.StatusCodes.Good)
            _two_state(e, "EnabledState", c.enabled, "Enabled", "Disabled")
            _two_state(e, "ActiveState", c.active, "Active", "Inactive")
            _two_state(e, "AckedState", c.acked, "Acknowledged", "Unacknowledged")
            e.Comment = ua.LocalizedText(c.comment)
            e.ClientUserId = c.user
            await self._send(self._gen, c.message, refresh_to)
            event_id = e.EventId.Value if isinstance(e.EventId, ua.Variant) else e.EventId
            c.occurrence_ids.append(event_id)
            if refresh_to is None:
                c.event_id = event_id


def _two_state(event, name: str, value: bool, true_text: str, false_text: str) -> None:
    setattr(event, name, ua.LocalizedText(true_text if value else false_text))
    setattr(event, f"{name}/Id", value)
    if hasattr(event, f"{name}/TrueState"):
        setattr(event, f"{name}/TrueState", ua.LocalizedText(true_text))
        setattr(event, f"{name}/FalseState", ua.LocalizedText(false_text))
