"""`sources:` in the YAML: what a valid file gives, and every refusal naming file, line and key (check-config)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from core.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
TE_NODES = "\n".join(f"      n{i}: \"nsu=urn:te;s=TE.N{i}\"" for i in range(52))
HEAD = """models:
  te: {kind: tensor, path: builtin:te-classifier, labels: [%s], alarm_classes: [c2]}
  llm-like: {kind: tensor, path: builtin:te-classifier}
sources:
""" % ", ".join(f"c{i}" for i in range(22))


def write(tmp_path, body: str) -> Path:
    path = tmp_path / "appliance.yaml"
    path.write_text(HEAD + body)
    return path


def errors(tmp_path, body: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, body))
    return e.value.errors


def test_a_valid_source_and_feed_are_read_with_their_defaults(tmp_path):
    cfg = load_config(write(tmp_path, f"""  line1:
    endpoint: opc.tcp://plc-line1:4840/ua
    user: s7user
    nodes:
{TE_NODES}
      pulse: {{path: ["nsu=urn:te;Line1", "nsu=urn:te;Pulse"], sampling_interval_ms: 50}}
    feeds:
      line1-te: {{model: te, columns: [{', '.join(f'n{i}' for i in range(52))}], window: 20, trigger: pulse}}
"""))
    src = cfg.sources["line1"]
    assert (src.security_policy, src.security_mode, src.user) == ("Basic256Sha256", "SignAndEncrypt", "s7user")
    assert src.nodes["n0"].ref.uri == "urn:te" and src.nodes["n0"].ref.identifier == "TE.N0"
    assert src.nodes["pulse"].ref.path == (("urn:te", "Line1"), ("urn:te", "Pulse"))
    feed = src.feeds["line1-te"]
    assert (feed.window, feed.stride, feed.trigger, feed.missing, feed.max_in_flight) == (20, 1, "pulse", "skip", 1)
    assert cfg.models["te"].alarm_sources == {"line1-te": "feed:line1-te"}  # its results: Last/line1-te, alarms
    assert cfg.warnings == []


def test_feed_columns_are_checked_against_the_model_input_shape_naming_file_line_and_key(tmp_path):
    errs = errors(tmp_path, """  line1:
    endpoint: opc.tcp://127.0.0.1:4840
    nodes:
      a: "nsu=urn:x;s=A"
      b: "nsu=urn:x;i=7"
    feeds:
      f1:
        model: te
        columns: [a, b, c]
        window: 20
      f2: {model: nosuch, window: 3}
""")
    path = tmp_path / "appliance.yaml"
    assert f"{path}:13: sources.line1.feeds.f1.columns[2]: 'c' is not a node of source 'line1' (a, b)" in errs
    assert any(e.startswith(f"{path}:14: sources.line1.feeds.f1.window: 20 rows x 3 columns = 60 values, but model "
                            "'te' takes 1040 values per sample") for e in errs), errs
    assert any(e.startswith(f"{path}:15: sources.line1.feeds.f2.model: expected the name of a configured tensor "
                            "model") for e in errs), errs


def test_nodes_by_namespace_index_and_bad_references_are_refused(tmp_path):
    errs = errors(tmp_path, """  line1:
    endpoint: opc.tcp://127.0.0.1:4840
    nodes:
      a: "ns=3;s=A"
      b: "nsu=urn:x;i=notanumber"
      c: {path: ["Plant", "Temp"]}
      d: {node: "nsu=urn:x;s=D", path: ["nsu=urn:x;D"]}
""")
    text = "\n".join(errs)
    assert "appliance.yaml:8: sources.line1.nodes.a: 'ns=3;s=A' names the namespace by index" in text
    assert "appliance.yaml:9: sources.line1.nodes.b:" in text and "not a valid numeric identifier" in text
    assert "appliance.yaml:10: sources.line1.nodes.c.path: browse path element 'Plant': expected " \
           "'nsu=URI;BrowseName'" in text
    assert "appliance.yaml:11: sources.line1.nodes.d: expected exactly one of `node`" in text


def test_security_none_only_when_written_and_then_a_warning(tmp_path):
    body = """  line1:
    endpoint: opc.tcp://127.0.0.1:4840
    security_policy: None
    security_mode: None
    nodes: {a: "nsu=urn:x;s=A"}
"""
    cfg = load_config(write(tmp_path, body))
    assert cfg.sources["line1"].insecure
    assert cfg.warnings == [f"{tmp_path / 'appliance.yaml'}:7: sources.line1.security_policy: None: the source's "
                            "data and the appliance's identity travel unsigned and unencrypted"]
    r = subprocess.run([sys.executable, "-m", "appliance", "check-config", str(tmp_path / "appliance.yaml")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "warning:" in r.stderr and "security_policy: None" in r.stderr
    errs = errors(tmp_path, body.replace("    security_mode: None\n", ""))
    assert any("sources.line1.security_policy: security_policy None goes with security_mode None" in e
               for e in errs), errs


def test_check_config_exits_2_listing_every_source_problem(tmp_path):
    path = write(tmp_path, """  line1:
    endpoint: http://plc:80
    nodes: {}
    feeds: {default: {model: te, window: 1}}
    colour: blue
""")
    r = subprocess.run([sys.executable, "-m", "appliance", "check-config", str(path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout
    assert f"{path}:6: sources.line1.endpoint: expected an endpoint URL opc.tcp://HOST:PORT[/PATH]" in r.stderr
    assert f"{path}:7: sources.line1.nodes: expected a mapping of node names" in r.stderr
    assert f"{path}:8: sources.line1.feeds.default: a feed name must" in r.stderr
    assert f"{path}:9: sources.line1.colour: unknown key 'colour' in source 'line1'" in r.stderr


def test_write_back_lists_result_fields_and_node_ids_only(tmp_path):
    errs = errors(tmp_path, """  line1:
    endpoint: opc.tcp://127.0.0.1:4840
    nodes: {a: "nsu=urn:x;s=A"}
    feeds:
      f1:
        model: llm-like
        window: 1040
        write_back: {ClassIndex: "nsu=urn:x;s=Cls", Output: "ns=2;s=Out", Colour: "nsu=urn:x;s=C"}
""")
    text = "\n".join(errs)
    assert "appliance.yaml:12: sources.line1.feeds.f1.write_back.Output: 'ns=2;s=Out' names the namespace by " \
           "index" in text
    assert "appliance.yaml:12: sources.line1.feeds.f1.write_back.Colour: expected one of ClassIndex, Label, " \
           "Confidence, Output, got 'Colour'" in text
    assert "appliance.yaml:12: sources.line1.feeds.f1.write_back.ClassIndex: ClassIndex needs a model with labels " \
           "('llm-like' has none)" in text
