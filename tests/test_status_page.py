"""The status page at GET /: a real appliance, fetched over HTTP; read-only, self-contained (no script, nothing from
elsewhere, a strict Content-Security-Policy), no secrets; rendered by headless Chromium without console errors."""
from __future__ import annotations

import shutil
import subprocess
import urllib.request

import pytest

from harness import RunningAppliance
from onnx_models import affine_model
from uaclient import call, floats, run, session

from appliance.status_page import StatusHistory, render


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    d = tmp_path_factory.mktemp("status")
    models = {"line3-classifier": {"kind": "tensor", "path": str(affine_model(d / "a.onnx")), "version": "v7"}}
    a = RunningAppliance(d / "state", models)
    a.operator = a.issue("plc", "operator")
    yield a
    a.stop()


def fetch(app, path: str = "/"):
    return urllib.request.urlopen(app.metrics_url + path, timeout=10)


def test_page_shows_state_models_alarms_and_nothing_secret(app):
    async def calls():
        async with session(app, *app.operator) as c:
            for _ in range(5):
                await call(c, "line3-classifier", "Infer", [floats([1, 2, 3, 4])])
    run(calls())
    reply = fetch(app)
    page = reply.read().decode()
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/html")
    assert "default-src 'none'" in reply.headers["Content-Security-Policy"]
    for text in ("line3-classifier", "v7", "onnxruntime-cpu", "Ready", "WorkerRestarting", "certificate expires"):
        assert text in page, text
    assert "<script" not in page and "http://" not in page and "https://" not in page
    assert str(app.state_dir) not in page  # no paths


def test_history_gives_rates_and_p99():
    h = StatusHistory()
    buckets = [(0.001, 0.0), (0.01, 0.0), (0.1, 0.0), (float("inf"), 0.0)]
    h.add({"m": 0.0}, {"m": buckets}, now=0.0)
    h.add({"m": 100.0}, {"m": [(0.001, 10.0), (0.01, 98.0), (0.1, 100.0), (float("inf"), 100.0)]}, now=10.0)
    rates, p99 = h.series("m")
    assert rates == [10.0] and p99 == [0.1]
    snapshot = {"state": "Ready", "device": "cpu", "heartbeat": 3, "alarms": {"ModelFailed": False},
                "engine": {"queue_depth": 0, "slots_total": 8, "slots_in_use": 1}, "certificate_expiry_s": 86400 * 90,
                "models": [{"name": "m", "kind": "tensor", "state": "Ready", "version": "1", "backend": "x",
                            "requests": 100, "errors": 0, "last_latency_ms": 1.0, "worker_up": True,
                            "restarting": False, "worker_restarts": 0, "heartbeat": 3, "failure_reason": ""}]}
    assert "<svg" not in render(snapshot, StatusHistory())  # no chart before two samples
    assert "collecting" in render(snapshot, StatusHistory())


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(chromium() is None, reason="Chromium is not installed (Debian package chromium; "
                                               "scripts/setup-system.sh installs it)")
def test_chromium_renders_it_without_console_errors(app, tmp_path):
    shot = tmp_path / "status.png"
    common = [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
              "--user-data-dir=" + str(tmp_path / "profile")]
    out = subprocess.run(common + ["--enable-logging=stderr", "--v=0", "--window-size=1400,700",
                                   f"--screenshot={shot}", app.metrics_url + "/"],
                         capture_output=True, text=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 5000, out.stderr[-2000:]
    console = [line for line in out.stderr.splitlines() if "CONSOLE" in line and "ERROR" in line.upper()]
    assert not console, console
    dom = subprocess.run(common + ["--dump-dom", app.metrics_url + "/"], capture_output=True, text=True,
                         timeout=120).stdout
    assert "line3-classifier" in dom and "Ready" in dom
