"""`appliance plc-types`: the SCL UDTs and PLCopen XML types declare exactly the contract's arguments.

The expected arguments below are transcribed from CONTRACT.md by hand (not from appliance/plc_types.py), so the
generator is checked against an independent table. The PLCopen XML is validated against the published TC6 XML 2.01
schema (tests/data/plcopen/tc6_xml_v201.xsd, see the README there).
"""
from __future__ import annotations

import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import xmlschema

from appliance.cli import main
from core.config import demo_config, load_config_text
from appliance.plc_types import PlcTypesError, model_methods, plcopen_xml, scl_source
from models.te_classifier import ONNX_PATH

XSD = Path(__file__).parent / "data" / "plcopen" / "tc6_xml_v201.xsd"
NS = {"p": "http://www.plcopen.org/xml/tc6_0201"}

# CONTRACT.md, Address space: method -> (inputs, outputs), each (name, OPC UA type, array?)
V = ("ModelVersion", "String", False)
ANSWER = [("Text", "String", False), ("TokenCount", "UInt32", False), ("FinishReason", "String", False),
          ("ContextTokens", "UInt32", False), ("ContextLost", "Boolean", False), V]
PROMPT = [("Prompt", "String", False), ("MaxTokens", "UInt32", False), ("Temperature", "Float", False)]
CONV = ("ConversationId", "String", False)
JOB = ("JobId", "UInt32", False)
TENSOR_CONTRACT = {
    "Infer": ([("Input", "Float", True)], [("Output", "Float", True), V]),
    "Classify": ([("Input", "Float", True)], [("ClassIndex", "Int32", True), ("Label", "String", True),
                                              ("Confidence", "Float", True), V]),
    "StartInfer": ([("Input", "Float", True)], [JOB]),
    "GetInferResult": ([JOB, ("WaitMs", "UInt32", False)], [("Done", "Boolean", False), ("Output", "Float", True), V]),
    "CancelJob": ([JOB], []),
    "ReleaseJob": ([JOB], []),
}
GENERATIVE_CONTRACT = {
    "Generate": (PROMPT, ANSWER),
    "Converse": ([CONV] + PROMPT, ANSWER),
    "EndConversation": ([CONV], []),
    "ResetContext": ([], []),
    "StartGenerate": ([CONV] + PROMPT, [JOB]),
    "GetGenerateResult": ([JOB, ("WaitMs", "UInt32", False)], [("Done", "Boolean", False)] + ANSWER),
    "Choose": ([("Prompt", "String", False), ("Options", "String", True)],
               [("Index", "Int32", False), ("Option", "String", False), ("Scores", "Float", True), V]),
    "CancelJob": ([JOB], []),
    "ReleaseJob": ([JOB], []),
}
# the demo's task alarm-triage (appliance/demo.yaml): its inputs, its output fields, FinishReason, ModelVersion
TRIAGE_ANSWER = [("Severity", "String", False), ("StopLine", "Boolean", False), ("Reason", "String", False),
                 ("FinishReason", "String", False), V]
DEMO_TASKS = {
    "alarm_triage_Run": ([("AlarmText", "String", False)], TRIAGE_ANSWER),
    "alarm_triage_StartTask": ([("AlarmText", "String", False)], [JOB]),
    "alarm_triage_GetTaskResult": ([JOB, ("WaitMs", "UInt32", False)], [("Done", "Boolean", False)] + TRIAGE_ANSWER),
}
DEMO_GENERATIVE = {**GENERATIVE_CONTRACT, **DEMO_TASKS}
# WSTRING lengths: max_text_chars 1024, the contract's 64 / 16 / 256, the task's max_length (an enum: its longest)
CHARS = {"Prompt": 1024, "Text": 1024, "ConversationId": 64, "FinishReason": 16, "ModelVersion": 64, "Options": 256,
         "Option": 256, "AlarmText": 200, "Severity": 6, "Reason": 80, "Label": 64}
# the S7-1500 mapping of OPC UA built-in types (FIELD-NOTES: REAL=Float, LREAL=Double, UDINT=UInt32, ...)
SCL = {"Float": "Real", "Double": "LReal", "UInt32": "UDInt", "Int32": "DInt", "Boolean": "Bool", "String": "WString"}
XML = {"Float": "REAL", "Double": "LREAL", "UInt32": "UDINT", "Int32": "DINT", "Boolean": "BOOL", "String": "wstring"}


