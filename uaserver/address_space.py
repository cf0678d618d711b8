"""Builds the contract's address space under Objects/Appliance and keeps its values at most one second old.

NodeIds are strings in the appliance namespace, e.g. `Appliance/Models/te-classifier/Infer`, so that a PLC
programmer can configure them by hand; clients still look the namespace index up in the NamespaceArray.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from asyncua import Node, Server, ua

from .method_table import ADMIN, MethodSpec

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
    alarms: dict[str, Node] = field(default_factory=dict)  # Alarms/<name> Booleans
    class_alarms: dict[tuple[str, int], Node] = field(default_factory=dict)  # (model, class) -> Alarms/<label>
    # (model, source, class) -> Alarms/<source>/<label>
    source_alarms: dict[tuple[str, str, int], Node] = field(default_factory=dict)


class AddressSpaceBuilder:
    def __init__(self, server: Server, ns: int):
        self.server = server
        self.ns = ns

    def nid(self, path: str) -> ua.NodeId:
        return ua.NodeId(path, self.ns)

    async def variable(self, parent: Node, path: str, name: str, value, vtype: ua.VariantType) -> Node:
        node = await parent.add_variable(self.nid(f"{path}/{name}"), ua.QualifiedName(name, self.ns),
                                         ua.Variant(value, vtype))
        return node  # read-only: asyncua variables are not writable unless set_writable() is called

    async def build(self, device: str, models: dict, alarms: tuple[str, ...] = (),
                    classifiers: dict | None = None, drift: tuple[str, ...] = ()) -> ApplianceNodes:
        """classifiers: model name -> (labels, alarm class indices, sources) for tensor models with labels; drift:
        the models with drift detection."""
        classifiers = classifiers or {}
        objects = self.server.nodes.objects
        root = await objects.add_object(self.nid("Appliance"), ua.QualifiedName("Appliance", self.ns))
        nodes = ApplianceNodes(root)
        nodes.values["State"] = await self.variable(root, "Appliance", "State", "Starting", V.String)
        nodes.values["Device"] = await self.variable(root, "Appliance", "Device", device, V.String)
        nodes.values["Heartbeat"] = await self.variable(root, "Appliance", "Heartbeat", 0, V.UInt32)

        models_obj = await root.add_object(self.nid("Appliance/Models"), ua.QualifiedName("Models", self.ns))
        for name, model in models.items():
            st = model.status()
            path = f"Appliance/Models/{name}"
            obj = await models_obj.add_object(self.nid(path), ua.QualifiedName(name, self.ns))
            m = ModelNodes(obj)
            for key, value, vtype in (("Kind", st.kind, V.String), ("Version", "", V.String),
                                      ("Backend", "", V.String), ("State", "Loading", V.String),
                                      ("RequestCount", 0, V.UInt64), ("ErrorCount", 0, V.UInt64),
                                      ("LastLatencyMs", 0.0, V.Double), ("Heartbeat", 0, V.UInt32),
                                      ("WorkerRestarts", 0, V.UInt32)):
                m.values[key] = await self.variable(obj, path, key, value, vtype)
            if st.kind == "tensor":
                m.values["InputShape"] = await self.variable(obj, path, "InputShape", [], V.UInt32)
                m.values["OutputShape"] = await self.variable(obj, path, "OutputShape", [], V.UInt32)
                m.values["MaxSamples"] = await self.variable(obj, path, "MaxSamples", int(st.max_samples), V.UInt32)
                if name in drift:
                    obj_drift = await obj.add_object(self.nid(f"{path}/Drift"), ua.QualifiedName("Drift", self.ns))
                    for key, value, vtype in (("State", "NoReference", V.String), ("Score", 0.0, V.Double),
                                              ("Feature", "", V.String), ("Since", None, V.DateTime)):
                        m.values[f"Drift/{key}"] = await self.variable(obj_drift, f"{path}/Drift", key, value, vtype)
                if name in classifiers:
                    last = await obj.add_object(self.nid(f"{path}/Last"), ua.QualifiedName("Last", self.ns))
                    await self._last(last, f"{path}/Last", m, "Last")
                    for source in classifiers[name][2]:  # Last/<source>: the latest result of each source
                        own = await last.add_object(self.nid(f"{path}/Last/{source}"),
                                                    ua.QualifiedName(source, self.ns))
                        await self._last(own, f"{path}/Last/{source}", m, f"Last/{source}")
            nodes.models[name] = m

        engine = await root.add_object(self.nid("Appliance/Engine"), ua.QualifiedName("Engine", self.ns))
        for key in ("QueueDepth", "SlotsTotal", "SlotsInUse"):
            nodes.values[f"Engine/{key}"] = await self.variable(engine, "Appliance/Engine", key, 0, V.UInt32)
        health = await root.add_object(self.nid("Appliance/Health"), ua.QualifiedName("Health", self.ns))
        for key, value, vtype in (("WatchdogState", "NoGpu", V.String), ("GpuTemperatureC", 0.0, V.Double),
                                  ("GpuMemoryUsedBytes", 0, V.UInt64), ("GpuEccErrors", 0, V.UInt64)):
            nodes.values[f"Health/{key}"] = await self.variable(health, "Appliance/Health", key, value, vtype)
        alarms_obj = await root.add_object(self.nid("Appliance/Alarms"), ua.QualifiedName("Alarms", self.ns))
        for alarm in alarms:
            nodes.alarms[alarm] = await self.variable(alarms_obj, "Appliance/Alarms", alarm, False, V.Boolean)
        if drift:
            drift_alarms = await alarms_obj.add_object(self.nid("Appliance/Alarms/Drift"),
                                                       ua.QualifiedName("Drift", self.ns))
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
                for c in alarm_classes:
                    nodes.source_alarms[(name, source, c)] = await own.add_variable(
                        self.nid(f"{path}/{labels[c]}"), ua.QualifiedName(labels[c], self.ns),
                        ua.Variant(False, V.Boolean))
        nodes.admin = await root.add_object(self.nid("Appliance/Admin"), ua.QualifiedName("Admin", self.ns))
        return nodes

    async def add_methods(self, nodes: ApplianceNodes, specs: list[MethodSpec], wrap) -> None:
        """The methods of the feature modules' tables: under their model's object, or Appliance/Admin; wrap(spec)
        is the asyncua callback (the method handlers' wrapper around the spec's body)."""
        for spec in specs:
            parent, path = ((nodes.admin, "Appliance/Admin") if spec.owner == ADMIN
                            else (nodes.models[spec.owner].obj, f"Appliance/Models/{spec.owner}"))
            await parent.add_method(self.nid(f"{path}/{spec.name}"), ua.QualifiedName(spec.name, self.ns),
                                    wrap(spec), spec.inputs, spec.outputs)

    async def _last(self, parent: Node, path: str, m: ModelNodes, key: str) -> None:
        for name, value, vtype in (("ClassIndex", -1, V.Int32), ("Label", "", V.String),
                                   ("Confidence", 0.0, V.Float), ("Time", None, V.DateTime)):
            m.values[f"{key}/{name}"] = await self.variable(parent, path, name, value, vtype)


async def write(server: Server, node: Node, value, vtype: ua.VariantType) -> None:
    await server.write_attribute_value(node.nodeid, ua.DataValue(ua.Variant(value, vtype)))
