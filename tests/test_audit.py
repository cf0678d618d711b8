"""The hash-chained audit log: records, tamper detection with file and line, rotation, resume, torn lines."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import threading
import time

import numpy as np

from appliance.audit import GENESIS, AuditLog, verify, verify_report, writer
from appliance.cli.audit import cmd_audit_verify
from appliance.metrics import Metrics
from core.audit_digest import DigestOf, digest


def write(log: AuditLog, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        log.record(action="Infer", session=f"s{i % 3}", client="ab" * 20, user="user:plc1", role="operator",
                   model="te_classifier", version="v1", input_digest=digest([float(i)] * 4),
                   output_digest=digest([0.5] * 21), status="Good", latency_ms=1.25 + i, detail="")


def lines_of(path) -> list[bytes]:
    return path.read_bytes().splitlines()


def errors_total(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value("appliance_audit_write_errors_total")


def test_records_are_chained_json_lines(tmp_path):
    path = tmp_path / "audit" / "audit.jsonl"
    log = AuditLog(path)
    write(log, 5)
    log.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    lines = lines_of(path)
    assert len(lines) == 5
    prev = GENESIS
    for n, line in enumerate(lines, start=1):
        rec = json.loads(line)
        assert rec["seq"] == n and rec["prev"] == prev
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", rec["time"])
        assert rec["user"] == "user:plc1" and rec["status"] == "Good" and rec["model"] == "te_classifier"
        body = {k: v for k, v in rec.items() if k != "hash"}
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        assert rec["hash"] == hashlib.sha256(canonical).hexdigest()
        prev = hashlib.sha256(line).hexdigest()
    assert log.head() == prev
    assert verify(path) == (True, [])


def test_an_edited_field_is_named_by_line(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    write(log, 6)
    log.close()
    lines = lines_of(path)
    lines[2] = lines[2].replace(b'"status":"Good"', b'"status":"Bad"')
    path.write_bytes(b"\n".join(lines) + b"\n")
    ok, problems = verify(path)
    assert not ok
    assert problems == ["audit.jsonl:3: record hash does not match its content (edited?)",
                        "audit.jsonl:4: previous-hash link broken (the line before it, audit.jsonl:3, was altered)"]


def test_a_deleted_line_is_named(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    write(log, 6)
    log.close()
    lines = lines_of(path)
    del lines[3]
    path.write_bytes(b"\n".join(lines) + b"\n")
    ok, problems = verify(path)
    assert not ok
    assert problems[0].startswith("audit.jsonl:4: previous-hash link broken")


def test_reordered_lines_are_named(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    write(log, 6)
    log.close()
    lines = lines_of(path)
    lines[1], lines[2] = lines[2], lines[1]
    path.write_bytes(b"\n".join(lines) + b"\n")
    ok, problems = verify(path)
    assert not ok
    assert [p.split(": ")[0] for p in problems] == ["audit.jsonl:2", "audit.jsonl:3", "audit.jsonl:4"]
    assert all("previous-hash link broken" in p for p in problems)


def test_rotation_keeps_the_chain_and_drops_the_oldest(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, max_bytes=2000, keep_files=3)
    write(log, 60)
    log.close()
    rotated = sorted(p.name for p in tmp_path.iterdir())
    assert rotated == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2", "audit.jsonl.3"]
    for p in tmp_path.iterdir():
        assert p.stat().st_size <= 2000
    # The first record of each newer file links to the last line of the older one.
    older, newer = lines_of(tmp_path / "audit.jsonl.1"), lines_of(path)
    assert json.loads(newer[0])["prev"] == hashlib.sha256(older[-1]).hexdigest()
    assert json.loads(newer[0])["seq"] == json.loads(older[-1])["seq"] + 1
    oldest_seq = json.loads(lines_of(tmp_path / "audit.jsonl.3")[0])["seq"]
    assert oldest_seq > 1  # older files were dropped
    assert json.loads(newer[-1])["seq"] == 60
    assert verify(path) == (True, [])


def test_tampering_in_a_rotated_file_names_that_file(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, max_bytes=2000, keep_files=5)
    write(log, 40)
    log.close()
    target = tmp_path / "audit.jsonl.2"
    lines = lines_of(target)
    lines[1] = lines[1].replace(b'"role":"operator"', b'"role":"engineer"')
    target.write_bytes(b"\n".join(lines) + b"\n")
    ok, problems = verify(path)
    assert problems[0] == "audit.jsonl.2:2: record hash does not match its content (edited?)"
    assert problems[1].startswith("audit.jsonl.2:3: previous-hash link broken") and len(problems) == 2
    # Deleting a whole rotated file in the middle breaks the link at the next file's first line.
    target.unlink()
    ok, problems = verify(path)
    assert not ok and problems[0].startswith("audit.jsonl.1:1: previous-hash link broken")


def test_a_restart_resumes_the_chain(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    write(log, 3)
    head = log.head()
    log.close()
    log = AuditLog(path)
    assert log.head() == head and log.seq == 3
    write(log, 2, start=3)
    log.close()
    assert [json.loads(line)["seq"] for line in lines_of(path)] == [1, 2, 3, 4, 5]
    assert verify(path) == (True, [])
    # After a rotation left the current file empty, the chain resumes from the rotated file.
    log = AuditLog(path, max_bytes=1)
    write(log, 1, start=5)
    log.close()
    assert json.loads(lines_of(tmp_path / "audit.jsonl.1")[-1])["seq"] == 5
    assert verify(path) == (True, [])


def test_a_torn_last_line_is_kept_and_the_chain_continues_in_a_new_file(tmp_path, capsys):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    write(log, 4)
    log.close()
    torn = b'{"seq":5,"time":"2025-01-01T00:00:00.000Z","act'  # power cut mid-write
    with open(path, "ab") as fh:
        fh.write(torn)
    before = path.read_bytes()
    metrics, notes = Metrics(), []
    log = AuditLog(path, metrics=metrics, on_torn=notes.append)
    assert errors_total(metrics) == 1 and len(notes) == 1 and "audit.jsonl.1:5" in notes[0]
    assert not log.failing  # a tear found at start is no write failure
    write(log, 2, start=5)
    log.close()
    kept = tmp_path / "audit.jsonl.1"
    assert kept.read_bytes() == before  # the torn file is kept byte for byte
    lines = lines_of(path)
    resume = json.loads(lines[0])
    assert resume["action"] == "audit_resume" and resume["event"] == "audit_resume" and resume["seq"] == 5
    assert "audit.jsonl.1:5" in resume["detail"]
    assert resume["prev"] == hashlib.sha256(lines_of(kept)[3]).hexdigest()  # chained to the last good record
    assert set(resume) == set(json.loads(lines[1]))  # same schema as every other record
    ok, problems = verify(path)
    assert ok, problems
    assert cmd_audit_verify(path) == 0
    out = capsys.readouterr().out
    assert "TORN: audit.jsonl.1:5: torn last line" in out and "1 torn line(s) acknowledged" in out


def test_an_unacknowledged_torn_tail_fails_verification(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    write(log, 3)
    log.close()
    with open(path, "ab") as fh:
        fh.write(b'{"seq":4,"ti')
    ok, problems = verify(path)
    assert not ok and problems[0].startswith("audit.jsonl:4: torn last line, not yet acknowledged")


class _FullDisk:
    """The disk fills in the middle of a write: half of what is written reaches the file, then ENOSPC (as a real
    full file system does it: tests/test_audit_disk_full.py). `room()` gives the space back."""

    def __init__(self, monkeypatch):
        self._monkeypatch = monkeypatch
        monkeypatch.setattr(writer, "_write_all", self._torn_write)

    @staticmethod
    def _torn_write(fd, data):
        os.write(fd, data[:len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    def room(self):
        self._monkeypatch.undo()


def test_a_failing_write_reports_the_state_and_recovers(tmp_path, monkeypatch):
    """The record whose write failed is cut back (no torn line), held and written later, in order."""
    path = tmp_path / "audit.jsonl"
    states = []
    log = AuditLog(path, on_state=lambda failing, reason: states.append((failing, reason)))
    assert log.record(action="Infer", status="Good", detail="1")
    disk = _FullDisk(monkeypatch)
    assert not log.record(action="Infer", status="Good", detail="2")
    assert log.failing and states[-1][0] is True and "No space left" in states[-1][1]
    assert path.read_bytes().endswith(b"}\n") and len(lines_of(path)) == 1  # cut back to the last whole line
    assert log.held == 1
    disk.room()
    assert log.record(action="Infer", status="Good", detail="3")  # the held record first, then this one
    assert not log.failing and states[-1] == (False, "") and log.held == 0
    log.close()
    assert verify(path) == (True, [])
    assert [(json.loads(line)["seq"], json.loads(line)["detail"]) for line in lines_of(path)] == \
        [(1, "1"), (2, "2"), (3, "3")]


def test_held_records_are_written_when_space_returns_without_a_new_record(tmp_path, monkeypatch):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    disk = _FullDisk(monkeypatch)
    assert not log.record(action="Infer", status="Good")
    assert log.failing
    disk.room()
    deadline = time.monotonic() + 10
    while log.failing and time.monotonic() < deadline:  # retried every RETRY_S
        time.sleep(0.05)
    assert not log.failing and len(lines_of(path)) == 1
    log.close()


def test_records_beyond_max_held_are_one_marked_gap(tmp_path, monkeypatch, capsys):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, max_held=3)
    write(log, 2)
    disk = _FullDisk(monkeypatch)
    write(log, 7, start=2)  # 3 held, 4 lost
    disk.room()
    write(log, 1, start=9)
    log.close()
    recs = [json.loads(line) for line in lines_of(path)]
    assert [r["seq"] for r in recs] == list(range(1, 8))
    assert [r["latency_ms"] for r in recs if r["event"] == "call"] == [1.25 + i for i in (0, 1, 2, 3, 4, 9)]
    marker = recs[5]
    assert marker["event"] == "audit_lost" and marker["detail"].startswith("4 records lost between seq 5 and 6 ")
    assert marker["detail"].endswith(": disk full")
    assert verify(path) == (True, [])
    assert cmd_audit_verify(path) == 0
    out = capsys.readouterr().out
    assert "GAP: audit.jsonl:6: 4 records lost between seq 5 and 6" in out and "1 gap(s) marked" in out


def test_a_torn_line_left_by_a_failed_acknowledgement_is_acknowledged_later(tmp_path, monkeypatch):
    """A torn last line found at start while the disk is full: the audit_resume that acknowledges it is held and
    written first once there is room; the tear never stands unacknowledged before a later record."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    write(log, 3)
    log.close()
    with open(path, "ab") as fh:
        fh.write(b'{"seq":4,"ti')
    disk = _FullDisk(monkeypatch)
    log = AuditLog(path)
    assert log.torn and not log.record(action="Infer", status="Good")
    log.close()  # stopped while still full: the held records are lost, the tear is still unacknowledged
    log = AuditLog(path)  # started again, still full
    assert not log.record(action="Infer", status="Good", detail="after")
    disk.room()
    assert log.record(action="Infer", status="Good", detail="later")
    log.close()
    recs = [json.loads(line) for line in lines_of(path)]
    assert [r["event"] for r in recs] == ["audit_resume", "call", "call"] and recs[0]["seq"] == 4
    assert "audit.jsonl.1:4" in recs[0]["detail"]
    problems, tears, gaps = verify_report(path)
    assert problems == [] and len(tears) == 1 and gaps == []


