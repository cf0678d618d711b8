"""`appliance nodeset`: the configured appliance's information model (its ObjectTypes and instances) as an OPC UA
NodeSet2 XML file, for TIA Portal client interfaces, CODESYS and TwinCAT information model repositories, UaModeler.

The address space is built by the server's own code (ApplianceUaServer.build_address_space) into an asyncua server
that never listens, from the configuration alone: each model is a DeclaredModel (name, kind, MaxSamples, the shapes
an ONNX file declares, the version that would serve), so no weights are loaded and no worker runs. asyncua's
XmlExporter writes the nodes of the appliance namespace under Types and Objects/Appliance; the Models element, which
asyncua's exporter does not write, is added here:
- Version: the first 12 hex digits of the SHA-256 of the exported nodes (the file without its Models element), so
  two exports of the same configuration, models and appliance carry the same Version, and a changed model, task,
  label or type changes it.
- PublicationDate: when the configuration last changed: the newest modification time of the configuration file and
  of the model files it names (a deployed model's serving version folder), whole seconds, UTC. A content hash gives
  no date; a fixed date would tell an engineering tool that compares dates nothing; the files' times are stable
  across exports and move forward when a model or the configuration is edited or deployed.
- RequiredModel: the oldest standard namespace version that holds every namespace-0 node the file uses: 1.04 when
  they are all in STANDARD_1_04_NODES, dated as the 1.04 revision they were checked against (1.04.9, 2021-01-21:
  importers such as asyncua require a date; every 1.05 is later), else the version asyncua carries.
Values only the running box knows (State, counters, heartbeats, health, alarms, drift, mailbox handshakes, the last
results) are left out, and
so is every value the configuration does not determine (an empty Version, InputShape or Framework): a file never
describes a box that is loading.
"""
from __future__ import annotations

import datetime
import hashlib
import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from asyncua import Server, ua
from asyncua.common.xmlexporter import XmlExporter

from core.config import ApplianceConfig, ModelConfig
from core.model_port import ModelStatus
from core.namespace import NAMESPACE_URI
from core.object_types import OBJECT_TYPES, type_path

from .daemon import offline_ua_server
from .model_store import ModelStore
from .plc_types import PlcTypesError, onnx_shapes

STANDARD_URI = "http://opcfoundation.org/UA/"
HIERARCHICAL = ua.ObjectIds.HierarchicalReferences
VERSION_CHARS = 12
# Namespace-0 nodes in every OPC UA 1.04 standard nodeset (the built-in data types, the reference types, the base
# object, variable and event types, the modelling rules, Argument and its encodings): tests/test_nodeset_metadata.py
# checks each against the 1.04.9 nodeset, and that the exports use no other.
_O = ua.ObjectIds
STANDARD_1_04 = ("1.04", datetime.datetime(2021, 1, 21, tzinfo=datetime.timezone.utc))  # checked: 1.04.9's date
STANDARD_1_04_NODES = frozenset(range(_O.Boolean, _O.DiagnosticInfo + 1)) | frozenset({
    _O.BaseDataType, _O.Number, _O.Integer, _O.UInteger, _O.Enumeration,
    _O.References, _O.NonHierarchicalReferences, _O.HierarchicalReferences, _O.HasChild, _O.Organizes,
    _O.HasEventSource, _O.HasModellingRule, _O.HasEncoding, _O.HasDescription, _O.HasTypeDefinition,
    _O.GeneratesEvent, _O.Aggregates, _O.HasSubtype, _O.HasProperty, _O.HasComponent, _O.HasNotifier,
    _O.HasOrderedComponent, _O.BaseObjectType, _O.FolderType, _O.BaseVariableType, _O.BaseDataVariableType,
    _O.PropertyType, _O.ModellingRule_Mandatory, _O.ModellingRule_Optional, _O.ObjectsFolder, _O.Server,
    _O.BaseEventType, _O.Argument, _O.Argument_Encoding_DefaultXml, _O.Argument_Encoding_DefaultBinary,
    _O.DefaultBinary, _O.DefaultXml, _O.Duration, _O.UtcTime, _O.LocaleId, _O.EnumValueType})
# The variables whose values only a running box has: left out of the file (their nodes, types and data types stay).
RUNTIME_VALUES = re.compile(r"Appliance/(State|Heartbeat|Engine/(QueueDepth|SlotsTotal|SlotsInUse)|Health/.+|"
                            r"Alarms/.+|AlarmSources/.+|Mailboxes/.+|Models/[^/]+/(State|Backend|RequestCount|"
                            r"ErrorCount|LastLatencyMs|Heartbeat|WorkerRestarts|QueueDepth|FailureReason|Last/.+|"
                            r"Drift/.+))$")


