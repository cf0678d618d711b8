"""The appliance's YAML configuration, read into typed, validated dataclasses.

One place reads the file: every other part receives an `ApplianceConfig`. Every key has a default, so a minimal file
names only its models. The loader walks the composed YAML nodes (not the loaded dict) so that each problem is
reported with its line, and it collects EVERY problem before raising, so an engineer fixes a file in one pass:

    /etc/appliance/appliance.yaml:12: engine.max_batch_size: expected an integer >= 1, got 'many'

The package, by role (each module imports only those above it):

    yaml_walk.py  ConfigError; YAML mapping nodes -> a dataclass's fields, every problem recorded with its line
    rules.py      the rule library: integer, number, text, choice, ListOf, Section, setting/required, value checks
    builtin.py    the models that ship with the appliance (`path: builtin:NAME`)
    schema.py     every section, key, default and rule (ServerConfig, SecurityConfig, EngineConfig, ModelConfig, ...)
    checks.py     checks across settings: model files and labels, fallbacks, mailboxes, limits, max_samples
    loader.py     the whole file: sections, users, models, mailboxes, then the checks; the demo
    docs.py       docs/configuration.md, written from the schema (`python -m core.config.docs`)

Other modules import from `core.config`, which re-exports the public names below.
"""
from __future__ import annotations

import importlib.metadata  # noqa: F401 - tests patch core.config.importlib.metadata (used by builtin.py)

from .builtin import BUILTIN_MODELS, SMOLLM2_PACKAGE, resolve_builtin
from .checks import CALL_OVERHEAD_BYTES, onnx_output_width, onnx_sample_floats
from .loader import (
    DEFAULT_CONFIG_PATH, demo_config, demo_yaml_text, load_config, load_config_text,
)
from .rules import (
    INVALID, CertificateRoles, LabelsRule, ListOf, NestedSection, Scalar, Section, boolean, choice, integer,
    normalize_thumbprint, number, optional, required, setting, subject_key, text,
)
from .schema import (
    GENERATIVE_ONLY, MAIN_VARIANT, MODEL_KINDS, NEVER_OFFERED_POLICIES, ROLES, SECURITY_MODES, SECURITY_POLICIES,
    TENSOR_ONLY, UA_CHUNK_BODY, ApplianceConfig, AuditConfig, DriftConfig, EngineConfig, JobsConfig, LimitsConfig,
    LoggingConfig, MailboxConfig, MetricsConfig, ModelConfig, RateLimit, RateLimitsConfig, SecurityConfig,
    ServerConfig, UserConfig, VariantConfig, VariantsRule, WatchdogConfig,
)
from .yaml_walk import ConfigError

__all__ = [
    "BUILTIN_MODELS", "CALL_OVERHEAD_BYTES", "DEFAULT_CONFIG_PATH", "GENERATIVE_ONLY", "INVALID", "MAIN_VARIANT",
    "MODEL_KINDS", "NEVER_OFFERED_POLICIES", "ROLES", "SECURITY_MODES", "SECURITY_POLICIES", "SMOLLM2_PACKAGE",
    "TENSOR_ONLY", "UA_CHUNK_BODY",
    "ApplianceConfig", "AuditConfig", "CertificateRoles", "ConfigError", "DriftConfig", "EngineConfig", "JobsConfig",
    "LabelsRule", "LimitsConfig", "ListOf", "LoggingConfig", "MailboxConfig", "MetricsConfig", "ModelConfig",
    "NestedSection", "RateLimit", "RateLimitsConfig", "Scalar", "Section", "SecurityConfig", "ServerConfig",
    "UserConfig", "VariantConfig", "VariantsRule", "WatchdogConfig",
    "boolean", "choice", "demo_config", "demo_yaml_text", "integer", "load_config",
    "load_config_text", "normalize_thumbprint", "number", "onnx_output_width", "onnx_sample_floats", "optional",
    "required", "resolve_builtin", "setting", "subject_key", "text",
]
