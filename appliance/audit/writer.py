"""The writer of the append-only JSON Lines audit log of every method call and administrative action, hash-chained.

Each line is one record: {"seq", "time", ...fields..., "prev", "hash"} where "prev" is the SHA-256 of the previous
line (its bytes, without the newline) and "hash" the SHA-256 of the record's canonical JSON without "hash".
appliance.audit.verify walks the rotated files oldest to newest and names the file and line of every broken link.

What the chain does and does not prove (honestly):
- It detects editing, deleting, inserting or reordering records *inside* the log by someone who does not rewrite
  everything after the change.
- It does not detect truncation of the end of the log, nor a rewrite of the whole chain from some record onward,
  by someone who can write the file: there is no secret key. `AuditLog.head()` returns the hash of the last line;
  ship it elsewhere (a SCADA historian, a syslog host) now and then, and a later truncation or rewrite shows up as
  a head that is no longer in the chain.
- Rotation drops the oldest files beyond `keep_files`; the oldest remaining record then anchors the chain, so
  records removed from the start of the oldest file are indistinguishable from rotation.
"""
from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from .digest import DigestOf
from .records import FIELDS, GENESIS, chain_files, rotated, sha256_hex

log = logging.getLogger("appliance.audit")

FSYNC_INTERVAL_S = 1.0
_TAIL_BLOCK = 64 * 1024


class AuditLogClosed(RuntimeError):
    """A record after close(): counted as a write failure like any other."""


# A record's keys in sorted order, "hash" left out (_with_hash puts it in): the canonical JSON of a record is written
# by filling them in, not by building, sorting and walking a dict (profiled: 9 of a record's 25 us).
_SORTED_KEYS = ("action", "audit_entry_id", "client", "correlation_id", "detail", "event", "input_digest", "latency_ms",
                "model", "output_digest", "prev", "role", "seq", "session", "status", "time", "user", "version")
_NUMBERS = frozenset({"latency_ms", "seq"})
_json_string = json.encoder.encode_basestring  # what json.dumps(ensure_ascii=False) writes a str with


def _record_json(rec: dict) -> bytes:
    """canonical(rec) for a record of _SORTED_KEYS (strings, but for seq and latency_ms): tests/test_audit.py
    checks each line against json.dumps."""
    return ("{" + ",".join([f'"{k}":{repr(rec[k]) if k in _NUMBERS else _json_string(rec[k])}'
                            for k in _SORTED_KEYS]) + "}").encode()


def _storable(text: str) -> str:
    return text if text.isascii() else text.encode("utf-8", "replace").decode("utf-8")


def _with_hash(unhashed: bytes, digest_hex: str) -> bytes:
    """canonical(record | {"hash": digest_hex}) from canonical(record), without encoding the record twice: "hash"
    sorts between "event" and "input_digest", and `,"input_digest":` can only be that key (inside a JSON string
    every quote is escaped)."""
    at = unhashed.index(b',"input_digest":')
    return unhashed[:at] + b',"hash":"' + digest_hex.encode() + b'"' + unhashed[at:]


_second_text = (-1, "")  # (a whole second since the epoch, its "%Y-%m-%dT%H:%M:%S." in UTC): formatted once a second


def _utc_now() -> str:
    global _second_text
    now = time.time()
    second = int(now)
    if _second_text[0] != second:
        _second_text = (second, datetime.fromtimestamp(second, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S."))
    return f"{_second_text[1]}{int((now - second) * 1000):03d}Z"


def _tail(path: Path) -> tuple[bytes | None, bytes, int]:
    """(the last complete line or None, the torn fragment after it (b"" when the file ends with a newline),
    the fragment's 1-based line number or 0). Reads only the end of the file, except to number a torn line."""
    with open(path, "rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        if size == 0:
            return None, b"", 0
        block = _TAIL_BLOCK
        while True:
            start = max(0, size - block)
            fh.seek(start)
            body, newline, fragment = fh.read().rpartition(b"\n")
            line_start = body.rfind(b"\n")
            if start == 0 or line_start >= 0:
                last = body[line_start + 1:] if newline else None
                break
            block *= 2  # a record longer than the block: look further back
        torn_line = 0
        if fragment:
            fh.seek(0)
            torn_line = sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 20), b"")) + 1
    return last, fragment, torn_line


def _fields(*, action: str, session: str = "", client: str = "", user: str = "", role: str = "", model: str = "",
            version: str = "", input_digest: str | DigestOf = "", output_digest: str | DigestOf = "", status: str,
            latency_ms: float = 0.0, detail: str = "", event: str = "", correlation_id: str = "",
            audit_entry_id: str = "") -> dict:
    """A record's fields as written: text (DigestOf hashed now; lone surrogates from clients' undecodable bytes
    stored as U+FFFD, not the record lost) and the latency rounded to microseconds (-1 when not finite)."""
    latency = round(float(latency_ms), 3)
    text = {"event": event or "call", "action": action, "correlation_id": correlation_id,
            "audit_entry_id": audit_entry_id, "session": session, "client": client, "user": user, "role": role,
            "model": model, "version": version, "input_digest": input_digest, "output_digest": output_digest,
            "status": status, "detail": detail}
    fields = {k: v if v.__class__ is str and v.isascii() else _storable(str(v)) for k, v in text.items()}
    fields["latency_ms"] = latency if math.isfinite(latency) else -1.0
    return fields


