"""`appliance certs csr | install-server`: the Part 12 steps for plants without a GDS, on a running appliance (through
its own ServerConfiguration, applied without a restart) and on the files when none runs."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from certs.pki import PKI
from certs.x509io import split_der_chain, thumbprint
from gds import plant_ca, sign_request
from harness import RunningAppliance
from onnx_models import affine_model
from test_ua_certificate_management import endpoint_certificate
from uaclient import run

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "appliance", "certs", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs_push")
    affine_model(d / "affine.onnx")
    a = RunningAppliance(d / "state", {"affine": {"kind": "tensor", "path": str(d / "affine.onnx")}})
    yield a
    a.stop()


def pem_chain(*ders: bytes) -> bytes:
    return b"".join(x509.load_der_x509_certificate(d).public_bytes(serialization.Encoding.PEM) for d in ders)


def test_csr_and_install_on_a_running_appliance_without_a_restart(app, tmp_path):
    old = app.pki.layout.own_cert_der.read_bytes()
    sup = app.app.supervisors[0]
    pid = sup.process.pid
    p = cli("csr", "--new-key", "--out", str(tmp_path / "server.csr"), "--config", str(app.config_path))
    assert p.returncode == 0, p.stderr
    assert "by the running appliance" in p.stdout
    csr = x509.load_pem_x509_csr((tmp_path / "server.csr").read_bytes())
    assert csr.public_key().public_numbers() != x509.load_der_x509_certificate(old).public_key().public_numbers()
    assert app.pki.layout.own_cert_der.read_bytes() == old  # a request changes nothing in use

    ca = plant_ca("Line 3 CA")
    signed = sign_request(ca, csr.public_bytes(serialization.Encoding.DER))
    expired = sign_request(ca, csr.public_bytes(serialization.Encoding.DER), days=1,
                           not_before=datetime.now(timezone.utc) - timedelta(days=3))
    (tmp_path / "expired.pem").write_bytes(pem_chain(expired, ca.cert_der))
    p = cli("install-server", str(tmp_path / "expired.pem"), "--config", str(app.config_path))
    assert p.returncode == 2 and "BadCertificateTimeInvalid" in p.stderr and "Traceback" not in p.stderr
    assert app.pki.layout.own_cert_der.read_bytes() == old

    (tmp_path / "server.pem").write_bytes(pem_chain(signed, ca.cert_der))  # the CA's answer: leaf + its CA
    p = cli("install-server", str(tmp_path / "server.pem"), "--config", str(app.config_path))
    assert p.returncode == 0, p.stderr
    assert "running appliance uses it" in p.stdout
    assert app.pki.layout.own_cert_der.read_bytes() == signed
    key = serialization.load_pem_private_key(app.pki.layout.own_key_pem.read_bytes(), None)
    assert key.public_key().public_numbers() == csr.public_key().public_numbers()  # the key the request was for
    chain = run(endpoint_certificate(app))
    assert split_der_chain(chain) == [signed, ca.cert_der]
    assert sup.process.pid == pid  # nothing restarted
    records = [json.loads(line) for line in (app.state_dir / "audit" / "audit.jsonl").read_text().splitlines()]
    admin = (app.state_dir / "clients" / "commissioning-security-admin.der").read_bytes()
    applied = [r for r in records if r["action"] == "ApplyChanges" and thumbprint(signed) in r["detail"]]
    assert applied and applied[-1]["user"] == f"x509:{thumbprint(admin)}" and applied[-1]["role"] == "security_admin"


def test_without_a_running_appliance_the_files_are_changed_for_the_next_start(tmp_path):
    state = tmp_path / "state"
    config = tmp_path / "appliance.yaml"
    port = 4840 + (os.getpid() % 1000) + 2000  # nothing listens there
    config.write_text(f"server:\n  endpoint: opc.tcp://127.0.0.1:{port}\n  state_dir: {state}\n"
                      "models:\n  te: {kind: tensor, path: 'builtin:te-classifier'}\n")
    uri = f"urn:{socket.gethostname()}:appliance"
    PKI(state).init(uri, ["localhost"], ["127.0.0.1"])
    p = cli("csr", "--out", str(tmp_path / "server.csr.der"), "--config", str(config))
    assert p.returncode == 0, p.stderr
    assert "no appliance is running" in p.stdout
    ca = plant_ca()
    signed = sign_request(ca, (tmp_path / "server.csr.der").read_bytes())
    (tmp_path / "server.der").write_bytes(signed)
    (tmp_path / "ca.der").write_bytes(ca.cert_der)
    p = cli("install-server", str(tmp_path / "server.der"), "--config", str(config))
    assert p.returncode == 2 and "issuer" in p.stderr  # no chain sent and the plant CA is unknown here
    p = cli("install-server", str(tmp_path / "server.der"), "--issuer", str(tmp_path / "ca.der"),
            "--config", str(config))
    assert p.returncode == 0, p.stderr
    assert "next start" in p.stdout
    assert PKI(state).layout.own_cert_der.read_bytes() == signed
    assert (state / "pki" / "own" / "issuers.der").read_bytes() == ca.cert_der
