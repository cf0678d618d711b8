"""The configuration of the sources, as the client process receives it (protocol.SourceSpec): node references
resolved to their parts, feed columns to node indices, the files of identity.py to paths, the password read."""
from __future__ import annotations

from pathlib import Path

from . import protocol as p
from .identity import SourceFiles


def source_spec(src, state_dir: Path) -> p.SourceSpec:
    """src: core.config SourceConfig."""
    files = SourceFiles.of(state_dir, src.name)
    names = list(src.nodes)
    nodes = []
    for name, n in src.nodes.items():
        ref = n.ref
        nodes.append(p.NodeSpec(
            name=name, uri=ref.uri, kind=ref.kind, identifier=ref.identifier, path=[tuple(e) for e in ref.path],
            sampling_interval_ms=float(n.sampling_interval_ms if n.sampling_interval_ms is not None
                                       else src.sampling_interval_ms),
            queue_size=int(n.queue_size if n.queue_size is not None else src.queue_size),
            deadband=float(n.deadband if n.deadband is not None else src.deadband if src.deadband is not None
                           else -1.0)))
    from core.node_ref import parse_node_id
    writes: list[str] = []  # the write-back NodeIds, each once
    for f in src.feeds.values():
        writes += [n for n in f.write_back.values() if n not in writes]
    write_specs = []
    for text in writes:
        ref = parse_node_id(text)
        write_specs.append(p.NodeSpec(name=text, uri=ref.uri, kind=ref.kind, identifier=ref.identifier, path=[],
                                      sampling_interval_ms=0.0, queue_size=0, deadband=-1.0))
    feeds = [p.FeedSpec(name=f.name, columns=[names.index(c) for c in f.columns], window=f.window, stride=f.stride,
                        trigger=names.index(f.trigger) if f.trigger else -1, trigger_kind=f.trigger_kind,
                        tolerance_s=f.tolerance_ms / 1000.0, missing=f.missing,
                        write_back=[(field, writes.index(n)) for field, n in f.write_back.items()])
             for f in src.feeds.values()]
    return p.SourceSpec(
        name=src.name, endpoint=src.endpoint, policy=src.security_policy, mode=src.security_mode,
        enabled=src.enabled, client_cert=str(files.client_cert), client_key=str(files.client_key),
        trusted_cert=str(files.trusted), user=src.user or "",
        password=files.password() if src.user else "", publishing_interval_ms=src.publishing_interval_ms,
        accept_uncertain=src.accept_uncertain, stale_after_s=src.stale_after_s, timeout_s=src.timeout_s,
        reconnect_min_s=src.reconnect_min_s, reconnect_max_s=src.reconnect_max_s,
        max_message_size=src.max_message_size, max_chunk_count=src.max_chunk_count,
        max_array_length=src.max_array_length, max_string_length=src.max_string_length, nodes=nodes, feeds=feeds,
        writes=write_specs)
