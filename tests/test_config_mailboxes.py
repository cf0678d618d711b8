"""`mailboxes:` in the YAML: defaults, the demo's one mailbox per model, and every mistake named by file, line and
key."""
from __future__ import annotations

import re

import pytest

from core.config import ConfigError, demo_config, load_config_text

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


def test_alarm_sources_name_mailboxes_of_the_model_or_identities():
    cfg = load_config_text(MODELS.replace("    path: builtin:te-classifier\n",
                                          "    path: builtin:te-classifier\n    labels: labels.txt\n"
                                          "    alarm_classes: [1]\n    alarm_on_results: 5\n"
                                          "    alarm_sources: {line3: box3, line4: 'user:s7-line4', line5: "
                                          "'x509:AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89:AB:CD:EF:01'}\n")
                           + "mailboxes:\n  box3: {model: te}\n")
    te = cfg.models["te"]
    assert (te.alarm_on_results, te.alarm_off_results) == (5, 3)
    assert te.alarm_sources == {"line3": "box3", "line4": "user:s7-line4",
                                "line5": "x509:abcdef0123456789abcdef0123456789abcdef01"}


def test_alarm_source_mistakes_are_named_by_line_and_key():
    errors = errors_of(MODELS.replace("    path: builtin:te-classifier\n",
                                      "    path: builtin:te-classifier\n    labels: labels.txt\n"
                                      "    alarm_classes: [1]\n    alarm_off_results: 0\n"  # 5-7
                                      "    alarm_sources:\n"  # 8
                                      "      default: box3\n"  # 9
                                      "      Time: box3\n"  # 10
                                      "      line3: ask\n"  # 11: a mailbox of another model
                                      "      line4: 'user:a b'\n"  # 12
                                      "      line5: nobox\n")  # 13
                       + "mailboxes:\n  box3: {model: te}\n  ask: {model: chat}\n")
    text = "\n".join(errors)
    assert "t.yaml:7: models.te.alarm_off_results: expected an integer in [1, 1000], got 0" in text
    assert "t.yaml:9: models.te.alarm_sources.default: a source name must start with a letter" in text
    assert "t.yaml:10: models.te.alarm_sources.Time: a source name" in text
    assert "t.yaml:11: models.te.alarm_sources.line3: expected a mailbox of model 'te' (box3)" in text
    assert "t.yaml:12: models.te.alarm_sources.line4: expected a mailbox name or an identity" in text
    assert "t.yaml:13: models.te.alarm_sources.line5: expected a mailbox of model 'te'" in text
    assert len(errors) == 6, errors
