"""`models.NAME.tasks`: typed tasks of a generative model (a prompt template over typed inputs, an output schema
whose fields become typed OPC UA output arguments and PLC UDT members), read and checked here.

    tasks:
      alarm-triage:
        prompt: "Classify this alarm: {AlarmText}"
        inputs:  {AlarmText: {type: String, max_length: 200}}
        output:
          Severity: {type: enum, values: [low, medium, high]}
          StopLine: {type: Boolean}
          Reason:   {type: String, max_length: 80, required: false}

The output schema is a deliberately small subset (what a PLC can hold in a UDT): String (max_length <= 254, an S7
STRING), Boolean, Int32 and Double with optional bounds, enum of strings. Anything else (objects, arrays, patterns,
unknown types or keys) is refused with its file, line and key. Whether the model's tokenizer can spell each enum
value is checked by checks.check_tasks, which reads the tokenizer from the model file (no weights).
"""
from __future__ import annotations

import math
import re
import string
from dataclasses import dataclass
from typing import Any

from yaml.nodes import Node, ScalarNode

from .rules import MODEL_NAME, ListOf, Scalar, boolean, integer, number, optional, setting, required, text
from .yaml_walk import INVALID, Context, key_path, named_items, parse_fields, shown

INPUT_TYPES = ("String", "Int32", "Double", "Boolean")
FIELD_TYPES = ("String", "Int32", "Double", "Boolean", "enum")
OUTPUT_STRING_MAX = 254  # an S7 STRING holds 254 characters: a field a PLC reads into a UDT member
INPUT_STRING_MAX = 16382  # an S7 WSTRING holds 16382
ENUM_VALUE_MAX = 64
INT32 = (-2**31, 2**31 - 1)
# A task's names become argument names, UDT members (IEC 61131-3 identifiers: no '-', no '__') and JSON keys.
IEC_NAME = re.compile(r"[A-Za-z](?:_?[A-Za-z0-9])*")
# Names a task's inputs and fields may not take: the answer's own outputs and the task mailbox's variables.
RESERVED_NAMES = ("FinishReason", "ModelVersion", "Request", "Busy", "Done", "Error", "ErrorCode", "Response",
                  "JobId", "WaitMs")
DEFAULT_TASK_MAX_TOKENS = 128


def _type_check(types: tuple[str, ...]):
    def check(v: Any, expect: str) -> str | None:
        if v in types:
            return None
        if isinstance(v, str) and v.lower() in ("object", "array", "list", "dict", "mapping", "struct"):
            return (f"type {shown(v)} is outside the supported subset: a task's output is flat (one field per "
                    f"output argument); expected one of {', '.join(types)}")
        hint = next((t for t in types if isinstance(v, str) and t.lower() == v.lower()), None)
        return f"expected one of {', '.join(types)}, got {shown(v)}" + (f"; did you mean '{hint}'?" if hint else "")
    return check


_ENUM_VALUE = text(f"a value of 1-{ENUM_VALUE_MAX} printable characters",
                   lambda v: v.isprintable() and v.strip() == v and 0 < len(v), max_len=ENUM_VALUE_MAX)


@dataclass
class TaskInputConfig:
    """One typed input of a task: an input argument of its Run method (and a variable of its mailbox)."""

    type: str = required(Scalar("one of " + ", ".join(INPUT_TYPES), _type_check(INPUT_TYPES)))
    max_length: int | None = setting(None, optional(integer(1, INPUT_STRING_MAX)))  # String: characters (null: 254)
    minimum: float | None = setting(None, optional(number()))  # Int32 / Double: the smallest value accepted
    maximum: float | None = setting(None, optional(number()))  # Int32 / Double: the largest value accepted

    @property
    def effective_max_length(self) -> int:
        return self.max_length if self.max_length is not None else OUTPUT_STRING_MAX


@dataclass
class TaskFieldConfig:
    """One field of a task's output: an output argument of its Run method, decoded under the schema's grammar."""

    type: str = required(Scalar("one of " + ", ".join(FIELD_TYPES), _type_check(FIELD_TYPES)))
    values: list[str] = setting([], ListOf(_ENUM_VALUE, "enum values"))  # enum: the values the field may take
    max_length: int | None = setting(None, optional(integer(1, OUTPUT_STRING_MAX)))  # String: characters (null: 254)
    minimum: float | None = setting(None, optional(number()))  # Int32 / Double: the smallest value answered
    maximum: float | None = setting(None, optional(number()))  # Int32 / Double: the largest value answered
    # false: the model may leave the field out (a PLC then reads "", false or 0); meant for a short free text
    required: bool = setting(True, boolean())

    @property
    def effective_max_length(self) -> int:
        return self.max_length if self.max_length is not None else OUTPUT_STRING_MAX


