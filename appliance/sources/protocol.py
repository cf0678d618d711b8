"""The serve process <-> sources client process messages. The transport is the model workers' (a socketpair, a
4-byte length and a msgspec MessagePack body: appliance.workers.protocol.Channel), only the messages differ.

serve -> client process: Start (every source, with what it needs to connect), Ping, Write (results into a source).
client process -> serve: WindowReady (a complete window of a feed), SourceStatus (a source's state and counters, on
every change and once a second), Pong, Written.
"""
from __future__ import annotations

from typing import Any, Union

import msgspec

from appliance.workers.protocol import Channel  # noqa: F401 - the one transport, re-exported for this package


class _Msg(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    pass


class NodeSpec(msgspec.Struct, array_like=True):
    name: str
    uri: str  # NodeId by URI: namespace URI, kind (s i g b), identifier
    kind: str
    identifier: str
    path: list[tuple[str, str]]  # or a browse path from Objects: (namespace URI, BrowseName) per element
    sampling_interval_ms: float
    queue_size: int
    deadband: float  # < 0: none


class FeedSpec(msgspec.Struct, array_like=True):
    name: str
    columns: list[int]  # node indices, in column order
    window: int
    stride: int
    trigger: int  # node index, -1: none
    trigger_kind: str
    tolerance_s: float
    missing: str
    write_back: list[tuple[str, int]] = []  # (result field, index into SourceSpec.writes)


class SourceSpec(msgspec.Struct, array_like=True):
    name: str
    endpoint: str
    policy: str
    mode: str
    enabled: bool
    client_cert: str  # the appliance's client certificate for sources (DER) and its key (PEM)
    client_key: str
    trusted_cert: str  # where `appliance sources trust` stores the server's certificate: read at every connection
    # attempt, so a certificate trusted while serve runs is taken at the next attempt (no file: not trusted yet)
    user: str
    password: str
    publishing_interval_ms: float
    accept_uncertain: bool
    stale_after_s: float
    timeout_s: float
    reconnect_min_s: float
    reconnect_max_s: float
    max_message_size: int
    max_chunk_count: int
    max_array_length: int
    max_string_length: int
    nodes: list[NodeSpec]
    feeds: list[FeedSpec]
    writes: list[NodeSpec] = []  # the NodeIds results may be written to (the YAML's write_back), nothing else


class Start(_Msg):
    sources: list[SourceSpec]
    log_level: str
    log_format: str = "text"


class Ping(_Msg):
    seq: int


class Write(_Msg):
    """Write results into a source: SourceSpec.writes[i] for each i of `nodes`, as `types` (Int32, Float, String;
    a list value is an array), without timestamps (PLC servers refuse written timestamps)."""
    id: int
    source: str
    nodes: list[int]
    types: list[str]
    values: list[Any]


ToSources = Union[Start, Ping, Write]


class WindowReady(_Msg):
    feed: str
    rows: int
    columns: int
    data: bytes  # float32, rows x columns, row-major
    last_source_time: float  # Unix seconds: the window's last SourceTimestamp


class SourceStatus(_Msg):
    source: str
    state: str  # Connected | Connecting | BadData | Refused | Disabled
    error: str  # LastError: why it is not Connected, or the last failure ("" none)
    samples: int  # samples received since the appliance started
    windows: int  # windows cut (sent to serve)
    skipped: dict[str, int]  # windows skipped, by reason
    reconnects: int


class Pong(_Msg):
    seq: int


class Written(_Msg):
    id: int
    statuses: list[str]  # each write's StatusCode name (BadNotConnected when the source is not connected)


FromSources = Union[WindowReady, SourceStatus, Pong, Written]
