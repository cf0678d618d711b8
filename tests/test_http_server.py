"""The monitoring HTTP endpoint, over real sockets on 127.0.0.1."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from appliance.http_server import MonitoringServer
from appliance.metrics import Metrics


class Running:
    """A MonitoringServer on its own event loop thread, so tests can use blocking urllib calls."""

    def __init__(self, readiness, read_timeout_s: float = 5.0, max_connections: int = 64):
        self.metrics = Metrics()
        self.readiness = readiness
        self.loop = asyncio.new_event_loop()
        self.server = MonitoringServer("127.0.0.1", 0, self.metrics, lambda: self.readiness(),
                                       read_timeout_s=read_timeout_s, max_connections=max_connections)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(5)
        self.base = f"http://127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def running():
    servers = []

    def start(readiness=lambda: (True, []), **kwargs) -> Running:
        servers.append(Running(readiness, **kwargs))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def fetch(url: str, method: str = "GET", data: bytes | None = None):
    request = urllib.request.Request(url, method=method, data=data)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def raw(port: int, payload: bytes, wait_s: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        sock.sendall(payload)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_metrics_exposes_prometheus_text(running):
    srv = running()
    srv.metrics.requests_total.labels("te", "Infer", "Good").inc(3)
    status, headers, body = fetch(srv.base + "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    text = body.decode()
    assert "# TYPE appliance_requests_total counter" in text
    assert 'appliance_requests_total{method="Infer",model="te",status="Good"} 3.0' in text
    assert "# HELP appliance_kv_slots_total" in text and "appliance_watchdog_state" in text
    # the contract: every metric's HELP and TYPE from the start, these two included
    assert "# TYPE appliance_prefix_cache_hits_total counter" in text
    assert "# TYPE appliance_conversations_parked gauge" in text


def test_healthz_is_pure_liveness(running):
    calls = []

    def readiness():
        calls.append(1)
        return False, ["engine down"]

    srv = running(readiness)
    status, headers, body = fetch(srv.base + "/healthz")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    assert headers["Content-Type"] == "application/json" and headers["Connection"] == "close"
    assert calls == []  # liveness never asks the engine


def test_readyz_follows_readiness(running):
    state = {"ready": False, "reasons": ["model te_classifier is Loading"]}
    srv = running(lambda: (state["ready"], state["reasons"]))
    status, _, body = fetch(srv.base + "/readyz")
    assert status == 503 and json.loads(body) == {"ready": False, "reasons": ["model te_classifier is Loading"]}
    state.update(ready=True, reasons=[])
    status, _, body = fetch(srv.base + "/readyz")
    assert status == 200 and json.loads(body) == {"ready": True}


def test_readyz_hides_a_failing_check(running):
    def readiness():
        raise RuntimeError("/var/lib/appliance/secret path")

    srv = running(readiness)
    status, _, body = fetch(srv.base + "/readyz")
    assert status == 503 and json.loads(body) == {"ready": False, "reasons": ["readiness check failed"]}
    assert b"/var/lib" not in body


def test_head_404_405_400(running):
    srv = running()
    get_status, get_headers, get_body = fetch(srv.base + "/healthz")
    status, headers, body = fetch(srv.base + "/healthz", method="HEAD")
    assert status == 200 and body == b"" and headers["Content-Length"] == get_headers["Content-Length"]
    assert fetch(srv.base + "/metrics", method="HEAD")[2] == b""
    assert fetch(srv.base + "/")[0] == 404
    assert fetch(srv.base + "/metrics/../etc/passwd")[0] == 404
    status, headers, _ = fetch(srv.base + "/metrics", method="POST", data=b"x=1")
    assert status == 405 and headers["Allow"] == "GET, HEAD"
    assert fetch(srv.base + "/readyz", method="DELETE")[0] == 405
    assert raw(srv.server.port, b"NONSENSE\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert fetch(srv.base + "/metrics?name[]=x")[0] == 200  # a query string is ignored


def test_oversized_head_is_refused_and_the_server_keeps_serving(running):
    srv = running()
    reply = raw(srv.server.port, b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 431 ")
    assert fetch(srv.base + "/healthz")[0] == 200


def test_a_slow_client_is_timed_out(running):
    srv = running(read_timeout_s=0.3)
    with socket.create_connection(("127.0.0.1", srv.server.port), timeout=5) as slow:
        slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finishes its head
        assert fetch(srv.base + "/healthz")[0] == 200  # others are served meanwhile
        t0 = time.monotonic()
        reply = slow.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408 ") and time.monotonic() - t0 < 2.0
        assert slow.recv(4096) in (b"",)  # closed


def test_connections_beyond_the_cap_are_closed(running):
    srv = running(read_timeout_s=2.0, max_connections=2)
    idle = [socket.create_connection(("127.0.0.1", srv.server.port), timeout=5) for _ in range(2)]
    try:
        time.sleep(0.1)
        extra = socket.create_connection(("127.0.0.1", srv.server.port), timeout=5)
        assert extra.recv(4096) == b""  # refused by closing, not queued
        extra.close()
    finally:
        for s in idle:
            s.close()
    for _ in range(50):  # slots come back once the idle clients leave
        if fetch(srv.base + "/healthz")[0] == 200:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the server did not recover its connection slots")


def test_many_concurrent_requests(running):
    srv = running()
    results = []

    def worker():
        for _ in range(10):
            results.append(fetch(srv.base + "/metrics")[0])

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 80


def test_stop_closes_the_port(running):
    srv = running()
    port = srv.server.port
    assert fetch(srv.base + "/healthz")[0] == 200
    asyncio.run_coroutine_threadsafe(srv.server.stop(), srv.loop).result(5)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
