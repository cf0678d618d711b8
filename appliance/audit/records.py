"""The audit log's record format, shared by its writer and its verifier: canonical JSON, the line hash, the
rotated files of one log.

Each line is one record: {"seq", "time", ...fields..., "prev", "hash"} where "prev" is the SHA-256 of the previous
line (its bytes, without the newline) and "hash" the SHA-256 of the record's canonical JSON without "hash".
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

GENESIS = "0" * 64  # the "prev" of the very first record
FIELDS = ("event", "action", "correlation_id", "audit_entry_id", "session", "client", "user", "role", "model",
          "version", "input_digest", "output_digest", "status", "latency_ms", "detail")
# What a record is about (its "event" field); docs/security.md lists them for auditors.
EVENTS = ("call", "role_denied", "rate_limited", "audit_refused", "login", "login_failed", "certificate_refused",
          "session_open", "session_close", "alarm_acknowledged", "deploy", "rollback", "promote", "reload",
          "commissioning_certificate", "model_event", "admin", "audit_resume", "audit_lost")


def canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def rotated(path: Path, index: int) -> Path:
    return path.with_name(f"{path.name}.{index}")


def chain_files(path: Path) -> list[Path]:
    """The log's files oldest first: audit.jsonl.N ... audit.jsonl.1, audit.jsonl."""
    indexes = []
    for p in path.parent.glob(path.name + ".*"):
        suffix = p.name[len(path.name) + 1:]
        if suffix.isdigit():
            indexes.append(int(suffix))
    files = [rotated(path, i) for i in sorted(indexes, reverse=True)]
    return files + [path] if path.exists() else files
