"""Everything of the appliance that reaches into asyncua's private parts, in one file.

Written for asyncua ASYNCUA_VERSION exactly: importing this module with another version installed raises
AsyncuaVersionError naming both, so that an upgrade of asyncua is one file to review (and `pyproject.toml` pins it).

What is here, and which asyncua internals it relies on:
- write_together: sets several Value attributes in the address space (AddressSpace._nodes, AttributeValue) before
  any data-change callback runs, so the changes land in one publish of every subscription.
- external_sessions: the server's registry of client sessions (InternalServer._external_sessions).
"""
from __future__ import annotations

import importlib.metadata
import logging
from datetime import datetime, timezone

from asyncua import Server, ua

log = logging.getLogger(__name__)
ASYNCUA_VERSION = "2.1.0"


class AsyncuaVersionError(ImportError):
    """The installed asyncua is not the version the appliance's asyncua internals were written for."""


def check_asyncua_version(installed: str | None = None) -> None:
    """Raise AsyncuaVersionError unless asyncua ASYNCUA_VERSION is installed (or `installed` is it, for tests)."""
    if installed is None:
        try:
            installed = importlib.metadata.version("asyncua")
        except importlib.metadata.PackageNotFoundError:
            installed = "none"
    if installed != ASYNCUA_VERSION:
        raise AsyncuaVersionError(
            f"the appliance's OPC UA server was written for asyncua {ASYNCUA_VERSION}, but asyncua {installed} is "
            f"installed: install asyncua=={ASYNCUA_VERSION} (`pip install asyncua=={ASYNCUA_VERSION}`), or review "
            "uaserver/asyncua_internals.py against the new version and change ASYNCUA_VERSION there")


check_asyncua_version()


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
        except Exception:  # as asyncua does: one subscriber's failure is not the writer's
            log.exception("data-change callback failed")


def external_sessions(server: Server) -> list:
    """The client sessions the server holds now."""
    return list(server.iserver._external_sessions.values())


async def add_bare_object(server: Server, nodeid: ua.NodeId, name: ua.QualifiedName, parent: ua.NodeId,
                          type_definition: ua.NodeId) -> None:
    """An Object of a type without instantiating the type's children (asyncua's add_object would copy the ~40
    variables of an alarm type per condition; the appliance keeps a condition's state in its events)."""
    item = ua.AddNodesItem()
    item.RequestedNewNodeId = nodeid
    item.BrowseName = name
    item.NodeClass = ua.NodeClass.Object
    item.ParentNodeId = parent
    item.ReferenceTypeId = ua.NodeId(ua.ObjectIds.HasComponent)
    item.TypeDefinition = type_definition
    attrs = ua.ObjectAttributes()
    attrs.DisplayName = ua.LocalizedText(name.Name)
    attrs.EventNotifier = 0
    item.NodeAttributes = attrs
    for result in await server.iserver.isession.add_nodes([item]):
        result.StatusCode.check()

