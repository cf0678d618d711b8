"""The information model over a real server and real clients (SignAndEncrypt): every object an instance of its
ObjectType, every model method called by the instance's and by the type's method NodeId with the same outcome, the
BadMethodInvalid cases, the NodeSet2 export (`appliance nodeset`, the real CLI) validated against the UANodeSet
schema, loaded into asyncua and into node-opcua and compared with the running appliance, and a node-opcua client
that, given only the file and the endpoint, finds the models by type and calls them through the type's methods."""
from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from asyncua import Server, ua

from appliance.cli import main as cli_main
from appliance.plc_types import write_plc_types
from harness import RunningAppliance
from models.te_classifier import load_te_test_windows
from uaclient import floats, run, session, status_name

pytest.importorskip("transformers")
from tiny_llm import make_model_dir  # noqa: E402

URI = "urn:opcua-inference-appliance"
V = ua.VariantType
ROOT = Path(__file__).resolve().parent
NODE_DIR = ROOT / "node"
XSD = NODE_DIR / "node_modules" / "node-opcua-nodesets" / "nodesets" / "UANodeSet.xsd"
MODEL_TYPES = {"te": "ClassifierType", "raw": "TensorModelType", "chat": "GenerativeModelType"}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    d = tmp_path_factory.mktemp("infomodel")
    chat = d / "chat"
    make_model_dir(chat, seed=1)
    models = {"te": {"kind": "tensor", "path": "builtin:te-classifier", "labels": "labels.txt"},
              "raw": {"kind": "tensor", "path": "builtin:te-classifier"},
              "chat": {"kind": "generative", "path": str(chat), "max_text_chars": 200}}
    a = RunningAppliance(d / "state", models, {
        "engine": {"kv_slots": 2, "max_seq_len": 256, "max_new_tokens": 16, "prefill_chunk": 16},
        "mailboxes": {"line3": {"model": "te"}, "ask": {"model": "chat", "max_tokens": 8}}})
    a.operator = a.issue("plc1", "operator")
    a.monitor = a.issue("hmi1", "monitor")
    a.engineer = a.issue("eng1", "engineer")
    yield a
    a.stop()


def nid(ns: int, path: str) -> ua.NodeId:
    return ua.NodeId(path, ns)


async def typedef(client, nodeid: ua.NodeId) -> ua.NodeId:
    refs = await client.get_node(nodeid).get_references(ua.ObjectIds.HasTypeDefinition)
    return refs[0].NodeId


async def call(client, obj: ua.NodeId, method: ua.NodeId, args: list) -> ua.CallMethodResult:
    req = ua.CallMethodRequest()
    req.ObjectId, req.MethodId, req.InputArguments = obj, method, args
    return (await client.uaclient.call([req]))[0]


def te_input(n: int = 2) -> ua.Variant:
    x, _ = load_te_test_windows(1)
    return floats(x[600:600 + n].ravel())


def gen_args(prompt="Hi", tokens=4):
    return [ua.Variant(prompt, V.String), ua.Variant(tokens, V.UInt32), ua.Variant(0.0, V.Float)]


