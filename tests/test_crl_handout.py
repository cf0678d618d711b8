"""The appliance CA's CRL handed out with the CA, the way a plant's client meets it: node-opcua (revocation checking
on, its default) given only the files `appliance certs issue` wrote connects over SignAndEncrypt; after `appliance
certs revoke` and the new CRL handed out, the revoked client is refused and the others keep connecting. Serve
re-signs the CRL before its nextUpdate by itself (audited); its remaining validity is a metric, and a CRL that
cannot be re-signed raises the expiring flag."""
from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from certs.crl import RevocationLedger, sign_crl
from harness import RunningAppliance
from onnx_models import affine_model
from uaclient import Events, run, session

ROOT = Path(__file__).resolve().parent.parent
GDS_PUSH = ROOT / "tests" / "node" / "gds_push.js"


def appliance_cli(app, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance", *args, "--config", str(app.config_path)],
                          capture_output=True, text=True, timeout=120)


def node_pki(folder: Path, ca_der: Path, crl: Path | None) -> Path:
    """A node-opcua certificate manager's folders holding only what the appliance handed out."""
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "trusted" / "certs").mkdir(parents=True)
    (folder / "trusted" / "crl").mkdir()
    shutil.copy(ca_der, folder / "trusted" / "certs" / ca_der.name)
    if crl is not None:
        shutil.copy(crl, folder / "trusted" / "crl" / crl.name)
    return folder


