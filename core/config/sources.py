"""The `sources:` section: the OPC UA servers the appliance reads as a client (a PLC's own server, a SCADA or
Kepware-type gateway), their nodes and the feeds that cut windows of them for a model.

    sources:
      line1:
        endpoint: opc.tcp://plc-line1:4840
        nodes:                              # name -> NodeId by namespace URI, or a browse path from Objects
          temp: "nsu=urn:plant:line1;s=Line1.Temperature"
          flow: {path: ["nsu=urn:plant:line1;Line1", "nsu=urn:plant:line1;Flow"], deadband: 0.1}
        feeds:
          line1-te: {model: te-classifier, columns: [temp, flow], window: 20, stride: 1}

Checks across sections (a feed's model, its columns against the model's input shape, names that become alarm
sources) are `check_sources`, run by the loader once the models are read.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from yaml.nodes import Node, ScalarNode, SequenceNode

from core.node_ref import NodeRef, NodeRefError, parse_browse_path, parse_node_id
from .rules import (ListOf, Scalar, boolean, choice, integer, is_host, number, opc_tcp_url, optional, required, setting,
                    text)
from .yaml_walk import INVALID, Context, as_mapping, key_path, mapping_items, named_items, parse_fields, shown

SOURCE_POLICIES = ("Basic256Sha256", "Aes128_Sha256_RsaOaep", "Aes256_Sha256_RsaPss", "None")
SOURCE_MODES = ("SignAndEncrypt", "Sign", "None")
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
_USER = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


def _source_endpoint_check(v: Any, expect: str) -> str | None:
    """opc.tcp://HOST:PORT[/path]: a server's endpoint may have a path (open62541, asyncua: /freeopcua/server/)."""
    url = opc_tcp_url(v)
    if url is None or not is_host(url.hostname) or url.username or url.query or url.fragment:
        return f"expected {expect}, got {shown(v)}"
    return None


def _node_id_check(v: Any, expect: str) -> str | None:
    try:
        parse_node_id(v)
    except NodeRefError as e:
        return str(e)
    return None


_NODE_ID = Scalar("a NodeId with its namespace as a URI, e.g. 'nsu=urn:plant:line1;s=Line1.Temperature'",
                  _node_id_check)
_PATH_ELEMENT = text("a browse path element 'nsu=URI;BrowseName'", lambda v: True)


@dataclass
class SourceNodeConfig:
    """One node, written as a mapping (a string is the NodeId alone): `node` or `path`, and its own sampling."""

    node: str | None = setting(None, optional(_NODE_ID))  # NodeId by namespace URI
    # a browse path from Objects, each element 'nsu=URI;BrowseName'
    path: list[str] | None = setting(None, ListOf(_PATH_ELEMENT, "browse path elements 'nsu=URI;BrowseName'"))
    sampling_interval_ms: float | None = setting(None, optional(number(0, 3_600_000)))  # null: the source's
    queue_size: int | None = setting(None, optional(integer(1, 10_000)))  # null: the source's
    deadband: float | None = setting(None, optional(number(0)))  # absolute deadband; null: the source's
    # filled by the rule, not a YAML key
    ref: NodeRef | None = None


