"""`appliance plc-types`: PLC data types for a model's OPC UA methods, so nobody types them by hand.

An S7-1500 passes a method's arguments as one STRUCT whose member names, order and types match the method exactly
(REAL=Float, LREAL=Double, UDINT=UInt32, DINT=Int32, BOOL=Boolean, WSTRING=String), with fixed-size arrays; CODESYS
and TwinCAT import PLCopen TC6 XML 2.01 data types. Both are written from one table of the contract's methods
(`model_methods`), sized from the model: InputShape/OutputShape read from the ONNX file x 1 sample, string lengths
from `max_text_chars`. Nothing here touches the engine or the server.
"""
from __future__ import annotations

import datetime
import math
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from core.object_types import declared_methods, model_type, task_type

from core.namespace import NAMESPACE_URI
from core.config import ModelConfig

PLCOPEN_NS = "http://www.plcopen.org/xml/tc6_0201"
# OPC UA built-in type -> (IEC 61131-3 / TIA SCL name, PLCopen XML element)
IEC_TYPES = {"Float": ("Real", "REAL"), "Double": ("LReal", "LREAL"), "UInt32": ("UDInt", "UDINT"),
             "Int32": ("DInt", "DINT"), "Boolean": ("Bool", "BOOL"), "String": ("WString", "wstring")}
VERSION_CHARS = 64  # a version label is at most 64 characters (config rule)
LABEL_CHARS = 64  # a label is at most 64 characters (config rule)
CONVERSATION_ID_CHARS = 64  # the contract: 1-64 printable ASCII
FINISH_REASON_CHARS = 16  # stop | length | context_full
CHOOSE_OPTIONS = 4  # Choose's Options and Scores in a PLC's UDT: a fixed array (`--choose-options N`)
CHOOSE_OPTION_CHARS = 256  # the contract: an option holds at most 256 characters


class PlcTypesError(Exception):
    """A model whose types cannot be written (e.g. no fixed InputShape); the message says why."""


@dataclass(frozen=True)
class Arg:
    """One method argument: OPC UA type, fixed array length (None: a scalar), WSTRING length for strings."""

    name: str
    ua_type: str
    array: int | None = None
    chars: int | None = None


@dataclass(frozen=True)
class Method:
    name: str
    inputs: tuple[Arg, ...]
    outputs: tuple[Arg, ...]
    task: str = ""  # a task's method: on the object Models/<model>/Tasks/<task>, declared on the task's own type

    @property
    def udt_stem(self) -> str:
        """The method's part of its UDT names: Generate, or alarm_triage_Run for a task's Run."""
        return f"{type_prefix(self.task)}_{self.name}" if self.task else self.name


def onnx_shapes(path: Path) -> tuple[list[int], list[int]]:
    """(InputShape, OutputShape) of one sample: the first input's and output's dimensions after the batch one."""
    import onnx
    from google.protobuf.message import DecodeError
    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except (OSError, DecodeError, ValueError) as e:  # unreadable; not a protobuf ModelProto; too large for one
        raise PlcTypesError(f"{path}: cannot read the ONNX model ({type(e).__name__})") from None
    initializers = {i.name for i in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]

    def sample_shape(value, what: str) -> list[int]:
        dims = value.type.tensor_type.shape.dim[1:]
        if not all(d.HasField("dim_value") and d.dim_value > 0 for d in dims):
            raise PlcTypesError(f"{path}: the {what} '{value.name}' has no fixed size per sample "
                                f"({[d.dim_param or d.dim_value for d in dims]}); PLC arrays need one")
        return [d.dim_value for d in dims]

    if not inputs or not graph.output:
        raise PlcTypesError(f"{path}: the ONNX model has no input or no output")
    return sample_shape(inputs[0], "input"), sample_shape(graph.output[0], "output")


def task_methods(task) -> list[Method]:
    """Run, StartTask and GetTaskResult of one task: its inputs and fields, strings sized by their max_length (an
    enum by its longest value)."""
    inputs = tuple(Arg(n, "String" if c.type == "String" else c.type,
                       chars=c.effective_max_length if c.type == "String" else None)
                   for n, c in task.inputs.items())
    fields = tuple(Arg(n, "String" if f.type in ("String", "enum") else f.type,
                       chars=(f.effective_max_length if f.type == "String" else max(len(v) for v in f.values))
                       if f.type in ("String", "enum") else None)
                   for n, f in task.output.items())
    answer = fields + (Arg("FinishReason", "String", chars=FINISH_REASON_CHARS),
                       Arg("ModelVersion", "String", chars=VERSION_CHARS))
    return [Method("Run", inputs, answer, task.name),
            Method("StartTask", inputs, (Arg("JobId", "UInt32"),), task.name),
            Method("GetTaskResult", (Arg("JobId", "UInt32"), Arg("WaitMs", "UInt32")),
                   (Arg("Done", "Boolean"),) + answer, task.name)]