class AuditLog:
    """Thread-safe writer. `record()` never raises into its caller: an I/O error is logged and counted in
    `metrics.audit_errors`, and the next record reopens the file and resumes the chain from what is on disk."""

    def __init__(self, path: Path, max_bytes: int = 10 * 1024 * 1024, keep_files: int = 10, metrics=None,
                 on_state=None, on_torn=None):
        """on_state(failing: bool, reason: str): called (from the writing thread) when writing starts failing or
        works again; on_torn(note): called once when a torn last line was found at start."""
        self.path = Path(path)
        self._on_state, self._on_torn = on_state, on_torn
        self.failing = False  # the last write failed (disk full, read-only, ...): see audit.on_failure
        self.failure_reason = ""
        self.torn = ""  # the note of a torn last line found at start, else ""
        self.max_bytes, self.keep_files = int(max_bytes), int(keep_files)
        self._metrics = metrics
        self._lock = threading.Lock()
        self._fh = None
        self._seq = 0
        self._prev = GENESIS
        self._last_fsync = 0.0
        self._fsync_timer: threading.Timer | None = None
        self._closed = False
        with self._lock:
            self._open_locked()

    # ---- opening and resuming ---------------------------------------------------------------------------------

    def _open_locked(self) -> bool:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            torn_note = self._resume_locked()
            if torn_note:
                # Keep the torn file exactly as it is (evidence); continue in a new file, chained to the last
                # complete record, the way a rotation does.
                self._shift_files_locked()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._fh = os.fdopen(fd, "ab")
            if torn_note:
                self.torn = torn_note
                self._write_locked({**dict.fromkeys(FIELDS, ""), "event": "audit_resume", "action": "audit_resume",
                                    "user": "system", "status": "TornLine", "latency_ms": 0.0, "detail": torn_note})
                self._fh.flush()
                _call_hook("torn-line", self._on_torn, torn_note)
            return True
        except OSError as exc:  # no directory, no room, no permission: failing until a later record reopens it
            self._fail(f"cannot open audit log: {exc}")
            self._fh = None
            return False

    def _resume_locked(self) -> str:
        """Continue the chain from the newest complete line on disk; returns a note when the current file ends in
        a torn (newline-less) line, which is then reported, closed and acknowledged by an audit_resume record."""
        note = ""
        for p in reversed(chain_files(self.path)):
            if p == self.path and p.stat().st_size == 0:
                continue
            last, fragment, torn_line = _tail(p)
            if fragment and p == self.path:
                note = (f"{rotated(p, 1).name}:{torn_line}: incomplete last line found at start (the process stopped "
                        "mid-write); the file is kept as it is and the chain continues in a new file from the "
                        "complete line before it")
                self._fail(f"audit log {note}")
            if last is None:
                continue
            self._prev = sha256_hex(last)
            try:
                self._seq = int(json.loads(last)["seq"])
            except (ValueError, KeyError, TypeError):
                log.error("audit log %s: last record unreadable; numbering continues from 0", p.name)
            break
        return note

    # ---- writing ------------------------------------------------------------------------------------------------

    def record(self, *, action: str, session: str = "", client: str = "", user: str = "", role: str = "",
               model: str = "", version: str = "", input_digest: str | DigestOf = "",
               output_digest: str | DigestOf = "", status: str,
               latency_ms: float = 0.0, detail: str = "", event: str = "", correlation_id: str = "",
               audit_entry_id: str = "") -> bool:
        """True when the record reached the file (flushed to the OS). The digests may be DigestOf: computed here."""
        return self.record_many([dict(
            action=action, session=session, client=client, user=user, role=role, model=model, version=version,
            input_digest=input_digest, output_digest=output_digest, status=status, latency_ms=latency_ms,
            detail=detail, event=event, correlation_id=correlation_id, audit_entry_id=audit_entry_id)])

    def record_many(self, records: list[dict]) -> bool:
        """Write records (each of record()'s keyword arguments) in order, flushed to the OS together: one write and
        one flush for the audit writer's batch instead of one per record. True when all reached the file; on a
        failure every record of the batch counts as failed (some may have reached it)."""
        try:
            cleaned = [_fields(**fields) for fields in records]
            with self._lock:
                if self._closed:
                    raise AuditLogClosed("audit log closed")
                if self._fh is None and not self._open_locked():
                    self._count_failures(len(records) - 1)  # the open's failure counted one
                    return False
                for fields in cleaned:
                    self._write_locked(fields)
                # Flushed to the OS (survives a crash of this process) with each batch (the audit writer hands one
                # over every 20 ms at most); fsync (survives power loss) at most once a second: on the SD/eMMC
                # storage of edge boxes an fsync per call costs milliseconds and wears the flash, while a power
                # cut loses at most the last second, and a timer makes sure that second gets synced.
                self._fh.flush()
                self._maybe_fsync_locked()
        except Exception as exc:  # noqa: BLE001 - never into the caller (the audit writer thread must go on)
            # A full disk or a closed log is expected; anything else is a bug here, logged with its traceback.
            actions = ", ".join(sorted({str(r.get("action", "")) for r in records}))
            self._fail(f"cannot write audit record ({actions}): {exc}",
                       traceback=not isinstance(exc, (OSError, AuditLogClosed)))
            self._count_failures(len(records) - 1)
            with self._lock:
                self._drop_handle_locked()
            return False
        self._set_failing(False, "")
        return True

    def _count_failures(self, n: int) -> None:
        if n > 0 and self._metrics is not None:
            self._metrics.audit_errors.inc(n)

    def _set_failing(self, failing: bool, reason: str) -> None:
        if failing == self.failing:
            return
        self.failing, self.failure_reason = failing, reason
        if failing:
            log.error("the audit log cannot be written: %s", reason)
        else:
            log.warning("the audit log is written again")
        _call_hook("state", self._on_state, failing, reason)

    def _write_locked(self, fields: dict) -> None:
        """One record into the file's buffer; the caller flushes."""
        rec = {**fields, "seq": self._seq + 1, "time": _utc_now(), "prev": self._prev}
        unhashed = _record_json(rec)
        line = _with_hash(unhashed, sha256_hex(unhashed))
        if self._fh.tell() > 0 and self._fh.tell() + len(line) + 1 > self.max_bytes:
            self._rotate_locked()
        self._fh.write(line + b"\n")
        self._seq, self._prev = rec["seq"], sha256_hex(line)

    def _maybe_fsync_locked(self) -> None:
        now = time.monotonic()
        if now - self._last_fsync >= FSYNC_INTERVAL_S:
            os.fsync(self._fh.fileno())
            self._last_fsync = now
        elif self._fsync_timer is None:
            self._fsync_timer = threading.Timer(FSYNC_INTERVAL_S - (now - self._last_fsync), self._deferred_fsync)
            self._fsync_timer.daemon = True
            self._fsync_timer.start()

    def _deferred_fsync(self) -> None:
        try:
            with self._lock:
                self._fsync_timer = None
                if self._fh is not None:
                    os.fsync(self._fh.fileno())
                    self._last_fsync = time.monotonic()
        except OSError as exc:  # the next record's write or fsync reports it again if it lasts
            self._fail(f"cannot sync audit log: {exc}")

    def _rotate_locked(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None
        self._shift_files_locked()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._fh = os.fdopen(fd, "ab")
        log.info("audit log rotated at seq %d", self._seq)

    def _shift_files_locked(self) -> None:
        """audit.jsonl -> audit.jsonl.1 -> .2 ...; the oldest beyond keep_files is dropped."""
        oldest = rotated(self.path, self.keep_files)
        if oldest.exists():
            oldest.unlink()
        for i in range(self.keep_files - 1, 0, -1):
            if rotated(self.path, i).exists():
                os.replace(rotated(self.path, i), rotated(self.path, i + 1))
        if self.keep_files > 0:
            os.replace(self.path, rotated(self.path, 1))
        else:
            self.path.unlink()

    def _drop_handle_locked(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError as exc:  # the handle is dropped either way; the next record opens a new one
                log.warning("closing the audit log file failed: %s", exc)
            self._fh = None

    def _fail(self, message: str, traceback: bool = False) -> None:
        log.error("%s", message, exc_info=traceback)
        if self._metrics is not None:
            self._metrics.audit_errors.inc()
        if "incomplete last line" not in message:
            self._set_failing(True, message)

    # ---- reading back -------------------------------------------------------------------------------------------

    def head(self) -> str:
        """SHA-256 of the last line written: ship it elsewhere to detect a later truncation or rewrite."""
        with self._lock:
            return self._prev

    @property
    def seq(self) -> int:
        with self._lock:
            return self._seq

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._fsync_timer is not None:
                self._fsync_timer.cancel()
                self._fsync_timer = None
            if self._fh is not None:
                try:
                    self._fh.flush()
                    os.fsync(self._fh.fileno())
                except OSError as exc:
                    self._fail(f"cannot sync audit log on close: {exc}")
                self._drop_handle_locked()


def _call_hook(what: str, hook, *args) -> None:
    """The owner's callbacks (on_state, on_torn) run on the writing thread: their failure is theirs, logged, and
    never stops the log."""
    if hook is None:
        return
    try:
        hook(*args)
    except Exception:  # noqa: BLE001 - a hook's bug must not break writing the audit log: logged with its traceback
        log.exception("audit %s hook failed", what)