def _check_numbers(cfg, nodes: dict[str, Node], ctx: Context, where: str, typ: str) -> bool:
    ok = True
    for key in ("minimum", "maximum"):
        value = getattr(cfg, key)
        if value is None:
            continue
        if typ == "Int32" and (value != math.floor(value) or not INT32[0] <= value <= INT32[1]):
            ctx.error(nodes[key], f"{where}.{key}", f"expected an Int32 (an integer in [{INT32[0]}, {INT32[1]}]), "
                      f"got {shown(value)}")
            ok = False
    if ok and cfg.minimum is not None and cfg.maximum is not None and cfg.minimum > cfg.maximum:
        ctx.error(nodes["maximum"], f"{where}.maximum", f"expected a number >= minimum ({cfg.minimum:g}), got "
                  f"{cfg.maximum:g}")
        ok = False
    return ok


def _only_for(cfg_nodes: dict[str, Node], ctx: Context, where: str, typ: str, allowed: dict[str, tuple[str, ...]]
              ) -> bool:
    ok = True
    for key, types in allowed.items():
        if key in cfg_nodes and typ not in types:
            ctx.error(cfg_nodes[key], f"{where}.{key}", f"{key} applies to {' and '.join(types)} only (this is "
                      f"{typ}); a schema outside the supported subset is refused")
            ok = False
    return ok


def _named_entries(node: Node, ctx: Context, path: str, noun: str, expect: str):
    items = named_items(node, ctx, path, expect, noun)
    if items is None:
        return None
    out = []
    for name, key_node, value_node in items:
        where = key_path(path, name)
        if not IEC_NAME.fullmatch(name) or len(name) > 64 or name in RESERVED_NAMES:
            ctx.error(key_node, where, f"a {noun} must be a PLC identifier: a letter, then letters, digits and "
                      f"single underscores, at most 64 characters, none of {', '.join(RESERVED_NAMES)}; got "
                      f"{shown(name)}")
            continue
        out.append((name, key_node, value_node, where))
    return out


@dataclass(frozen=True)
class InputsRule:
    expect: str = "a mapping of input names to {type: String | Int32 | Double | Boolean, max_length, minimum, maximum}"

    def parse(self, node: Node, ctx: Context, path: str) -> Any:
        entries = _named_entries(node, ctx, path, "input name", self.expect)
        if entries is None:
            return INVALID
        out: dict[str, TaskInputConfig] = {}
        for name, _key, value_node, where in entries:
            parsed = parse_fields(TaskInputConfig, value_node, ctx, where, where=f"input '{name}'")
            if not parsed.complete or where in ctx.bad:
                continue
            cfg = TaskInputConfig(**parsed.values)
            ok = _only_for(parsed.nodes, ctx, where, cfg.type, {"max_length": ("String",),
                                                                "minimum": ("Int32", "Double"),
                                                                "maximum": ("Int32", "Double")})
            if ok and _check_numbers(cfg, parsed.nodes, ctx, where, cfg.type):
                out[name] = cfg
        if len(out) != len(entries):
            ctx.bad.add(path)
            return INVALID
        return out


@dataclass(frozen=True)
class OutputRule:
    expect: str = ("a non-empty mapping of field names to {type: String | Boolean | Int32 | Double | enum, values, "
                   "max_length, minimum, maximum, required}")

    def parse(self, node: Node, ctx: Context, path: str) -> Any:
        entries = _named_entries(node, ctx, path, "field name", self.expect)
        if entries is None:
            return INVALID
        empty = (isinstance(node, ScalarNode) and ctx.scalar(node) is None) or not getattr(node, "value", None)
        if empty and path not in ctx.bad:
            ctx.error(node, path, f"expected {self.expect}, got no field")
            return INVALID
        out: dict[str, TaskFieldConfig] = {}
        for name, _key, value_node, where in entries:
            parsed = parse_fields(TaskFieldConfig, value_node, ctx, where, where=f"field '{name}'")
            if not parsed.complete or where in ctx.bad:
                continue
            cfg = TaskFieldConfig(**parsed.values)
            ok = _only_for(parsed.nodes, ctx, where, cfg.type, {"values": ("enum",), "max_length": ("String",),
                                                                "minimum": ("Int32", "Double"),
                                                                "maximum": ("Int32", "Double")})
            if ok and cfg.type == "enum" and not cfg.values:
                ctx.error(parsed.nodes.get("values", value_node), f"{where}.values",
                          "an enum needs its values: a non-empty list of strings")
                ok = False
            if ok and _check_numbers(cfg, parsed.nodes, ctx, where, cfg.type):
                out[name] = cfg
        if len(out) != len(entries):
            ctx.bad.add(path)
            return INVALID
        return out