@dataclass(frozen=True)
class NodesRule:
    """`nodes`: node name -> a NodeId string, or a mapping {node | path, sampling_interval_ms, queue_size,
    deadband}; in file order (a feed without `columns` takes them in this order)."""

    expect: str = ("a mapping of node names to a NodeId ('nsu=URI;s=NAME') or {node: ..., path: [...], "
                   "sampling_interval_ms, queue_size, deadband}")

    def parse(self, node: Node, ctx: Context, path: str) -> Any:
        mapping = as_mapping(node, ctx, path, self.expect)
        if mapping is None or not mapping.value:
            if path not in ctx.bad:
                ctx.error(node, path, f"expected {self.expect}, with at least one node")
            return INVALID
        out: dict[str, SourceNodeConfig] = {}
        for name, key_node, value_node in mapping_items(mapping, ctx, path, "node name"):
            where = key_path(path, name)
            if not NAME.fullmatch(name):
                ctx.error(key_node, where, "a node name must start with a letter and hold at most 64 characters "
                          f"A-Z a-z 0-9 _ -, got {shown(name)}")
                continue
            ctx.nodes[where] = value_node
            if isinstance(value_node, ScalarNode):
                value = _NODE_ID.parse(value_node, ctx, where)
                if value is not INVALID:
                    out[name] = SourceNodeConfig(node=value, ref=parse_node_id(value))
                continue
            parsed = parse_fields(SourceNodeConfig, value_node, ctx, where, where=f"node '{name}'")
            if where in ctx.bad or any(k.startswith(where + ".") for k in ctx.bad):
                continue
            cfg = SourceNodeConfig(**parsed.values)
            if (cfg.node is None) == (cfg.path is None):
                ctx.error(value_node, where, "expected exactly one of `node` (a NodeId 'nsu=URI;s=NAME') or `path` "
                          "(a browse path from Objects)")
                continue
            try:
                cfg.ref = parse_node_id(cfg.node) if cfg.node is not None else parse_browse_path(cfg.path)
            except NodeRefError as e:
                ctx.error(parsed.nodes.get("path") or value_node, f"{where}.path", str(e))
                continue
            out[name] = cfg
        return out


WRITE_BACK_FIELDS = ("ClassIndex", "Label", "Confidence", "Output")


@dataclass(frozen=True)
class WriteBackRule:
    """`write_back`: result field (ClassIndex, Label, Confidence, Output) -> a NodeId by namespace URI."""

    expect: str = ("a mapping of result fields (" + ", ".join(WRITE_BACK_FIELDS) + ") to NodeIds "
                   "('nsu=URI;s=NAME')")

    def parse(self, node: Node, ctx: Context, path: str) -> Any:
        items = named_items(node, ctx, path, self.expect, "result field")
        if items is None:
            return INVALID
        out: dict[str, str] = {}
        for name, key_node, value_node in items:
            where = key_path(path, name)
            if name not in WRITE_BACK_FIELDS:
                ctx.error(key_node, where, f"expected one of {', '.join(WRITE_BACK_FIELDS)}, got {shown(name)}")
                continue
            value = _NODE_ID.parse(value_node, ctx, where)
            if value is not INVALID:
                ctx.nodes[where] = value_node
                out[name] = value
        return out


@dataclass
class FeedConfig:
    """A model's windows cut from a source's nodes; its name is the results' source (`Last/<feed>`,
    `Alarms/<feed>/<label>`)."""

    model: str = required(text("the name of a configured tensor model"))
    window: int = required(integer(1, 1_000_000))  # rows per window: window x columns = the model's input size
    # node names forming a window's columns, in order; null: every node of the source in file order (not the trigger)
    columns: list[str] | None = setting(None, ListOf(text("a node name of this source"), "node names"))
    stride: int = setting(1, integer(1, 1_000_000))  # run every this many new rows (without a trigger)
    # a node name: windows are cut at its rising edge (a Boolean) or any change (a counter) instead of by stride
    trigger: str | None = setting(None, optional(text("a node name of this source")))
    trigger_kind: str = setting("rising", choice("rising", "change"))
    # samples whose SourceTimestamps lie within this of a row's first sample form that row
    tolerance_ms: float = setting(50.0, number(0, 3_600_000))
    # a column without a sample in a row: hold its last value (unless stale) or skip the window
    missing: str = setting("skip", choice("skip", "hold"))
    # windows of this feed in the model at once; one arriving while that many run is dropped and counted
    max_in_flight: int = setting(1, integer(1, 16))
    # results written back into the source (off unless listed): ClassIndex, Label, Confidence (labelled models) or
    # Output -> the NodeId to write it to; only these NodeIds are ever written, and every write is audited
    write_back: dict[str, str] = setting({}, WriteBackRule())
    name: str = ""


