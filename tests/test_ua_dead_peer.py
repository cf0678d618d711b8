"""A pulled cable: a PLC whose link goes dead mid-Generate sends no FIN and no RST, as one that loses power or its
cable does (tests/test_ua_vanished_client.py aborts a socket, so the client's kernel still tells the server).

The PLC runs in a network namespace the test makes (a veth pair to the appliance, which listens on the host end).
Mid-Generate its end of the link is set down: from then on nothing of it reaches the server. The contract: the
server sees it gone within `server.dead_peer_timeout_s` (TCP keepalive and TCP_USER_TIMEOUT on every accepted
connection), then treats it as a vanished client: its generation stops within 1 s, its session keeps the KV slot
until the session timeout, then the slot is freed. Needs root (CI runs as root) and iproute2
(scripts/setup-system.sh installs it).
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from harness import RunningAppliance, free_ports
from test_ua_vanished_client import CYCLE, generated, metric, scrape, slots_used

pytest.importorskip("transformers")
from tiny_llm import make_model_dir  # noqa: E402
from worker_probes import wait_for  # noqa: E402

DEAD_PEER_S = 3
SESSION_TIMEOUT_S = 4.0
TESTS = Path(__file__).resolve().parent


def ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


class PlcNamespace:
    """A network namespace with one veth link to the host: host end HOST_IP, the PLC's end PLC_DEVICE inside."""

    def __init__(self):
        n = os.getpid()
        self.name, self.host_device, self.plc_device = f"ua31-{n}", f"u31h{n % 10**7}", f"u31p{n % 10**7}"
        subnet = f"10.231.{n % 250}"
        self.host_ip, self.plc_ip = f"{subnet}.1", f"{subnet}.2"
        ip("netns", "add", self.name)
        try:
            ip("link", "add", self.host_device, "type", "veth", "peer", "name", self.plc_device)
            ip("link", "set", self.plc_device, "netns", self.name)
            ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_device)
            ip("link", "set", self.host_device, "up")
            self.exec("ip", "addr", "add", f"{self.plc_ip}/30", "dev", self.plc_device)
            self.exec("ip", "link", "set", self.plc_device, "up")
            self.exec("ip", "link", "set", "lo", "up")
        except Exception:
            self.remove()
            raise

    def exec(self, *args: str) -> None:
        ip("netns", "exec", self.name, *args)

    def cut(self) -> None:
        """The PLC's end of the link goes down: nothing of it reaches the server any more, no FIN, no RST."""
        self.exec("ip", "link", "set", self.plc_device, "down")

    def remove(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)  # takes the veth pair
        subprocess.run(["ip", "link", "del", self.host_device], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def plc_net():
    if os.geteuid() != 0:
        pytest.skip("a network namespace needs root: run as root (CI does) to cut a PLC's link")
    if shutil.which("ip") is None:
        pytest.fail("iproute2's `ip` is missing: run scripts/setup-system.sh (as root)")
    try:
        net = PlcNamespace()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        pytest.fail(f"running as root, but the PLC's network namespace could not be made: {e}")
    yield net
    net.remove()


@pytest.fixture(scope="module")
def app(tmp_path_factory, plc_net):
    d = tmp_path_factory.mktemp("dead-peer")
    make_model_dir(d / "chat", scripted=CYCLE, endless=True, max_positions=16384)
    models = {"chat": {"kind": "generative", "path": str(d / "chat"), "max_text_chars": 16000}}
    port = free_ports(1)[0]
    a = RunningAppliance(d / "state", models, {
        # listening on the host end of the PLC's link (the harness's metrics stay on loopback)
        "server": {"endpoint": f"opc.tcp://{plc_net.host_ip}:{port}", "session_timeout_s": SESSION_TIMEOUT_S,
                   "dead_peer_timeout_s": DEAD_PEER_S},
        "engine": {"max_seq_len": 16384, "max_new_tokens": 12000, "kv_slots": 2, "request_timeout_s": 120}})
    a.endpoint = f"opc.tcp://{plc_net.host_ip}:{port}"
    a.plc = a.issue("plc1", "operator")
    yield a
    a.stop()


def start_plc(app, net: PlcNamespace) -> tuple[subprocess.Popen, queue.Queue]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    proc = subprocess.Popen(["ip", "netns", "exec", net.name, sys.executable, str(TESTS / "netns_plc.py"),
                             app.endpoint, str(app.plc[0]), str(app.plc[1]), str(int(SESSION_TIMEOUT_S * 1000))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    return proc, lines


def test_a_plc_whose_link_goes_dead_mid_generate_is_seen_gone_and_treated_as_vanished(app, plc_net):
    abandoned_before = metric(scrape(app), "appliance_requests_total", model="chat", method="Generate",
                              status="BadConnectionClosed")
    plc, lines = start_plc(app, plc_net)
    try:
        try:
            first = json.loads(lines.get(timeout=90))
        except queue.Empty:
            plc.kill()
            pytest.fail(f"the PLC in the namespace never got its first answer: {plc.stderr.read()[-2000:]}")
        assert first == {"first": "Good"}
        before = generated(app)
        # the long Generate runs: tokens flow and the PLC's session holds a slot
        wait_for(lambda: generated(app) > before + 50, 60, "the long generation to start")
        wait_for(lambda: slots_used(app) == 1, 5, "the PLC's session to hold a slot")

        plc_net.cut()
        cut = time.monotonic()
        at_cut = generated(app)
        wait_for(lambda: generated(app) > at_cut, 1.5, "tokens after the cut (the generation stopped with the link: no test)")

        # seen gone within dead_peer_timeout_s: its call is abandoned (counted as BadConnectionClosed) ...
        def abandoned() -> bool:
            return metric(scrape(app), "appliance_requests_total", model="chat", method="Generate",
                          status="BadConnectionClosed") == abandoned_before + 1
        wait_for(abandoned, DEAD_PEER_S + 5, "the PLC's call to be abandoned after its link went dead (no FIN, no RST)")
        seen_gone = time.monotonic() - cut
        print(f"seen gone {seen_gone:.2f} s after the cut (dead_peer_timeout_s {DEAD_PEER_S})")
        assert seen_gone <= DEAD_PEER_S + 0.5, f"seen gone only {seen_gone:.1f} s after the cut"
        # ... and its generation stops within 1 s after that (the tokens metric is at most 1 s old)
        time.sleep(1.0)
        at_stop = generated(app)
        time.sleep(1.0)
        assert generated(app) == at_stop, "the generation went on after its client was seen gone"
        assert at_stop < before + 12000, "the generation ran to its end instead of stopping"
        assert lines.empty(), "the PLC got an answer through a dead link"

        # the vanished PLC's session keeps its slot until the session times out, then the slot is free
        assert slots_used(app) == 1, "the slot went with the connection, before the session timed out"
        wait_for(lambda: slots_used(app) == 0, SESSION_TIMEOUT_S + 3, "the dead PLC's slot to be freed")
        freed = time.monotonic() - cut
        assert freed >= SESSION_TIMEOUT_S, f"the slot was freed {freed:.1f} s after the cut, before the session timeout"
    finally:
        plc.kill()
        plc.wait(10)
