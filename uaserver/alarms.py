"""The alarms: `Alarms/...` Booleans and their Part 9 conditions changed in one place (set_alarm), the class alarms
that classifier results drive (per source, debounced: the classifier states the daemon builds, appliance/classify.py),
and the condition methods (Acknowledge, AddComment, Enable, Disable, ConditionRefresh, ConditionRefresh2) that SCADA
calls.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import datetime, timezone

from asyncua import Server, ua

from core.services import Classified, Classifier

from .address_space import ApplianceNodes, write
from .conditions import (CONDITION_REFRESH, CONDITION_REFRESH2, METHODS, AlarmConditions, ConditionError,
                         ConditionSpec)
from .methods import CallContext, MethodHandlers, MethodStatus, require_type

log = logging.getLogger(__name__)
V = ua.VariantType
SEVERITY = {"EngineFault": 1000, "GpuCritical": 900, "ModelFailed": 800, "WorkerRestarting": 600, "GpuWarning": 600}
CLASS_SEVERITY, DRIFT_SEVERITY, OTHER_SEVERITY, SOURCE_SEVERITY = 700, 500, 700, 600
AUDIT_EVENT = {"Acknowledge": "alarm_acknowledged", "AddComment": "alarm_commented", "Enable": "alarm_enabled",
               "Disable": "alarm_disabled"}


class Alarms:
    def __init__(self, classifiers: Mapping[str, Classifier], *, metrics, emit_event: Callable[..., None]):
        self.classifiers = classifiers
        self.metrics = metrics
        self.emit_event = emit_event
        self.server: Server | None = None
        self.nodes: ApplianceNodes | None = None
        self.conditions: AlarmConditions | None = None
        self._booleans: dict[str, object] = {}  # alarm name -> its Boolean node
        self._values: dict[str, bool] = {}  # alarm name -> the value its Boolean and condition show

    async def build(self, server: Server, ns: int, nodes: ApplianceNodes, handlers: MethodHandlers) -> None:
        """The conditions, and the condition methods linked to the handlers (the type's and each instance's)."""
        self.server, self.nodes = server, nodes
        self._booleans = dict(nodes.alarms)
        for (model, c), node in nodes.class_alarms.items():
            self._booleans[f"{model}/{self.classifiers[model].labels[c]}"] = node
        for (model, source, c), node in nodes.source_alarms.items():
            self._booleans[f"{model}/{source}/{self.classifiers[model].labels[c]}"] = node
        self.conditions = AlarmConditions(server, ns)
        await self.conditions.build(self._condition_specs())
        wrapped = {name: handlers.wrap(name, "", "engineer", n_args, self._condition_method(name))
                   for name, _, n_args in METHODS}
        for name, type_method, _ in METHODS:  # called on the type's method or on the condition's own
            server.link_method(server.get_node(type_method), wrapped[name])
        for nodeid, name in self.conditions.instance_methods():
            server.link_method(server.get_node(nodeid), wrapped[name])
        server.link_method(server.get_node(CONDITION_REFRESH),
                           handlers.wrap("ConditionRefresh", "", "monitor", 1, self._condition_refresh))
        server.link_method(server.get_node(CONDITION_REFRESH2),
                           handlers.wrap("ConditionRefresh2", "", "monitor", 2, self._condition_refresh2))

    def _condition_specs(self) -> list[ConditionSpec]:
        """The appliance's alarms, drift, and each source's class alarms (the debounced state a control room acts
        on; `Alarms/<label>`, any source, is a Boolean for PLCs only)."""
        n, specs = self.nodes, []
        for name, node in n.alarms.items():
            if name.startswith("Drift/"):
                model = name.removeprefix("Drift/")
                specs.append(ConditionSpec(name, DRIFT_SEVERITY, n.models[model].obj.nodeid, model, node.nodeid))
            elif name.startswith("SourceFault/"):  # uaserver/sources.py: about the source's own object
                source = name.removeprefix("SourceFault/")
                specs.append(ConditionSpec(name, SOURCE_SEVERITY, ua.NodeId(f"Appliance/Sources/{source}",
                                                                            node.nodeid.NamespaceIndex),
                                           source, node.nodeid))
            else:
                specs.append(ConditionSpec(name, SEVERITY.get(name, OTHER_SEVERITY), n.root.nodeid, "Appliance",
                                           node.nodeid))
        for (model, source, c), node in n.source_alarms.items():
            specs.append(ConditionSpec(f"{model}/{source}/{self.classifiers[model].labels[c]}", CLASS_SEVERITY,
                                       n.models[model].obj.nodeid, model, node.nodeid))
        return specs

    async def set_alarm(self, name: str, active: bool, message: str = "") -> None:
        """The one place an alarm is raised or cleared: its Boolean and its condition change together."""
        if self._values.get(name) == active:
            return
        node = self._booleans.get(name)
        if node is None:
            return
        self._values[name] = active
        await write(self.server, node, active, V.Boolean)
        if self.conditions is not None:
            await self.conditions.set(name, active, f"{message or name} {'active' if active else 'cleared'}")

    async def classified(self, model: str, output, source: str) -> Classified:
        """Last, Last/<source> and the class alarms follow every Classify and Infer result of a labelled model;
        returns the classification."""
        classifier = self.classifiers[model]
        u = classifier.update(output, source)
        result, values = u.result, self.nodes.models[model].values
        now = datetime.now(timezone.utc)
        for last in ("Last", f"Last/{source}"):
            await write(self.server, values[f"{last}/ClassIndex"], result.class_index[-1], V.Int32)
            await write(self.server, values[f"{last}/Label"], result.label[-1], V.String)
            await write(self.server, values[f"{last}/Confidence"], result.confidence[-1], V.Float)
            await write(self.server, values[f"{last}/Time"], now, V.DateTime)
        for c in u.raised | u.cleared:
            active, label = c in u.raised, classifier.labels[c]
            await self._class_alarm(f"{model}/{source}/{label}", active,
                                    f"Alarm {label} of model {model} from {source}")
            self.emit_event(f"Alarm {label} of model {model} from {source} " + ("raised" if active else "cleared"),
                            severity=CLASS_SEVERITY if active else 300)
        for c in u.any_raised | u.any_cleared:
            await self._class_alarm(f"{model}/{classifier.labels[c]}", c in u.any_raised)
        return result

    async def _class_alarm(self, name: str, active: bool, message: str = "") -> None:
        await self.set_alarm(name, active, message)
        if self.metrics is not None:
            self.metrics.alarm_active.labels(name).set(1 if active else 0)

    # ---- the condition methods ----

    def _condition_method(self, method: str):
        """Acknowledge / AddComment (EventId, Comment), Enable / Disable () on a condition (the call's object)."""
        event = AUDIT_EVENT[method]

        async def body(ctx: CallContext, args):
            ctx.event = event
            text, event_id = "", None
            if method in ("Acknowledge", "AddComment"):
                event_id = require_type(args[0], 0, (V.ByteString,), array=False)
                comment = require_type(args[1], 1, (V.LocalizedText,), array=False)
                text = (comment.Text or "")[:512] if comment is not None else ""
            try:
                c = self.conditions.condition_of(ctx.parent)
                ctx.detail = f"condition {c.name}" + (f": {text[:200]}" if text else "")
                if method == "Acknowledge":
                    await self.conditions.acknowledge(ctx.parent, event_id, text, ctx.session.identity)
                elif method == "AddComment":
                    await self.conditions.add_comment(ctx.parent, event_id, text, ctx.session.identity)
                else:
                    await self.conditions.enable(ctx.parent, method == "Enable")
            except ConditionError as e:
                raise MethodStatus(e.status) from None
            return []
        return body

    async def _condition_refresh(self, ctx: CallContext, args):
        subscription_id = require_type(args[0], 0, (V.UInt32,), array=False)
        try:
            self.conditions.check_refresh(ctx.session.session_id, subscription_id)
        except ConditionError as e:
            raise MethodStatus(e.status) from None
        await self.conditions.refresh(subscription_id)  # that subscription only
        return []

    async def _condition_refresh2(self, ctx: CallContext, args):
        """ConditionRefresh2 (Part 9): SubscriptionId, MonitoredItemId; that monitored item only."""
        subscription_id = require_type(args[0], 0, (V.UInt32,), array=False)
        monitored_item_id = require_type(args[1], 1, (V.UInt32,), array=False)
        try:
            self.conditions.check_refresh2(ctx.session.session_id, subscription_id, monitored_item_id)
        except ConditionError as e:
            raise MethodStatus(e.status) from None
        await self.conditions.refresh(subscription_id, monitored_item_id)
        return []