def node_connect(app, out: Path, name: str, pki: Path) -> dict:
    """node-opcua connects with NAME's certificate (application and X509 user identity) trusting only `pki`."""
    uri = f"urn:{socket.gethostname()}:appliance:client:{name}"
    proc = subprocess.run(["node", str(GDS_PUSH), "connect", app.endpoint, str(out / f"{name}.pem"),
                           str(out / f"{name}.key.pem"), uri, str(pki)], capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, (proc.stdout, proc.stderr)
    return json.loads(lines[-1])


def metric(app, name: str) -> float:
    with urllib.request.urlopen(app.metrics_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_node_opcua_with_revocation_checks_trusts_the_files_the_cli_wrote(tmp_path):
    affine_model(tmp_path / "affine.onnx")
    app = RunningAppliance(tmp_path / "state", {"affine": {"kind": "tensor", "path": str(tmp_path / "affine.onnx")}})
    try:
        out = tmp_path / "handed-out"
        for name in ("hmi1", "hmi2"):
            done = appliance_cli(app, "certs", "issue", name, "--role", "operator", "--out", str(out))
            assert done.returncode == 0, done.stderr
            assert f"{name}.ca.crl" in done.stdout and "next update" in done.stdout
        crl = x509.load_der_x509_crl((out / "hmi1.ca.crl").read_bytes())
        ca = x509.load_der_x509_certificate((out / "hmi1.ca.der").read_bytes())
        assert crl.is_signature_valid(ca.public_key()) and crl.next_update_utc - datetime.now(timezone.utc) > \
            timedelta(days=300)

        # the CA alone: node-opcua cannot tell whether the server's certificate is revoked and refuses it
        refused = node_connect(app, out, "hmi1", node_pki(tmp_path / "ca-only", out / "hmi1.ca.der", None))
        assert "BadCertificateRevocationUnknown" in refused.get("error", ""), refused
        # the CA and its CRL, as `certs issue` wrote them: connected over SignAndEncrypt
        for name in ("hmi1", "hmi2"):
            pki = node_pki(tmp_path / f"pki-{name}", out / f"{name}.ca.der", out / f"{name}.ca.crl")
            assert node_connect(app, out, name, pki).get("status") == "Good"

        revoked = appliance_cli(app, "certs", "revoke", "hmi1")
        assert revoked.returncode == 0, revoked.stderr
        assert "Hand out the new CRL" in revoked.stdout and "appliance-ca.crl.der" in revoked.stdout
        exported = tmp_path / "export"
        done = appliance_cli(app, "certs", "export-server", "--out", str(exported))
        assert done.returncode == 0 and "appliance-ca.crl" in done.stdout, done
        new_crl = exported / "appliance-ca.crl"
        assert x509.load_der_x509_crl(new_crl.read_bytes()).get_revoked_certificate_by_serial_number(
            x509.load_der_x509_certificate((out / "hmi1.der").read_bytes()).serial_number) is not None
        for name in ("hmi1", "hmi2"):  # the new CRL handed out to both, replacing the one given before
            node_pki(tmp_path / f"pki-{name}", exported / "appliance-ca.der", new_crl)
        gone = node_connect(app, out, "hmi1", tmp_path / "pki-hmi1")
        assert "BadCertificateRevoked" in gone.get("error", ""), gone
        assert node_connect(app, out, "hmi2", tmp_path / "pki-hmi2").get("status") == "Good"
    finally:
        app.stop()


def _stale_crl(app, days_left: float, key_file: Path | None = None) -> None:
    """The CA's CRL as if it had been signed long ago: its nextUpdate `days_left` days from now."""
    layout = app.pki.layout
    ca = x509.load_der_x509_certificate(layout.ca_cert_der.read_bytes())
    key = serialization.load_pem_private_key((key_file or layout.ca_key_pem).read_bytes(), None)
    signed = datetime.now(timezone.utc) - timedelta(days=365 - days_left)
    data = RevocationLedger(layout.revocation_ledger).load()
    layout.ca_crl_der.write_bytes(sign_crl(ca, key, {}, int(data["crl_number"]) + 1, signed))


def test_serve_re_signs_the_crl_before_its_next_update_and_audits_it(tmp_path):
    affine_model(tmp_path / "affine.onnx")
    app = RunningAppliance(tmp_path / "state", {"affine": {"kind": "tensor", "path": str(tmp_path / "affine.onnx")}},
                           extra={"security": {"crl_check_interval_s": 1}})
    try:
        assert metric(app, "appliance_ca_crl_expiry_seconds") > 300 * 86400
        _stale_crl(app, days_left=10)
        stale = app.pki.layout.ca_crl_der.read_bytes()
        end = time.monotonic() + 30
        while time.monotonic() < end and app.pki.layout.ca_crl_der.read_bytes() == stale:
            time.sleep(0.2)
        time.sleep(0.5)  # the metric is set on the loop right after the file is written
        assert metric(app, "appliance_ca_crl_expiry_seconds") > 300 * 86400
        assert metric(app, "appliance_ca_crl_expiring") == 0
        crl = x509.load_der_x509_crl(app.pki.layout.ca_crl_der.read_bytes())
        assert crl.next_update_utc - datetime.now(timezone.utc) > timedelta(days=300)
        records = [json.loads(line) for line in (app.state_dir / "audit" / "audit.jsonl").read_text().splitlines()]
        resigned = [r for r in records if r["action"] == "crl_resign"]
        assert len(resigned) == 1 and resigned[0]["status"] == "Good" and \
            crl.next_update_utc.isoformat() in resigned[0]["detail"]
    finally:
        app.stop()


def test_a_crl_that_cannot_be_re_signed_is_flagged(tmp_path):
    """The CA key taken off the box (kept by the plant's security officer): the CRL runs toward its nextUpdate; the
    metric flags it and an HMI subscribed to the Server's events is told, before clients refuse the server."""
    affine_model(tmp_path / "affine.onnx")
    app = RunningAppliance(tmp_path / "state", {"affine": {"kind": "tensor", "path": str(tmp_path / "affine.onnx")}},
                           extra={"security": {"crl_check_interval_s": 1}})
    try:
        hmi = app.issue("hmi", "monitor")
        assert metric(app, "appliance_ca_crl_expiring") == 0

        async def go():
            events = Events()
            async with session(app, *hmi) as client:
                await (await client.create_subscription(50, events)).subscribe_events(client.nodes.server)
                app.pki.layout.ca_key_pem.rename(tmp_path / "ca.key.pem")
                _stale_crl(app, days_left=5, key_file=tmp_path / "ca.key.pem")
                end = time.monotonic() + 30
                while time.monotonic() < end and not any("CRL expires" in m for m in events.messages()):
                    await asyncio.sleep(0.2)
            return events.messages()
        messages = run(go(), 60)
        assert any("CRL expires in 5 days" in m and "CA key" in m for m in messages), messages
        left = metric(app, "appliance_ca_crl_expiry_seconds")
        assert 4 * 86400 < left < 5 * 86400
        assert metric(app, "appliance_ca_crl_expiring") == 1
    finally:
        app.stop()


def test_check_config_names_a_trusted_ca_without_its_crl(tmp_path):
    """The configuration is valid (exit 0), but the engineer is told which CA's certificates will be refused."""
    import yaml
    from certs.pki import PKI
    from certificates import make_test_certificate, make_test_crl
    state = tmp_path / "state"
    pki = PKI(state)
    pki.init(f"urn:{socket.gethostname()}:appliance", ["localhost"], ["127.0.0.1"])
    plant = make_test_certificate("Plant CA", is_ca=True, application_uri=None)
    (pki.layout.trusted / "plant-ca.der").write_bytes(plant.cert_der)
    affine_model(tmp_path / "affine.onnx")
    path = tmp_path / "appliance.yaml"

    def check(require_crl: bool) -> subprocess.CompletedProcess:
        model = {"kind": "tensor", "path": str(tmp_path / "affine.onnx")}
        path.write_text(yaml.safe_dump({"server": {"state_dir": str(state)}, "security": {"require_crl": require_crl},
                                        "models": {"affine": model}}))
        return subprocess.run([sys.executable, "-m", "appliance", "check-config", str(path)], capture_output=True,
                              text=True, timeout=120)
    done = check(True)
    assert done.returncode == 0 and "OK:" in done.stdout
    assert "CN=Plant CA" in done.stderr and "has no CRL" in done.stderr and "Appliance CA" not in done.stderr
    assert "no CRL" not in check(False).stderr
    (pki.layout.crl / "plant-ca.crl").write_bytes(make_test_crl(plant, []))
    assert "no CRL" not in check(True).stderr