class DeclaredModel:
    """A configured model as the address space sees it before loading: never Ready and never called."""

    def __init__(self, model: ModelConfig, state_dir: Path):
        self.name, self.kind, self.model = model.name, model.kind, model
        self.version = served_version(model, state_dir)
        self.input_shape: tuple[int, ...] = ()
        self.output_shape: tuple[int, ...] = ()
        path = model.resolved_path
        if model.is_tensor and path is not None and path.suffix == ".onnx" and path.is_file():
            try:
                inputs, outputs = onnx_shapes(path)
                self.input_shape, self.output_shape = tuple(inputs), tuple(outputs)
            except PlcTypesError:
                pass  # no fixed shape per sample: InputShape stays empty, as while a model loads

    @property
    def state(self) -> str:
        return "Loading"

    @property
    def max_floats(self) -> int:
        return self.model.max_samples * math.prod(self.input_shape) if self.input_shape else 0

    def status(self) -> ModelStatus:
        return ModelStatus(name=self.name, kind=self.kind, state="Loading", version=self.version,
                           backend="", request_count=0, error_count=0, last_latency_ms=0.0, heartbeat=0,
                           worker_restarts=0, worker_up=False, restarting=False, failure_reason="", queue_depth=0,
                           input_shape=self.input_shape, output_shape=self.output_shape,
                           max_samples=self.model.max_samples if self.model.is_tensor else 0)

    async def reload(self) -> str:
        raise RuntimeError("a declared model is never loaded")


def served_version(model: ModelConfig, state_dir: Path) -> str:
    """The version the address space shows once the model serves, as the worker names it (appliance.model_specs,
    the tensor service): the YAML's `version`, else the deployed version that serves, else for a tensor model the
    first 12 hex digits of its file's content digest; "" (left out of the file) for a generative model's weights,
    whose version its loader derives from the files it loads."""
    if model.version:
        return model.version
    store = ModelStore(state_dir)
    if store.deployed(model.name):
        return store.serving_version(model.name) or ""
    path = model.resolved_path
    if model.is_tensor and path is not None and path.is_file():
        from loader.file_digest import content_digest
        return content_digest(path)[:VERSION_CHARS]
    return ""


def last_changed(config: ApplianceConfig) -> datetime.datetime:
    """The newest modification time of the configuration file and the model files it names (a deployed model's
    serving version), in whole seconds."""
    store = ModelStore(config.server.state_dir)
    paths = [Path(config.source)]
    for name, m in config.models.items():
        paths.append(store.model_dir(name) / "current" if store.deployed(name) else m.resolved_path)
        paths += [v.resolved_path for v in m.variants.values()]  # A/B arms
    times = []
    for path in paths:
        if path is None or not path.exists():
            continue
        files = [p for p in path.resolve().rglob("*") if p.is_file()] if path.is_dir() else [path]
        times += [p.stat().st_mtime for p in files] + [path.stat().st_mtime]
    newest = int(max(times)) if times else 0
    return datetime.datetime.fromtimestamp(newest, datetime.timezone.utc)


async def export_nodeset(config: ApplianceConfig, out: Path) -> int:
    """Write the NodeSet2 file; returns the number of nodes written."""
    services = {name: DeclaredModel(m, config.server.state_dir) for name, m in config.models.items()}
    appliance = offline_ua_server(config, services)  # the server's own address space (see the docstring)
    for name in services:
        appliance.ai.weights_facts(name)
    server = Server()
    await server.init()
    await appliance.build_address_space(server)
    for name, declared in services.items():  # what the configuration determines, as the running box shows it
        await describe_declared(server, appliance.ns, name, declared)
    nodes = await appliance_nodes(server, appliance.ns, list(appliance.nodes.types.values()))
    exporter = XmlExporter(server, export_values=True)
    await exporter.build_etree(nodes)
    root = exporter.etree.getroot()
    drop_dangling_references(root)
    xml_encoding_ids(root)
    drop_runtime_values(root)
    content = ET.tostring(root)  # the nodes as exported: what the Version names
    root.insert(1, await models_element(server, hashlib.sha256(content).hexdigest()[:VERSION_CHARS],
                                        last_changed(config), standard_nodes_used(root)))
    ET.indent(exporter.etree, space="  ")
    out.parent.mkdir(parents=True, exist_ok=True)
    exporter.etree.write(out, encoding="utf-8", xml_declaration=True)
    return len(nodes)


async def describe_declared(server: Server, ns: int, name: str, declared: DeclaredModel) -> None:
    """Version and (tensor models) InputShape and OutputShape, written as the running box's publisher writes them
    (uaserver/publishing.py); what stays empty is left out of the file."""
    values = [("Version", ua.Variant(declared.version, ua.VariantType.String))]
    if declared.model.is_tensor:
        values += [(key, ua.Variant([int(d) for d in shape], ua.VariantType.UInt32))
                   for key, shape in (("InputShape", declared.input_shape), ("OutputShape", declared.output_shape))]
    for key, value in values:
        await server.get_node(ua.NodeId(f"Appliance/Models/{name}/{key}", ns)).write_value(value)


