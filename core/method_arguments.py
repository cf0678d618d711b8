"""The argument lists of the contract's methods (names, OPC UA types, descriptions), declared once: the ObjectTypes
(core/object_types.py), the server's method tables (uaserver/method_table.py), `appliance plc-types` and the
NodeSet2 export all read them.
"""
from __future__ import annotations

from asyncua import ua

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
GENERATE_OUT = [argument("Text", V.String, description="the reply, at most the model's max_text_chars"),
                argument("TokenCount", V.UInt32, description="tokens of the reply"),
                argument("FinishReason", V.String, description="stop | length | context_full | deadline"),
                argument("ContextTokens", V.UInt32, description="tokens the conversation holds now"),
                argument("ContextLost", V.Boolean, description="the earlier conversation was dropped since the "
                         "last call"),
                argument("ModelVersion", V.String, description="version of the weights that wrote Text")]
CLASSIFY_OUT = [argument("ClassIndex", V.Int32, True, "arg-max class per sample"),
                argument("Label", V.String, True, "its label"),
                argument("Confidence", V.Float, True, "its probability"),
                argument("ModelVersion", V.String, description="version of the weights that computed the result")]
CONVERSATION_ID = argument("ConversationId", V.String, description="1-64 printable ASCII; yours alone")
CONVERSE_IN = [CONVERSATION_ID, *GENERATE_IN]
JOB_ID = argument("JobId", V.UInt32, description="a job of the calling identity (certificate + user)")
WAIT_MS = argument("WaitMs", V.UInt32, description="wait at most this long for the result (0: answer at once)")
DONE = argument("Done", V.Boolean, description="false: the job still runs (Text holds what is there so far)")
START_GENERATE_IN = [argument("ConversationId", V.String, description="empty: the calling session's conversation"),
                     *GENERATE_IN]
START_OUT = [JOB_ID]
GET_RESULT_IN = [JOB_ID, WAIT_MS]
GET_INFER_RESULT_OUT = [DONE, *INFER_OUT]
GET_GENERATE_RESULT_OUT = [DONE, *GENERATE_OUT]
CHOOSE_IN = [argument("Prompt", V.String, description="non-empty UTF-8, at most 16 KiB"),
             argument("Options", V.String, True, "the labels to choose among: 1 .. 16, each 1 .. 256 characters")]
CHOOSE_OUT = [argument("Index", V.Int32, description="the option with the highest score (0-based; the first on "
                       "ties)"),
              argument("Option", V.String, description="that option's text"),
              argument("Scores", V.Float, True, "per option: the log-probability of its tokens after the prompt"),
              argument("ModelVersion", V.String, description="version of the weights that scored the options")]
FINISH_REASON = argument("FinishReason", V.String, description="stop: the answer is complete (a Bad status "
                         "answers any other)")
RELOAD_IN = [argument("Name", V.String, description="the model's name")]
RELOAD_OUT = [argument("Version", V.String, description="the version now serving")]
PROMOTE_IN = [argument("Model", V.String, description="the model's name"),
              argument("Variant", V.String, description="one of the model's YAML variants, 'main' for its own path, "
                       "or empty to restore the configured split")]


# ---- a task's arguments (models.NAME.tasks: core/config/tasks.py) ----

TASK_TYPES = {"String": V.String, "enum": V.String, "Int32": V.Int32, "Double": V.Double, "Boolean": V.Boolean}


def _bounds(cfg) -> str:
    parts = [f">= {cfg.minimum:g}" if cfg.minimum is not None else "",
             f"<= {cfg.maximum:g}" if cfg.maximum is not None else ""]
    return " and ".join(p for p in parts if p)


def task_inputs(task) -> list[ua.Argument]:
    """One argument per input, in the YAML's order."""
    out = []
    for name, cfg in task.inputs.items():
        what = (f"at most {cfg.effective_max_length} characters" if cfg.type == "String"
                else _bounds(cfg) if cfg.type != "Boolean" else "")
        out.append(argument(name, TASK_TYPES[cfg.type], description=what))
    return out


def task_fields(task) -> list[ua.Argument]:
    """One argument per output field, in the YAML's order (enums as String)."""
    out = []
    for name, f in task.output.items():
        what = (f"one of: {', '.join(f.values)}" if f.type == "enum"
                else f"at most {f.effective_max_length} characters" if f.type == "String"
                else _bounds(f) if f.type != "Boolean" else "")
        if not f.required:
            what = (what + "; " if what else "") + "optional: empty / false / 0 when the model left it out"
        out.append(argument(name, TASK_TYPES[f.type], description=what))
    return out


def task_outputs(task) -> list[ua.Argument]:
    """Run's outputs: the fields, FinishReason, ModelVersion."""
    return [*task_fields(task), FINISH_REASON,
            argument("ModelVersion", V.String, description="version of the weights that answered")]


def get_task_result_outputs(task) -> list[ua.Argument]:
    return [argument("Done", V.Boolean, description="false: the job still runs (the fields are empty until then)"),
            *task_outputs(task)]
