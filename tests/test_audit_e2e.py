"""The audit trail end to end: every Infer call through a real client leaves a hash-chained record (accepted and
rejected ones alike, with who called), and editing or deleting a line makes `appliance audit verify` (run as a
subprocess, as an engineer would) fail and name the line."""
from __future__ import annotations

import hashlib
import json
import time
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from asyncua import ua

from appliance.client import connect
from attack_tools import SAMPLE, close, run_node_client, start_appliance
from uaclient import call, floats, run, status_name

ROOT = Path(__file__).resolve().parent.parent
STRING = ua.VariantType.String


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    a = start_appliance(tmp_path_factory.mktemp("audit_e2e"))
    a.monitor = a.issue("scada", "monitor")
    yield a
    a.stop()


def audit_path(app):
    return app.state_dir / "audit" / "audit.jsonl"


def records(app) -> list[dict]:
    return [json.loads(line) for line in audit_path(app).read_text().splitlines() if line.strip()]


def verify(path, app) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance", "audit", "verify", str(path), "--config",
                           str(app.config_path)], capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_every_call_is_recorded_with_its_caller_and_outcome(app):
    async def go():
        before = len(records(app)) if audit_path(app).exists() else 0
        operator = await connect(app.endpoint, *app.operator)
        monitor = await connect(app.endpoint, *app.monitor)
        try:
            outcomes = [status_name(await call(operator, "affine", "Infer", [floats(SAMPLE)])),
                        status_name(await call(operator, "affine", "Infer", [floats([1.0, 2.0, 3.0])])),
                        status_name(await call(operator, "affine", "Infer", [ua.Variant("1,2", STRING)])),
                        status_name(await call(monitor, "affine", "Infer", [floats(SAMPLE)]))]
        finally:
            await close(operator)
            await close(monitor)
        return before, outcomes

    before, outcomes = run(go())
    assert outcomes == ["Good", "BadInvalidArgument", "BadInvalidArgument", "BadUserAccessDenied"]
    deadline = time.monotonic() + 5  # records are written by the audit thread, a moment after the answer
    while len([r for r in records(app)[before:] if r["action"] == "Infer"]) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    new = [r for r in records(app)[before:] if r["action"] == "Infer"]
    assert [r["status"] for r in new] == outcomes
    operator_thumb = hashlib.sha1(app.operator[0].read_bytes()).hexdigest()
    ok = new[0]
    assert ok["model"] == "affine" and ok["role"] == "operator" and ok["client"] == operator_thumb
    assert ok["user"] == f"x509:{operator_thumb}" and ok["input_digest"] and ok["output_digest"]
    assert ok["session"] and ok["session"] == new[1]["session"] != new[3]["session"]
    assert new[3]["role"] == "monitor"
    seqs = [r["seq"] for r in records(app)]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    p = verify(audit_path(app), app)
    assert p.returncode == 0 and p.stdout.startswith("OK:"), (p.stdout, p.stderr)


def test_an_edited_or_deleted_line_fails_verification_and_is_named(app, tmp_path):
    run_node_client(app)  # one more caller, an independent client, before the log is tampered with
    lines = audit_path(app).read_bytes().splitlines(keepends=True)
    assert len(lines) >= 5
    target = 3  # 1-based line number of the record an intruder changes

    edited = tmp_path / "edited" / "audit.jsonl"
    edited.parent.mkdir()
    rec = json.loads(lines[target - 1])
    rec["status"] = "Good" if rec["status"] != "Good" else "BadInternalError"
    edited.write_bytes(b"".join(lines[:target - 1]) + json.dumps(rec, separators=(",", ":")).encode() + b"\n"
                       + b"".join(lines[target:]))
    p = verify(edited, app)
    assert p.returncode != 0, p.stdout
    assert f"audit.jsonl:{target}:" in p.stdout and "edited" in p.stdout, p.stdout

    deleted = tmp_path / "deleted" / "audit.jsonl"
    deleted.parent.mkdir()
    deleted.write_bytes(b"".join(lines[:target - 1] + lines[target:]))
    p = verify(deleted, app)
    assert p.returncode != 0, p.stdout
    assert f"audit.jsonl:{target}:" in p.stdout and "deleted" in p.stdout, p.stdout

    pristine = tmp_path / "pristine" / "audit.jsonl"
    pristine.parent.mkdir()
    shutil.copy(audit_path(app), pristine)
    assert verify(pristine, app).returncode == 0
