"""The settings: every section, key, default and rule of the appliance's YAML, read in one place.

Each dataclass field that is a YAML key is declared with `setting(default, rule)` or `required(rule)` (rules.py);
fields without a rule (a model's `name`, `resolved_path`) are filled by the loader. `SECTIONS` and `TOP_KEYS`
say which sections a file may hold.
"""
from __future__ import annotations

import dataclasses
import math
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from yaml.nodes import Node

from .builtin import BUILTIN_MODELS
from .tasks import TaskConfig, TasksRule
from .rules import (
    DNS_NAME, MODEL_NAME, CertificateRoles, LabelsRule, ListOf, NestedSection, RoleGrant, Scalar, Section, boolean,
    choice, class_check,
    endpoint_check, integer, ip_check, is_host, listen_check, normalize_thumbprint, number, optional,
    password_hash_check, path_rule, required, resolve_path, setting, split_listen, subject_key, text, uri_check,
)
from .sources import SourceConfig
from .yaml_walk import INVALID, Context, did_you_mean, key_path, named_items, parse_fields, shown

ROLES = ("monitor", "operator", "engineer", "security_admin")
SECURITY_POLICIES = ("Basic256Sha256", "Aes128_Sha256_RsaOaep", "Aes256_Sha256_RsaPss")
NEVER_OFFERED_POLICIES = ("None", "Basic128Rsa15", "Basic256")
SECURITY_MODES = ("SignAndEncrypt", "Sign")
MODEL_KINDS = ("tensor", "generative")
UA_CHUNK_BODY = 65535  # bytes per chunk used to derive the default max_chunk_count

_USER_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
_DEVICE = re.compile(r"auto|cpu|cuda|cuda:\d{1,2}")


def _policy_check(v: Any, expect: str) -> str | None:
    if v in SECURITY_POLICIES:
        return None
    if v in NEVER_OFFERED_POLICIES:
        return (f"security policy {v!r} is never offered (it is insecure or deprecated); valid policies: "
                + ", ".join(SECURITY_POLICIES))
    hint = did_you_mean(v, SECURITY_POLICIES) if isinstance(v, str) else ""
    return f"expected {expect}, got {shown(v)}" + (f"; {hint.strip()}" if hint else "")