def model_methods(model: ModelConfig, choose_options: int = CHOOSE_OPTIONS) -> list[Method]:
    """The contract's methods of one model with every array and string sized (CONTRACT.md, Address space);
    choose_options: how many options the PLC passes to Choose (its Options and Scores arrays)."""
    version = Arg("ModelVersion", "String", chars=VERSION_CHARS)
    job_id = Arg("JobId", "UInt32")
    jobs_end = [Method("CancelJob", (job_id,), ()), Method("ReleaseJob", (job_id,), ())]
    if model.is_tensor:
        path = model.resolved_path
        if path is None or path.suffix != ".onnx" or not path.is_file():
            raise PlcTypesError(f"model '{model.name}': InputShape is read from an ONNX file, and {path} is not "
                                "one; export the model to ONNX to generate PLC types")
        in_shape, out_shape = onnx_shapes(path)
        n_in, n_out = math.prod(in_shape), math.prod(out_shape)
        tensor_in = (Arg("Input", "Float", array=n_in),)
        methods = [Method("Infer", tensor_in, (Arg("Output", "Float", array=n_out), version))]
        if model.labels:
            methods.append(Method("Classify", tensor_in, (
                Arg("ClassIndex", "Int32", array=1), Arg("Label", "String", array=1, chars=LABEL_CHARS),
                Arg("Confidence", "Float", array=1), version)))
        methods += [
            Method("StartInfer", tensor_in, (job_id,)),
            Method("GetInferResult", (job_id, Arg("WaitMs", "UInt32")),
                   (Arg("Done", "Boolean"), Arg("Output", "Float", array=n_out), version)),
        ]
        return methods + jobs_end
    text_chars = model.max_text_chars
    prompt_args = (Arg("Prompt", "String", chars=text_chars), Arg("MaxTokens", "UInt32"),
                   Arg("Temperature", "Float"))
    conversation = Arg("ConversationId", "String", chars=CONVERSATION_ID_CHARS)
    answer = (Arg("Text", "String", chars=text_chars), Arg("TokenCount", "UInt32"),
              Arg("FinishReason", "String", chars=FINISH_REASON_CHARS), Arg("ContextTokens", "UInt32"),
              Arg("ContextLost", "Boolean"), version)
    return [
        Method("Generate", prompt_args, answer),
        Method("Converse", (conversation,) + prompt_args, answer),
        Method("EndConversation", (conversation,), ()),
        Method("ResetContext", (), ()),
        Method("StartGenerate", (conversation,) + prompt_args, (job_id,)),
        Method("GetGenerateResult", (job_id, Arg("WaitMs", "UInt32")), (Arg("Done", "Boolean"),) + answer),
        Method("Choose", (Arg("Prompt", "String", chars=text_chars),
                          Arg("Options", "String", array=choose_options, chars=CHOOSE_OPTION_CHARS)),
               (Arg("Index", "Int32"), Arg("Option", "String", chars=CHOOSE_OPTION_CHARS),
                Arg("Scores", "Float", array=choose_options), version)),
    ] + jobs_end + [m for task in model.tasks.values() for m in task_methods(task)]


def type_prefix(model_name: str) -> str:
    """A PLC identifier from a model name: '-' becomes '_' (IEC identifiers hold letters, digits and '_')."""
    return re.sub(r"[^A-Za-z0-9_]", "_", model_name)


def udt_name(model_name: str, method: str, direction: str) -> str:
    """method: Method.udt_stem (a task's methods carry the task's name)."""
    return f"{type_prefix(model_name)}_{method}_{direction}"


def scl_type(arg: Arg) -> str:
    base = IEC_TYPES[arg.ua_type][0] + (f"[{arg.chars}]" if arg.ua_type == "String" else "")
    return f"Array[0..{arg.array - 1}] of {base}" if arg.array is not None else base


# ----------------------------------------------------------------------------------------------------------------
# TIA Portal SCL source