def test_every_object_is_an_instance_of_its_type_with_declared_members(app):
    async def go():
        async with session(app, *app.operator) as c:
            ns = await c.get_namespace_index(URI)
            assert await typedef(c, nid(ns, "Appliance")) == nid(ns, "Types/ApplianceType")
            for name, type_name in MODEL_TYPES.items():
                assert await typedef(c, nid(ns, f"Appliance/Models/{name}")) == nid(ns, f"Types/{type_name}")
            for path, type_name in (("Engine", "EngineType"), ("Health", "HealthType"), ("Admin", "AdminType"),
                                    ("Models/te/Last", "LastResultType"), ("Mailboxes/line3", "TensorMailboxType"),
                                    ("Mailboxes/ask", "GenerativeMailboxType")):
                assert await typedef(c, nid(ns, f"Appliance/{path}")) == nid(ns, f"Types/{type_name}"), path
            assert await typedef(c, nid(ns, "Appliance/Models")) == ua.NodeId(ua.ObjectIds.FolderType)
            # Browse answers each child's type definition too (what a client filters on)
            children = await c.get_node(nid(ns, "Appliance/Models")).get_children_descriptions()
            assert {d.BrowseName.Name: d.TypeDefinition for d in children} == \
                {name: nid(ns, f"Types/{t}") for name, t in MODEL_TYPES.items()}
            # a classifier is a tensor model with Classify and Last
            parent = await c.get_node(nid(ns, "Types/ClassifierType")).get_parent()
            assert parent.nodeid == nid(ns, "Types/TensorModelType")
            infer = c.get_node(nid(ns, "Types/TensorModelType/Infer"))
            rule = await infer.get_references(ua.ObjectIds.HasModellingRule)
            assert rule[0].NodeId == ua.NodeId(ua.ObjectIds.ModellingRule_Mandatory)
            drift = await c.get_node(nid(ns, "Types/TensorModelType/Drift")).get_references(
                ua.ObjectIds.HasModellingRule)
            assert drift[0].NodeId == ua.NodeId(ua.ObjectIds.ModellingRule_Optional)
            args = await c.get_node(nid(ns, "Types/TensorModelType/Infer/InputArguments")).read_value()
            assert args[0].Name == "Input" and args[0].ValueRank == 1 and args[0].ArrayDimensions == [0]
            assert "MaxSamples" in args[0].Description.Text
            # the draft AI properties, with the running model's values; Version and State are the contract's nodes
            te = c.get_node(nid(ns, "Appliance/Models/te"))
            props = {(await p.read_browse_name()).Name: await p.read_value() for p in await te.get_properties()}
            assert props["TaskKind"] == "classification" and props["Format"] == "ONNX"
            assert props["Framework"] == "ONNX Runtime" and props["Inputs"] == ["Input: Float[k x 20 x 52]"]
            assert props["ParameterCount"] > 0 and props["BatchSize"] == 32 and props["FallbackPolicy"] == "none"
            assert "Version" not in props and "State" not in props
            for _ in range(50):  # the digest is read off the event loop after the start
                digest = await c.get_node(nid(ns, "Appliance/Models/te/Digest")).read_value()
                if digest:
                    break
                await asyncio.sleep(0.1)
            assert digest.startswith("sha256:") and len(digest) == 7 + 64
            chat = c.get_node(nid(ns, "Appliance/Models/chat"))
            assert await (await chat.get_child(f"{ns}:TaskKind")).read_value() == "text-generation"
    run(go())