def expected_udts(prefix: str, contract: dict) -> dict[str, list[tuple[str, str, bool]]]:
    udts = {}
    for method, (inputs, outputs) in contract.items():
        if inputs:
            udts[f"{prefix}_{method}_In"] = inputs
        if outputs:
            udts[f"{prefix}_{method}_Out"] = outputs
    return udts


def parse_scl_udts(source: str) -> dict[str, list[tuple[str, str]]]:
    """TYPE "name" ... STRUCT members END_STRUCT ... END_TYPE -> {name: [(member, type text)]} in order."""
    udts = {}
    for name, body in re.findall(r'TYPE "(\w+)"\s+VERSION : 0\.1\s+STRUCT\n(.*?)\s*END_STRUCT;\s+END_TYPE', source,
                                 re.S):
        udts[name] = [tuple(m) for m in re.findall(r"^\s*(\w+) : ([^;]+);$", body, re.M)]
    return udts


def scl_expected_type(ua_type: str, array: bool, n_array: int, chars: int) -> str:
    base = SCL[ua_type] + (f"[{chars}]" if ua_type == "String" else "")
    return f"Array[0..{n_array - 1}] of {base}" if array else base


@pytest.fixture(scope="module")
def demo():
    return demo_config()


def test_scl_for_the_demo_classifier_declares_exactly_the_contracts_arguments_sized_from_the_onnx(demo):
    model = demo.models["te-classifier"]
    source = scl_source(model)
    udts = parse_scl_udts(source)
    expected = expected_udts("te_classifier", TENSOR_CONTRACT)
    assert list(udts) == list(expected)  # one UDT per method's non-empty inputs and outputs, nothing else
    for name, args in expected.items():
        sizes = {"Input": 20 * 52, "Output": 22}  # InputShape [20, 52] x 1 sample; OutputShape [22]
        want = [(a, scl_expected_type(t, arr, sizes.get(a, 1), 64 if a in ("Label", "ModelVersion") else 0))
                for a, t, arr in args]
        assert udts[name] == want, name
    assert source.count("TYPE \"") == len(expected) and source.count("END_TYPE") == len(expected)
    # an example FB per method, each calling the S7 compact method-call instruction with the method's UDTs
    assert source.count("OPC_UA_MethodCall_C;") == len(TENSOR_CONTRACT)
    assert 'Arguments : "te_classifier_Infer_In"' in source and 'Results : "te_classifier_Infer_Out"' in source


def test_scl_for_the_demo_language_model_sizes_strings_from_max_text_chars(demo):
    model = demo.models["assistant"]
    source = scl_source(model)
    udts = parse_scl_udts(source)
    expected = expected_udts("assistant", DEMO_GENERATIVE)
    assert list(udts) == list(expected)
    for name, args in expected.items():  # Choose's Options and Scores: 4 entries by default
        assert udts[name] == [(a, scl_expected_type(t, arr, 4, CHARS.get(a, 0))) for a, t, arr in args], name
    # an example FB per method and per task method, the task's calling its task object's Run
    assert source.count("OPC_UA_MethodCall_C;") == len(DEMO_GENERATIVE)
    assert "s=Appliance/Models/assistant/Tasks/alarm-triage/Run\n" in source
    assert "s=Types/assistant.alarm-triage.TaskType/Run\n" in source
    assert parse_scl_udts(scl_source(model, choose_options=2))["assistant_Choose_In"][1] == \
        ("Options", "Array[0..1] of WString[256]")
    # an S7 STRING holds 254 characters: a model configured for it gets WString[254] for Prompt and Text
    small = load_config_text("models:\n  chat: {kind: generative, path: builtin:smollm2, max_text_chars: 254}\n")
    generate_out = parse_scl_udts(scl_source(small.models["chat"]))["chat_Generate_Out"]
    assert generate_out[0] == ("Text", "WString[254]")


def test_a_classifier_without_labels_has_no_classify(tmp_path):
    cfg = load_config_text("models:\n  te: {kind: tensor, path: builtin:te-classifier}\n")
    names = [m.name for m in model_methods(cfg.models["te"])]
    assert names == ["Infer", "StartInfer", "GetInferResult", "CancelJob", "ReleaseJob"]