@dataclass(frozen=True)
class FeedsRule:
    """`feeds`: feed name -> {model, columns, window, stride | trigger, ...}."""

    expect: str = "a mapping of feed names to {model, columns, window, stride, ...}"

    def parse(self, node: Node, ctx: Context, path: str) -> Any:
        items = named_items(node, ctx, path, self.expect, "feed name")
        if items is None:
            return INVALID
        out: dict[str, FeedConfig] = {}
        for name, key_node, value_node in items:
            where = key_path(path, name)
            if not NAME.fullmatch(name) or name in ("default", "ClassIndex", "Label", "Confidence", "Time"):
                ctx.error(key_node, where, "a feed name must start with a letter and hold at most 64 characters "
                          "A-Z a-z 0-9 _ - (and not be default, ClassIndex, Label, Confidence or Time: it becomes "
                          f"an alarm source and Last/<feed>), got {shown(name)}")
                continue
            parsed = parse_fields(FeedConfig, value_node, ctx, where, where=f"feed '{name}'")
            if parsed.complete:
                out[name] = FeedConfig(**parsed.values, name=name)
        return out


@dataclass
class SourceConfig:
    endpoint: str = required(Scalar("an endpoint URL opc.tcp://HOST:PORT[/PATH]", _source_endpoint_check))
    # node name -> NodeId by namespace URI, or a browse path from Objects (never a namespace index)
    nodes: dict[str, SourceNodeConfig] = required(NodesRule())
    # None only when written (and then warned about by check-config and at the start)
    security_policy: str = setting("Basic256Sha256", choice(*SOURCE_POLICIES))
    security_mode: str = setting("SignAndEncrypt", choice(*SOURCE_MODES))
    # a user name for the source's session; its password is kept in the state directory (`appliance sources passwd
    # NAME`), never here. null: the appliance's client certificate alone (anonymous user)
    user: str | None = setting(None, optional(text("a user name of 1-64 characters A-Z a-z 0-9 _ . @ -",
                                                   lambda v: bool(_USER.fullmatch(v)))))
    enabled: bool = setting(True, boolean())  # false: not connected, State Disabled
    sampling_interval_ms: float = setting(100.0, number(0, 3_600_000))  # each node's, unless the node says
    publishing_interval_ms: float = setting(100.0, number(10, 3_600_000))
    queue_size: int = setting(10, integer(1, 10_000))  # each monitored item's queue on the source server
    deadband: float | None = setting(None, optional(number(0)))  # absolute deadband; null: every change
    accept_uncertain: bool = setting(False, boolean())  # Uncertain samples are used (else: the window is skipped)
    stale_after_s: float = setting(10.0, number(0, 86400, lo_open=True))  # no new row this long: the window restarts
    timeout_s: float = setting(5.0, number(0.1, 600))  # a request unanswered this long: the source is down
    reconnect_min_s: float = setting(0.5, number(0.01, 3600))  # back-off after a failure, doubling ...
    reconnect_max_s: float = setting(30.0, number(0.01, 86400))  # ... up to this
    # decode limits for what the source sends: more, and the source is disconnected, alarmed, retried
    max_message_size: int = setting(4 * 1048576, integer(8192, 2**31 - 1))
    max_chunk_count: int = setting(128, integer(1, 1_000_000))
    max_array_length: int = setting(65536, integer(1))
    max_string_length: int = setting(65536, integer(1))
    feeds: dict[str, FeedConfig] = setting({}, FeedsRule())
    name: str = ""

    @property
    def insecure(self) -> bool:
        return self.security_policy == "None" or self.security_mode == "None"


def parse_sources(node: Node | None, ctx: Context) -> dict[str, SourceConfig]:
    mapping = as_mapping(node, ctx, "sources", "a mapping of source names to their settings (endpoint, nodes, ...)")
    if mapping is None:
        return {}
    out: dict[str, SourceConfig] = {}
    for name, key_node, value_node in mapping_items(mapping, ctx, "sources", "source name"):
        path = key_path("sources", name)
        if not NAME.fullmatch(name):
            ctx.error(key_node, path, "a source name must start with a letter and hold at most 64 characters "
                      f"A-Z a-z 0-9 _ -, got {shown(name)}")
            continue
        parsed = parse_fields(SourceConfig, value_node, ctx, path, where=f"source '{name}'")
        if parsed.complete:
            out[name] = SourceConfig(**parsed.values, name=name)
    return out


