"""Reading a whole file: the top-level sections, users, models and mailboxes, then the checks; the demo.
(`appliance check-config` is appliance/cli/serve.py.)"""
from __future__ import annotations

import dataclasses
import importlib.resources
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .checks import (check_alarm_names, check_alarm_sources, check_certificate_roles, check_draft_tokenizers,
                     check_fallbacks, check_mailboxes, check_max_samples, check_model, check_tasks, cross_check,
                     onnx_sample_floats)
from .sources import check_sources, parse_sources
from .schema import MODEL_NAME, SECTIONS, TOP_KEYS, ApplianceConfig, MailboxConfig, ModelConfig, UserConfig
from .yaml_walk import (
    ConfigError, Context, as_mapping, did_you_mean, key_path, mapping_items, parse_fields, shown,
)

DEFAULT_CONFIG_PATH = Path("/etc/appliance/appliance.yaml")


# ----------------------------------------------------------------------------------------------------------------
# The top-level sections


def _parse_users(node: Node | None, ctx: Context) -> list[UserConfig]:
    if node is None or (isinstance(node, ScalarNode) and ctx.scalar(node) is None):
        return []
    if not isinstance(node, SequenceNode):
        ctx.error(node, "users", "expected a list of users, each with name, role and password_hash")
        return []
    users: list[UserConfig] = []
    first_line: dict[str, int] = {}
    for i, item in enumerate(node.value):
        path = f"users[{i}]"
        parsed = parse_fields(UserConfig, item, ctx, path, where="a user")
        if not parsed.complete:
            continue
        user = UserConfig(**parsed.values)
        if user.name in first_line:
            ctx.error(parsed.nodes["name"], f"{path}.name",
                      f"duplicate user name '{user.name}' (first on line {first_line[user.name]})")
            continue
        first_line[user.name] = item.start_mark.line + 1
        users.append(user)
    return users


def _check_name(name: str, what: str, key_node: Node, path: str, ctx: Context) -> bool:
    """A model's or mailbox's name (it becomes a browse name and a metric label)."""
    if MODEL_NAME.fullmatch(name):
        return True
    ctx.error(key_node, path, f"a {what} name must start with a letter and hold at most 64 characters "
              f"A-Z a-z 0-9 _ -, got {shown(name)}")
    return False


def _parse_models(node: Node | None, root: MappingNode | None, ctx: Context) -> dict[str, ModelConfig]:
    hint = "a mapping of model names to their settings (kind, path, ...)"
    mapping = as_mapping(node, ctx, "models", hint)
    if mapping is None or not mapping.value:
        if "models" not in ctx.bad:
            ctx.error(mapping or node or root, "models",
                      f"at least one model is required: expected {hint}, e.g. models: {{my-model: {{kind: tensor, "
                      "path: model.onnx}}")
        return {}
    models: dict[str, ModelConfig] = {}
    for name, key_node, value_node in mapping_items(mapping, ctx, "models", "model name"):
        path = key_path("models", name)
        name_ok = _check_name(name, "model", key_node, path, ctx)
        parsed = parse_fields(ModelConfig, value_node, ctx, path, where=f"model '{name}'")
        resolved = check_model(parsed, ctx, path)  # checked even when incomplete: report every problem
        if name_ok and parsed.complete and resolved is not None:
            models[name] = ModelConfig(**parsed.values, name=name, resolved_path=resolved)
    return models


def _parse_mailboxes(node: Node | None, ctx: Context) -> dict[str, MailboxConfig]:
    mapping = as_mapping(node, ctx, "mailboxes", "a mapping of mailbox names to their settings (model, writers)")
    if mapping is None:
        return {}
    boxes: dict[str, MailboxConfig] = {}
    for name, key_node, value_node in mapping_items(mapping, ctx, "mailboxes", "mailbox name"):
        path = key_path("mailboxes", name)
        name_ok = _check_name(name, "mailbox", key_node, path, ctx)
        parsed = parse_fields(MailboxConfig, value_node, ctx, path, where=f"mailbox '{name}'")
        if name_ok and parsed.complete:
            boxes[name] = MailboxConfig(**parsed.values, name=name)
    return boxes