@dataclass
class ServerConfig:
    endpoint: str = setting("opc.tcp://0.0.0.0:4840",
                            Scalar("an endpoint URL opc.tcp://HOST:PORT (port 1-65535)", endpoint_check))
    # host name or IP put into endpoint URLs for clients behind NAT; None: the host the client dialled
    advertised_host: str | None = setting(None, optional(text("a DNS name or IP address", is_host)))
    application_uri: str | None = setting(
        None, optional(Scalar("a URI such as 'urn:plant-edge-01:appliance'", uri_check)))
    application_name: str = setting("OPC UA Inference Appliance", text(max_len=256))
    state_dir: Path = setting(Path("/var/lib/appliance"), path_rule())
    dns_names: list[str] = setting([], ListOf(text("a DNS name", lambda v: bool(DNS_NAME.fullmatch(v))),
                                                      "DNS names"))
    ip_addresses: list[str] = setting([], ListOf(Scalar("an IPv4 or IPv6 address", ip_check), "IP addresses"))
    # SIGTERM: calls in flight may finish for this long; then they answer BadTimeout
    drain_timeout_s: float = setting(10.0, number(0, 3600))
    # the longest session timeout granted: a session whose client vanished (no CloseSession) lives this long at
    # most, then it is closed and its KV slot freed; re-activated on a new channel before then, it goes on
    session_timeout_s: float = setting(60.0, number(0, 86400, lo_open=True))
    # a client that vanished without FIN or RST (power lost, cable pulled) is seen as gone within this many seconds
    # (TCP keepalive and TCP_USER_TIMEOUT on every accepted connection), then treated as a vanished client
    dead_peer_timeout_s: int = setting(10, integer(2, 7200))

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
    # sessions of one client identity (certificate + user) before its oldest ones without a live channel are closed
    # to make room (a full table closes the oldest such session too); only a table of live channels refuses a client
    max_sessions_per_client: int = setting(10, integer(1))
    max_requests_per_session: int = setting(16, integer(1))
    session_activation_timeout_s: float = setting(5.0, number(0, 3600, lo_open=True))
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
    # Part 12 certificate management calls (ServerConfiguration, its TrustList) of security_admin clients
    security_admin: RateLimit | None = setting(None, Section(RateLimit, nullable=True))
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
    # thumbprint -> role, subject -> role or {role, issuer: CA thumbprint}; normalized: thumbprints as 40 lowercase
    # hex digits, subjects as written ("CN=..."); a subject without issuer only while one CA is trusted
    certificate_roles: dict[str, RoleGrant] = setting({}, CertificateRoles(ROLES))
    login_backoff_s: float = setting(1.0, number(0, 3600))
    login_backoff_max_s: float = setting(30.0, number(0, 86400))
    cert_expiry_warning_days: int = setting(30, integer(0, 3650))
    # a CA in the trust list or issuers list without a CRL: its certificates refused (Part 4 revocation unknown)
    require_crl: bool = setting(True, boolean())
    # how often serve checks that the appliance CA's CRL is re-signed in time (30 days before its nextUpdate)
    crl_check_interval_s: float = setting(3600.0, number(1, 86400))
    # Part 12 certificate management (ServerConfiguration, its TrustList): security_admin, and engineers when true
    engineers_manage_certificates: bool = setting(False, boolean())
    limits: LimitsConfig = setting(None, NestedSection(LimitsConfig))
    rate_limits: RateLimitsConfig = setting(None, Section(RateLimitsConfig))

    def __post_init__(self) -> None:
        if self.limits is None:
            self.limits = LimitsConfig()
        if self.rate_limits is None:
            self.rate_limits = RateLimitsConfig()

    def role_for_certificate(self, thumbprint: str, subject: str = "", issuer: str | None = None,
                             trusted_cas: int = 1) -> str | None:
        """The role mapped to a user certificate by its SHA-1 thumbprint (hex), or by its subject together with the
        thumbprint of the CA that issued it (`issuer`). A subject mapping that names no CA grants its role only
        while the trust list holds one CA (`trusted_cas`): any other CA could issue the same subject."""
        by_thumb = self.certificate_roles.get(normalize_thumbprint(thumbprint) or "")
        if by_thumb:
            return by_thumb.role
        wanted = subject_key(subject) if subject else None
        for key, grant in self.certificate_roles.items():
            if wanted and normalize_thumbprint(key) is None and subject_key(key) == wanted:
                if grant.issuer is not None:
                    return grant.role if grant.issuer == issuer else None
                return grant.role if trusted_cas <= 1 else None
        return None


@dataclass
class UserConfig:
    name: str = required(text("a user name of 1-64 characters A-Z a-z 0-9 _ . @ -",
                              lambda v: bool(_USER_NAME.fullmatch(v))))
    role: str = required(choice(*ROLES))
    password_hash: str = required(Scalar(
        "a scrypt or argon2 password hash ('scrypt$n=...,r=...,p=...$SALT$KEY' or '$argon2id$...'; "
        "`appliance users add` makes one)",
        password_hash_check))


