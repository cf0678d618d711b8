"""systemd's notify protocol against a datagram socket the test opens (no systemd runs here): the Notifier's
messages, and `appliance serve` telling READY=1 once its models are loaded, WATCHDOG=1 while it runs, RELOADING=1 on
SIGHUP and STOPPING=1 on SIGTERM."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from harness import free_ports
from onnx_models import affine_model

from appliance.sdnotify import Notifier


def listener(tmp_path: Path, abstract: bool = False) -> tuple[socket.socket, str]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"appliance-test-{os.getpid()}-{time.monotonic_ns()}"
        sock.bind("\0" + name)
        address = "@" + name
    else:
        address = str(tmp_path / "notify.sock")
        sock.bind(address)
    sock.settimeout(30)
    return sock, address


def test_notifier_messages(tmp_path):
    sock, address = listener(tmp_path, abstract=True)
    n = Notifier({"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())})
    assert n.enabled and n.watchdog_interval_s == 2.0
    n.ready("Ready: 2 models")
    assert sock.recv(4096).decode().splitlines() == ["READY=1", "STATUS=Ready: 2 models"]
    n.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"
    n.extend_timeout(60)
    assert sock.recv(4096) == b"EXTEND_TIMEOUT_USEC=60000000"
    n.reloading()
    lines = sock.recv(4096).decode().splitlines()
    assert lines[0] == "RELOADING=1" and lines[1].startswith("MONOTONIC_USEC=")
    n.stopping()
    assert sock.recv(4096).decode().startswith("STOPPING=1")
    n.close()


def test_without_systemd_every_call_is_a_no_op():
    n = Notifier({})
    assert not n.enabled and n.watchdog_interval_s is None
    assert n.ready("x") is False and n.watchdog() is False
    # a watchdog meant for another process is not ours
    assert Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}).watchdog_interval_s is None


def test_serve_speaks_the_protocol(tmp_path):
    sock, address = listener(tmp_path)
    state = tmp_path / "state"
    config = tmp_path / "appliance.yaml"
    port, metrics_port = free_ports(2)
    config.write_text(yaml.safe_dump({
        "server": {"endpoint": f"opc.tcp://127.0.0.1:{port}", "state_dir": str(state)},
        "metrics": {"listen": f"127.0.0.1:{metrics_port}"}, "watchdog": {"backend": "none"},
        "models": {"affine": {"kind": "tensor", "path": str(affine_model(tmp_path / "a.onnx"))}}}))
    env = dict(os.environ, NOTIFY_SOCKET=address, WATCHDOG_USEC="1000000",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    env.pop("WATCHDOG_PID", None)
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "serve", "--config", str(config)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: list[str] = []

    def until(prefix: str) -> str:
        while True:
            for line in sock.recv(4096).decode().splitlines():
                seen.append(line)
                if line.startswith(prefix):
                    return line
    try:
        until("READY=1")
        status = until("STATUS=")
        assert "affine Ready" in status, status
        until("WATCHDOG=1")
        until("WATCHDOG=1")  # and again: it keeps telling while it runs
        proc.send_signal(signal.SIGHUP)
        until("RELOADING=1")
        until("READY=1")
        proc.send_signal(signal.SIGTERM)
        until("STOPPING=1")
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close()
    assert seen.index("READY=1") < seen.index("STOPPING=1")
