"""The complete audit trail on a real server (real certificates, SignAndEncrypt): a scripted session leaves every
event kind in the log with the appliance's correlation id (and the client's AuditEntryId beside it) and `appliance
audit verify` passes; a log that cannot be written (an injected ENOSPC) refuses calls and raises the alarm; a torn
last line found at start is kept, the chain continues in a new file and the alarm is raised."""
from __future__ import annotations

import asyncio

import errno
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from asyncua import ua

from appliance.audit import AuditLog, verify_report, writer
from appliance.client import connect
from attack_tools import SAMPLE, close, refusal, start_appliance, status_of
from certificates import make_test_certificate
from uaclient import call, floats, read, run, status_name
from worker_probes import wait_for

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    a = start_appliance(tmp_path_factory.mktemp("audit_complete"),
                        extra={"security": {"rate_limits": {"per_client": {"calls_per_s": 0.5, "burst": 12}}}},
                        labels=["a", "b", "c", "d"], alarm_classes=["d"])
    a.monitor = a.issue("hmi", "monitor")
    a.engineer = a.issue("eng", "engineer")
    yield a
    a.stop()


def audit_file(app) -> Path:
    return app.state_dir / "audit" / "audit.jsonl"


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def cli(app, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance", *args, "--config", str(app.config_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


async def call_with_audit_entry_id(client, model: str, method: str, args: list, entry_id: str):
    """A Call whose RequestHeader carries the plant's own AuditEntryId."""
    from appliance.client import model_node
    parent, ns = await model_node(client, model)
    node = await parent.get_child(f"{ns}:{method}")
    request = ua.CallRequest()
    item = ua.CallMethodRequest()
    item.ObjectId, item.MethodId, item.InputArguments = parent.nodeid, node.nodeid, args
    request.Parameters.MethodsToCall = [item]
    request.RequestHeader.AuditEntryId = entry_id
    from asyncua.ua.ua_binary import struct_from_binary
    data = await client.uaclient.protocol.send_request(request)
    return struct_from_binary(ua.CallResponse, data).Results[0]


def test_a_scripted_session_leaves_every_event_kind_and_verifies(app, tmp_path):
    before = len(records(audit_file(app)))
    rogue = make_test_certificate("rogue", application_uri="urn:rogue:client").write(tmp_path, "rogue")

    async def go():
        out = {}
        operator = await connect(app.endpoint, *app.operator)
        monitor = await connect(app.endpoint, *app.monitor)
        engineer = await connect(app.endpoint, *app.engineer)
        try:
            out["traced"] = status_name(await call_with_audit_entry_id(
                operator, "affine", "Infer", [floats(SAMPLE)], "plant-trace-0042"))
            out["forged"] = status_name(await call_with_audit_entry_id(
                operator, "affine", "Infer", [floats(SAMPLE)], "bad\x07id"))
            out["denied"] = status_name(await call(monitor, "affine", "Infer", [floats(SAMPLE)]))
            out["reload"] = status_name(await call(engineer, "", "ReloadModel", [ua.Variant("affine", ua.VariantType.String)]))
            out["acknowledged"] = await acknowledge_a_raised_alarm(engineer)
            statuses = []
            for _ in range(20):  # the operator identity's bucket (burst 12) runs dry
                statuses.append(status_name(await call(operator, "affine", "Infer", [floats(SAMPLE)])))
                if statuses[-1] == "BadTooManyOperations":
                    break
            out["rate"] = statuses[-1]
        finally:
            await close(operator)
            await close(monitor)
            await close(engineer)
        out["bad_login"] = status_of(await refusal(connect(app.endpoint, *app.operator, username="mallory",
                                                           password="guess-1234")))
        out["bad_cert"] = status_of(await refusal(connect(app.endpoint, *rogue)))
        return out

    out = run(go())
    assert out["traced"] == "Good" and out["forged"] == "Good" and out["denied"] == "BadUserAccessDenied"
    assert out["reload"] == "Good" and out["rate"] == "BadTooManyOperations"
    assert out["bad_login"] and out["bad_cert"] == "BadCertificateUntrusted", out
    assert out["acknowledged"] == "Good", out

    # CLI: the implicit commissioning certificate of `appliance call`, then deploy and rollback of a version
    p = cli(app, "call", "affine", "--input", ",".join(str(v) for v in SAMPLE))
    assert p.returncode == 0, p.stdout + p.stderr
    version_dir = tmp_path / "v2"
    version_dir.mkdir()
    (version_dir / "affine.onnx").write_bytes(Path(app.config.models["affine"].path).read_bytes())
    for args in (("models", "deploy", "affine", str(version_dir), "--version", "v2"),
                 ("models", "deploy", "affine", str(version_dir), "--version", "v3"),
                 ("models", "rollback", "affine")):
        p = cli(app, *args)
        assert "Traceback" not in p.stderr, p.stderr

    wanted = {"call", "role_denied", "rate_limited", "login", "login_failed", "certificate_refused", "session_open",
              "session_close", "reload", "alarm_acknowledged"}
    new = wait_for(lambda: (lambda rs: rs if wanted <= {r["event"] for r in rs} else None)(
        records(audit_file(app))[before:]), 5,
        lambda: f"every kind of audit record; missing {wanted - {r['event'] for r in records(audit_file(app))[before:]}}")
    events = {r["event"] for r in new}
    assert wanted <= events, wanted - events
    # every record has an appliance-made correlation id; the client's AuditEntryId stands beside it, if printable
    assert all(re.fullmatch(r"[0-9a-f]{32}", r["correlation_id"]) for r in new)
    assert len({r["correlation_id"] for r in new}) == len(new)
    ack = [r for r in new if r["event"] == "alarm_acknowledged"]
    assert ack and ack[0]["action"] == "Acknowledge" and ack[0]["role"] == "engineer" and ack[0]["status"] == "Good"
    assert ack[0]["detail"] == "condition affine.default.d: seen by the shift lead", ack
    infers = [r for r in new if r["action"] == "Infer" and r["event"] == "call"]
    assert infers[0]["audit_entry_id"] == "plant-trace-0042" and infers[1]["audit_entry_id"] == ""
    failed = [r for r in new if r["event"] == "login_failed"]
    assert failed[0]["user"] == "user:mallory" and "guess-1234" not in json.dumps(new)
    refused = [r for r in new if r["event"] == "certificate_refused"][0]
    assert refused["status"] == "BadCertificateUntrusted" and refused["client"]

    admin = records(audit_file(app).with_name("admin.jsonl"))
    admin_events = {r["event"] for r in admin}
    assert {"commissioning_certificate", "deploy", "rollback"} <= admin_events, admin_events
    implicit = {r["action"] for r in admin if r["event"] == "commissioning_certificate"}
    assert implicit == {"certs issue commissioning", "certs issue commissioning-engineer"}, implicit

    p = cli(app, "audit", "verify")
    assert p.returncode == 0 and "OK:" in p.stdout, p.stdout + p.stderr

    # the latency histogram's exemplars are the calls' correlation ids (OpenMetrics, as Prometheus asks for it)
    request = urllib.request.Request(app.metrics_url + "/metrics",
                                     headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    text = urllib.request.urlopen(request, timeout=10).read().decode()
    exemplars = re.findall(r'appliance_request_duration_seconds_bucket\{[^}]*\} \S+ # \{correlation_id="([0-9a-f]{32})"\}',
                           text)
    assert exemplars and set(exemplars) <= {r["correlation_id"] for r in records(audit_file(app))}


async def acknowledge_a_raised_alarm(engineer) -> str:
    """Raise class d's alarm with three results of it, then acknowledge its condition through the Part 9
    Acknowledge method, as a SCADA operator console does; the method's status."""
    events, arrived = [], asyncio.Event()

    class Handler:
        def event_notification(self, event):
            events.append(event)
            arrived.set()
    sub = await engineer.create_subscription(20, Handler())
    await sub.subscribe_events(engineer.nodes.server, ua.ObjectIds.OffNormalAlarmType)
    await call(engineer, "affine", "Classify", [floats([0, 0, 0, 5] * 3)])
    raised = None
    while raised is None:
        await asyncio.wait_for(arrived.wait(), 10)
        arrived.clear()
        raised = next((e for e in events if e.ConditionName == "affine.default.d"
                       and getattr(e, "ActiveState/Id") is True), None)
    request = ua.CallMethodRequest()
    request.ObjectId = raised.NodeId
    request.MethodId = ua.NodeId(ua.ObjectIds.AcknowledgeableConditionType_Acknowledge)
    request.InputArguments = [ua.Variant(raised.EventId, ua.VariantType.ByteString),
                              ua.Variant(ua.LocalizedText("seen by the shift lead"), ua.VariantType.LocalizedText)]
    result = (await engineer.uaclient.call([request]))[0]
    await call(engineer, "affine", "Classify", [floats([5, 0, 0, 0] * 3)])  # cleared again
    await sub.delete()
    return status_name(result)


def test_an_unwritable_audit_log_refuses_calls_and_raises_the_alarm(app, monkeypatch):
    log = app.app.audit

    def disk_full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    async def go(expect_alarm: bool):
        client = await connect(app.endpoint, *app.engineer)
        try:
            statuses = [status_name(await call(client, "", "ReloadModel", [ua.Variant("nope", ua.VariantType.String)]))]
            wait_for(lambda: log.failing == expect_alarm, 5, f"the audit log's failing state {expect_alarm}")
            statuses.append(status_name(await call(client, "", "ReloadModel",
                                                   [ua.Variant("nope", ua.VariantType.String)])))
            await app.app.ua.publish_values()
            alarm = await read(client, "Alarms", "AuditLogFailed")
            return statuses, alarm
        finally:
            await close(client)

    monkeypatch.setattr(writer, "_write_all", disk_full)  # a real full file system: tests/test_audit_disk_full.py
    statuses, alarm = run(go(True))
    assert log.failing and alarm is True
    assert statuses[-1] == "BadResourceUnavailable", statuses  # refused: it could not be audited
    monkeypatch.undo()
    statuses, alarm = run(go(False))  # the next records reach the disk again: calls are answered again
    assert not log.failing and alarm is False and statuses[-1] == "BadInvalidArgument", statuses
    text = urllib.request.urlopen(app.metrics_url + "/metrics", timeout=10).read().decode()
    assert re.search(r"appliance_audit_write_errors_total [1-9]", text)


def test_a_torn_last_line_at_start_is_kept_chained_and_alarmed(tmp_path):
    audit_dir = tmp_path / "state" / "audit"
    log = AuditLog(audit_dir / "audit.jsonl")
    for i in range(3):
        log.record(action="Infer", status="Good", detail=str(i))
    log.close()
    with open(audit_dir / "audit.jsonl", "ab") as fh:
        fh.write(b'{"seq":4,"time":"2026-01-01T00:0')  # the power went mid-write
    torn_bytes = (audit_dir / "audit.jsonl").read_bytes()
    app = start_appliance(tmp_path)
    try:
        async def go():
            client = await connect(app.endpoint, *app.operator)
            try:
                await app.app.ua.publish_values()
                return await read(client, "Alarms", "AuditLogTorn"), status_name(
                    await call(client, "affine", "Infer", [floats(SAMPLE)]))
            finally:
                await close(client)
        alarm, status = run(go())
        assert alarm is True and status == "Good"
    finally:
        app.stop()
    assert (audit_dir / "audit.jsonl.1").read_bytes() == torn_bytes  # kept as it was
    first = records(audit_dir / "audit.jsonl")[0]
    assert first["event"] == "audit_resume" and first["seq"] == 4 and "audit.jsonl.1:4" in first["detail"]
    problems, tears, _gaps = verify_report(audit_dir / "audit.jsonl")
    assert problems == [] and len(tears) == 1 and tears[0].startswith("audit.jsonl.1:4: torn last line")
    p = subprocess.run([sys.executable, "-m", "appliance", "audit", "verify", str(audit_dir / "audit.jsonl")],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0 and "TORN: audit.jsonl.1:4" in p.stdout, p.stdout
