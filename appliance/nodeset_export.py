"""`appliance nodeset`: the configured appliance's information model (its ObjectTypes and instances) as an OPC UA
NodeSet2 XML file, for TIA Portal client interfaces, CODESYS and TwinCAT information model repositories, UaModeler.

The address space is built by the server's own code (ApplianceUaServer.build_address_space) into an asyncua server
that never listens, from the configuration alone: each model is a DeclaredModel (name, kind, MaxSamples, the shapes
an ONNX file declares), so no weights are loaded and no worker runs. asyncua's XmlExporter writes the nodes of the
appliance namespace under Types and Objects/Appliance; the Models element (this model's URI, version, publication
date, and the standard namespace as RequiredModel) is added here, which asyncua's exporter does not write.
"""
from __future__ import annotations

import datetime
import math
import xml.etree.ElementTree as ET
from pathlib import Path

from asyncua import Server, ua
from asyncua.common.xmlexporter import XmlExporter

from uaserver.object_types import OBJECT_TYPES, type_path
from uaserver.server import ApplianceUaServer

from . import NAMESPACE_URI, __version__
from .alarm_names import DAEMON_ALARMS
from .config import ApplianceConfig, ModelConfig
from .model_port import ModelStatus
from .plc_types import PlcTypesError, onnx_shapes

STANDARD_URI = "http://opcfoundation.org/UA/"
HIERARCHICAL = ua.ObjectIds.HierarchicalReferences


class DeclaredModel:
    """A configured model as the address space sees it before loading: never Ready and never called."""

    def __init__(self, model: ModelConfig):
        self.name, self.kind, self.model = model.name, model.kind, model
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
        return ModelStatus(name=self.name, kind=self.kind, state="Loading", version=self.model.version or "",
                           backend="", request_count=0, error_count=0, last_latency_ms=0.0, heartbeat=0,
                           worker_restarts=0, worker_up=False, restarting=False, failure_reason="", queue_depth=0,
                           input_shape=self.input_shape, output_shape=self.output_shape,
                           max_samples=self.model.max_samples if self.model.is_tensor else 0)

    async def reload(self) -> str:
        raise RuntimeError("a declared model is never loaded")


async def export_nodeset(config: ApplianceConfig, out: Path, published: datetime.datetime | None = None) -> int:
    """Write the NodeSet2 file; returns the number of nodes written."""
    services = {name: DeclaredModel(m) for name, m in config.models.items()}
    appliance = ApplianceUaServer(config, pki=None, trust_list=None, user_store=None, services=services,
                                  device=config.engine.device,
                                  alarms=lambda: dict.fromkeys(DAEMON_ALARMS, False))
    for name in services:
        appliance.ai.weights_facts(name)
    server = Server()
    await server.init()
    await appliance.build_address_space(server)
    nodes = await appliance_nodes(server, appliance.ns, list(appliance.nodes.types.values()))
    exporter = XmlExporter(server, export_values=True)
    await exporter.build_etree(nodes)
    root = exporter.etree.getroot()
    drop_dangling_references(root)
    xml_encoding_ids(root)
    root.insert(1, await models_element(server, published))
    ET.indent(exporter.etree, space="  ")
    out.parent.mkdir(parents=True, exist_ok=True)
    exporter.etree.write(out, encoding="utf-8", xml_declaration=True)
    return len(nodes)


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


async def models_element(server: Server, published: datetime.datetime | None) -> ET.Element:
    """<Models><Model ModelUri=... Version=... PublicationDate=...><RequiredModel (the standard namespace)/>."""
    when = published or datetime.datetime.now(datetime.timezone.utc)
    std_version = await server.get_node(ua.ObjectIds.OPCUANamespaceMetadata_NamespaceVersion).read_value()
    std_date = await server.get_node(ua.ObjectIds.OPCUANamespaceMetadata_NamespacePublicationDate).read_value()
    models = ET.Element("Models")
    model = ET.SubElement(models, "Model", ModelUri=NAMESPACE_URI, Version=__version__,
                          PublicationDate=xml_date(when))
    ET.SubElement(model, "RequiredModel", ModelUri=STANDARD_URI, Version=std_version,
                  PublicationDate=xml_date(std_date))
    return models


def xml_date(when: datetime.datetime) -> str:
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return when.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
