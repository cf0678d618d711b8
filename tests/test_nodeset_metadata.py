"""What the NodeSet2 file says about itself, as an engineering tool reads it (`appliance nodeset`, the real CLI):
its Model Version and PublicationDate are those of the configuration's content (the same for two exports, changed by
a model or a task), its RequiredModel names OPC UA 1.04 and every namespace-0 node it uses is in the 1.04.9 standard
nodeset (node-opcua-nodesets 2.41.1, installed under tests/node as node-opcua-nodesets-1.04), and its instance
values describe the configured models (Version, InputShape) or are left out: never a box that is loading."""
from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from appliance.model_store import ModelStore
from appliance.nodeset_export import STANDARD_1_04_NODES
from loader.file_digest import content_digest
from onnx_models import affine_model

ROOT = Path(__file__).resolve().parent
NODE_DIR = ROOT / "node"
STANDARD_1_04 = NODE_DIR / "node_modules" / "node-opcua-nodesets-1.04" / "nodesets" / "Opc.Ua.NodeSet2.xml"
UA = {"u": "http://opcfoundation.org/UA/2011/03/UANodeSet.xsd"}


@pytest.fixture
def plant(tmp_path):
    """A configuration with an ONNX classifier (a fixed sample of 4 floats) and the builtin TE classifier."""
    affine_model(tmp_path / "line.onnx")
    doc = {"server": {"state_dir": str(tmp_path / "state")},
           "models": {"line": {"kind": "tensor", "path": str(tmp_path / "line.onnx"), "labels": ["a", "b", "c", "d"]},
                      "te": {"kind": "tensor", "path": "builtin:te-classifier", "version": "te-2026.1"}}}
    config = tmp_path / "appliance.yaml"
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    return tmp_path, config, doc


def export(config: Path, out: Path) -> ET.Element:
    proc = subprocess.run([sys.executable, "-m", "appliance", "nodeset", "--config", str(config), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return ET.parse(out).getroot()


def model_entry(root: ET.Element) -> ET.Element:
    return root.find("u:Models/u:Model", UA)


def value_of(root: ET.Element, path: str):
    """The exported value of Appliance/<path> (its text, or the list of its items' texts), None when left out."""
    node = next(n for n in root if re.fullmatch(rf"ns=\d+;s=Appliance/{re.escape(path)}", n.get("NodeId", "")))
    value = node.find("u:Value", UA)
    if value is None:
        return None
    content = value[0]
    return [item.text for item in content] if len(content) else content.text


def test_version_and_publication_date_follow_the_configurations_content(plant):
    folder, config, doc = plant
    first, again = export(config, folder / "1.xml"), export(config, folder / "2.xml")
    model = model_entry(first)
    assert re.fullmatch(r"[0-9a-f]{12}", model.get("Version")), model.attrib
    assert (folder / "1.xml").read_bytes() == (folder / "2.xml").read_bytes()  # the same file: nothing moved
    published = datetime.datetime.fromisoformat(model.get("PublicationDate").replace("Z", "+00:00"))
    newest = max(p.stat().st_mtime for p in (config, folder / "line.onnx"))
    assert published.timestamp() == int(newest)  # when the configuration or a model last changed
    assert model_entry(again).attrib == model.attrib

    time.sleep(1.1)  # a later second: the new model file's time
    affine_model(folder / "line.onnx", scale=3.0)  # a retrained model
    retrained = model_entry(export(config, folder / "3.xml"))
    assert retrained.get("Version") != model.get("Version")
    assert retrained.get("PublicationDate") > model.get("PublicationDate")

    time.sleep(1.1)
    doc["models"]["line"].update(alarm_classes=["d"], max_samples=16)  # its task changed in the YAML: an alarm
    # class (an Alarms/d node and its condition), a smaller MaxSamples
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    relabelled = model_entry(export(config, folder / "4.xml"))
    assert relabelled.get("Version") not in (model.get("Version"), retrained.get("Version"))
    assert relabelled.get("PublicationDate") > retrained.get("PublicationDate")


def test_the_required_model_is_opc_ua_1_04_and_every_standard_node_used_is_in_it(plant):
    folder, config, _ = plant
    root = export(config, folder / "n.xml")
    required = model_entry(root).find("u:RequiredModel", UA)
    assert required.attrib == {"ModelUri": "http://opcfoundation.org/UA/", "Version": "1.04",
                               "PublicationDate": "2021-01-21T00:00:00Z"}, required.attrib
    assert STANDARD_1_04.exists(), "run `npm ci` in tests/node (node-opcua-nodesets-1.04: the 1.04.9 nodeset)"
    standard = STANDARD_1_04.read_text(encoding="utf-8")
    assert 'Version="1.04.9" PublicationDate="2021-01-21T00:00:00Z"' in standard
    in_1_04 = {int(n) for n in re.findall(r'<UA\w+ NodeId="i=(\d+)"', standard)}
    text = (folder / "n.xml").read_text(encoding="utf-8")
    used = {int(n) for n in re.findall(r"(?<![\w;=])i=(\d+)", text)}
    assert used and used <= in_1_04, f"namespace-0 nodes newer than 1.04: {sorted(used - in_1_04)}"
    assert STANDARD_1_04_NODES <= in_1_04, sorted(STANDARD_1_04_NODES - in_1_04)  # the exporter's own list
    node = subprocess.run(["node", str(NODE_DIR / "nodeset.js"), "load", str(folder / "n.xml"), str(STANDARD_1_04)],
                          capture_output=True, text=True, timeout=180)
    lines = [line for line in node.stdout.splitlines() if line.startswith("{")]
    assert node.returncode == 0 and lines, (node.stdout[-2000:], node.stderr[-2000:])
    loaded = {n["nodeId"] for n in json.loads(lines[-1])["nodes"]}
    assert "s=Appliance/Models/line/Classify" in loaded  # node-opcua built it on the 1.04 standard nodeset


def test_instance_values_describe_the_configured_models_or_are_left_out(plant):
    folder, config, _ = plant
    root = export(config, folder / "v.xml")
    assert "Loading" not in (folder / "v.xml").read_text()
    assert value_of(root, "Models/line/Version") == content_digest(folder / "line.onnx")[:12]  # what it will serve
    assert value_of(root, "Models/te/Version") == "te-2026.1"  # the YAML's label
    assert value_of(root, "Models/line/InputShape") == ["4"] and value_of(root, "Models/line/MaxSamples")
    for runtime in ("State", "Heartbeat", "Models/line/State", "Models/line/RequestCount", "Models/line/Backend",
                    "Models/line/Last/Label", "Alarms/EngineFault"):
        assert value_of(root, runtime) is None, runtime


def test_a_deployed_models_version_is_the_deployed_one(tmp_path):
    affine_model(tmp_path / "v7.onnx", scale=7.0)
    state = tmp_path / "state"
    version = ModelStore(state).deploy("line", tmp_path / "v7.onnx")
    affine_model(tmp_path / "line.onnx")
    doc = {"server": {"state_dir": str(state)},
           "models": {"line": {"kind": "tensor", "path": str(tmp_path / "line.onnx")}}}
    (tmp_path / "appliance.yaml").write_text(yaml.safe_dump(doc))
    root = export(tmp_path / "appliance.yaml", tmp_path / "d.xml")
    assert value_of(root, "Models/line/Version") == version
