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

import errno
import json
import logging
import math
import os
import threading
import time
from collections import deque
from datetime import datetime, timezone
from pathlib import Path

import msgspec

from core.audit_digest import DigestOf
from .records import FIELDS, GENESIS, chain_files, rotated, sha256_hex

log = logging.getLogger("appliance.audit")

FSYNC_INTERVAL_S = 1.0
_TAIL_BLOCK = 64 * 1024


class AuditLogClosed(RuntimeError):
    """A record after close(): counted as a write failure like any other."""


# A record's keys in sorted order, "hash" left out (_with_hash puts it in): the canonical JSON of a record is written
# by filling them in, not by building, sorting and walking a dict (profiled: 9 of a record's 25 us). msgspec's
# encoder with sorted keys writes the same bytes as json.dumps(sort_keys=True, ensure_ascii=False, compact) for
# strings and ints (every code point checked) and for the floats a latency can be (it writes 1e16 where json writes
# 1e+16: beyond _MSGSPEC_FLOATS the record is written by hand), in a quarter of the time (0.9 us against 3.6).
_SORTED_KEYS = ("action", "audit_entry_id", "client", "correlation_id", "detail", "event", "input_digest", "latency_ms",
                "model", "output_digest", "prev", "role", "seq", "session", "status", "time", "user", "version")
_NUMBERS = frozenset({"latency_ms", "seq"})
_json_string = json.encoder.encode_basestring  # what json.dumps(ensure_ascii=False) writes a str with
_sorted_json = msgspec.json.Encoder(order="sorted").encode
_MSGSPEC_FLOATS = 1e15  # |latency_ms| below this: msgspec and json write it alike (both the shortest repr)


def _record_json(rec: dict) -> bytes:
    """canonical(rec) for a record of _SORTED_KEYS (strings, but for seq and latency_ms): tests/test_audit.py
    checks each line against json.dumps."""
    if len(rec) == len(_SORTED_KEYS) and -_MSGSPEC_FLOATS < rec["latency_ms"] < _MSGSPEC_FLOATS:
        return _sorted_json(rec)
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
    try:  # the usual record: ASCII text throughout, taken as it is (one test for all of it, not one per field)
        plain = "".join(text.values()).isascii()
    except TypeError:  # a DigestOf, hashed now, or another value that is not text
        plain = False
    fields = text if plain else {k: v if v.__class__ is str and v.isascii() else _storable(str(v))
                                 for k, v in text.items()}
    fields["latency_ms"] = latency if math.isfinite(latency) else -1.0
    return fields


def _actions(records: list[dict]) -> str:
    """The actions of records that could not be written, for the error's log line."""
    return ", ".join(sorted({str(r.get("action", "")) for r in records if "lost" not in r}))


RETRY_S = 0.25  # while records wait for the file (a full disk), the write is retried this often, and with each record
# Why a write failed, as the audit_lost record and the alarm's event say it.
_CAUSES = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded", errno.EROFS: "read-only file system"}


