"""The YAML walker's core: composed YAML nodes -> a dataclass's fields, every problem recorded with its line.

Nothing here knows the appliance's settings: `parse_fields` reads the keys of any dataclass whose fields carry a
`rule` (see rules.py) and asks each rule to parse its value node. Problems are collected in a `Context` as
"file:line: key: message" and raised together as one `ConfigError` by the loader (loader.py).
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode


# ----------------------------------------------------------------------------------------------------------------
# Errors


class ConfigError(Exception):
    """Every problem found in one configuration, each as "file:line: key: message"."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


# ----------------------------------------------------------------------------------------------------------------
# How a problem is worded


def shown(value: Any) -> str:
    """A value as an engineer wrote it, short enough for one error line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value if len(value) <= 60 else value[:57] + "...")
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return str(value) if len(str(value)) <= 60 else str(value)[:57] + "..."


def did_you_mean(word: str, options: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    if not close:
        lowered = {o.lower(): o for o in options}
        close = [lowered[word.lower()]] if word.lower() in lowered else []
    return f"did you mean '{close[0]}'? " if close else ""


def key_path(parent: str, key: str) -> str:
    simple = re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", key)
    if not parent:
        return key if simple else f"[{key!r}]"
    return f"{parent}.{key}" if simple else f"{parent}[{key!r}]"


# ----------------------------------------------------------------------------------------------------------------
# The walk's state: where problems go, which keys were rejected, the node of every key


class _Invalid:
    """Marks a value that failed its rule (its error is already recorded)."""


INVALID = _Invalid()


@dataclass
class Context:
    source: str
    base_dir: Path
    problems: list[tuple[int, str]] = field(default_factory=list)
    bad: set[str] = field(default_factory=set)  # key paths whose value was rejected: skip cross-checks on them
    nodes: dict[str, Node] = field(default_factory=dict)  # key path -> its value node, for cross-check lines
    constructor: yaml.constructor.SafeConstructor = field(default_factory=yaml.constructor.SafeConstructor)

    def error(self, node: Node | None, path: str, message: str) -> None:
        line = node.start_mark.line + 1 if node is not None else 1
        where = f"{path}: " if path else ""
        self.problems.append((line, f"{self.source}:{line}: {where}{message}"))
        if path:
            self.bad.add(path)

    def scalar(self, node: ScalarNode) -> Any:
        try:
            return self.constructor.construct_object(node, deep=True)
        except (yaml.YAMLError, ValueError, TypeError):  # e.g. `!custom x` or `!!int abc`
            self.error(node, "", f"cannot read {node.value!r} as YAML tag {node.tag!r}; write a plain value")
            return node.value


def node_kind(node: Node) -> str:
    return "a mapping" if isinstance(node, MappingNode) else "a list"


# ----------------------------------------------------------------------------------------------------------------
# Mappings -> dataclass fields


def mapping_items(node: MappingNode, ctx: Context, path: str, noun: str = "key",
           merging: frozenset[int] = frozenset()) -> list[tuple[str, Node, Node]]:
    """The (key, key node, value node) pairs of a mapping; a repeated key is an error (YAML would keep the last).
    Merge keys ('<<: *anchor') are honoured: the merged keys come first and the mapping's own keys override them."""
    first_line: dict[str, int] = {}
    merged: dict[str, tuple[str, Node, Node]] = {}
    own: list[tuple[str, Node, Node]] = []
    for key_node, value_node in node.value:
        if not isinstance(key_node, ScalarNode):
            ctx.error(key_node, path, f"a {noun} must be a plain name, got {node_kind(key_node)}")
            continue
        if key_node.tag == "tag:yaml.org,2002:merge":
            sources = value_node.value if isinstance(value_node, SequenceNode) else [value_node]
            for source in sources:
                if not isinstance(source, MappingNode) or id(source) in merging | {id(node)}:
                    ctx.error(source, path, "a merge key ('<<') takes a mapping or a list of mappings, not itself")
                    continue
                for item in mapping_items(source, ctx, path, noun, merging | {id(node)}):
                    merged.setdefault(item[0], item)  # YAML: the first merged mapping wins
            continue
        key = key_node.value  # the text as written: thumbprints like 12:34:.. must not become sexagesimal ints
        if key in first_line:
            ctx.error(key_node, key_path(path, key), f"duplicate {noun} '{key}' (first on line {first_line[key]})")
            continue
        first_line[key] = key_node.start_mark.line + 1
        own.append((key, key_node, value_node))
    return [item for key, item in merged.items() if key not in first_line] + own


def as_mapping(node: Node | None, ctx: Context, path: str, expect: str) -> MappingNode | None:
    """A section's node; an empty section (null) counts as an empty mapping, so every default applies."""
    if node is None:
        return None
    if isinstance(node, ScalarNode) and ctx.scalar(node) is None:
        return None
    if not isinstance(node, MappingNode):
        got = shown(ctx.scalar(node)) if isinstance(node, ScalarNode) else "a list"
        ctx.error(node, path, f"expected {expect}, got {got}")
        return None
    return node


def named_items(node: Node | None, ctx: Context, path: str, expect: str,
                noun: str) -> list[tuple[str, Node, Node]] | None:
    """The (name, key node, value node) entries of a mapping of named entries (variants, sources, feeds, tasks):
    [] for an empty one (null), None (the error reported) for anything but a mapping."""
    if isinstance(node, ScalarNode) and ctx.scalar(node) is None:
        return []
    mapping = as_mapping(node, ctx, path, expect)
    return None if mapping is None else mapping_items(mapping, ctx, path, noun)


@dataclass
class Fields:
    """What one mapping gave for a dataclass: its valid values, the value node of every key present, and whether
    every required key is present and valid (only then can the dataclass be built)."""

    values: dict[str, Any]
    nodes: dict[str, Node]
    complete: bool


def parse_fields(cls: type, node: Node | None, ctx: Context, path: str, where: str | None = None) -> Fields:
    """The YAML keys of one dataclass, each checked by its field's rule; every problem is recorded."""
    keyed = {f.name: f for f in dataclasses.fields(cls) if "rule" in f.metadata}
    valid_keys = list(keyed)
    mapping = as_mapping(node, ctx, path, f"a mapping with keys {', '.join(valid_keys)}")
    if mapping is None and node is not None and path in ctx.bad:
        return Fields({}, {}, complete=False)
    if mapping is not None:
        ctx.nodes[path] = mapping
    values: dict[str, Any] = {}
    nodes: dict[str, Node] = {}
    for key, key_node, value_node in (mapping_items(mapping, ctx, path) if mapping else []):
        if key not in keyed:
            place = f"in {where or path}" if (where or path) else "at the top level"
            ctx.error(key_node, key_path(path, key), f"unknown key '{key}' {place}; "
                      f"{did_you_mean(key, valid_keys)}valid keys: {', '.join(valid_keys)}")
            continue
        nodes[key] = ctx.nodes[key_path(path, key)] = value_node
        value = _parse_value(keyed[key], value_node, ctx, key_path(path, key))
        if value is not INVALID:
            values[key] = value
    complete = True
    for name, f in keyed.items():
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            continue
        if name not in nodes:
            ctx.error(mapping if mapping is not None else node, key_path(path, name),
                      f"missing required key '{name}': expected {f.metadata['rule'].expect}")
        complete = complete and name in values
    return Fields(values, nodes, complete)


def _parse_value(f: dataclasses.Field, node: Node, ctx: Context, path: str) -> Any:
    return f.metadata["rule"].parse(node, ctx, path)
