"""The contract's ObjectTypes (core/object_types.py) added to a running server's address space, and the two node
fix-ups asyncua needs (an array's ValueRank, an object's type definition)."""
from __future__ import annotations

from asyncua import Node, ua

from core.object_types import FOLDER, OBJECT_TYPES, Member, ObjectTypeSpec, type_path

V = ua.VariantType

DEFAULTS = {V.String: "", V.Boolean: False, V.Double: 0.0, V.Float: 0.0, V.UInt32: 0, V.UInt64: 0, V.Int32: 0}


class TypeBuilder:
    """Adds the ObjectTypes to a server's address space (before the instances, which reference them)."""

    def __init__(self, server, ns: int):
        self.server = server
        self.ns = ns

    def nid(self, path: str) -> ua.NodeId:
        return ua.NodeId(path, self.ns)

    def type_id(self, name: str) -> ua.NodeId:
        if name == FOLDER:
            return ua.NodeId(ua.ObjectIds.FolderType)
        return self.nid(type_path(name))

    async def build(self, add_method, extra: tuple[ObjectTypeSpec, ...] = ()) -> dict[str, ua.NodeId]:
        """Every type of OBJECT_TYPES, then `extra` (the configuration's task types); add_method(parent, path,
        member) adds a declared method (with its arguments and the dispatcher that runs an instance's method).
        Returns type name -> its NodeId."""
        base = self.server.get_node(ua.ObjectIds.BaseObjectType)
        made: dict[str, ua.NodeId] = {}
        for spec in (*OBJECT_TYPES, *extra):  # supertypes come first in the table
            parent = base if not spec.supertype else self.server.get_node(made[spec.supertype])
            path = type_path(spec.name)
            node = await parent.add_object_type(self.nid(path), ua.QualifiedName(spec.name, self.ns))
            if spec.abstract:
                await node.write_attribute(ua.AttributeIds.IsAbstract, ua.DataValue(ua.Variant(True, V.Boolean)))
            if spec.description:
                await node.write_attribute(ua.AttributeIds.Description,
                                           ua.DataValue(ua.Variant(ua.LocalizedText(spec.description),
                                                                   V.LocalizedText)))
            for m in spec.members:
                child = await self._member(node, path, m, add_method)
                await child.add_reference(ua.NodeId(m.rule), ua.ObjectIds.HasModellingRule, bidirectional=False)
            made[spec.name] = node.nodeid
        return made

    async def _member(self, parent, path: str, m: Member, add_method):
        child_path = f"{path}/{m.name}"
        qname = ua.QualifiedName(m.name, self.ns)
        if m.kind == "method":
            return await add_method(parent, child_path, m)
        if m.kind == "object":
            obj = await parent.add_object(self.nid(child_path), qname)
            await retype(obj, self.type_id(m.type_name))
            return obj
        value = ua.Variant([] if m.array else (None if m.vtype == V.DateTime else DEFAULTS[m.vtype]), m.vtype)
        add = parent.add_property if m.kind == "property" else parent.add_variable
        node = await add(self.nid(child_path), qname, value, m.vtype, ua.NodeId(m.vtype.value))
        if m.array:
            await set_array(node)
        return node


async def set_array(node) -> None:
    """A one-dimensional array of any length (asyncua leaves ValueRank unset for a list value without dimensions)."""
    await node.write_value_rank(1)
    await node.write_array_dimensions([0])


async def retype(node, type_id: ua.NodeId) -> None:
    """Point an object's HasTypeDefinition at type_id (asyncua creates plain objects as BaseObjectType). A parent's
    reference carries the TypeDefinition that Browse answers, taken when it was added: it is added anew."""
    for ref in await node.get_references(ua.ObjectIds.HasTypeDefinition, ua.BrowseDirection.Forward):
        await node.delete_reference(ref.NodeId, ua.ObjectIds.HasTypeDefinition, bidirectional=False)
    await node.add_reference(type_id, ua.ObjectIds.HasTypeDefinition, bidirectional=False)
    for ref in await node.get_references(ua.ObjectIds.HierarchicalReferences, ua.BrowseDirection.Inverse):
        parent = Node(node.session, ref.NodeId)
        await parent.delete_reference(node, ref.ReferenceTypeId, bidirectional=False)
        await parent.add_reference(node, ref.ReferenceTypeId, bidirectional=False)
