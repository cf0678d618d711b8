"""Builds the contract's address space under Objects/Appliance and keeps its values at most one second old.

NodeIds are strings in the appliance namespace, e.g. `Appliance/Models/te-classifier/Infer`, so that a PLC
programmer can configure them by hand; clients still look the namespace index up in the NamespaceArray.

Every object is an instance of an ObjectType of object_types.py (HasTypeDefinition; containers are FolderType), built
after the types; a method's arguments are properties with string NodeIds (`.../Infer/InputArguments`), on the
instance's method and on the type's alike. The type's method runs an instance's method (type_calls.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from asyncua import Node, Server, ua

from .method_table import ADMIN, MethodSpec
from core.object_types import (FOLDER, Member, ObjectTypeSpec, declared_methods, model_type, task_mailbox_type,
                               task_type, task_type_specs)
from .type_builder import TypeBuilder, retype, set_array
from .type_calls import TypeCalls, own_object_only

V = ua.VariantType


@dataclass
class ModelNodes:
    obj: Node
    values: dict[str, Node] = field(default_factory=dict)


@dataclass
class ApplianceNodes:
    root: Node
    admin: Node | None = None
    values: dict[str, Node] = field(default_factory=dict)  # "State", "Engine/QueueDepth", "Health/..."
    models: dict[str, ModelNodes] = field(default_factory=dict)
    types: dict[str, ua.NodeId] = field(default_factory=dict)  # ObjectType name -> NodeId
    type_of: dict[ua.NodeId, str] = field(default_factory=dict)  # an instance object -> its ObjectType's name
    alarms: dict[str, Node] = field(default_factory=dict)  # Alarms/<name> Booleans
    class_alarms: dict[tuple[str, int], Node] = field(default_factory=dict)  # (model, class) -> Alarms/<label>
    # (model, source, class) -> Alarms/<source>/<label>
    source_alarms: dict[tuple[str, str, int], Node] = field(default_factory=dict)
    tasks: dict[tuple[str, str], Node] = field(default_factory=dict)  # (model, task) -> Models/<model>/Tasks/<task>


class AddressSpaceBuilder:
    def __init__(self, server: Server, ns: int):
        self.server = server
        self.ns = ns
        self.type_calls = TypeCalls()
        self._types: dict[str, ua.NodeId] = {}
        self.task_types: dict[str, ObjectTypeSpec] = {}  # the configuration's task (and task mailbox) types

    def nid(self, path: str) -> ua.NodeId:
        return ua.NodeId(path, self.ns)

    async def variable(self, parent: Node, path: str, name: str, value, vtype: ua.VariantType,
                       prop: bool = False) -> Node:
        node = await (parent.add_property if prop else parent.add_variable)(self.nid(f"{path}/{name}"), ua.QualifiedName(name, self.ns),
                                         ua.Variant(value, vtype), vtype, ua.NodeId(vtype.value))
        if isinstance(value, list):
            await set_array(node)
        return node  # read-only: asyncua variables are not writable unless set_writable() is called

    async def typed(self, nodes: ApplianceNodes, node: Node, type_name: str) -> Node:
        """Make node an instance of the named ObjectType (FOLDER: the standard FolderType)."""
        type_id = ua.NodeId(ua.ObjectIds.FolderType) if type_name == FOLDER else self._types[type_name]
        await retype(node, type_id)
        nodes.type_of[node.nodeid] = type_name
        return node

    async def _method(self, parent: Node, path: str, name: str, callback, inputs, outputs) -> Node:
        """A method node with its argument properties under string NodeIds (asyncua would number them)."""
        node = await parent.add_method(self.nid(path), ua.QualifiedName(name, self.ns), callback, [], [])
        for bname, args in (("InputArguments", inputs), ("OutputArguments", outputs)):
            if args:
                prop = await node.add_property(self.nid(f"{path}/{bname}"), ua.QualifiedName(bname, 0),
                                               ua.Variant(list(args), ua.VariantType.ExtensionObject),
                                               datatype=ua.NodeId(ua.ObjectIds.Argument))
                await prop.write_value_rank(1)
                await prop.write_array_dimensions([len(args)])
                await prop.add_reference(ua.NodeId(ua.ObjectIds.ModellingRule_Mandatory),
                                         ua.ObjectIds.HasModellingRule, bidirectional=False)
        return node

    async def _type_method(self, parent: Node, path: str, member: Member) -> Node:
        nodeid = self.nid(path)
        return await self._method(parent, path, member.name, self.type_calls.dispatcher(nodeid), member.inputs,
                                  member.outputs)

    async def build(self, device: str, models: dict, alarms: tuple[str, ...] = (),
                    classifiers: dict | None = None, drift: tuple[str, ...] = (), describe=None,
                    tasks: dict | None = None, task_mailboxes: frozenset = frozenset()) -> ApplianceNodes:
        """classifiers: model name -> (labels, alarm class indices, sources) for tensor models with labels; drift:
        the models with drift detection; describe(status): the draft AI properties' values of a model
        (ai_properties.py), as name -> (value, VariantType); tasks: model name -> its TaskConfigs (YAML `tasks`),
        each an object Tasks/<task> of a type of its own; task_mailboxes: the (model, task) pairs a mailbox
        serves (their mailbox types are declared)."""
        classifiers = classifiers or {}
        tasks = tasks or {}
        for name, configs in tasks.items():
            for task in configs.values():
                for spec in task_type_specs(name, task, (name, task.name) in task_mailboxes):
                    self.task_types[spec.name] = spec
        self._types = await TypeBuilder(self.server, self.ns).build(self._type_method,
                                                                     tuple(self.task_types.values()))
        objects = self.server.nodes.objects
        root = await objects.add_object(self.nid("Appliance"), ua.QualifiedName("Appliance", self.ns))
        nodes = ApplianceNodes(root, types=dict(self._types))
        await self.typed(nodes, root, "ApplianceType")
        nodes.values["State"] = await self.variable(root, "Appliance", "State", "Starting", V.String)
        nodes.values["Device"] = await self.variable(root, "Appliance", "Device", device, V.String)
        nodes.values["Heartbeat"] = await self.variable(root, "Appliance", "Heartbeat", 0, V.UInt32)

        models_obj = await self.typed(nodes, await root.add_object(self.nid("Appliance/Models"),
                                                                   ua.QualifiedName("Models", self.ns)), FOLDER)
        for name, model in models.items():
            st = model.status()
            path = f"Appliance/Models/{name}"
            obj = await models_obj.add_object(self.nid(path), ua.QualifiedName(name, self.ns))
            await self.typed(nodes, obj, model_type(st.kind, name in classifiers))
            m = ModelNodes(obj)
            for key, value, vtype in (("Kind", st.kind, V.String), ("Version", "", V.String),
                                      ("Backend", "", V.String), ("State", "Loading", V.String),
                                      ("RequestCount", 0, V.UInt64), ("ErrorCount", 0, V.UInt64),
                                      ("LastLatencyMs", 0.0, V.Double), ("Heartbeat", 0, V.UInt32),
                                      ("WorkerRestarts", 0, V.UInt32)):
                m.values[key] = await self.variable(obj, path, key, value, vtype)
            for key, (value, vtype) in (describe(st) if describe else {}).items():
                m.values[f"AI/{key}"] = await self.variable(obj, path, key, value, vtype, prop=True)
            if st.kind == "tensor":
                m.values["InputShape"] = await self.variable(obj, path, "InputShape", [], V.UInt32)
                m.values["OutputShape"] = await self.variable(obj, path, "OutputShape", [], V.UInt32)
                m.values["MaxSamples"] = await self.variable(obj, path, "MaxSamples", int(st.max_samples), V.UInt32)
                if name in drift:
                    obj_drift = await obj.add_object(self.nid(f"{path}/Drift"), ua.QualifiedName("Drift", self.ns))
                    await self.typed(nodes, obj_drift, "DriftType")
                    for key, value, vtype in (("State", "NoReference", V.String), ("Score", 0.0, V.Double),
                                              ("Feature", "", V.String), ("Since", None, V.DateTime)):
                        m.values[f"Drift/{key}"] = await self.variable(obj_drift, f"{path}/Drift", key, value, vtype)
                if name in classifiers:
                    last = await obj.add_object(self.nid(f"{path}/Last"), ua.QualifiedName("Last", self.ns))
                    await self.typed(nodes, last, "LastResultType")
                    await self._last(last, f"{path}/Last", m, "Last")
                    for source in classifiers[name][2]:  # Last/<source>: the latest result of each source
                        own = await last.add_object(self.nid(f"{path}/Last/{source}"),
                                                    ua.QualifiedName(source, self.ns))
                        await self.typed(nodes, own, "LastResultType")
                        await self._last(own, f"{path}/Last/{source}", m, f"Last/{source}")
            if st.kind == "generative" and tasks.get(name):
                folder = await self.typed(nodes, await obj.add_object(self.nid(f"{path}/Tasks"),
                                                                      ua.QualifiedName("Tasks", self.ns)), FOLDER)
                for task in tasks[name].values():
                    task_obj = await folder.add_object(self.nid(f"{path}/Tasks/{task.name}"),
                                                       ua.QualifiedName(task.name, self.ns))
                    nodes.tasks[(name, task.name)] = await self.typed(nodes, task_obj, task_type(name, task.name))
            nodes.models[name] = m

        engine = await root.add_object(self.nid("Appliance/Engine"), ua.QualifiedName("Engine", self.ns))
        await self.typed(nodes, engine, "EngineType")
        for key in ("QueueDepth", "SlotsTotal", "SlotsInUse"):
            nodes.values[f"Engine/{key}"] = await self.variable(engine, "Appliance/Engine", key, 0, V.UInt32)
        health = await root.add_object(self.nid("Appliance/Health"), ua.QualifiedName("Health", self.ns))
        await self.typed(nodes, health, "HealthType")
        for key, value, vtype in (("WatchdogState", "NoGpu", V.String), ("GpuTemperatureC", 0.0, V.Double),
                                  ("GpuMemoryUsedBytes", 0, V.UInt64), ("GpuEccErrors", 0, V.UInt64)):
            nodes.values[f"Health/{key}"] = await self.variable(health, "Appliance/Health", key, value, vtype)
        alarms_obj = await root.add_object(self.nid("Appliance/Alarms"), ua.QualifiedName("Alarms", self.ns))
        await self.typed(nodes, alarms_obj, FOLDER)
        for alarm in alarms:
            nodes.alarms[alarm] = await self.variable(alarms_obj, "Appliance/Alarms", alarm, False, V.Boolean)
        if drift:
            drift_alarms = await alarms_obj.add_object(self.nid("Appliance/Alarms/Drift"),
                                                       ua.QualifiedName("Drift", self.ns))
            await self.typed(nodes, drift_alarms, FOLDER)
            for name in drift:
                nodes.alarms[f"Drift/{name}"] = await self.variable(drift_alarms, "Appliance/Alarms/Drift", name,
                                                                    False, V.Boolean)
        for name, (labels, alarm_classes, sources) in classifiers.items():
            for c in alarm_classes:  # BrowseName: the class label; NodeId: unique per model
                nodes.class_alarms[(name, c)] = await alarms_obj.add_variable(
                    self.nid(f"Appliance/Alarms/{name}/{labels[c]}"), ua.QualifiedName(labels[c], self.ns),
                    ua.Variant(False, V.Boolean))
            for source in sources:  # Alarms/<source>/<label>: each source's own debounced state
                path = f"Appliance/AlarmSources/{name}/{source}"
                own = await alarms_obj.add_object(self.nid(path), ua.QualifiedName(source, self.ns))
                await self.typed(nodes, own, FOLDER)
                for c in alarm_classes:
                    nodes.source_alarms[(name, source, c)] = await own.add_variable(
                        self.nid(f"{path}/{labels[c]}"), ua.QualifiedName(labels[c], self.ns),
                        ua.Variant(False, V.Boolean))
        nodes.admin = await root.add_object(self.nid("Appliance/Admin"), ua.QualifiedName("Admin", self.ns))
        await self.typed(nodes, nodes.admin, "AdminType")
        return nodes

    async def add_methods(self, nodes: ApplianceNodes, specs: list[MethodSpec], wrap) -> None:
        """The methods of the feature modules' tables: under their model's object, or Appliance/Admin; wrap(spec)
        is the asyncua callback (the method handlers' wrapper around the spec's body). Each is also what the same
        method of the object's type runs for this object; a method its type does not declare with the same
        arguments is a programming error (the types would not describe the appliance)."""
        for spec in specs:
            if spec.task:
                parent, path = (nodes.tasks[(spec.owner, spec.task)],
                                f"Appliance/Models/{spec.owner}/Tasks/{spec.task}")
            else:
                parent, path = ((nodes.admin, "Appliance/Admin") if spec.owner == ADMIN
                                else (nodes.models[spec.owner].obj, f"Appliance/Models/{spec.owner}"))
            type_name = nodes.type_of[parent.nodeid]
            declared, member = declared_methods(type_name, self.task_types).get(spec.name, ("", None))
            if member is None or list(member.inputs) != list(spec.inputs) or \
                    list(member.outputs) != list(spec.outputs):
                raise ValueError(f"{spec.name} of {type_name} differs from its type's declaration")
            callback = wrap(spec)
            await self._method(parent, f"{path}/{spec.name}", spec.name, own_object_only(parent.nodeid, callback),
                               spec.inputs, spec.outputs)
            self.type_calls.register(self.nid(f"Types/{declared}/{spec.name}"), parent.nodeid, callback)

    async def type_mailboxes(self, nodes: ApplianceNodes, kinds: dict[str, str],
                             tasks: dict[str, tuple[str, str]] | None = None) -> None:
        """The mailboxes (built by mailboxes.py) as instances of their types: kinds is mailbox name -> model kind,
        tasks mailbox name -> (model, task) for a task's mailboxes."""
        if not kinds:
            return
        tasks = tasks or {}
        await self.typed(nodes, self.server.get_node(self.nid("Appliance/Mailboxes")), FOLDER)
        for name, kind in kinds.items():
            path = f"Appliance/Mailboxes/{name}"
            type_name = (task_mailbox_type(*tasks[name]) if name in tasks
                         else "TensorMailboxType" if kind == "tensor" else "GenerativeMailboxType")
            await self.typed(nodes, self.server.get_node(self.nid(path)), type_name)
            if kind == "tensor":
                await set_array(self.server.get_node(self.nid(f"{path}/Output")))

    async def _last(self, parent: Node, path: str, m: ModelNodes, key: str) -> None:
        for name, value, vtype in (("ClassIndex", -1, V.Int32), ("Label", "", V.String),
                                   ("Confidence", 0.0, V.Float), ("Time", None, V.DateTime)):
            m.values[f"{key}/{name}"] = await self.variable(parent, path, name, value, vtype)


async def write(server: Server, node: Node, value, vtype: ua.VariantType) -> None:
    await server.write_attribute_value(node.nodeid, ua.DataValue(ua.Variant(value, vtype)))
