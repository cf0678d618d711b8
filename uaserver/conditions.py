"""The `Alarms/<name>` Booleans as OPC UA Alarms & Conditions (Part 9), for SCADA that handles them.

Each alarm is an OffNormalAlarmType condition, a component of the Server object (NodeId
`Appliance/Conditions/<name>` in the appliance namespace), whose events the Server object emits: raised and cleared
in the same step as its Boolean (see ApplianceUaServer.set_alarm), with ActiveState, AckedState, Retain, Severity
and a Message. Acknowledge (AcknowledgeableConditionType, i=9111; EventId of the condition's latest event and a
Comment) is for engineers: it runs through the method handlers (role, audit), so an operator's answers
BadUserAccessDenied and every attempt is audited. ConditionRefresh (i=3875) sends every retained condition again
between RefreshStart and RefreshEnd events, as SCADA clients ask after (re)connecting.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from asyncua import Server, ua

from .asyncua_internals import add_bare_object

log = logging.getLogger(__name__)
V = ua.VariantType
ACKNOWLEDGE = ua.NodeId(ua.ObjectIds.AcknowledgeableConditionType_Acknowledge)
CONDITION_REFRESH = ua.NodeId(ua.ObjectIds.ConditionType_ConditionRefresh)


class ConditionError(Exception):
    """A refused condition method: its status code name."""

    def __init__(self, status: str):
        super().__init__(status)
        self.status = status


@dataclass
class Condition:
    name: str
    nodeid: ua.NodeId
    severity: int
    active: bool = False
    acked: bool = True
    event_id: bytes | None = None  # the latest event's EventId (Acknowledge names it)
    comment: str = ""
    user: str = ""
    message: str = ""
    history: list[bytes] = field(default_factory=list)

    @property
    def retain(self) -> bool:
        return self.active or not self.acked


class AlarmConditions:
    def __init__(self, server: Server, ns: int):
        self.server = server
        self.ns = ns
        self.conditions: dict[str, Condition] = {}
        self._by_node: dict[ua.NodeId, Condition] = {}
        self._gen = None
        self._refresh = {}
        self._lock = asyncio.Lock()

    async def build(self, names: dict[str, int]) -> None:
        """names: alarm name -> severity (1..1000) while active."""
        server_node = self.server.nodes.server
        for name, severity in names.items():
            nodeid = ua.NodeId(f"Appliance/Conditions/{name}", self.ns)
            await add_bare_object(self.server, nodeid, ua.QualifiedName(name, self.ns), server_node.nodeid,
                                  ua.NodeId(ua.ObjectIds.OffNormalAlarmType))
            c = Condition(name, nodeid, severity)
            self.conditions[name] = c
            self._by_node[nodeid] = c
        if not names:
            return
        self._gen = await self.server.get_event_generator(ua.ObjectIds.OffNormalAlarmType, ua.ObjectIds.Server)
        for key, etype in (("start", ua.ObjectIds.RefreshStartEventType),
                           ("end", ua.ObjectIds.RefreshEndEventType)):
            self._refresh[key] = await self.server.get_event_generator(etype, ua.ObjectIds.Server)

    def condition_of(self, nodeid: ua.NodeId) -> Condition:
        c = self._by_node.get(nodeid)
        if c is None:
            raise ConditionError("BadNodeIdUnknown")
        return c

    async def set(self, name: str, active: bool, message: str = "") -> None:
        """Raise or clear a condition (an event only when its state changes)."""
        c = self.conditions.get(name)
        if c is None or c.active == active:
            return
        c.active = active
        if active:
            c.acked, c.comment, c.user = False, "", ""
        c.message = message or f"{name} {'active' if active else 'cleared'}"
        await self._trigger(c)

    async def acknowledge(self, nodeid: ua.NodeId, event_id: bytes | None, comment: str, user: str) -> Condition:
        c = self.condition_of(nodeid)
        if not event_id or event_id not in c.history:
            raise ConditionError("BadEventIdUnknown")
        if c.acked:
            raise ConditionError("BadConditionBranchAlreadyAcked")
        c.acked, c.comment, c.user = True, comment, user
        c.message = f"{c.name} acknowledged" + (f": {comment}" if comment else "")
        await self._trigger(c)
        return c

    async def refresh(self) -> None:
        """ConditionRefresh: every retained condition's state again, between RefreshStart and RefreshEnd."""
        await self._refresh["start"].trigger(message="ConditionRefresh start")
        for c in self.conditions.values():
            if c.retain:
                await self._trigger(c)
        await self._refresh["end"].trigger(message="ConditionRefresh end")

    async def _trigger(self, c: Condition, remember: bool = True) -> None:
        if self._gen is None:
            return
        async with self._lock:  # one event object: fill it and send it without another condition in between
            e = self._gen.event
            e.NodeId = c.nodeid
            e.ConditionName = c.name
            e.ConditionClassId = ua.NodeId(ua.ObjectIds.BaseConditionClassType)
            e.ConditionClassName = ua.LocalizedText("BaseConditionClass")
            e.BranchId = ua.NodeId()
            e.Retain = c.retain
            e.Severity = c.severity if c.active else 100
            e.LastSeverity = e.Severity
            e.Quality = ua.StatusCode(ua.StatusCodes.Good)
            _two_state(e, "EnabledState", True, "Enabled", "Disabled")
            _two_state(e, "ActiveState", c.active, "Active", "Inactive")
            _two_state(e, "AckedState", c.acked, "Acknowledged", "Unacknowledged")
            e.Comment = ua.LocalizedText(c.comment)
            e.ClientUserId = c.user
            await self._gen.trigger(message=c.message)
            if remember:
                c.event_id = e.EventId.Value if isinstance(e.EventId, ua.Variant) else e.EventId
                c.history = (c.history + [c.event_id])[-8:]


def _two_state(event, name: str, value: bool, true_text: str, false_text: str) -> None:
    setattr(event, name, ua.LocalizedText(true_text if value else false_text))
    setattr(event, f"{name}/Id", value)
    if hasattr(event, f"{name}/TrueState"):
        setattr(event, f"{name}/TrueState", ua.LocalizedText(true_text))
        setattr(event, f"{name}/FalseState", ua.LocalizedText(false_text))
