"""The appliance's ObjectTypes: what a client meets, declared once on a type (variables, properties, methods with
their argument descriptions, ModellingRule Mandatory or Optional), so that engineering tools (TIA Portal, CODESYS,
UaModeler) import one interface and a PLC function block written for "a tensor model" calls any model.

    BaseObjectType
      ApplianceType            State Device Heartbeat; Models Engine Health Alarms Admin [Mailboxes]
      ModelType (abstract)     the contract's model variables, the draft AI ModelType/DeploymentType properties,
                               CancelJob ReleaseJob
        TensorModelType        InputShape OutputShape MaxSamples; Infer StartInfer GetInferResult; [Drift]
          ClassifierType       Classify; Last
        GenerativeModelType    Generate Converse EndConversation ResetContext StartGenerate GetGenerateResult
                               Choose; [Tasks]
      TaskType (abstract)      a typed task of a generative model
        <model>.<task>.TaskType   Run StartTask GetTaskResult, with the task's own arguments (one type per task)
      MailboxType (abstract)   Request Busy Done Error ErrorCode Response ModelVersion
        TensorMailboxType      Input Output [ClassIndex Label Confidence]
        GenerativeMailboxType  Prompt Text
        <model>.<task>.MailboxType  the task's inputs, its fields and FinishReason (a task's mailbox)
      EngineType HealthType AdminType DriftType LastResultType
      SourceType               State Endpoint SamplesReceived WindowsRun WindowsSkipped WindowsDropped Reconnects
                               LastError (Sources/<name>: a server the appliance reads)

NodeIds are strings in the appliance namespace, `Types/<TypeName>[/<Member>...]`, like the instances' (stable from
one build to the next, so an exported file matches every appliance of the same configuration).
"""
from __future__ import annotations

from dataclasses import dataclass

from asyncua import ua

from .method_arguments import (CHOOSE_IN, CHOOSE_OUT, CLASSIFY_OUT, CONVERSATION_ID, CONVERSE_IN, GENERATE_IN, GENERATE_OUT, GET_GENERATE_RESULT_OUT,
                           GET_INFER_RESULT_OUT, GET_RESULT_IN, INFER_IN, INFER_OUT, JOB_ID, PROMOTE_IN, RELOAD_IN,
                           RELOAD_OUT, START_GENERATE_IN, START_OUT, TASK_TYPES, get_task_result_outputs,
                           task_inputs, task_outputs)

V = ua.VariantType
MANDATORY, OPTIONAL = ua.ObjectIds.ModellingRule_Mandatory, ua.ObjectIds.ModellingRule_Optional
TYPES_PATH = "Types"
FOLDER = "FolderType"  # the standard FolderType (ns 0) for containers: Models, Alarms, Mailboxes


@dataclass(frozen=True)
class Member:
    """One instance declaration of a type."""
    name: str
    kind: str  # variable | property | object | method
    vtype: ua.VariantType | None = None  # variables and properties
    array: bool = False
    rule: int = MANDATORY
    type_name: str = ""  # objects: the member's ObjectType (FOLDER for the standard FolderType)
    inputs: tuple = ()  # methods: ua.Argument lists
    outputs: tuple = ()


@dataclass(frozen=True)
class ObjectTypeSpec:
    name: str
    supertype: str  # "" for BaseObjectType
    members: tuple[Member, ...]
    abstract: bool = False
    description: str = ""


def var(name, vtype, array=False, rule=MANDATORY):
    return Member(name, "variable", vtype, array, rule)


def prop(name, vtype, array=False, rule=MANDATORY):
    return Member(name, "property", vtype, array, rule)


def obj(name, type_name, rule=MANDATORY):
    return Member(name, "object", rule=rule, type_name=type_name)


def method(name, inputs, outputs, rule=MANDATORY):
    return Member(name, "method", rule=rule, inputs=tuple(inputs), outputs=tuple(outputs))


