"""A task's output schema as the JSON Schema the engine decodes under, and the engine's answer read back into typed
values (validated again: the grammar makes an invalid answer impossible, and this says so if it ever is not).

UA-free and torch-free: the UA handlers (uaserver/tasks.py) call it, bench and tests too.
"""
from __future__ import annotations

import json
import math
from typing import Any

from .config.tasks import INT32, TaskConfig, TaskFieldConfig
from .errors import ApplianceError, EngineFailure

INCOMPLETE = "incomplete"  # the reason of AnswerIncomplete (uaserver/status.py: BadNoDataAvailable)


class AnswerIncomplete(ApplianceError):
    """The answer could not be completed under the task's schema within its max_tokens (or the context, or the
    deadline of a job): no partial value is shown as Good."""

    reason = INCOMPLETE


class AnswerInvalid(EngineFailure):
    """The engine's answer does not match the task's schema (BadInternalError; counted, never expected)."""


def json_schema(task: TaskConfig) -> dict[str, Any]:
    """The output fields in order as one JSON object's properties, every key listed, nothing else allowed."""
    properties: dict[str, Any] = {}
    for name, f in task.output.items():
        properties[name] = _field_schema(f)
    return {"type": "object", "properties": properties,
            "required": [n for n, f in task.output.items() if f.required], "additionalProperties": False}


def _field_schema(f: TaskFieldConfig) -> dict[str, Any]:
    if f.type == "String":
        return {"type": "string", "maxLength": f.effective_max_length}
    if f.type == "Boolean":
        return {"type": "boolean"}
    if f.type == "enum":
        return {"type": "string", "enum": list(f.values)}
    out: dict[str, Any] = {"type": "integer" if f.type == "Int32" else "number"}
    low, high = f.minimum, f.maximum
    if f.type == "Int32":  # an Int32 output argument holds no more
        low = INT32[0] if low is None else max(int(low), INT32[0])
        high = INT32[1] if high is None else min(int(high), INT32[1])
    if low is not None:
        out["minimum"] = low
    if high is not None:
        out["maximum"] = high
    return out


def schema_text(task: TaskConfig) -> str:
    """The schema as the engine receives it (`grammar=`): compact and stable, so the engine compiles it once."""
    return json.dumps(json_schema(task), separators=(",", ":"), ensure_ascii=False)


ZERO = {"String": "", "enum": "", "Boolean": False, "Int32": 0, "Double": 0.0}


def read_answer(task: TaskConfig, text: str) -> dict[str, Any]:
    """Field name -> typed value of a complete answer, in the schema's order; a field the model left out (only an
    optional one can be) holds its type's zero. AnswerInvalid when the text breaks the schema."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        raise AnswerInvalid("the answer is not one JSON document") from None
    if not isinstance(doc, dict):
        raise AnswerInvalid("the answer is not a JSON object")
    extra = set(doc) - set(task.output)
    if extra:
        raise AnswerInvalid(f"the answer holds fields the schema does not: {sorted(extra)[:3]}")
    out: dict[str, Any] = {}
    for name, f in task.output.items():
        if name not in doc:
            if f.required:
                raise AnswerInvalid(f"the answer lacks the required field {name}")
            out[name] = ZERO[f.type]
            continue
        out[name] = _field_value(name, f, doc[name])
    return out


def _field_value(name: str, f: TaskFieldConfig, value: Any) -> Any:
    def bad(why: str):
        return AnswerInvalid(f"field {name}: {why}")
    if f.type in ("String", "enum"):
        if not isinstance(value, str):
            raise bad("not a string")
        if f.type == "enum" and value not in f.values:
            raise bad("not one of the enum's values")
        if f.type == "String" and len(value) > f.effective_max_length:
            raise bad("longer than its max_length")
        return value
    if f.type == "Boolean":
        if not isinstance(value, bool):
            raise bad("not a boolean")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad("not a number")
    if f.type == "Int32":
        if isinstance(value, float) and not value.is_integer():
            raise bad("not an integer")
        value = int(value)
        low, high = INT32
    else:
        value = float(value)
        if not math.isfinite(value):
            raise bad("not finite")
        low, high = -math.inf, math.inf
    if f.minimum is not None:
        low = max(low, f.minimum)
    if f.maximum is not None:
        high = min(high, f.maximum)
    if not low <= value <= high:
        raise bad("out of its bounds")
    return value