def _cause(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno in _CAUSES:
        return _CAUSES[exc.errno]
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _write_all(fd: int, data: bytes) -> None:
    """os.write until all of data is in the file: a write may take only part of it (the last free block of a full
    disk) before the next one fails."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class _Lost:
    """A run of records that could not be held (beyond max_held, or dropped by the owner's full queue): written as
    one audit_lost record where they would have stood."""
    __slots__ = ("count", "first", "last", "cause")

    def __init__(self, count: int, cause: str):
        self.count, self.cause = count, cause
        self.first = self.last = _utc_now()

    def fields(self, after_seq: int, seq: int) -> dict:
        when = f"at {self.first}" if self.first == self.last else f"from {self.first} to {self.last}"
        noun = "record" if self.count == 1 else "records"
        return {**dict.fromkeys(FIELDS, ""), "event": "audit_lost", "action": "audit_lost", "user": "system",
                "status": "RecordsLost", "latency_ms": 0.0, "time": self.first,
                "detail": f"{self.count} {noun} lost between seq {after_seq} and {seq} {when}: {self.cause}"}


class AuditLog:
    """Thread-safe writer. `record()` never raises into its caller.

    A record is written whole or not at all: when a write fails (disk full, read-only file system) the file is cut
    back to the end of its last complete line and the records are held in memory, in order, and written before any
    later record as soon as the file takes them again (retried every RETRY_S, and with each new record); they keep
    the time they were recorded and get their sequence numbers when written, so no number is used twice. Beyond
    `max_held` held records the later ones are lost, and one `audit_lost` record stands where they would have been
    ("N records lost between seq A and B at TIME: disk full"), which `appliance audit verify` reports and accepts.
    Records still held when the process stops are lost with no record saying so (the log's error line counts them).
    Every failure is logged and counted in `metrics.audit_errors`; `failing` is true while records are held."""

    def __init__(self, path: Path, max_bytes: int = 10 * 1024 * 1024, keep_files: int = 10, metrics=None,
                 on_state=None, on_torn=None, max_held: int = 10000):
        """on_state(failing: bool, reason: str): called (from the writing thread) when writing starts failing or
        works again; on_torn(note): called once when a torn last line was found at start."""
        self.path = Path(path)
        self._on_state, self._on_torn = on_state, on_torn
        self.failing = False  # records are held: the last write failed (disk full, ...): see audit.on_failure
        self.failure_reason = ""
        self.torn = ""  # the note of a torn last line found at start, else ""
        self.max_bytes, self.keep_files = int(max_bytes), int(keep_files)
        self.max_held = int(max_held)
        self._metrics = metrics
        self._lock = threading.Lock()
        self._state_lock = threading.RLock()  # failing's transitions and their hook, in order
        self._fd: int | None = None
        self._size = 0  # bytes in the current file
        self._seq = 0
        self._prev = GENESIS
        self._held: deque = deque()  # field dicts (with their "time") and _Lost runs, waiting for the file
        self._n_held = 0  # field dicts in _held
        self._cause = ""  # why the last write failed ("disk full", ...)
        self._last_fsync = 0.0
        self._fsync_timer: threading.Timer | None = None
        self._retry_timer: threading.Timer | None = None
        self._closed = False
        with self._lock:
            try:
                self._open_locked()
                error = self._drain_locked()  # a tear's audit_resume, now
            except OSError as exc:  # no directory, no room, no permission: failing until a later record opens it
                self._close_fd_locked()
                self._fail(f"cannot open audit log: {exc}")
                return
        self._after_drain(error)

    # ---- opening and resuming ---------------------------------------------------------------------------------

    def _open_locked(self) -> None:
        """Open the current file, the chain resumed from what is on disk; raises OSError."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        torn_note, shift = self._resume_locked()
        if shift:
            # Keep the torn file exactly as it is (evidence); continue in a new file, chained to the last complete
            # record, the way a rotation does.
            self._shift_files_locked()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._size = os.fstat(self._fd).st_size
        if torn_note:
            # Acknowledged by an audit_resume record right after the last complete one: held first, so that a
            # write that fails now (a full disk at start) writes it later, before anything else.
            resume = {**dict.fromkeys(FIELDS, ""), "event": "audit_resume", "action": "audit_resume",
                      "user": "system", "status": "TornLine", "latency_ms": 0.0, "detail": torn_note,
                      "time": _utc_now()}
            if self._held and isinstance(self._held[0], dict) and self._held[0]["event"] == "audit_resume":
                self._held[0] = resume  # found again after a failed write of it: the same tear
            else:
                self._held.appendleft(resume)
                self._n_held += 1
            if not self.torn:
                self.torn = torn_note
                log.error("audit log %s", torn_note)
                self._count(1)
                _call_hook("torn-line", self._on_torn, torn_note)

    def _resume_locked(self) -> tuple[str, bool]:
        """Continue the chain from the newest complete line on disk. When the newest non-empty file ends in a torn
        (newline-less) line, not yet acknowledged: (a note naming it, whether it is the current file, which is then
        shifted away); else ("", False)."""
        note, shift, newest = "", False, True
        self._seq, self._prev = 0, GENESIS
        for p in reversed(chain_files(self.path)):
            if p.stat().st_size == 0:
                continue
            last, fragment, torn_line = _tail(p)
            if fragment and newest:
                shift = p == self.path
                note = (f"{rotated(p, 1).name if shift else p.name}:{torn_line}: incomplete last line found at start "
                        "(the process stopped mid-write); the file is kept as it is and the chain continues in a new "
                        "file from the complete line before it")
            newest = False
            if last is None:
                continue
            self._prev = sha256_hex(last)
            try:
                self._seq = int(json.loads(last)["seq"])
            except (ValueError, KeyError, TypeError):
                log.error("audit log %s: last record unreadable; numbering continues from 0", p.name)
            break
        return note, shift

    # ---- writing ------------------------------------------------------------------------------------------------

    def record(self, *, action: str, session: str = "", client: str = "", user: str = "", role: str = "",
               model: str = "", version: str = "", input_digest: str | DigestOf = "",
               output_digest: str | DigestOf = "", status: str,
               latency_ms: float = 0.0, detail: str = "", event: str = "", correlation_id: str = "",
               audit_entry_id: str = "") -> bool:
        """True when the record reached the file (written to the OS). The digests may be DigestOf: computed here."""
        return self.record_many([dict(
            action=action, session=session, client=client, user=user, role=role, model=model, version=version,
            input_digest=input_digest, output_digest=output_digest, status=status, latency_ms=latency_ms,
            detail=detail, event=event, correlation_id=correlation_id, audit_entry_id=audit_entry_id)])

    def record_many(self, records: list[dict]) -> bool:
        """Write records (each of record()'s keyword arguments, or {"lost": N, "cause": TEXT} for N records its
        owner could not hand over: an audit_lost record in their place) in order, with one write for the audit
        writer's batch. True when they (and every record held before them) reached the file; else they are held
        (see the class) and each counts as a write failure."""
        try:
            cleaned = [r if "lost" in r else _fields(**r) for r in records]
        except Exception:  # noqa: BLE001 - a bug here must not reach the audit writer thread: logged, counted
            log.exception("cannot write audit record (%s)", _actions(records))
            self._count(len(records))
            return False
        now = _utc_now()
        with self._lock:
            closed = self._closed
            if not closed:
                if self._held and self._n_held + len(cleaned) > self.max_held:
                    self._drain_locked()  # room again? then these are held behind the others, not lost
                for fields in cleaned:
                    if "lost" in fields:
                        self._lose_locked(int(fields["lost"]), str(fields["cause"]))
                    else:
                        fields["time"] = now
                        self._hold_locked(fields)
                error = self._drain_locked()
        if closed:
            self._fail(f"cannot write audit record ({_actions(records)}): audit log closed")
            self._count(len(records) - 1)
            return False
        if error is not None:
            self._count(sum(1 for r in records if "lost" not in r))
        self._after_drain(error)
        return error is None

    def _hold_locked(self, fields: dict) -> None:
        if self._n_held < self.max_held:
            self._held.append(fields)
            self._n_held += 1
        else:
            self._lose_locked(1, self._cause or "the audit log could not be written")

    def _lose_locked(self, count: int, cause: str) -> None:
        last = self._held[-1] if self._held else None
        if isinstance(last, _Lost) and last.cause == cause:
            last.count += count
            last.last = _utc_now()
        else:
            self._held.append(_Lost(count, cause))

    def _drain_locked(self) -> OSError | None:
        """Write the held records in order, each whole; None when all reached the file, else the error (the file
        cut back, the records still held, a retry scheduled)."""
        if not self._held:
            return None
        try:
            if self._fd is None:
                self._open_locked()
            self._write_held_locked()
            self._maybe_fsync_locked()
        except OSError as exc:
            self._close_fd_locked()  # reopened at the next try: the chain resumes from what is on disk
            self._cause = _cause(exc)
            self._schedule_retry_locked()
            return exc
        return None

    def _write_held_locked(self) -> None:
        items = list(self._held)
        buf, staged, seq, prev = bytearray(), 0, self._seq, self._prev
        for item in items:
            fields = item.fields(seq, seq + 1) if isinstance(item, _Lost) else item
            unhashed = _record_json({**fields, "seq": seq + 1, "prev": prev})
            line = _with_hash(unhashed, sha256_hex(unhashed))
            if self._size + len(buf) > 0 and self._size + len(buf) + len(line) + 1 > self.max_bytes:
                self._commit_locked(buf, staged, seq, prev)
                buf, staged = bytearray(), 0
                self._rotate_locked()
            buf += line
            buf += b"\n"
            staged, seq, prev = staged + 1, seq + 1, sha256_hex(line)
        self._commit_locked(buf, staged, seq, prev)

    def _commit_locked(self, buf: bytearray, staged: int, seq: int, prev: str) -> None:
        """Write the lines of the first `staged` held items in one go; on a failure cut the file back to where it
        was, so that no torn line stays (raises the failure)."""
        if not buf:
            return
        start = self._size
        try:
            _write_all(self._fd, bytes(buf))
        except OSError:
            try:
                os.ftruncate(self._fd, start)
            except OSError as exc:  # the torn end stays: the next open finds it and acknowledges it (audit_resume)
                log.error("cannot cut the audit log back after a failed write: %s", exc)
            raise
        self._size = start + len(buf)
        for _ in range(staged):
            if not isinstance(self._held.popleft(), _Lost):
                self._n_held -= 1
        self._seq, self._prev = seq, prev

    def _schedule_retry_locked(self) -> None:
        if self._retry_timer is None and not self._closed:
            self._retry_timer = threading.Timer(RETRY_S, self._retry)
            self._retry_timer.daemon = True
            self._retry_timer.start()

    def _retry(self) -> None:
        with self._lock:
            self._retry_timer = None
            if self._closed or not self._held:
                return
            error = self._drain_locked()
        self._after_drain(error)

    def _after_drain(self, error: OSError | None) -> None:
        """Outside the lock (the hooks may log, emit events, record)."""
        if error is None:
            self._set_failing(False, "")
        elif not self.failing:
            held = self._n_held
            self._set_failing(True, f"cannot write audit records: {error}; {held} held until they can be written")

    def _count(self, n: int) -> None:
        if n > 0 and self._metrics is not None:
            self._metrics.audit_errors.inc(n)

    def _set_failing(self, failing: bool, reason: str) -> None:
        # Its own lock: the writer thread and the retry timer may both get here, and a hook may record (the log's
        # lock is not held here).
        with self._state_lock:
            if failing == self.failing:
                return
            self.failing, self.failure_reason = failing, reason
            if failing:
                log.error("the audit log cannot be written: %s", reason)
            else:
                log.warning("the audit log is written again")
            _call_hook("state", self._on_state, failing, reason)

    def _maybe_fsync_locked(self) -> None:
        now = time.monotonic()
        if now - self._last_fsync >= FSYNC_INTERVAL_S:
            os.fsync(self._fd)
            self._last_fsync = now
        elif self._fsync_timer is None:
            self._fsync_timer = threading.Timer(FSYNC_INTERVAL_S - (now - self._last_fsync), self._deferred_fsync)
            self._fsync_timer.daemon = True
            self._fsync_timer.start()

    def _deferred_fsync(self) -> None:
        try:
            with self._lock:
                self._fsync_timer = None
                if self._fd is not None:
                    os.fsync(self._fd)
                    self._last_fsync = time.monotonic()
        except OSError as exc:  # the next record's write or fsync reports it again if it lasts
            self._fail(f"cannot sync audit log: {exc}")

    def _rotate_locked(self) -> None:
        os.fsync(self._fd)
        self._close_fd_locked()
        self._shift_files_locked()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._size = 0
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

    def _close_fd_locked(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError as exc:  # the descriptor is gone either way; the next record opens a new one
                log.warning("closing the audit log file failed: %s", exc)
            self._fd = None

    def _fail(self, message: str, traceback: bool = False) -> None:
        log.error("%s", message, exc_info=traceback)
        self._count(1)
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

    @property
    def held(self) -> int:
        """Records waiting for the file (a full disk)."""
        with self._lock:
            return self._n_held

    def close(self) -> None:
        """Write what is held (one last try), sync and close."""
        with self._lock:
            self._closed = True
            for timer in (self._fsync_timer, self._retry_timer):
                if timer is not None:
                    timer.cancel()
            self._fsync_timer = self._retry_timer = None
            error = self._drain_locked()
            if error is not None:
                log.error("%d audit record(s) could not be written before the stop (%s): they are lost, and no "
                          "record in the log says so", self._n_held, self._cause)
            if self._fd is not None:
                try:
                    os.fsync(self._fd)
                except OSError as exc:
                    log.error("cannot sync audit log on close: %s", exc)
                    self._count(1)
                self._close_fd_locked()


def _call_hook(what: str, hook, *args) -> None:
    """The owner's callbacks (on_state, on_torn) run on the writing thread: their failure is theirs, logged, and
    never stops the log."""
    if hook is None:
        return
    try:
        hook(*args)
    except Exception:  # noqa: BLE001 - a hook's bug must not break writing the audit log: logged with its traceback
        log.exception("audit %s hook failed", what)


