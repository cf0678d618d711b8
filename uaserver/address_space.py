"""Builds the contract's address space under Objects/Appliance and keeps its values at most one second old.

NodeIds are strings in the appliance namespace, e.g. `Appliance/Models/te-classifier/Infer`, so that a PLC
programmer can configure them by hand; clients still look the namespace index up in the NamespaceArray.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from asyncua import Node, Server, ua

V = ua.VariantType


def argument(name: str, vtype: ua.VariantType, array: bool = False, description: str = "") -> ua.Argument:
    arg = ua.Argument()
    arg.Name = name
    arg.DataType = ua.NodeId(vtype.value)
    if array:  # asyncua needs ValueRank and ArrayDimensions spelled out for arrays
        arg.ValueRank = 1
        arg.ArrayDimensions = [0]
    else:
        arg.ValueRank = -1
        arg.ArrayDimensions = []
    arg.Description = ua.LocalizedText(description)
    return arg


INFER_IN = [argument("Input", V.Float, True, "k samples back to back, 1 <= k <= MaxSamples")]
INFER_OUT = [argument("Output", V.Float, True, "k results back to back"),
             argument("ModelVersion", V.String, description="version of the weights that computed Output")]
GENERATE_IN = [argument("Prompt", V.String, description="non-empty UTF-8, at most 16 KiB"),
               argument("MaxTokens", V.UInt32, description="1 .. engine.max_new_tokens"),
               argument("Temperature", V.Float, description="0 (greedy) .. 2")]
GENERATE_OUT = [argument("Text", V.String), argument("TokenCount", V.UInt32), argument("FinishReason", V.String),
                argument("ContextTokens", V.UInt32), argument("ContextLost", V.Boolean),
                argument("ModelVersion", V.String)]
CLASSIFY_OUT = [argument("ClassIndex", V.Int32, True, "arg-max class per sample"),
                argument("Label", V.String, True, "its label"),
                argument("Confidence", V.Float, True, "its probability"),
                argument("ModelVersion", V.String, description="version of the weights that computed the result")]
JOB_ID = argument("JobId", V.UInt32, description="a job of the calling identity (certificate + user)")
WAIT_MS = argument("WaitMs", V.UInt32, description="wait at most this long for the result (0: answer at once)")
DONE = argument("Done", V.Boolean, description="false: the job still runs (Text holds what is there so far)")
CONVERSATION_ID = argument("ConversationId", V.String, description="1-64 printable ASCII; yours alone")
START_INFER_OUT = [JOB_ID]
GET_INFER_RESULT_OUT = [DONE, *INFER_OUT]
START_GENERATE_IN = [argument("ConversationId", V.String,
                              description="empty: the calling session's conversation"), *GENERATE_IN]
GET_RESULT_IN = [JOB_ID, WAIT_MS]
GET_GENERATE_RESULT_OUT = [DONE, *GENERATE_OUT]
CONVERSE_IN = [CONVERSATION_ID, *GENERATE_IN]
# (method, inputs, outputs) a model offers besides Infer / Generate, by kind
JOB_METHODS = {
    "tensor": [("StartInfer", INFER_IN, START_INFER_OUT), ("GetInferResult", GET_RESULT_IN, GET_INFER_RESULT_OUT)],
    "generative": [("Converse", CONVERSE_IN, GENERATE_OUT), ("EndConversation", [CONVERSATION_ID], []),
                   ("StartGenerate", START_GENERATE_IN, START_INFER_OUT),
                   ("GetGenerateResult", GET_RESULT_IN, GET_GENERATE_RESULT_OUT)],
}
COMMON_JOB_METHODS = [("CancelJob", [JOB_ID], []), ("ReleaseJob", [JOB_ID], [])]
RELOAD_IN = [argument("Name", V.String, description="the model's name")]
RELOAD_OUT = [argument("Version", V.String)]
PROMOTE_IN = [argument("Model", V.String, description="the model's name"),
              argument("Variant", V.String, description="one of the model's YAML variants, 'main' for its own path, "
                       "or empty to restore the configured split")]


@dataclass
class ModelNodes:
    obj: Node
    values: dict[str, Node] = field(default_factory=dict)


@dataclass
class ApplianceNodes:
    root: Node
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

    async def build(self, device: str, models: dict, callbacks: dict, alarms: tuple[str, ...] = (),
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
                await obj.add_method(self.nid(f"{path}/Infer"), ua.QualifiedName("Infer", self.ns),
                                     callbacks[(name, "Infer")], INFER_IN, INFER_OUT)
                if name in drift:
                    obj_drift = await obj.add_object(self.nid(f"{path}/Drift"), ua.QualifiedName("Drift", self.ns))
                    for key, value, vtype in (("State", "NoReference", V.String), ("Score", 0.0, V.Double),
                                              ("Feature", "", V.String), ("Since", None, V.DateTime)):
                        m.values[f"Drift/{key}"] = await self.variable(obj_drift, f"{path}/Drift", key, value, vtype)
                if name in classifiers:
                    await obj.add_method(self.nid(f"{path}/Classify"), ua.QualifiedName("Classify", self.ns),
                                         callbacks[(name, "Classify")], INFER_IN, CLASSIFY_OUT)
                    last = await obj.add_object(self.nid(f"{path}/Last"), ua.QualifiedName("Last", self.ns))
                    await self._last(last, f"{path}/Last", m, "Last")
                    for source in classifiers[name][2]:  # Last/<source>: the latest result of each source
                        own = await last.add_object(self.nid(f"{path}/Last/{source}"),
                                                    ua.QualifiedName(source, self.ns))
                        await self._last(own, f"{path}/Last/{source}", m, f"Last/{source}")
            else:
                await obj.add_method(self.nid(f"{path}/Generate"), ua.QualifiedName("Generate", self.ns),
                                     callbacks[(name, "Generate")], GENERATE_IN, GENERATE_OUT)
                await obj.add_method(self.nid(f"{path}/ResetContext"), ua.QualifiedName("ResetContext", self.ns),
                                     callbacks[(name, "ResetContext")], [], [])
            for method, inputs, outputs in JOB_METHODS[st.kind] + COMMON_JOB_METHODS:
                await obj.add_method(self.nid(f"{path}/{method}"), ua.QualifiedName(method, self.ns),
                                     callbacks[(name, method)], inputs, outputs)
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
        admin = await root.add_object(self.nid("Appliance/Admin"), ua.QualifiedName("Admin", self.ns))
        await admin.add_method(self.nid("Appliance/Admin/ReloadModel"), ua.QualifiedName("ReloadModel", self.ns),
                               callbacks[("", "ReloadModel")], RELOAD_IN, RELOAD_OUT)
        await admin.add_method(self.nid("Appliance/Admin/PromoteVariant"), ua.QualifiedName("PromoteVariant", self.ns),
                               callbacks[("", "PromoteVariant")], PROMOTE_IN, [])
        return nodes

    async def _last(self, parent: Node, path: str, m: ModelNodes, key: str) -> None:
        for name, value, vtype in (("ClassIndex", -1, V.Int32), ("Label", "", V.String),
                                   ("Confidence", 0.0, V.Float), ("Time", None, V.DateTime)):
            m.values[f"{key}/{name}"] = await self.variable(parent, path, name, value, vtype)


async def write(server: Server, node: Node, value, vtype: ua.VariantType) -> None:
    await server.write_attribute_value(node.nodeid, ua.DataValue(ua.Variant(value, vtype)))