@dataclass
class TaskConfig:
    """`models.NAME.tasks.TASK`: becomes the object Models/NAME/Tasks/TASK with its method Run."""

    # the prompt: a template over the inputs' names, e.g. "Classify this alarm: {AlarmText}" ({{ and }}: braces)
    prompt: str = required(text("a non-empty prompt template such as 'Classify: {AlarmText}'", max_len=16384))
    inputs: dict[str, TaskInputConfig] = setting({}, InputsRule())
    output: dict[str, TaskFieldConfig] = setting({}, OutputRule())
    # tokens the answer may take (null: 128, at most engine.max_new_tokens); a schema that cannot be completed
    # within them answers BadNoDataAvailable
    max_tokens: int | None = setting(None, optional(integer(1)))
    temperature: float = setting(0.0, number(0, 2))  # 0: greedy and deterministic
    name: str = ""  # filled by the rule

    @property
    def effective_max_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else DEFAULT_TASK_MAX_TOKENS

    def prompt_for(self, values: dict[str, Any]) -> str:
        """The prompt with each input's value put in (Booleans as true/false)."""
        shown_ = {k: ("true" if v else "false") if isinstance(v, bool) else v for k, v in values.items()}
        return self.prompt.format_map(shown_)


def template_names(prompt: str) -> list[tuple[str, str]]:
    """(field name, what is wrong or "") for every replacement field of a prompt template; ValueError when the
    template itself is malformed (a lone brace)."""
    out = []
    for _literal, name, spec, conversion in string.Formatter().parse(prompt):
        if name is None:
            continue
        problem = ""
        if not name or not IEC_NAME.fullmatch(name):
            problem = "a replacement field must name an input: {Name}"
        elif spec or conversion:
            problem = "a replacement field takes no format or conversion: write {Name}"
        out.append((name, problem))
    return out


@dataclass(frozen=True)
class TasksRule:
    """`tasks`: task name -> {prompt, inputs, output, max_tokens, temperature}; the template's names are checked
    against the inputs here, the tokenizer and the engine's bounds in checks.check_tasks."""

    expect: str = "a mapping of task names to {prompt, inputs, output, max_tokens, temperature}"

    def parse(self, node: Node, ctx: Context, path: str) -> Any:
        items = named_items(node, ctx, path, self.expect, "task name")
        if items is None:
            return INVALID
        out: dict[str, TaskConfig] = {}
        for name, key_node, value_node in items:
            where = key_path(path, name)
            if not MODEL_NAME.fullmatch(name):
                ctx.error(key_node, where, "a task name must start with a letter and hold at most 64 characters "
                          f"A-Z a-z 0-9 _ -, got {shown(name)}")
                continue
            parsed = parse_fields(TaskConfig, value_node, ctx, where, where=f"task '{name}'")
            if not parsed.complete or where in ctx.bad:
                continue
            task = TaskConfig(**parsed.values, name=name)
            if self._check(task, parsed.nodes, ctx, where):
                out[name] = task
        return out

    @staticmethod
    def _check(task: TaskConfig, nodes: dict[str, Node], ctx: Context, where: str) -> bool:
        prompt_node, key = nodes["prompt"], f"{where}.prompt"
        try:
            names = template_names(task.prompt)
        except ValueError as e:
            ctx.error(prompt_node, key, f"the template is malformed ({e}); write {{{{ and }}}} for a brace")
            return False
        ok = True
        for name, problem in names:
            if problem:
                ctx.error(prompt_node, key, f"{problem}, got {{{name}}}")
                ok = False
            elif name not in task.inputs and f"{where}.inputs" not in ctx.bad:
                ctx.error(prompt_node, key, f"the template names {{{name}}}, which is not an input of the task "
                          f"(inputs: {', '.join(task.inputs) or 'none'})")
                ok = False
        used = {n for n, _ in names}
        for name in task.inputs:
            if name not in used:
                ctx.error(nodes.get("inputs"), f"{where}.inputs.{name}", f"input '{name}' is not used by the prompt"
                          f" template: write {{{name}}} where its value belongs")
                ok = False
        both = sorted(set(task.inputs) & set(task.output))
        if both:
            ctx.error(nodes.get("output"), f"{where}.output.{both[0]}", f"'{both[0]}' is both an input and an "
                      "output field: a task mailbox holds both as variables of one object")
            ok = False
        return ok and f"{where}.inputs" not in ctx.bad and f"{where}.output" not in ctx.bad