def test_every_model_method_answers_the_same_by_instance_and_by_type(app):
    """Both ways, in turn, over one session: the outputs' types and (for the tensor models) values are equal, and a
    job started by the type's StartInfer is fetched and released by the type's methods."""
    async def go():
        async with session(app, *app.operator) as c:
            ns = await c.get_namespace_index(URI)

            async def both(model: str, type_name: str, method: str, args: list) -> list[ua.CallMethodResult]:
                obj = nid(ns, f"Appliance/Models/{model}")
                own = await call(c, obj, nid(ns, f"Appliance/Models/{model}/{method}"), args)
                by_type = await call(c, obj, nid(ns, f"Types/{type_name}/{method}"), args)
                assert status_name(own) == status_name(by_type), (model, method, own, by_type)
                assert [v.VariantType for v in own.OutputArguments] == \
                    [v.VariantType for v in by_type.OutputArguments], (model, method)
                return [own, by_type]

            for model in ("te", "raw"):
                own, by_type = await both(model, "TensorModelType", "Infer", [te_input()])
                assert status_name(own) == "Good"
                assert np.allclose(own.OutputArguments[0].Value, by_type.OutputArguments[0].Value)
                jobs = []
                for r in await both(model, "TensorModelType", "StartInfer", [te_input()]):
                    jobs.append(r.OutputArguments[0].Value)
                for job in jobs:
                    for method in ("GetInferResult",):
                        r = await call(c, nid(ns, f"Appliance/Models/{model}"),
                                       nid(ns, f"Types/TensorModelType/{method}"),
                                       [ua.Variant(job, V.UInt32), ua.Variant(2000, V.UInt32)])
                        assert status_name(r) == "Good" and r.OutputArguments[0].Value is True
                        assert np.allclose(r.OutputArguments[1].Value, own.OutputArguments[0].Value)
                    r = await call(c, nid(ns, f"Appliance/Models/{model}"), nid(ns, "Types/ModelType/ReleaseJob"),
                                   [ua.Variant(job, V.UInt32)])
                    assert status_name(r) == "Good"
                for method in ("CancelJob", "ReleaseJob"):  # released: unknown now, both ways
                    for r in await both(model, "ModelType", method, [ua.Variant(jobs[0], V.UInt32)]):
                        assert status_name(r) == "BadNotFound"
                for r in await both(model, "TensorModelType", "GetInferResult",
                                    [ua.Variant(jobs[1], V.UInt32), ua.Variant(0, V.UInt32)]):
                    assert status_name(r) == "BadNotFound"
            own, by_type = await both("te", "ClassifierType", "Classify", [te_input()])
            assert status_name(own) == "Good" and own.OutputArguments[0].Value == by_type.OutputArguments[0].Value
            # bad input: the same code and the same argument marked
            for r in await both("te", "ClassifierType", "Classify", [ua.Variant([1.0, 2.0], V.Float)]):
                assert status_name(r) == "BadInvalidArgument" and r.InputArgumentResults[0].name == "BadOutOfRange"

            g = "GenerativeModelType"
            for r in await both("chat", g, "Generate", gen_args()):
                assert status_name(r) == "Good" and r.OutputArguments[1].Value >= 1
            conv = [ua.Variant("line-1", V.String), *gen_args()]
            for r in await both("chat", g, "Converse", conv):
                assert status_name(r) == "Good"
            for r in await both("chat", g, "EndConversation", [ua.Variant("line-1", V.String)]):
                assert status_name(r) == "Good"
            for r in await both("chat", g, "ResetContext", []):
                assert status_name(r) == "Good"
            jobs = [r.OutputArguments[0].Value for r in await both("chat", g, "StartGenerate", conv)]
            for job in jobs:
                r = await call(c, nid(ns, "Appliance/Models/chat"), nid(ns, f"Types/{g}/GetGenerateResult"),
                               [ua.Variant(job, V.UInt32), ua.Variant(2000, V.UInt32)])
                assert status_name(r) == "Good"
            for r in await both("chat", g, "GetGenerateResult", [ua.Variant(jobs[0], V.UInt32),
                                                                 ua.Variant(2000, V.UInt32)]):
                assert status_name(r) == "Good" and r.OutputArguments[0].Value is True
            for r in await both("chat", g, "Generate", gen_args(prompt="")):
                assert status_name(r) == "BadInvalidArgument"
    run(go(), timeout=240)


def test_a_type_call_has_the_instance_calls_roles_and_audit(app):
    async def go():
        async with session(app, *app.monitor) as c:
            ns = await c.get_namespace_index(URI)
            r = await call(c, nid(ns, "Appliance/Models/te"), nid(ns, "Types/TensorModelType/Infer"), [te_input()])
            assert status_name(r) == "BadUserAccessDenied"
        async with session(app, *app.operator) as c:
            r = await call(c, nid(ns, "Appliance/Models/raw"), nid(ns, "Types/TensorModelType/Infer"),
                           [te_input(3)])
            assert status_name(r) == "Good"
    run(go())
    audit = app.state_dir / "audit" / "audit.jsonl"
    end = time.monotonic() + 10
    while time.monotonic() < end:
        records = [json.loads(line) for line in audit.read_text().splitlines() if line.strip()]
        denied = [x for x in records if x.get("event") == "role_denied" and x.get("model") == "te"
                  and x.get("action") == "Infer"]
        calls = [x for x in records if x.get("event") == "call" and x.get("model") == "raw"
                 and x.get("action") == "Infer" and x.get("status") == "Good"]
        if denied and calls:
            break
        time.sleep(0.2)
    assert denied and calls