@dataclass
class EngineConfig:
    device: str = setting("auto", text("auto, cpu, cuda or cuda:N", lambda v: bool(_DEVICE.fullmatch(v))))
    threads: int = setting(0, integer(0, 1024))  # 0: all cores (ONNX: one or all, measured at load)
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
    # generative, CPU: how weights are held. auto: for a GGUF file with quantized blocks, the fastest of its own
    # blocks (our kernels), torch's int4 op and dense float32/bfloat16, measured on this CPU at the first load and
    # recorded (appliance models prepare measures again); float files as `dtype`. blocks: the file's own GGUF blocks;
    # int8 / int4: requantized to Q8_0 / 4-bit blocks. Laid-out weights are cached under state_dir/cache/weights
    weights: str = setting("auto", choice("auto", "float32", "bfloat16", "int8", "int4", "blocks"))
    # quantized weights' activations: int8 (per block of 32, integer dot products) or float32 (exact); auto: measured
    activations: str = setting("auto", choice("auto", "int8", "float32"))
    # who multiplies quantized weights: our kernels for one instruction set, or torch's ops; auto: measured
    quant_kernels: str = setting("auto", choice("auto", "amx", "avx512vnni", "avxvnni", "avx2", "torch"))
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
    # generative, CPU: the decode step compiled ahead of time (torch.export + AOTInductor). auto: in the background
    # once the model is Ready (decode eager until then), before Ready once its package is on this box; on: before
    # Ready; off: eager only. Packages are kept in state_dir/cache/inductor
    compile: str = setting("auto", choice("auto", "on", "off"))
    tensorrt_fp16: bool = setting(True, boolean())  # backend tensorrt: build fp16 engines (fp32 inputs/outputs)
    # each model's worker gets CPU time in proportion to its models.NAME.cpu_share where CPUs are short. auto: the
    # unit's delegated cgroup (cpu.weight per worker) where systemd gives one (Delegate=yes), else nice levels; and
    # with engine.threads 0 each worker's threads sized to its share of the cores. off: every worker at one nice level
    cpu_shares: str = setting("auto", choice("auto", "off"))


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

    def parse(self, node: Node, ctx: Context, path: str) -> Any:
        items = named_items(node, ctx, path, self.expect, "variant name")
        if items is None:
            return INVALID
        out: dict[str, VariantConfig] = {}
        for name, key_node, value_node in items:
            where = key_path(path, name)
            if not MODEL_NAME.fullmatch(name) or name == MAIN_VARIANT:
                ctx.error(key_node, where, "a variant name must start with a letter and hold at most 64 characters "
                          f"A-Z a-z 0-9 _ - (and not be '{MAIN_VARIANT}', the model's own path), got {shown(name)}")
                continue
            parsed = parse_fields(VariantConfig, value_node, ctx, where, where=f"variant '{name}'")
            if not parsed.complete or where in ctx.bad:
                continue
            variant = VariantConfig(**parsed.values)
            resolved = resolve_path(variant.path, ctx)
            if not resolved.exists():
                ctx.error(parsed.nodes["path"], f"{where}.path", f"no such file or directory: {resolved} (relative "
                          f"paths are resolved against {ctx.base_dir})")
                continue
            out[name] = dataclasses.replace(variant, resolved_path=resolved)
        total = sum(v.weight for v in out.values())
        if total > 100:
            ctx.error(node, path, f"the variants' weights add up to {total:g} percent; expected at most 100 (the "
                      f"model's own path, variant '{MAIN_VARIANT}', serves what is left)")
            return INVALID
        return out


@dataclass(frozen=True)
class AlarmSourcesRule:
    """`alarm_sources`: source name -> the mailbox (its name) or the caller identity ('user:NAME',
    'x509:SHA1-THUMBPRINT') whose results it holds; every other caller is source 'default'. Whether a mailbox
    is one of this model's is checked once the mailboxes are read (checks._check_alarm_sources)."""

    expect: str = "a mapping of source names to a mailbox name or an identity ('user:NAME', 'x509:THUMBPRINT')"

    def parse(self, node: Node, ctx: Context, path: str) -> Any:
        items = named_items(node, ctx, path, self.expect, "source name")
        if items is None:
            return INVALID
        out: dict[str, str] = {}
        first_line: dict[str, int] = {}
        for name, key_node, value_node in items:
            where = key_path(path, name)
            if not MODEL_NAME.fullmatch(name) or name in RESERVED_SOURCE_NAMES:
                ctx.error(key_node, where, "a source name must start with a letter and hold at most 64 characters "
                          f"A-Z a-z 0-9 _ - (and not be {', '.join(RESERVED_SOURCE_NAMES)}: 'default' is every "
                          f"other caller, the others are Last's own variables), got {shown(name)}")
                continue
            value = _SOURCE.parse(value_node, ctx, where)
            if value is INVALID:
                continue
            if value in first_line:
                ctx.error(value_node, where, f"{shown(value)} is already a source (line {first_line[value]})")
                continue
            first_line[value] = value_node.start_mark.line + 1
            ctx.nodes[where] = value_node  # the mailbox it names is checked once the mailboxes are read
            out[name] = value
        return out