def scl_source(model: ModelConfig, choose_options: int = CHOOSE_OPTIONS) -> str:
    """UDTs (one per method's inputs and one per its outputs; none for an empty argument list: the instruction's
    argument parameter stays unwired then) and an example FB per method calling OPC_UA_MethodCall_C."""
    methods = model_methods(model, choose_options)
    out = [f"// PLC data types for the OPC UA methods of model '{model.name}' ({model.kind}), written by",
           "// `appliance plc-types`. Import in TIA Portal: External source files > Add new external file >",
           "// Generate blocks from source. Member names, order and types match the methods' arguments exactly.",
           "// Arrays hold one sample (InputShape x 1); strings are WSTRING of the lengths shown. Choose's Options",
           f"// and Scores hold {choose_options} entries (`--choose-options N`): pass exactly that many non-empty",
           "// options.",
           "// A task's UDTs (<model>_<task>_Run_In / _Out) hold its inputs and its output fields, typed as in the",
           "// YAML; a Good answer fills every field, a Bad MethodResult (e.g. 16#80B10000 BadNoDataAvailable: no",
           "// complete answer within the task's max_tokens) leaves Results as they were.", ""]
    for method in methods:
        for direction, args in (("In", method.inputs), ("Out", method.outputs)):
            if not args:
                continue
            out += [f'TYPE "{udt_name(model.name, method.udt_stem, direction)}"', "VERSION : 0.1", "   STRUCT"]
            out += [f"      {a.name} : {scl_type(a)};" for a in args]
            out += ["   END_STRUCT;", "", "END_TYPE", ""]
    declared = declared_methods(model_type(model.kind, bool(model.labels)))
    for method in methods:
        declaring = task_type(model.name, method.task) if method.task else declared[method.name][0]
        out += _scl_example_fb(model.name, method, declaring)
    return "\n".join(out)


def method_node_ids(model_name: str, method: str, declaring_type: str, task: str = "") -> dict[str, str]:
    """The NodeIds a client interface needs, namespace by URI (the index may differ between servers): the model
    object (ObjectId; a task's object for its methods), its own method, and the method declared on its type
    (callable with any object of the type)."""
    nsu = f"nsu={NAMESPACE_URI};s="
    obj = f"Appliance/Models/{model_name}" + (f"/Tasks/{task}" if task else "")
    return {"ObjectId": f"{nsu}{obj}", "MethodId": f"{nsu}{obj}/{method}",
            "TypeMethodId": f"{nsu}Types/{declaring_type}/{method}"}


def _scl_example_fb(model_name: str, method: Method, declaring_type: str) -> list[str]:
    prefix = type_prefix(model_name)
    ids = method_node_ids(model_name, method.name, declaring_type, method.task)
    fb = f"{prefix}_{method.udt_stem}_Call"
    where = f"Models/{model_name}" + (f"/Tasks/{method.task}" if method.task else "")
    lines = [f'FUNCTION_BLOCK "{fb}"', "{ S7_Optimized_Access := 'TRUE' }", "VERSION : 0.1",
             "   VAR_INPUT", "      Execute : Bool;   // rising edge starts one call", "   END_VAR",
             "   VAR_OUTPUT", "      Done : Bool;", "      Busy : Bool;", "      Error : Bool;",
             "      Status : DWord;   // the instruction's status (connection, session) when Error",
             "      MethodResult : DWord;   // the method's StatusCode: 0 Good, e.g. 16#80AB0000 BadInvalidArgument",
             "   END_VAR", "   VAR"]
    if method.inputs:
        lines.append(f'      Arguments : "{udt_name(model_name, method.udt_stem, "In")}";   // fill before Execute')
    if method.outputs:
        lines.append(f'      Results : "{udt_name(model_name, method.udt_stem, "Out")}";')
    lines += ["      Call : OPC_UA_MethodCall_C;", "   END_VAR", "", "BEGIN",
              f"   // Calls Objects/Appliance/{where}/{method.name}. The server endpoint, the session",
              "   // (MaintainSession) and the method's NodeId come from the OPC UA client interface configured in",
              "   // TIA Portal (Basic256Sha256, SignAndEncrypt, user name). The parameters follow PLCopen",
              "   // UA_MethodCall (OPC 30001); check them against your TIA Portal version's help (not compiled here).",
              "   // NodeIds (namespace urn:opcua-inference-appliance; `appliance nodeset` exports them all):",
              f"   //   ObjectId      {ids['ObjectId']}",
              f"   //   MethodId      {ids['MethodId']}",
              f"   //   or by type    {ids['TypeMethodId']}",
              f"   //                 (the same method of {declaring_type}: one call block serves every such "
              f"{'task object' if method.task else 'model'})",
              "   #Call(REQ := #Execute,"]
    if method.inputs:
        lines.append("         InputArguments := #Arguments,")
    if method.outputs:
        lines.append("         OutputArguments := #Results,")
    lines += ["         MethodResult := #MethodResult,", "         Done => #Done,", "         Busy => #Busy,",
              "         Error => #Error,", "         Status => #Status);", "END_FUNCTION_BLOCK", ""]
    return lines