def test_admin_methods_answer_the_same_by_type(app):
    async def go():
        async with session(app, *app.engineer) as c:
            ns = await c.get_namespace_index(URI)
            admin = nid(ns, "Appliance/Admin")
            args = [ua.Variant("no-such-model", V.String), ua.Variant("main", V.String)]
            own = await call(c, admin, nid(ns, "Appliance/Admin/PromoteVariant"), args)
            by_type = await call(c, admin, nid(ns, "Types/AdminType/PromoteVariant"), args)
            assert status_name(own) == status_name(by_type) == "BadInvalidArgument"
            assert own.InputArgumentResults == by_type.InputArgumentResults
            r = await call(c, nid(ns, "Appliance/Models/te"), nid(ns, "Types/AdminType/PromoteVariant"), args)
            assert status_name(r) == "BadMethodInvalid"
        async with session(app, *app.operator) as c:  # an operator may not, by either NodeId
            r = await call(c, admin, nid(ns, "Types/AdminType/ReloadModel"), [ua.Variant("te", V.String)])
            assert status_name(r) == "BadUserAccessDenied"
    run(go())


def test_a_method_on_an_object_of_another_type_is_invalid(app):
    async def go():
        async with session(app, *app.operator) as c:
            ns = await c.get_namespace_index(URI)
            cases = [("Appliance/Models/raw", "Types/ClassifierType/Classify"),  # a tensor model is no classifier
                     ("Appliance/Models/te", "Types/GenerativeModelType/Generate"),
                     ("Appliance/Models/chat", "Types/TensorModelType/Infer"),
                     ("Appliance/Engine", "Types/TensorModelType/Infer"),
                     ("Appliance/Models/raw", "Appliance/Models/te/Infer")]  # another instance's own method
            for obj, method in cases:
                args = gen_args() if "Generate" in method else [te_input()]
                r = await call(c, nid(ns, obj), nid(ns, method), args)
                assert status_name(r) == "BadMethodInvalid", (obj, method, r)
    run(go())


