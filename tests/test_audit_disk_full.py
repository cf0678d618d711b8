"""The audit chain on a real small file system that fills under a PLC's calls (a 4 MiB tmpfs mounted by the test, a
loop-mounted ext4 image where tmpfs cannot be mounted): the alarm and the refusals while it is full, Good again once
space is back, and afterwards `appliance audit verify` passes: every record whose write failed is written whole
later, in order, or stands as a marked gap ("N records lost between seq A and B ...: disk full"); never a torn
line, a reused sequence number or a broken link."""
from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from appliance.audit import verify_report
from appliance.client import connect
from attack_tools import SAMPLE, close, start_appliance
from uaclient import call, floats, read, run, status_name

ROOT = Path(__file__).resolve().parent.parent
TIME = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


def _mount_small_fs(mnt: Path, image: Path) -> str:
    """Mount a 4 MiB file system at mnt: tmpfs, else a loop-mounted ext4 image; the reason why not, else ""."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "mounting a small file system needs root (tmpfs or a loop device)"
    tried = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
    if tried.returncode == 0:
        return ""
    why = f"tmpfs: {tried.stderr.strip()}"
    if shutil.which("mkfs.ext4") is None:
        return why + "; no mkfs.ext4 for a loop device"
    with open(image, "wb") as fh:
        fh.truncate(4 * 1024 * 1024)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, text=True)
    looped = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True, text=True) \
        if made.returncode == 0 else made
    return "" if looped.returncode == 0 else why + f"; loop device: {looped.stderr.strip()}"


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    reason = _mount_small_fs(mnt, tmp_path / "small.img")
    if reason:
        pytest.skip(f"no small file system can be mounted here: {reason}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(folder: Path) -> Path:
    """Fill the file system until a write fails with ENOSPC; returns the filler file (delete it: space is back)."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as fh:
        for size in (1 << 16, 1 << 12, 1 << 8, 1):
            try:
                while True:
                    fh.write(b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    return filler


def records(folder: Path) -> list[dict]:
    """Every complete record of the log, oldest file first."""
    files = sorted(folder.glob("audit.jsonl*"), key=lambda p: -int(p.suffix[1:]) if p.suffix[1:].isdigit() else 0)
    return [json.loads(line) for p in files for line in p.read_bytes().split(b"\n") if line.strip()]


def verify_cli(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance", "audit", "verify", str(path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


async def plc_through_a_full_disk(app, audit_dir: Path, calls_while_full: int) -> tuple[dict, list[bool]]:
    """A PLC calling Infer every 50 ms: some calls Good, the disk filled, calls until `calls_while_full` were
    refused, space back, calls until Good again and a few more. Returns the count of each answer (and of the Good
    ones after the disk filled, before the first refusal) and the AuditLogFailed alarm as read by the client at each
    phase."""
    client = await connect(app.endpoint, *app.operator)
    answers: dict[str, int] = {}
    alarms = []

    async def infer() -> str:
        status = status_name(await call(client, "affine", "Infer", [floats(SAMPLE)]))
        answers[status] = answers.get(status, 0) + 1
        await asyncio.sleep(0.05)
        return status

    try:
        for _ in range(10):
            assert await infer() == "Good"
        filler = fill(audit_dir)
        answers["Good while full"] = -answers["Good"]
        refused = 0
        deadline = time.monotonic() + 60
        while refused < calls_while_full and time.monotonic() < deadline:
            refused += await infer() == "BadResourceUnavailable"
        assert refused == calls_while_full, f"the full disk never refused a call: {answers}"
        answers["Good while full"] += answers["Good"]  # answered before the failed write was seen: held, not lost
        await app.app.ua.publish_values()
        alarms.append(await read(client, "Alarms", "AuditLogFailed"))
        filler.unlink()  # space is back
        deadline = time.monotonic() + 30
        while await infer() != "Good":
            assert time.monotonic() < deadline, f"still refused 30 s after space came back: {answers}"
        for _ in range(5):
            assert await infer() == "Good"
        await asyncio.sleep(0.5)
        await app.app.ua.publish_values()
        alarms.append(await read(client, "Alarms", "AuditLogFailed"))
    finally:
        await close(client)
    return answers, alarms


def test_a_full_disk_under_a_plcs_calls_leaves_a_chain_that_verifies_with_every_record(small_fs, tmp_path):
    """Every record whose write failed is written whole later, in order: each answer the PLC got has its record."""
    audit_dir = small_fs / "audit"
    app = start_appliance(tmp_path / "app", extra={"audit": {"path": str(audit_dir / "audit.jsonl"),
                                                             "max_bytes": 65536, "keep_files": 200}})
    try:
        answers, alarms = run(plc_through_a_full_disk(app, audit_dir, calls_while_full=8), timeout=180)
    finally:
        app.stop()
    assert alarms == [True, False]
    p = verify_cli(audit_dir / "audit.jsonl")
    print(f"answers: {answers}; verify: {p.stdout.strip()}")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "GAP" not in p.stdout and "TORN" not in p.stdout, p.stdout  # nothing was lost: nothing to report
    recs = records(audit_dir)
    assert [r["seq"] for r in recs] == list(range(recs[0]["seq"], recs[0]["seq"] + len(recs)))
    infers = [r for r in recs if r["action"] == "Infer"]
    assert sum(r["status"] == "Good" for r in infers) == answers["Good"], answers
    assert sum(r["event"] == "audit_refused" for r in infers) == answers["BadResourceUnavailable"], answers
    assert [r["time"] for r in recs] == sorted(r["time"] for r in recs)  # written in the order they happened


def test_records_beyond_what_memory_holds_stand_as_a_marked_gap(small_fs, tmp_path):
    """audit.queue_size bounds the records held while the disk is full: the rest are lost and a marker in the log
    says how many, between which sequence numbers, when and why; `appliance audit verify` reports it and passes."""
    audit_dir = small_fs / "audit"
    app = start_appliance(tmp_path / "app", extra={"audit": {"path": str(audit_dir / "audit.jsonl"),
                                                             "queue_size": 16}})
    try:
        answers, alarms = run(plc_through_a_full_disk(app, audit_dir, calls_while_full=30), timeout=180)
    finally:
        app.stop()
    assert alarms == [True, False]
    p = verify_cli(audit_dir / "audit.jsonl")
    assert p.returncode == 0, p.stdout + p.stderr
    print(f"answers: {answers}; verify: {p.stdout.strip()}")
    gaps = [line for line in p.stdout.splitlines() if line.startswith("GAP: ")]
    assert len(gaps) == 1, p.stdout
    problems, _tears, reported = verify_report(audit_dir / "audit.jsonl")
    assert problems == [] and len(reported) == 1
    recs = records(audit_dir)
    marker = next(r for r in recs if r["event"] == "audit_lost")
    found = re.fullmatch(rf"(\d+) records? lost between seq {marker['seq'] - 1} and {marker['seq']} "
                         rf"(at {TIME}|from {TIME} to {TIME}): disk full", marker["detail"])
    assert found and marker["detail"] in gaps[0], marker["detail"]
    lost = int(found.group(1))
    assert [r["seq"] for r in recs] == list(range(recs[0]["seq"], recs[0]["seq"] + len(recs)))
    infers = [r for r in recs if r["action"] == "Infer"]
    # every answer is either in the log or counted by the marker
    assert len(infers) + lost == answers["Good"] + answers["BadResourceUnavailable"], (answers, lost)
    assert lost > 0 and "OK:" in p.stdout and "1 gap(s) marked" in p.stdout, p.stdout