async def appliance_nodes(server: Server, ns: int, type_ids: list | None = None) -> list:
    """The appliance namespace's types and Objects/Appliance, with everything below them in that namespace
    (following hierarchical references down: components, properties, method arguments); the Part 9 condition
    instances on the Server object are runtime state and stay out. type_ids: every ObjectType built (the
    configuration's task types with the fixed ones); default: the fixed ones."""
    if type_ids is None:
        type_ids = [ua.NodeId(type_path(t.name), ns) for t in OBJECT_TYPES]
    roots = [server.get_node(type_id) for type_id in type_ids]
    roots += [ref for ref in await server.get_node(ua.ObjectIds.BaseEventType).get_children(
        refs=ua.ObjectIds.HasSubtype) if ref.nodeid.NamespaceIndex == ns]  # JobResultReadyEventType
    roots.append(server.get_node(ua.NodeId("Appliance", ns)))
    seen, order = set(), []
    queue = list(roots)
    while queue:
        node = queue.pop(0)
        if node.nodeid in seen:
            continue
        seen.add(node.nodeid)
        order.append(node)
        for child in await node.get_children(refs=HIERARCHICAL):
            if child.nodeid.NamespaceIndex == ns and child.nodeid not in seen and \
                    await child.read_node_class() != ua.NodeClass.ObjectType:  # subtypes are roots of their own
                queue.append(child)
    return order


def drop_dangling_references(root: ET.Element) -> None:
    """References from exported nodes to nodes of the appliance namespace that are not exported (the condition
    instances) would not resolve in an importer: leave them out. (asyncua's exporter writes unqualified element
    names under a default xmlns attribute.)"""
    exported = {el.attrib["NodeId"] for el in root if "NodeId" in el.attrib}
    for node_el in root:
        refs = node_el.find("References")
        if refs is None:
            continue
        for ref in list(refs):
            target = (ref.text or "").strip()
            if target.startswith("ns=") and target not in exported:
                refs.remove(ref)


def xml_encoding_ids(root: ET.Element) -> None:
    """An ExtensionObject's TypeId in XML is its type's DefaultXml encoding (Part 6, 5.3.1.16), as the standard
    nodesets write it; asyncua's exporter writes the DataType's NodeId (node-opcua then drops the arguments)."""
    for type_id in root.iter("uax:TypeId"):
        ident = type_id.find("uax:Identifier")
        if ident is not None and ident.text == f"i={ua.ObjectIds.Argument}":
            ident.text = f"i={ua.ObjectIds.Argument_Encoding_DefaultXml}"


def drop_runtime_values(root: ET.Element) -> None:
    """Leave out the values only a running box has (RUNTIME_VALUES) and the ones the configuration leaves empty (a
    String or an array with nothing in it): a Value element is optional in NodeSet2. (The file has one namespace of
    its own: every string NodeId is the appliance's.)"""
    for node_el in root:
        value = node_el.find("Value")
        found = re.fullmatch(r"ns=\d+;s=(.+)", node_el.attrib.get("NodeId", ""))
        if value is None or found is None:
            continue
        path = found.group(1)
        content = value[0] if len(value) else None
        empty = content is None or (not (content.text or "").strip() and len(content) == 0)
        if RUNTIME_VALUES.match(path) or empty:
            node_el.remove(value)


def standard_nodes_used(root: ET.Element) -> set[int]:
    """The numeric namespace-0 NodeIds the file names anywhere: aliases, attributes, references, values."""
    used = set()
    for el in root.iter():
        for text in [el.text or "", *el.attrib.values()]:
            used.update(int(n) for n in re.findall(r"(?<![\w;=])i=(\d+)", text))
    return used


async def models_element(server: Server, version: str, published: datetime.datetime,
                         standard_used: set[int]) -> ET.Element:
    """<Models><Model ModelUri=... Version=... PublicationDate=...><RequiredModel (the standard namespace)/>."""
    models = ET.Element("Models")
    model = ET.SubElement(models, "Model", ModelUri=NAMESPACE_URI, Version=version,
                          PublicationDate=xml_date(published))
    if standard_used <= STANDARD_1_04_NODES:
        ET.SubElement(model, "RequiredModel", ModelUri=STANDARD_URI, Version=STANDARD_1_04[0],
                      PublicationDate=xml_date(STANDARD_1_04[1]))
    else:  # a node newer than 1.04 (or not yet checked against it): the standard version asyncua carries
        std_version = await server.get_node(ua.ObjectIds.OPCUANamespaceMetadata_NamespaceVersion).read_value()
        std_date = await server.get_node(ua.ObjectIds.OPCUANamespaceMetadata_NamespacePublicationDate).read_value()
        ET.SubElement(model, "RequiredModel", ModelUri=STANDARD_URI, Version=std_version,
                      PublicationDate=xml_date(std_date))
    return models


def xml_date(when: datetime.datetime) -> str:
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return when.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