# The OPC Foundation's draft AI information model (http://opcfoundation.org/UA/AI/, draft 0.2.0, provisional): the
# property names of its ModelType and DeploymentType that fit this appliance. Version and State are the contract's
# variables of the same names (not duplicated); the rest are properties of every model object.
AI_MODEL_PROPERTIES = (prop("Framework", V.String), prop("Format", V.String), prop("TaskKind", V.String),
                       prop("Digest", V.String), prop("Quantization", V.String), prop("ParameterCount", V.UInt64),
                       prop("Inputs", V.String, True), prop("Outputs", V.String, True))
AI_DEPLOYMENT_PROPERTIES = (prop("AcceleratorKind", V.String), prop("BatchSize", V.UInt32),
                            prop("FallbackPolicy", V.String), prop("RateLimit", V.String))

OBJECT_TYPES: tuple[ObjectTypeSpec, ...] = (
    ObjectTypeSpec("EngineType", "", (var("QueueDepth", V.UInt32), var("SlotsTotal", V.UInt32),
                                      var("SlotsInUse", V.UInt32)), description="the engine's queue and KV slots"),
    ObjectTypeSpec("HealthType", "", (var("WatchdogState", V.String), var("GpuTemperatureC", V.Double),
                                      var("GpuMemoryUsedBytes", V.UInt64), var("GpuEccErrors", V.UInt64)),
                   description="the accelerator's watchdog"),
    ObjectTypeSpec("AdminType", "", (method("ReloadModel", RELOAD_IN, RELOAD_OUT),
                                     method("PromoteVariant", PROMOTE_IN, [])),
                   description="engineers' methods"),
    ObjectTypeSpec("DriftType", "", (var("State", V.String), var("Score", V.Double), var("Feature", V.String),
                                     var("Since", V.DateTime)), description="input drift against the reference"),
    ObjectTypeSpec("LastResultType", "", (var("ClassIndex", V.Int32), var("Label", V.String),
                                          var("Confidence", V.Float), var("Time", V.DateTime)),
                   description="the latest classification result"),
    ObjectTypeSpec("ModelType", "", (
        var("Kind", V.String), var("Version", V.String), var("Backend", V.String), var("State", V.String),
        var("RequestCount", V.UInt64), var("ErrorCount", V.UInt64), var("LastLatencyMs", V.Double),
        var("Heartbeat", V.UInt32), var("WorkerRestarts", V.UInt32),
        *AI_MODEL_PROPERTIES, *AI_DEPLOYMENT_PROPERTIES,
        method("CancelJob", [JOB_ID], []), method("ReleaseJob", [JOB_ID], [])),
        abstract=True, description="a served model"),
    ObjectTypeSpec("TensorModelType", "ModelType", (
        var("InputShape", V.UInt32, True), var("OutputShape", V.UInt32, True), var("MaxSamples", V.UInt32),
        method("Infer", INFER_IN, INFER_OUT), method("StartInfer", INFER_IN, START_OUT),
        method("GetInferResult", GET_RESULT_IN, GET_INFER_RESULT_OUT), obj("Drift", "DriftType", OPTIONAL)),
        description="a tensor model: Float[] in, Float[] out"),
    ObjectTypeSpec("ClassifierType", "TensorModelType", (
        method("Classify", INFER_IN, CLASSIFY_OUT), obj("Last", "LastResultType")),
        description="a tensor model with class labels"),
    ObjectTypeSpec("GenerativeModelType", "ModelType", (
        method("Generate", GENERATE_IN, GENERATE_OUT), method("Converse", CONVERSE_IN, GENERATE_OUT),
        method("EndConversation", [CONVERSATION_ID], []), method("ResetContext", [], []),
        method("StartGenerate", START_GENERATE_IN, START_OUT),
        method("GetGenerateResult", GET_RESULT_IN, GET_GENERATE_RESULT_OUT), method("Choose", CHOOSE_IN, CHOOSE_OUT),
        obj("Tasks", FOLDER, OPTIONAL)),
        description="a generative (text) model"),
    ObjectTypeSpec("TaskType", "", (), abstract=True,
                   description="a typed task of a generative model: Run (typed inputs -> typed fields), StartTask, "
                   "GetTaskResult; each task's subtype declares its own arguments"),
    ObjectTypeSpec("MailboxType", "", (
        var("Request", V.UInt32), var("Busy", V.Boolean), var("Done", V.Boolean), var("Error", V.Boolean),
        var("ErrorCode", V.UInt32), var("Response", V.UInt32), var("ModelVersion", V.String)),
        abstract=True, description="a request / busy / done handshake for clients without methods"),
    ObjectTypeSpec("TensorMailboxType", "MailboxType", (
        var("Input", V.Float, True), var("Output", V.Float, True), var("ClassIndex", V.Int32, rule=OPTIONAL),
        var("Label", V.String, rule=OPTIONAL), var("Confidence", V.Float, rule=OPTIONAL)),
        description="a tensor model's mailbox"),
    ObjectTypeSpec("GenerativeMailboxType", "MailboxType", (var("Prompt", V.String), var("Text", V.String)),
                   description="a generative model's mailbox"),
    ObjectTypeSpec("SourceType", "", (
        var("State", V.String), var("Endpoint", V.String), var("SamplesReceived", V.UInt64), var("WindowsRun", V.UInt64),
        var("WindowsSkipped", V.UInt64), var("WindowsDropped", V.UInt64), var("Reconnects", V.UInt32),
        var("LastError", V.String)),
        description="an OPC UA server the appliance reads as a client (YAML sources)"),
    ObjectTypeSpec("ApplianceType", "", (
        var("State", V.String), var("Device", V.String), var("Heartbeat", V.UInt32), obj("Models", FOLDER),
        obj("Engine", "EngineType"), obj("Health", "HealthType"), obj("Alarms", FOLDER), obj("Admin", "AdminType"),
        obj("Mailboxes", FOLDER, OPTIONAL), obj("Sources", FOLDER, OPTIONAL)), description="the inference appliance"),
)
BY_NAME = {t.name: t for t in OBJECT_TYPES}