def _build(root: Node | None, ctx: Context, spelling: bool = False) -> ApplianceConfig:
    mapping = as_mapping(root, ctx, "", "a mapping with the sections " + ", ".join(TOP_KEYS))
    if mapping is not None:
        ctx.nodes[""] = mapping
    top: dict[str, Node] = {}
    for key, key_node, value_node in (mapping_items(mapping, ctx, "") if mapping else []):
        if key not in TOP_KEYS:
            ctx.error(key_node, key_path("", key), f"unknown section '{key}'; {did_you_mean(key, TOP_KEYS)}"
                      f"valid sections: {', '.join(TOP_KEYS)}")
            continue
        top[key] = value_node
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        sections[name] = cls(**parse_fields(cls, top.get(name), ctx, name).values)
    users = _parse_users(top.get("users"), ctx)
    models = _parse_models(top.get("models"), mapping, ctx)
    mailboxes = _parse_mailboxes(top.get("mailboxes"), ctx)
    sources = parse_sources(top.get("sources"), ctx)
    cfg = ApplianceConfig(users=users, models=models, mailboxes=mailboxes, sources=sources, source=ctx.source,
                          **sections)
    cross_check(cfg, ctx)
    check_fallbacks(cfg, ctx)
    check_mailboxes(cfg, ctx)
    cfg.warnings.extend(check_sources(cfg, ctx, _sample_floats))  # feeds become alarm sources: before those checks
    check_alarm_sources(cfg, ctx)
    check_alarm_names(cfg, ctx)
    check_max_samples(cfg, ctx)
    check_certificate_roles(cfg, ctx)
    check_tasks(cfg, ctx, spelling)
    if spelling:
        check_draft_tokenizers(cfg, ctx)
    return cfg


def _sample_floats(model) -> int | None:
    """The floats of one input of a model whose file says its shape (ONNX), else None (checked at load)."""
    path = model.resolved_path
    return onnx_sample_floats(path) if path is not None and path.suffix == ".onnx" and path.is_file() else None


# ----------------------------------------------------------------------------------------------------------------
# Public entry points


def load_config_text(text: str, source: str = "<string>", base_dir: Path | None = None,
                     spelling: bool = False) -> ApplianceConfig:
    """Parse and validate YAML text; relative paths resolve against `base_dir` (default: the current directory).
    spelling: also check that each task's enum values are spelt by the model's tokenizer, and that a draft model has
    its model's tokenizer (reads the model files' headers: seconds for a GGUF file; `appliance check-config` asks
    for it)."""
    ctx = Context(source=source, base_dir=Path(base_dir if base_dir is not None else Path.cwd()).resolve())
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else 1
        context = f" ({e.context} on line {e.context_mark.line + 1})" if e.context and e.context_mark else ""
        raise ConfigError([f"{source}:{line}: YAML syntax error: {e.problem or e.context}{context}"]) from None
    except yaml.YAMLError as e:
        raise ConfigError([f"{source}:1: YAML syntax error: {e}"]) from None
    except RecursionError:
        raise ConfigError([f"{source}:1: YAML nesting is too deep for a configuration file"]) from None
    cfg = _build(root, ctx, spelling)
    if ctx.problems:
        ctx.problems.sort(key=lambda p: p[0])  # stable: file order, then discovery order within a line
        raise ConfigError(list(dict.fromkeys(message for _, message in ctx.problems)))
    return cfg


def load_config(path: str | Path, spelling: bool = False) -> ApplianceConfig:
    """Read a configuration file; raises ConfigError listing every problem (spelling: see load_config_text)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError([f"{path}: cannot read the configuration file: {e.strerror or e}"]) from None
    try:
        text_ = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError([f"{path}:{line}: the file is not UTF-8 text"]) from None
    return load_config_text(text_, source=str(path), base_dir=path.resolve().parent, spelling=spelling)


def demo_yaml_text() -> str:
    return importlib.resources.files("appliance").joinpath("demo.yaml").read_text(encoding="utf-8")


def demo_config(state_dir: Path | None = None) -> ApplianceConfig:
    """The built-in demo; its state lives in `state_dir` (default ./.appliance in the current directory)."""
    source = str(importlib.resources.files("appliance").joinpath("demo.yaml"))
    cfg = load_config_text(demo_yaml_text(), source=source, base_dir=Path.cwd())
    if state_dir is not None:
        server = dataclasses.replace(cfg.server, state_dir=Path(state_dir).resolve())
        audit = dataclasses.replace(cfg.audit, path=None)  # re-derived from the new state_dir
        cfg = dataclasses.replace(cfg, server=server, audit=audit)
    return cfg