def export(app, out: Path) -> Path:
    env = dict(os.environ, PYTHONPATH=str(ROOT.parent))
    proc = subprocess.run([sys.executable, "-m", "appliance", "nodeset", "--config", str(app.config_path),
                           "--out", str(out)], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def nodeset(app, tmp_path_factory):
    return export(app, tmp_path_factory.mktemp("nodeset") / "appliance.NodeSet2.xml")


def test_the_export_is_valid_nodeset2_with_its_models_element(nodeset):
    xmlschema = pytest.importorskip("xmlschema")
    assert XSD.exists(), "run `npm ci` in tests/node (node-opcua-nodesets ships the UANodeSet schema)"
    schema = xmlschema.XMLSchema(str(XSD))
    errors = [f"{e.path}: {e.reason}" for e in schema.iter_errors(str(nodeset))]
    assert not errors, errors[:5]
    doc = schema.to_dict(str(nodeset))
    model = doc["Models"]["Model"][0]
    assert model["@ModelUri"] == URI and model["@Version"] and model["@PublicationDate"]
    assert model["RequiredModel"][0]["@ModelUri"] == "http://opcfoundation.org/UA/"
    assert doc["NamespaceUris"]["Uri"] == [URI]


async def described(read_node, nodeids) -> dict:
    """NodeId string -> (BrowseName, NodeClass, TypeDefinition, DataType, Input/OutputArguments) via read_node."""
    out = {}
    for nodeid in nodeids:
        out[nodeid.Identifier] = await read_node(nodeid)
    return out


async def describe_node(node) -> tuple:
    bname = (await node.read_browse_name()).Name
    cls = await node.read_node_class()
    refs = await node.get_references(ua.ObjectIds.HasTypeDefinition, ua.BrowseDirection.Forward)
    tdef = refs[0].NodeId.Identifier if refs else None
    dtype = (await node.read_data_type()).to_string() if cls == ua.NodeClass.Variable else None
    value = None
    if bname in ("InputArguments", "OutputArguments"):
        value = [(a.Name, a.DataType.to_string(), a.ValueRank, list(a.ArrayDimensions or []), a.Description.Text)
                 for a in await node.read_value()]
    return bname, cls.name, tdef, dtype, value


async def namespace_nodes(root_nodes, ns: int) -> set:
    seen, queue = set(), list(root_nodes)
    while queue:
        node = queue.pop()
        if node.nodeid in seen:
            continue
        seen.add(node.nodeid)
        for child in await node.get_children(refs=ua.ObjectIds.HierarchicalReferences):
            if child.nodeid.NamespaceIndex == ns:
                queue.append(child)
    return seen


def test_the_export_loads_into_asyncua_and_matches_the_running_appliance(app, nodeset):
    async def go():
        bare = Server()
        await bare.init()
        await bare.import_xml(str(nodeset))
        bns = await bare.get_namespace_index(URI)
        loaded = await namespace_nodes([bare.get_node(nid(bns, "Appliance"))] +
                                       [bare.get_node(nid(bns, f"Types/{t}")) for t in
                                        ("ApplianceType", "ModelType", "TensorModelType", "ClassifierType",
                                         "GenerativeModelType", "MailboxType", "TensorMailboxType",
                                         "GenerativeMailboxType", "EngineType", "HealthType", "AdminType",
                                         "DriftType", "LastResultType")], bns)
        mine = await described(lambda n: describe_node(bare.get_node(n)), loaded)
        async with session(app, *app.operator) as c:
            ns = await c.get_namespace_index(URI)
            running_ids = await namespace_nodes([c.get_node(nid(ns, "Appliance"))], ns)
            theirs = await described(lambda n: describe_node(c.get_node(ua.NodeId(n.Identifier, ns))), loaded)
        missing = {n.Identifier for n in running_ids} - set(mine)
        assert not missing, sorted(missing)[:10]
        assert len(mine) > 250
        diff = {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}
        assert not diff, "\n".join(f"{k}: {a} != {b}" for k, (a, b) in list(diff.items())[:5])
        assert mine["Types/ClassifierType/Classify/OutputArguments"][4][0][0] == "ClassIndex"
        undescribed = [(k, a[0]) for k, d in mine.items() if d[4] for a in d[4] if not a[4]]
        assert not undescribed, undescribed  # every argument of every method says what it is
    run(go(), timeout=240)


def node_js(*args, timeout=180) -> dict:
    proc = subprocess.run(["node", str(NODE_DIR / "nodeset.js"), *args], capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, (proc.stdout[-2000:], proc.stderr[-2000:])
    return json.loads(lines[-1])


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
def test_node_opcua_loads_the_export_with_the_same_types_and_arguments(app, nodeset):
    assert (NODE_DIR / "node_modules" / "node-opcua-address-space").exists(), "run `npm ci` in tests/node"
    loaded = node_js("load", str(nodeset))["nodes"]
    nodes = {n["nodeId"].removeprefix("s="): n for n in loaded}

    async def go():
        async with session(app, *app.operator) as c:
            ns = await c.get_namespace_index(URI)
            assert len(nodes) > 250
            for key, n in nodes.items():
                node = c.get_node(ua.NodeId.from_string(f"ns={ns};{n['nodeId']}"))
                assert (await node.read_browse_name()).Name == n["browseName"], key
                assert (await node.read_node_class()).name == n["nodeClass"], key
                if n["nodeClass"] == "Variable":
                    assert (await node.read_data_type()).to_string() == n["dataType"].replace("ns=0;", ""), key
                if n["nodeClass"] == "Method":
                    for prop, name in (("inputArguments", "InputArguments"), ("outputArguments", "OutputArguments")):
                        want = [(a["name"], a["dataType"].replace("ns=0;", ""), a["valueRank"], a["arrayDimensions"],
                                 a["description"]) for a in n[prop]]
                        child = [ch for ch in await node.get_properties()
                                 if (await ch.read_browse_name()).Name == name]
                        got = [(a.Name, a.DataType.to_string(), a.ValueRank, list(a.ArrayDimensions or []),
                                a.Description.Text or "") for a in (await child[0].read_value() if child else [])]
                        assert got == want, (key, name)
    run(go(), timeout=240)
    assert nodes["Types/ClassifierType"]["subtypeOf"].endswith("s=Types/TensorModelType")
    assert nodes["Appliance/Models/chat"]["typeDefinition"].endswith("s=Types/GenerativeModelType")


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
def test_node_opcua_finds_every_model_by_type_and_calls_through_the_types_methods(app, nodeset):
    """Done when: given only the exported file and the endpoint."""
    cert_der, key = app.operator
    uri = f"urn:{socket.gethostname()}:appliance:client:plc1"
    out = node_js("call", str(nodeset), app.endpoint, str(cert_der.with_suffix(".pem")), str(key), uri,
                  str(app.state_dir / "node-pki"))
    models = {m["name"]: m for m in out["models"]}
    assert out["modelsFolder"] == "s=Appliance/Models", out
    assert {n: m["type"] for n, m in models.items()} == MODEL_TYPES, out
    for name in ("te", "raw"):
        infer = models[name]["calls"]["Infer"]
        assert infer["status"] == "Good" and infer["methodId"] == "s=Types/TensorModelType/Infer"
        assert infer["outputs"][0] == 22  # one sample of zeros: 22 class scores
    classify = models["te"]["calls"]["Classify"]
    assert classify["status"] == "Good" and classify["methodId"] == "s=Types/ClassifierType/Classify"
    assert "Classify" not in models["raw"]["calls"]
    generate = models["chat"]["calls"]["Generate"]
    assert generate["status"] == "Good" and generate["methodId"] == "s=Types/GenerativeModelType/Generate"
    assert generate["outputs"][1] >= 1


def test_plc_types_scl_names_node_ids_that_the_server_answers(app):
    """Every method's ObjectId, MethodId and type MethodId in `appliance plc-types`' SCL exist on the server, and
    Infer answers through the instance's and the type's NodeId given there."""
    text, _ = write_plc_types(app.config.models["te"], "scl", None)
    triples = re.findall(r"ObjectId\s+(\S+)\n\s*//\s+MethodId\s+(\S+)\n\s*//\s+or by type\s+(\S+)", text)
    assert len(triples) == 6, text  # Infer Classify StartInfer GetInferResult CancelJob ReleaseJob

    async def go():
        async with session(app, *app.operator) as c:
            ns = await c.get_namespace_index(URI)
            ids = [tuple(ua.NodeId.from_string(i.replace(f"nsu={URI};", f"ns={ns};")) for i in t) for t in triples]
            for obj, own, by_type in ids:
                for node in (obj, own, by_type):
                    await c.get_node(node).read_browse_name()  # raises BadNodeIdUnknown if it is not there
            infer = [t for t in ids if t[1].Identifier.endswith("/Infer")][0]
            for method in infer[1:]:
                assert status_name(await call(c, infer[0], method, [te_input(1)])) == "Good"
    run(go())


def test_the_nodeset_cli_writes_to_stdout_and_refuses_an_unwritable_file(app, tmp_path, capsys):
    assert cli_main(["nodeset", "--config", str(app.config_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("<?xml") and 'NodeId="ns=1;s=Types/ClassifierType"' in out
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli_main(["nodeset", "--config", str(app.config_path), "--out", str(blocker / "x.xml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("appliance: cannot write") and "Traceback" not in err
