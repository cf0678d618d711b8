"""`mailboxes:` in the YAML: defaults, the demo's one mailbox per model, and every mistake named by file, line and
key."""
from __future__ import annotations

import re

import pytest

from appliance.config import ConfigError, demo_config, load_config_text

MODELS = ("models:\n"
          "  te:\n    kind: tensor\n    path: builtin:te-classifier\n"  # lines 2-4
          "  chat:\n    kind: generative\n    path: builtin:smollm2\n")  # lines 5-7


def errors_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config_text(text, source="t.yaml")
    for error in info.value.errors:
        assert re.match(r"t\.yaml:\d+: ", error), error
    return info.value.errors


def test_defaults_and_identities():
    cfg = load_config_text(MODELS + "mailboxes:\n  line3: {model: te}\n"
                           "  ask:\n    model: chat\n    writers: [engineer, 'user:s7-line3', "
                           "'x509:AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89:AB:CD:EF:01']\n    max_tokens: 32\n")
    line3, ask = cfg.mailboxes["line3"], cfg.mailboxes["ask"]
    assert line3.writers == ["operator"] and line3.model == "te" and line3.name == "line3"
    assert ask.writers[2] == "x509:abcdef0123456789abcdef0123456789abcdef01"  # normalised like certificate_roles
    assert ask.effective_max_tokens == 32 and ask.effective_temperature == 0.0
    assert ask.may_write("operator", "user:s7-line3") and not ask.may_write("operator", "user:other")
    assert ask.may_write("operator", "x509:abcdef0123456789abcdef0123456789abcdef01")


def test_the_demo_has_one_mailbox_per_model_writable_by_operators():
    cfg = demo_config()
    assert {b.model for b in cfg.mailboxes.values()} == set(cfg.models)
    assert all(b.writers == ["operator"] for b in cfg.mailboxes.values())


def test_mistakes_are_named_by_line_and_key():
    errors = errors_of(MODELS + "mailboxes:\n"
                       "  line3:\n    model: nope\n"  # 9-10
                       "  hmi:\n    model: te\n    writers: [monitor, 'user:a b']\n"  # 11-13
                       "  tensor-tokens:\n    model: te\n    max_tokens: 5\n"  # 14-16
                       "  too-many:\n    model: chat\n    max_tokens: 100000\n"  # 17-19
                       "  9bad: {model: te}\n"  # 20
                       "  typo: {model: te, writer: [operator]}\n"  # 21
                       "  nomodel: {}\n")  # 22
    text = "\n".join(errors)
    assert "t.yaml:10: mailboxes.line3.model: expected the name of a configured model (te, chat), got 'nope'" in text
    assert "t.yaml:13: mailboxes.hmi.writers[0]: the monitor role may never write a mailbox" in text
    assert "t.yaml:13: mailboxes.hmi.writers[1]: expected a role (operator, engineer) or an identity" in text
    assert "t.yaml:16: mailboxes.tensor-tokens.max_tokens: max_tokens applies to mailboxes of generative" in text
    assert "t.yaml:19: mailboxes.too-many.max_tokens: expected an integer <= engine.max_new_tokens (512)" in text
    assert "t.yaml:20: mailboxes['9bad']: a mailbox name must start with a letter" in text
    assert "t.yaml:21: mailboxes.typo.writer: unknown key 'writer'" in text
    assert "t.yaml:22: mailboxes.nomodel.model: missing required key 'model'" in text
    assert len(errors) == 8, errors


def test_mailboxes_must_be_a_mapping():
    [error] = errors_of(MODELS + "mailboxes: [a, b]\n")
    assert error.startswith("t.yaml:8: mailboxes: expected a mapping of mailbox names")
