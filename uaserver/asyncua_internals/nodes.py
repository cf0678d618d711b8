"""Values and nodes: several writes in one publish, the session and subscription registries, copies of
an instantiated object (items 5 and 6)."""
from __future__ import annotations

import logging
import uuid
from datetime import datetime, timezone

from asyncua import Server, ua

log = logging.getLogger(__name__)


# ==============================================================================================================
# Values and nodes
#
# Writes of several values in one publish; the session registry; bare objects.

async def write_together(server: Server, items: list[tuple[ua.NodeId, ua.Variant]]) -> None:
    """Set the Value of every node first, then run the data-change callbacks: the monitored items of every
    subscription queue all changes before its next publish, and a Read in between sees them all or none."""
    aspace = server.iserver.aspace
    now = datetime.now(timezone.utc)
    pending = []
    for nodeid, variant in items:
        dv = ua.DataValue(variant, SourceTimestamp=now, ServerTimestamp=now)
        attval = aspace._nodes[nodeid].attributes[ua.AttributeIds.Value]
        attval.value = dv
        attval.value_callback = None
        pending.extend((handle, callback, dv) for handle, callback in list(attval.datachange_callbacks.items()))
    for handle, callback, dv in pending:
        try:
            await callback(handle, dv)
        except Exception:  # noqa: BLE001 - as asyncua does: one subscriber's failure is not the writer's; logged
            log.exception("data-change callback failed")


def external_sessions(server: Server) -> list:
    """The client sessions the server holds now."""
    return list(server.iserver._external_sessions.values())


def subscription_of(server: Server, session_id: ua.NodeId, subscription_id: int) -> bool:
    """True when the subscription exists and belongs to that session."""
    sub = server.iserver.subscription_service.subscriptions.get(subscription_id)
    return sub is not None and sub.session_id == session_id


def monitored_item_of(server: Server, subscription_id: int, monitored_item_id: int) -> bool:
    """True when the subscription has that monitored item (MonitoredItemService._monitored_items)."""
    sub = server.iserver.subscription_service.subscriptions.get(subscription_id)
    return sub is not None and monitored_item_id in sub.monitored_item_srv._monitored_items


async def trigger_for_monitored_item(server: Server, generator, subscription_id: int, monitored_item_id: int,
                                     message: str) -> None:
    """EventGenerator.trigger for one monitored item only (ConditionRefresh2): the event gets a new EventId and
    the time as trigger gives them, and goes to MonitoredItemService.trigger_event(event, mid) of that subscription,
    not through SubscriptionService.trigger_event (whose record of retained conditions a refresh must not change)."""
    event = generator.event
    event.EventId = ua.Variant(uuid.uuid4().hex.encode("utf-8"), ua.VariantType.ByteString)
    event.Time = event.ReceiveTime = datetime.now(timezone.utc)
    event.Message = ua.LocalizedText(message)
    sub = server.iserver.subscription_service.subscriptions.get(subscription_id)
    if sub is not None:
        await sub.monitored_item_srv.trigger_event(event, monitored_item_id)


_CHILD_REFERENCES = (ua.ObjectIds.HasComponent, ua.ObjectIds.HasProperty)
_ATTRIBUTES = {  # NodeClass -> (its AddNodes attributes type, the attributes copied)
    ua.NodeClass.Variable: (ua.VariableAttributes, ("DisplayName", "Description", "Value", "DataType", "ValueRank",
                                                    "ArrayDimensions", "AccessLevel", "UserAccessLevel",
                                                    "MinimumSamplingInterval", "Historizing")),
    ua.NodeClass.Method: (ua.MethodAttributes, ("DisplayName", "Description", "Executable", "UserExecutable")),
    ua.NodeClass.Object: (ua.ObjectAttributes, ("DisplayName", "Description", "EventNotifier")),
}


async def instantiate_many(server: Server, parent: ua.NodeId, type_id: ua.NodeId,
                           items: list[tuple[ua.NodeId, ua.QualifiedName]]) -> None:
    """Objects of one type with the type's mandatory children, under `parent` (HasComponent), for many at once.

    The first through asyncua's instantiate; the others as copies of its subtree (attributes, type definitions,
    child NodeIds '<object>.<child>' as instantiate names them) added in one AddNodes call: instantiate browses the
    type hierarchy anew for every object (30-80 ms per alarm condition here, a second or more of every start)."""
    from asyncua.common.instantiate_util import instantiate
    if not items:
        return
    (first_id, first_name), rest = items[0], items[1:]
    await instantiate(server.get_node(parent), server.get_node(type_id), nodeid=first_id, bname=first_name,
                      instantiate_optional=False)
    nodes = server.iserver.aspace._nodes
    prefix = first_id.Identifier
    template = []  # (suffix, parent suffix, reference type, node data): parents before their children

    def walk(nodeid: ua.NodeId, suffix: str) -> None:
        for ref in nodes[nodeid].references:
            if ref.IsForward and ref.ReferenceTypeId.Identifier in _CHILD_REFERENCES:
                child = nodes[ref.NodeId]
                child_suffix = ref.NodeId.Identifier[len(prefix):]
                template.append((child_suffix, suffix, ref.ReferenceTypeId, child))
                walk(ref.NodeId, child_suffix)
    walk(first_id, "")
    additions = []
    for nodeid, name in rest:
        additions.append(_add_item(nodeid, name, parent, ua.NodeId(ua.ObjectIds.HasComponent), type_id,
                                   nodes[first_id]))
        for suffix, parent_suffix, reference, data in template:
            additions.append(_add_item(ua.NodeId(nodeid.Identifier + suffix, nodeid.NamespaceIndex), None,
                                       ua.NodeId(nodeid.Identifier + parent_suffix, nodeid.NamespaceIndex),
                                       reference, _type_definition(data), data))
    for result in await server.iserver.isession.add_nodes(additions):
        result.StatusCode.check()


def _type_definition(data) -> ua.NodeId:
    for ref in data.references:
        if ref.IsForward and ref.ReferenceTypeId.Identifier == ua.ObjectIds.HasTypeDefinition:
            return ref.NodeId
    return ua.NodeId()


def _add_item(nodeid: ua.NodeId, name: ua.QualifiedName | None, parent: ua.NodeId, reference: ua.NodeId,
              type_definition: ua.NodeId, data) -> ua.AddNodesItem:
    attributes = {a: v.value.Value.Value for a, v in data.attributes.items() if v.value is not None
                  and v.value.Value is not None}
    node_class = ua.NodeClass(attributes[ua.AttributeIds.NodeClass])
    item = ua.AddNodesItem()
    item.RequestedNewNodeId = nodeid
    item.BrowseName = name or attributes[ua.AttributeIds.BrowseName]
    item.NodeClass = node_class
    item.ParentNodeId = parent
    item.ReferenceTypeId = reference
    item.TypeDefinition = type_definition if node_class != ua.NodeClass.Method else ua.NodeId()
    kind, names = _ATTRIBUTES[node_class]
    attrs = kind()
    for attr in names:
        value = attributes.get(getattr(ua.AttributeIds, attr))
        if value is not None:
            setattr(attrs, attr, value)
    if name is not None:
        attrs.DisplayName = ua.LocalizedText(name.Name)
    item.NodeAttributes = attrs
    return item