def check_sources(cfg, ctx: Context, sample_floats) -> list[str]:
    """Across sections: security, each feed's model, columns, trigger and shape; feed names as alarm sources.
    sample_floats(model path) -> the floats of one model input, or None when unknown. Returns warnings."""
    warnings: list[str] = []
    feed_line: dict[str, str] = {}
    for sname, src in cfg.sources.items():
        spath = key_path("sources", sname)
        if (src.security_policy == "None") != (src.security_mode == "None"):
            key = "security_mode" if f"{spath}.security_mode" in ctx.nodes else "security_policy"
            ctx.error(ctx.nodes.get(f"{spath}.{key}") or ctx.nodes.get(spath), f"{spath}.{key}",
                      "security_policy None goes with security_mode None, and only with it (got policy "
                      f"{src.security_policy}, mode {src.security_mode})")
        elif src.insecure:
            node = ctx.nodes.get(f"{spath}.security_policy")
            line = node.start_mark.line + 1 if node is not None else 1
            warnings.append(f"{ctx.source}:{line}: {spath}.security_policy: None: the source's data and the "
                            "appliance's identity travel unsigned and unencrypted")
        if src.reconnect_max_s < src.reconnect_min_s:
            ctx.error(ctx.nodes.get(f"{spath}.reconnect_max_s") or ctx.nodes.get(spath), f"{spath}.reconnect_max_s",
                      f"expected a number >= reconnect_min_s ({src.reconnect_min_s}), got {src.reconnect_max_s}")
        for fname, feed in src.feeds.items():
            fpath = key_path(f"{spath}.feeds", fname)
            where = ctx.nodes.get(fpath)
            if fname in feed_line:
                ctx.error(where, fpath, f"feed name {shown(fname)} is already used by {feed_line[fname]}: feed "
                          "names are the results' sources and must be unique")
                continue
            feed_line[fname] = f"source '{sname}'"
            model = cfg.models.get(feed.model)
            if model is None or model.kind != "tensor":
                tensors = [n for n, m in cfg.models.items() if m.kind == "tensor"]
                ctx.error(ctx.nodes.get(f"{fpath}.model"), f"{fpath}.model", "expected the name of a configured "
                          f"tensor model ({', '.join(tensors) or 'none'}), got {shown(feed.model)}")
                continue
            if feed.columns is None:
                feed.columns = [n for n in src.nodes if n != feed.trigger]
            columns_node = ctx.nodes.get(f"{fpath}.columns")
            for i, col in enumerate(feed.columns):
                if col not in src.nodes:
                    item = columns_node.value[i] if isinstance(columns_node, SequenceNode) else columns_node
                    ctx.error(item or where, f"{fpath}.columns[{i}]", f"{shown(col)} is not a node of source "
                              f"'{sname}' ({', '.join(src.nodes)})")
            if feed.trigger is not None and feed.trigger not in src.nodes:
                ctx.error(ctx.nodes.get(f"{fpath}.trigger"), f"{fpath}.trigger", f"{shown(feed.trigger)} is not a "
                          f"node of source '{sname}' ({', '.join(src.nodes)})")
            floats = sample_floats(model) if model.resolved_path is not None else None
            if floats is not None and feed.window * len(feed.columns) != floats:
                node = ctx.nodes.get(f"{fpath}.window") or columns_node or where
                ctx.error(node, f"{fpath}.window", f"{feed.window} rows x {len(feed.columns)} columns = "
                          f"{feed.window * len(feed.columns)} values, but model '{feed.model}' takes {floats} values "
                          "per sample (its input shape)" + (f": with {len(feed.columns)} columns the window must be "
                                                            f"{floats // len(feed.columns)} rows"
                                                            if feed.columns and floats % len(feed.columns) == 0
                                                            else ""))
            for field_ in ("ClassIndex", "Label", "Confidence"):
                if field_ in feed.write_back and not model.labels:
                    key = f"{fpath}.write_back.{field_}"
                    ctx.error(ctx.nodes.get(key) or where, key, f"{field_} needs a model with labels ('{feed.model}' "
                              "has none): write Output instead")
            if model.labels and fname in model.alarm_sources:
                ctx.error(where, fpath, f"{shown(fname)} is already an alarm source of model '{feed.model}'")
            elif model.labels:
                model.alarm_sources[fname] = FEED_PREFIX + fname  # its results keep their own Last and alarms
    return warnings


FEED_PREFIX = "feed:"  # an alarm source that is a feed (appliance/classify.py's source_of(mailbox=FEED_PREFIX+name))