def test_a_failing_hook_is_logged_and_the_log_goes_on(tmp_path, caplog):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    write(log, 2)
    log.close()
    with open(path, "ab") as fh:
        fh.write(b'{"seq":3,"ti')  # torn: the next start calls on_torn

    def broken(*args):
        raise KeyError("the owner's bug")
    log = AuditLog(path, on_torn=broken, on_state=broken)
    assert log.torn and not log.failing  # opened and resumed although the hook raised
    assert log.record(action="Infer", status="Good")
    log.close()
    assert verify(path) == (True, [])
    assert any(r.message == "audit torn-line hook failed" and r.exc_info for r in caplog.records)


def test_record_never_raises_and_counts_errors(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    metrics = Metrics()
    log = AuditLog(blocker / "audit.jsonl", metrics=metrics)  # cannot create a file under a file
    write(log, 2)
    assert errors_total(metrics) >= 2
    log.close()
    log.record(action="after-close", session="", client="", user="", role="", status="Good")


def test_concurrent_writers_keep_one_chain(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, max_bytes=20_000, keep_files=50)
    threads = [threading.Thread(target=write, args=(log, 50, k * 50)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    assert verify(path) == (True, [])
    seqs = [json.loads(line)["seq"] for p in sorted(tmp_path.iterdir(), key=lambda p: (-len(p.suffix), p.name))
            for line in lines_of(p)]
    assert sorted(seqs) == list(range(1, 201))


def test_digest_is_canonical():
    values = [0.25, -1.5, 3.0]
    assert digest(values) == digest(np.array(values, dtype=np.float32)) == digest(np.array([values]))
    assert re.fullmatch(r"sha256:[0-9a-f]{32}", digest(values))
    assert digest(values) != digest([0.25, -1.5, 3.5])
    assert digest("abc") != digest(b"abc")
    assert digest("abc") == digest("abc")
    assert digest([float("nan")]) == digest(np.array([np.nan], dtype=np.float32))


def test_a_line_is_the_canonical_json_of_its_record_whatever_the_text(tmp_path):
    """The writer splices "hash" into the record's canonical JSON instead of encoding it twice: the line must still
    be exactly the canonical encoding, also with client text that quotes the next key, backslashes, non-ASCII and
    lone surrogates; digests given as DigestOf are hashed when written, as digest() does."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    tricky = ['we\\",\\"input_digest\\":"x', ',"input_digest":', "\\", 'ü "q"', "bad \udcff byte", ""]
    samples = np.array([0.5, float("nan"), -2.0], dtype=np.float32)
    for text in tricky:
        assert log.record(action="Infer", status="Good", user=f"user:{text}", detail=text,
                          input_digest=DigestOf(samples), output_digest=DigestOf(text))
    log.close()
    for line, text in zip(lines_of(path), tricky):
        rec = json.loads(line)
        assert json.dumps(rec, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode() == line
        assert rec["input_digest"] == digest(samples) and rec["output_digest"] == digest(text)
    assert verify(path) == (True, [])


def test_a_line_is_canonical_whatever_the_latency_and_the_control_characters(tmp_path):
    """The record's JSON is written by msgspec where it writes what json.dumps writes, by hand beyond (json writes
    1e+16, msgspec 1e16): each line must be the canonical encoding, its hash verified, either way."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    controls = "".join(chr(c) for c in range(0x20)) + "\x7f\u2028\u2029\ufeff"
    latencies = [0.0, 0.001, 0.812, 123456.789, 1e15, 1e16, 3.5e20, float("inf")]
    for ms in latencies:
        assert log.record(action="Infer", status="Good", latency_ms=ms, detail=controls, user=f"user:{ms}")
    log.close()
    lines = lines_of(path)
    assert [json.loads(line)["latency_ms"] for line in lines] == latencies[:-1] + [-1.0]
    for line in lines:
        assert json.dumps(json.loads(line), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode() == line
    assert verify(path) == (True, [])


def test_cmd_audit_verify(tmp_path, capsys):
    path = tmp_path / "audit.jsonl"
    assert cmd_audit_verify(path) == 2
    log = AuditLog(path, max_bytes=2000)
    write(log, 20)
    log.close()
    files = len(list(tmp_path.iterdir()))
    assert cmd_audit_verify(path) == 0
    assert capsys.readouterr().out.strip().endswith(f"OK: 20 records in {files} files")
    rotated = tmp_path / "audit.jsonl.1"
    lines = lines_of(rotated)
    rotated.write_bytes(b"\n".join(lines[:1] + lines[2:]) + b"\n")
    assert cmd_audit_verify(path) == 2
    assert "audit.jsonl.1:2: previous-hash link broken" in capsys.readouterr().out


def test_log_lines_about_a_call_carry_its_correlation_id_as_json():
    import io
    import logging

    from appliance.logs import CorrelationFilter, JsonFormatter
    from core.correlation import correlation_id

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(CorrelationFilter())
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("test.correlation")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        token = correlation_id.set("0123456789abcdef0123456789abcdef")
        try:
            logger.warning("Infer on te refused")
        finally:
            correlation_id.reset(token)
        logger.warning("not about a call")
    finally:
        logger.removeHandler(handler)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["correlation_id"] == "0123456789abcdef0123456789abcdef" and first["message"] == "Infer on te refused"
    assert "correlation_id" not in second and second["level"] == "WARNING"


def test_verify_names_a_file_of_the_chain_it_cannot_read(tmp_path, capsys):
    from appliance.cli.audit import cmd_audit_verify
    log = AuditLog(tmp_path / "audit.jsonl")
    log.record(event="call", action="Infer", session="s", client="c", user="u", role="operator", status="Good")
    log.close()
    (tmp_path / "audit.jsonl.1").mkdir()  # a rotated file that is a folder
    assert cmd_audit_verify(tmp_path / "audit.jsonl") == 2
    out = capsys.readouterr().out
    assert "audit.jsonl.1" in out and "Traceback" not in out


def test_a_batch_is_written_in_order_across_rotations_and_a_failed_one_counts_each_record(tmp_path, monkeypatch):
    """The audit writer thread hands over the records of up to 20 ms at once (record_many: one flush)."""
    path = tmp_path / "audit.jsonl"
    metrics = Metrics()
    log = AuditLog(path, max_bytes=1500, keep_files=20, metrics=metrics)
    batch = [dict(action="Infer", status="Good", user=f"user:{i}", latency_ms=i / 7, input_digest=DigestOf(b"x" * i))
             for i in range(25)]
    assert log.record_many(batch)
    assert len(list(tmp_path.iterdir())) > 3  # the batch crossed several rotations
    assert verify(path) == (True, [])
    disk = _FullDisk(monkeypatch)
    assert not log.record_many(batch[:5])
    assert errors_total(metrics) == 5 and log.failing
    disk.room()
    assert log.record_many(batch[:2])  # the 5 held ones first, then these
    log.close()
    assert verify(path) == (True, [])
    oldest_first = sorted(tmp_path.iterdir(), key=lambda p: -int(p.suffix[1:]) if p.suffix[1:].isdigit() else 0)
    users = [json.loads(line)["user"] for p in oldest_first for line in lines_of(p)]
    assert users == [f"user:{i}" for i in range(25)] + [f"user:{i}" for i in range(5)] + ["user:0", "user:1"]


_KILLED_MID_WRITE = """
import os, sys, time
from appliance.audit import AuditLog, writer
log = AuditLog(sys.argv[1])
for i in range(3):
    log.record(action="Infer", status="Good", detail=str(i))
def stalls(fd, data):  # the process is killed while its write is half done
    os.write(fd, data[:len(data) // 2])
    print("mid-write", flush=True)
    time.sleep(60)
writer._write_all = stalls
log.record(action="Infer", status="Good", detail="torn")
"""


def test_a_process_killed_mid_write_leaves_a_tear_the_next_start_acknowledges(tmp_path):
    """kill -9 in the middle of a record's write: the next start keeps the torn file, acknowledges the tear with an
    audit_resume record, and verify reports it (TORN) and passes: a marked gap, never taken for tampering."""
    import signal
    import subprocess
    import sys
    path = tmp_path / "audit.jsonl"
    child = subprocess.Popen([sys.executable, "-c", _KILLED_MID_WRITE, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "mid-write"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert not path.read_bytes().endswith(b"\n")  # torn
    assert not verify(path)[0]  # not yet acknowledged: the appliance has not started since
    log = AuditLog(path)
    assert log.record(action="Infer", status="Good", detail="after")
    log.close()
    problems, tears, gaps = verify_report(path)
    assert problems == [] and len(tears) == 1 and tears[0].startswith("audit.jsonl.1:4: torn last line")
    recs = [json.loads(line) for line in lines_of(path)]
    assert [(r["seq"], r["event"]) for r in recs] == [(4, "audit_resume"), (5, "call")]