def type_path(name: str) -> str:
    return f"{TYPES_PATH}/{name}"


def supertypes(name: str, extra: dict[str, ObjectTypeSpec] | None = None) -> list[str]:
    """The type and its appliance supertypes, most derived first (extra: the configuration's task types)."""
    types = {**BY_NAME, **(extra or {})}
    out = []
    while name:
        out.append(name)
        name = types[name].supertype
    return out


def declared_methods(name: str, extra: dict[str, ObjectTypeSpec] | None = None) -> dict[str, tuple[str, Member]]:
    """Every method an instance of the type offers: method name -> (the type that declares it, its Member)."""
    types = {**BY_NAME, **(extra or {})}
    out: dict[str, tuple[str, Member]] = {}
    for t in reversed(supertypes(name, extra)):
        for m in types[t].members:
            if m.kind == "method":
                out[m.name] = (t, m)
    return out


def task_type(model: str, task: str) -> str:
    return f"{model}.{task}.TaskType"


def task_mailbox_type(model: str, task: str) -> str:
    return f"{model}.{task}.MailboxType"


def task_type_specs(model: str, task, mailbox: bool) -> list[ObjectTypeSpec]:
    """The ObjectType of one task (its methods with the task's own arguments: a PLC's call block and a client's
    Call by the type's method NodeId meet the real types), and with `mailbox` the type of its mailboxes."""
    inputs = task_inputs(task)
    specs = [ObjectTypeSpec(task_type(model, task.name), "TaskType", (
        method("Run", inputs, task_outputs(task)), method("StartTask", inputs, START_OUT),
        method("GetTaskResult", GET_RESULT_IN, get_task_result_outputs(task))),
        description=f"task {task.name} of model {model}")]
    if mailbox:
        members = [var(n, TASK_TYPES[c.type]) for n, c in task.inputs.items()]
        members += [var(n, TASK_TYPES[f.type]) for n, f in task.output.items()]
        specs.append(ObjectTypeSpec(task_mailbox_type(model, task.name), "MailboxType",
                                    (*members, var("FinishReason", V.String)),
                                    description=f"a mailbox of task {task.name} of model {model}"))
    return specs


def model_type(kind: str, classifier: bool) -> str:
    if kind == "generative":
        return "GenerativeModelType"
    return "ClassifierType" if classifier else "TensorModelType"