def _source_check(v: Any, expect: str) -> str | None:
    if isinstance(v, str) and v.startswith(("user:", "x509:")):
        return _writer_check(v, expect)
    if isinstance(v, str) and MODEL_NAME.fullmatch(v):
        return None  # a mailbox's name
    return f"expected {expect}, got {shown(v)}"


_SOURCE = Scalar("a mailbox name or an identity ('user:NAME', 'x509:SHA1-THUMBPRINT')", _source_check,
                 lambda v, ctx: _writer_convert(v, ctx))
DEFAULT_ALARM_SOURCE = "default"
RESERVED_SOURCE_NAMES = (DEFAULT_ALARM_SOURCE, "ClassIndex", "Label", "Confidence", "Time")
MAIN_VARIANT = "main"  # the model's own path in an A/B split
TENSOR_ONLY = ("max_samples", "labels", "alarm_classes", "alarm_confidence", "alarm_on_results",
               "alarm_off_results", "alarm_sources", "drift")
SPECULATION_MODES = ("off", "lookup", "draft")
# YAML reads an unquoted `off` as false: the same switch
_SPECULATION = Scalar("one of off, lookup, draft",
                      lambda v, exp: None if v is False or v in SPECULATION_MODES else choice(*SPECULATION_MODES).check(v, exp),
                      lambda v, ctx: "off" if v is False else v)
GENERATIVE_ONLY = ("max_text_chars", "system_prompt", "top_p", "tasks", "speculation", "speculation_draft_min",
                   "speculation_draft_max", "speculation_draft_model")


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
    # generative: speculative decoding. lookup: the next tokens drafted from the reply's own prompt and output
    # (n-gram lookup) and verified in one step; draft: drafted by the smaller model speculation_draft_model;
    # answers are the same as with off (greedy: token for token)
    speculation: str = setting("off", _SPECULATION)
    speculation_draft_min: int = setting(1, integer(1, 64))  # the shortest draft worth verifying
    speculation_draft_max: int = setting(8, integer(1, 64))  # the longest (the length adapts in between)
    # speculation: draft: the draft model's GGUF file or HF directory (relative to this file's directory); its
    # tokenizer must be the model's own (the same vocabulary, token for token)
    speculation_draft_model: Path | None = setting(None, optional(path_rule()))
    # models with the same worker name share one worker process; default: a process of its own
    worker: str | None = setting(None, optional(text("a worker group name of 1-64 characters A-Z a-z 0-9 _ -",
                                                     lambda v: bool(MODEL_NAME.fullmatch(v)))))
    # tensor classifiers: class names (a list, or a file beside the model; after loading always a list)
    labels: list[str] | None = setting(None, LabelsRule())
    # classes (labels or indices) that raise Alarms/<label> when predicted with at least alarm_confidence
    alarm_classes: list[str | int] = setting([], ListOf(Scalar("a class label or index", class_check),
                                                        "class labels or indices"))
    alarm_confidence: float = setting(0.5, number(0, 1, lo_open=True))
    # debounce: a class alarm turns on after this many consecutive results of its class (per source) ...
    alarm_on_results: int = setting(3, integer(1, 1000))
    # ... and off after this many consecutive results without it
    alarm_off_results: int = setting(3, integer(1, 1000))
    # who a result comes from, for class alarms and Last kept per source: name -> mailbox or identity
    alarm_sources: dict[str, str] = setting({}, AlarmSourcesRule())
    drift: DriftConfig | None = setting(None, Section(DriftConfig, nullable=True))
    # versions kept under state_dir/models/<name>/ by `appliance models deploy` (the serving and previous included)
    keep_versions: int = setting(5, integer(2, 1000))
    # the CPU weight of this model's worker against the other workers' (engine.cpu_shares), as systemd's CPUWeight=:
    # a model with 200 gets twice the CPU time of one with 100 where both want more than there is
    cpu_share: int = setting(100, integer(1, 10000))
    # another model of the same kind that answers when this one is not Ready, its worker restarts, or its queue says
    # the request's deadline would be missed (ModelVersion then names the fallback's weights)
    fallback: str | None = setting(None, optional(text("the name of another model", lambda v: bool(
        MODEL_NAME.fullmatch(v)))))
    # A/B split: other weights of this model, each with the percent of callers it serves (a stable hash of the
    # caller's identity chooses); the model's own path (variant "main") serves the rest. Admin/PromoteVariant
    # sends all traffic to one of them.
    variants: dict[str, VariantConfig] = setting({}, VariantsRule())
    # generative: typed tasks, each an object Tasks/<task> with its method Run (typed inputs, typed output fields
    # decoded under the schema's grammar): name -> {prompt, inputs, output, max_tokens, temperature}
    tasks: dict[str, TaskConfig] = setting({}, TasksRule())
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