@pytest.mark.parametrize("model_name, prefix, contract", [
    ("te-classifier", "te_classifier", TENSOR_CONTRACT), ("assistant", "assistant", DEMO_GENERATIVE)])
def test_plcopen_xml_is_valid_tc6_2_01_and_declares_the_contracts_arguments(demo, model_name, prefix, contract):
    text = plcopen_xml(demo.models[model_name])
    xmlschema.XMLSchema(str(XSD)).validate(text)  # raises with the offending path when invalid
    root = ET.fromstring(text)
    types = root.findall("p:types/p:dataTypes/p:dataType", NS)
    expected = expected_udts(prefix, contract)
    assert [t.get("name") for t in types] == list(expected)
    for data_type in types:
        members = data_type.findall("p:baseType/p:struct/p:variable", NS)
        want = expected[data_type.get("name")]
        assert [m.get("name") for m in members] == [a for a, _, _ in want]
        for member, (_, ua_type, array) in zip(members, want):
            type_node = member.find("p:type", NS)
            if array:
                dim = type_node.find("p:array/p:dimension", NS)
                assert dim.get("lower") == "0"
                n = int(dim.get("upper")) + 1
                assert n == {"Input": 1040, "Output": 22, "Options": 4, "Scores": 4}.get(member.get("name"), 1)
                type_node = type_node.find("p:array/p:baseType", NS)
            (leaf,) = list(type_node)
            assert leaf.tag == f"{{{NS['p']}}}{XML[ua_type]}"
            if ua_type == "String":
                assert int(leaf.get("length")) == CHARS[member.get("name")]


def test_the_schema_check_can_fail():
    """The validation above is not vacuous: the same schema refuses a project without its fileHeader and a
    type that TC6 does not know."""
    schema = xmlschema.XMLSchema(str(XSD))
    text = plcopen_xml(demo_config().models["te-classifier"])
    root = ET.fromstring(text)
    root.remove(root.find("p:fileHeader", NS))
    assert not schema.is_valid(ET.tostring(root, encoding="unicode"))
    assert not schema.is_valid(text.replace("<REAL />", "<FLOAT32 />"))


def test_the_cli_writes_both_formats_into_a_folder_and_to_stdout(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["plc-types", "te-classifier", "--format", "scl", "--out", str(tmp_path / "out")]) == 0
    assert main(["plc-types", "assistant", "--format", "plcopenxml", "--out", str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["assistant.xml", "te_classifier.scl"]
    assert "te_classifier_Classify_Out" in (tmp_path / "out" / "te_classifier.scl").read_text()
    xmlschema.XMLSchema(str(XSD)).validate(str(tmp_path / "out" / "assistant.xml"))
    capsys.readouterr()
    assert main(["plc-types", "assistant", "--format", "scl"]) == 0
    assert 'TYPE "assistant_Generate_In"' in capsys.readouterr().out


def test_the_cli_refuses_an_unknown_model_and_a_model_without_an_onnx_file(tmp_path, capsys):
    assert main(["plc-types", "nope", "--format", "scl"]) == 2
    assert "no model 'nope'" in capsys.readouterr().err
    shutil.copy(ONNX_PATH.with_suffix(".pt2"), tmp_path / "m.pt2")
    (tmp_path / "a.yaml").write_text("models:\n  ts: {kind: tensor, path: m.pt2}\n")
    assert main(["plc-types", "ts", "--format", "scl", "--config", str(tmp_path / "a.yaml")]) == 2
    err = capsys.readouterr().err
    assert "InputShape is read from an ONNX file" in err and "Traceback" not in err


def test_a_model_without_a_fixed_sample_shape_is_refused_with_a_reason(tmp_path):
    import onnx
    from onnx import TensorProto, helper
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "n"])])
    onnx.save(helper.make_model(graph), str(tmp_path / "dyn.onnx"))
    cfg = load_config_text("models:\n  d: {kind: tensor, path: dyn.onnx}\n", base_dir=tmp_path)
    with pytest.raises(PlcTypesError, match="no fixed size per sample"):
        model_methods(cfg.models["d"])
    (tmp_path / "bad.onnx").write_bytes(b"not a model")
    cfg = load_config_text("models:\n  b: {kind: tensor, path: bad.onnx}\n", base_dir=tmp_path)
    with pytest.raises(PlcTypesError, match="cannot read the ONNX model"):
        model_methods(cfg.models["b"])