# ----------------------------------------------------------------------------------------------------------------
# PLCopen TC6 XML 2.01


def plcopen_xml(model: ModelConfig, now: datetime.datetime | None = None,
                choose_options: int = CHOOSE_OPTIONS) -> str:
    """A PLCopen TC6 XML 2.01 project holding the data types only (CODESYS: Import PLCopenXML; TwinCAT: the
    PLCopen XML import of a PLC project)."""
    methods = model_methods(model, choose_options)
    ET.register_namespace("", PLCOPEN_NS)
    q = lambda tag: f"{{{PLCOPEN_NS}}}{tag}"  # noqa: E731
    stamp = (now or datetime.datetime.now(datetime.timezone.utc)).replace(microsecond=0)
    project = ET.Element(q("project"))
    ET.SubElement(project, q("fileHeader"), companyName="OPC UA Inference Appliance",
                  productName="appliance plc-types", productVersion="1",
                  creationDateTime=stamp.strftime("%Y-%m-%dT%H:%M:%S"))
    header = ET.SubElement(project, q("contentHeader"), name=f"{type_prefix(model.name)}_types")
    coords = ET.SubElement(header, q("coordinateInfo"))
    for language in ("fbd", "ld", "sfc"):
        ET.SubElement(ET.SubElement(coords, q(language)), q("scaling"), x="1", y="1")
    types = ET.SubElement(project, q("types"))
    data_types = ET.SubElement(types, q("dataTypes"))
    for method in methods:
        for direction, args in (("In", method.inputs), ("Out", method.outputs)):
            if not args:
                continue
            data_type = ET.SubElement(data_types, q("dataType"),
                                      name=udt_name(model.name, method.udt_stem, direction))
            struct = ET.SubElement(ET.SubElement(data_type, q("baseType")), q("struct"))
            for arg in args:
                _xml_type(ET.SubElement(ET.SubElement(struct, q("variable"), name=arg.name), q("type")), arg, q)
            doc = ET.SubElement(ET.SubElement(data_type, q("documentation")), "{http://www.w3.org/1999/xhtml}p")
            where = f"{model.name}/Tasks/{method.task}" if method.task else model.name
            doc.text = f"{'Input' if direction == 'In' else 'Output'} arguments of {where}/{method.name}"
    ET.SubElement(types, q("pous"))
    ET.SubElement(ET.SubElement(project, q("instances")), q("configurations"))
    ET.indent(project, space="  ")
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(project, encoding="unicode") + "\n"


def _xml_type(parent: ET.Element, arg: Arg, q) -> None:
    element = IEC_TYPES[arg.ua_type][1]
    if arg.array is not None:
        array = ET.SubElement(parent, q("array"))
        ET.SubElement(array, q("dimension"), lower="0", upper=str(arg.array - 1))
        parent = ET.SubElement(array, q("baseType"))
    if arg.ua_type == "String":
        ET.SubElement(parent, q(element), length=str(arg.chars))
    else:
        ET.SubElement(parent, q(element))


# ----------------------------------------------------------------------------------------------------------------
# The command


def write_plc_types(model: ModelConfig, fmt: str, out_dir: Path | None,
                    choose_options: int = CHOOSE_OPTIONS) -> tuple[str, Path | None]:
    """The text in `fmt` ('scl' or 'plcopenxml'), and the file it was written to when `out_dir` is given."""
    text = scl_source(model, choose_options) if fmt == "scl" else plcopen_xml(model, choose_options=choose_options)
    if out_dir is None:
        return text, None
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{type_prefix(model.name)}.{'scl' if fmt == 'scl' else 'xml'}"
    target.write_text(text, encoding="utf-8")
    return text, target