@dataclass
class MetricsConfig:
    enabled: bool = setting(True, boolean())
    listen: str = setting("0.0.0.0:9464", Scalar("HOST:PORT such as '0.0.0.0:9464' (port 1-65535)", listen_check))

    @property
    def host(self) -> str:
        return (split_listen(self.listen) or ("0.0.0.0", 9464))[0]

    @property
    def port(self) -> int:
        return (split_listen(self.listen) or ("0.0.0.0", 9464))[1]


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
    # a job's run is bounded by this, not by engine.request_timeout_s; a generation job that reaches it ends Done
    # with the text so far and FinishReason "deadline"
    timeout_s: float = setting(300.0, number(1, 86400))


def _writer_check(v: Any, expect: str) -> str | None:
    if v == "monitor":
        return "the monitor role may never write a mailbox (CONTRACT: monitor browses, reads, subscribes)"
    if v in ("operator", "engineer"):
        return None
    if isinstance(v, str) and v.startswith("user:") and _USER_NAME.fullmatch(v[5:]):
        return None
    if isinstance(v, str) and v.startswith("x509:") and normalize_thumbprint(v[5:]) is not None:
        return None
    return f"expected {expect}, got {shown(v)}"


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
    # generative: one of the model's tasks; the mailbox then holds the task's typed inputs and output fields
    # (Prompt / Text otherwise) and runs the task with its own max_tokens and temperature
    task: str | None = setting(None, optional(text("the name of one of the model's tasks")))
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
    path: Path | None = setting(None, optional(path_rule()))  # None: <state_dir>/audit/audit.jsonl
    max_bytes: int = setting(10485760, integer(4096))
    keep_files: int = setting(10, integer(1, 1000))
    # refuse: while the audit log cannot be written (disk full, read-only), calls answer BadResourceUnavailable and
    # Alarms/AuditLogFailed is true; continue: calls go on unaudited (the alarm is raised all the same)
    on_failure: str = setting("refuse", choice("refuse", "continue"))
    queue_size: int = setting(10000, integer(16, 1000000))  # records waiting for the writer thread, at most; also the records held in memory while the disk is full (beyond: an `audit_lost` record, docs/security.md)


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
    sources: dict[str, SourceConfig] = field(default_factory=dict)  # OPC UA servers read as a client, in file order
    source: str = "<defaults>"
    warnings: list[str] = field(default_factory=list)  # what check-config and the start warn about (file:line: key)

    def __post_init__(self) -> None:
        if self.audit.path is None:
            self.audit = dataclasses.replace(self.audit, path=self.server.state_dir / "audit" / "audit.jsonl")

    @property
    def state_dir(self) -> Path:
        return self.server.state_dir


SECTIONS = {"server": ServerConfig, "security": SecurityConfig, "engine": EngineConfig, "metrics": MetricsConfig,
             "watchdog": WatchdogConfig, "jobs": JobsConfig, "audit": AuditConfig,
             "logging": LoggingConfig}
TOP_KEYS = ("server", "security", "users", "engine", "models", "mailboxes", "sources", "metrics", "watchdog", "jobs",
            "audit", "logging")
