"""The demo fault classifier served end to end: batching across concurrent clients, monitoring over HTTP, the
security defaults, an independent node-opcua client, and `appliance call`."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from harness import RunningAppliance
from onnx_models import affine_model
from uaclient import call, floats, read, run, session, status_name

from models.te_classifier import INPUT_SHAPE, load_te_test_windows

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = int(np.prod(INPUT_SHAPE))


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    d = tmp_path_factory.mktemp("ua_system")
    affine_model(d / "affine.onnx")
    models = {
        "te-classifier": {"kind": "tensor", "path": "builtin:te-classifier", "max_samples": 64,
                          "max_queue_delay_ms": 20},
        "affine": {"kind": "tensor", "path": str(d / "affine.onnx")},
    }
    a = RunningAppliance(d / "state", models)
    a.operator = a.issue("plc1", "operator")
    yield a
    a.stop()


def te_windows(n: int) -> np.ndarray:
    x, y = load_te_test_windows(1)
    return x[y == 1][:n].astype(np.float32)  # windows after the fault's onset


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def batch_histogram(app) -> dict[str, float]:
    _, text = http_get(app.metrics_url + "/metrics")
    out = {}
    for line in text.splitlines():
        if line.startswith('appliance_batch_size_bucket{') and 'model="te-classifier"' in line:
            le = line.split('le="')[1].split('"')[0]
            out[le] = float(line.rsplit(" ", 1)[1])
    return out


def test_concurrent_clients_share_batches_and_match_unbatched(app):
    windows = te_windows(16)

    async def one_client(i: int):
        async with session(app, *app.operator) as c:
            results = []
            for _ in range(3):
                r = await call(c, "te-classifier", "Infer", [floats(windows[i].ravel())])
                assert status_name(r) == "Good"
                results.append(np.array(r.OutputArguments[0].Value, np.float32))
            return results

    async def unbatched():
        async with session(app, *app.operator) as c:
            out = []
            for w in windows:
                r = await call(c, "te-classifier", "Infer", [floats(w.ravel())])
                out.append(np.array(r.OutputArguments[0].Value, np.float32))
            return out

    async def go():
        alone = await unbatched()
        await asyncio.sleep(0.6)  # engine metrics come from the worker with its liveness answers (4 a second)
        before = batch_histogram(app)
        together = await asyncio.gather(*[one_client(i) for i in range(16)])
        await asyncio.sleep(0.6)
        after = batch_histogram(app)
        return alone, together, before, after

    alone, together, before, after = run(go(), timeout=300)
    for i, results in enumerate(together):
        for r in results:
            np.testing.assert_allclose(r, alone[i], atol=1e-5)
    # batches of more than one sample ran: the count in the le="1.0" bucket grew less than the total count
    grown_total = after["+Inf"] - before.get("+Inf", 0)
    grown_single = after["1.0"] - before.get("1.0", 0)
    assert grown_total > 0 and grown_single < grown_total, (before, after)
    assert np.allclose(sum(alone[0]), 1.0, atol=1e-4)


def test_several_samples_in_one_call(app):
    windows = te_windows(5)

    async def go():
        async with session(app, *app.operator) as c:
            r = await call(c, "te-classifier", "Infer", [floats(windows.ravel())])
            assert status_name(r) == "Good"
            out = np.array(r.OutputArguments[0].Value).reshape(5, 22)
            assert np.allclose(out.sum(axis=1), 1.0, atol=1e-4)
            assert (out.argmax(axis=1) == 1).sum() >= 3  # fault 1 windows (after onset) are recognised
            assert await read(c, "Models", "te-classifier", "InputShape") == list(INPUT_SHAPE)
    run(go())


def test_metrics_and_health_endpoints(app):
    run(_one_call(app))
    status, text = http_get(app.metrics_url + "/metrics")
    assert status == 200
    for name in ("appliance_requests_total", "appliance_request_duration_seconds", "appliance_queue_wait_seconds",
                 "appliance_batch_size", "appliance_queue_depth", "appliance_kv_slots_total",
                 "appliance_kv_slots_used", "appliance_tokens_total", "appliance_time_to_first_token_seconds",
                 "appliance_ua_sessions", "appliance_model_info", "appliance_watchdog_state"):
        assert f"# TYPE {name.removesuffix('_total')}" in text, name
    assert 'appliance_requests_total{method="Infer",model="te-classifier",status="Good"}' in text
    assert 'appliance_model_info{backend="onnxruntime-cpu",model="te-classifier"' in text
    assert "appliance_gpu_" not in text  # no GPU here
    assert http_get(app.metrics_url + "/healthz")[0] == 200
    status, body = http_get(app.metrics_url + "/readyz")
    assert status == 200 and json.loads(body)["ready"] is True


async def _one_call(app):
    async with session(app, *app.operator) as c:
        assert status_name(await call(c, "affine", "Infer", [floats([1, 2, 3, 4])])) == "Good"


def test_readyz_503_names_the_model_that_is_not_ready(tmp_path):
    (tmp_path / "bad.onnx").write_bytes(b"garbage")
    affine_model(tmp_path / "affine.onnx")
    a = RunningAppliance(tmp_path / "state", {"good": {"kind": "tensor", "path": str(tmp_path / "affine.onnx")},
                                              "bad": {"kind": "tensor", "path": str(tmp_path / "bad.onnx")}})
    try:
        status, body = http_get(a.metrics_url + "/readyz")
        assert status == 503
        doc = json.loads(body)
        assert doc["ready"] is False and any("bad" in r and "Failed" in r for r in doc["reasons"])
        assert not any("good" in r for r in doc["reasons"])
        assert str(tmp_path) not in body  # no paths leak
    finally:
        a.stop()


def test_default_security_refuses_anonymous_user_names_and_untrusted_certificates(app, tmp_path):
    from attack_tools import refusal, status_of
    from certificates import make_test_certificate

    def refused(cert, key, **kw) -> str:
        """The status code the server refused this session with ("" if it was accepted)."""
        async def attempt():
            async with session(app, cert, key, **kw):
                pass
        return status_of(run(refusal(attempt(), 60)))

    assert refused(*app.operator, anonymous=True) == "BadIdentityTokenRejected"  # anonymous is off by default
    assert refused(*app.operator, username="admin", password="admin") == "BadUserAccessDenied"
    assert refused(*app.operator, username="plc1", password="whatever") == "BadUserAccessDenied"
    # an untrusted (self-signed) client certificate: refused, and copied to pki/rejected for an engineer to trust
    cert, key = make_test_certificate("rogue", application_uri="urn:rogue:client").write(tmp_path, "rogue")
    before = set(os.listdir(app.state_dir / "pki" / "rejected"))
    assert refused(cert, key) == "BadCertificateUntrusted"
    after = set(os.listdir(app.state_dir / "pki" / "rejected"))
    assert after - before, "the rejected certificate was not copied to pki/rejected"


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
def test_independent_node_opcua_client(app):
    node_modules = ROOT / "tests" / "node" / "node_modules" / "node-opcua-client"
    assert node_modules.exists(), "run `bash scripts/setup.sh --test` (it installs node-opcua-client)"
    cert_der, key = app.operator
    cert_pem = cert_der.with_suffix(".pem")
    import socket
    uri = f"urn:{socket.gethostname()}:appliance:client:plc1"
    sample = te_windows(1)[0].ravel().tolist()
    proc = subprocess.run(["node", str(ROOT / "tests" / "node" / "infer.js"), app.endpoint, str(cert_pem), str(key),
                           uri, str(app.state_dir / "node-pki"), "te-classifier", json.dumps(sample)],
                          capture_output=True, text=True, timeout=120)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    line = lines[-1] if lines else ""
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    result = json.loads(line)
    assert result["status"] == "Good", result
    assert len(result["output"]) == 22 and abs(sum(result["output"]) - 1) < 1e-4
    assert result["securityMode"] == "SignAndEncrypt"


def test_cli_call_with_csv_and_json(app, tmp_path):
    cert, key = app.operator
    csv_file = tmp_path / "sample.csv"
    csv_file.write_text("a,b,c,d\n1,2,3,4\n")
    base = [sys.executable, "-m", "appliance", "call", "affine", "--config", str(app.config_path),
            "--cert", str(cert), "--key", str(key)]
    p = subprocess.run(base + ["--input", str(csv_file)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "status: Good" in p.stdout and "Output: [3, 5, 7, 9]" in p.stdout
    p = subprocess.run(base + ["--input", "[1, 1, 1]"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "BadInvalidArgument" in p.stdout and "BadOutOfRange" in p.stdout
    p = subprocess.run(base + ["--input", "[1, oops]"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--input" in p.stderr
    # a file name that names no file is an error naming it, not inline data the server refuses
    p = subprocess.run(base + ["--input", str(tmp_path / "window.csv")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "window.csv: no such file" in p.stderr and "status:" not in p.stdout, p.stderr
    # inline values longer than any file name (64 samples, 1 KiB of text) are values, not a path
    p = subprocess.run(base + ["--input", "[" + ",".join(["0.5"] * 256) + "]"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "status: Good" in p.stdout, p.stderr


def test_anonymous_when_enabled_is_monitor(tmp_path):
    affine_model(tmp_path / "affine.onnx")
    a = RunningAppliance(tmp_path / "state", {"affine": {"kind": "tensor", "path": str(tmp_path / "affine.onnx")}},
                         {"security": {"anonymous": True}})
    try:
        cert = a.issue("panel", "operator")  # the application certificate; the user is anonymous

        async def go():
            async with session(a, *cert, anonymous=True) as c:
                assert await read(c, "Models", "affine", "State") == "Ready"
                r = await call(c, "affine", "Infer", [floats([1, 2, 3, 4])])
                assert status_name(r) == "BadUserAccessDenied"
        run(go())
    finally:
        a.stop()


def test_users_cli_account_logs_in_with_its_role(app):
    env = dict(os.environ, APPLIANCE_PASSWORD="s7-line3-secret")
    p = subprocess.run([sys.executable, "-m", "appliance", "users", "add", "s7line3", "--role", "operator",
                        "--config", str(app.config_path)], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    stored = (app.state_dir / "access" / "users.json").read_text()
    assert "s7-line3-secret" not in stored and "scrypt$" in stored

    async def go():
        async with session(app, *app.operator, username="s7line3", password="s7-line3-secret") as c:
            assert status_name(await call(c, "affine", "Infer", [floats([1, 2, 3, 4])])) == "Good"
    run(go())
    admin_log = app.state_dir / "audit" / "admin.jsonl"
    assert "users add" in admin_log.read_text() and "s7line3" in admin_log.read_text()


def test_advertised_host_for_clients_behind_nat(tmp_path):
    from asyncua import Client
    from cryptography import x509

    affine_model(tmp_path / "affine.onnx")
    a = RunningAppliance(tmp_path / "state", {"affine": {"kind": "tensor", "path": str(tmp_path / "affine.onnx")}},
                         {"server": {"advertised_host": "line3-gw.plant.example"}})
    try:
        async def endpoints():
            return await Client(a.endpoint).connect_and_get_server_endpoints()
        eps = run(endpoints())
        assert eps and all(e.EndpointUrl == f"opc.tcp://line3-gw.plant.example:{a.port}" for e in eps)
        cert = x509.load_der_x509_certificate(a.pki.layout.own_cert_der.read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert "line3-gw.plant.example" in san.get_values_for_type(x509.DNSName)
        assert a.config.server.application_uri in san.get_values_for_type(x509.UniformResourceIdentifier)
    finally:
        a.stop()
