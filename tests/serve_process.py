"""`appliance serve` as systemd runs it, for tests that signal or cap the whole process: a process group of its own
(start_new_session), its output in a log file, optionally started inside a cgroup the test made (as systemd puts a
unit in its own), and the processes it started found through /proc."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from harness import free_ports
from worker_probes import process_gone

ROOT = Path(__file__).resolve().parents[1]


def _live_processes(field: int, value: int) -> list[int]:
    """The live (not zombie) processes whose /proc/PID/stat field after the name (1: parent, 2: process group) is
    value."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[field]) == value and fields[0] != "Z":
                    found.append(int(entry))
    return found


def children(pid: int) -> list[int]:
    """The live (not zombie) processes whose parent is pid."""
    return _live_processes(1, pid)


def worker_pids(serve_pid: int) -> list[int]:
    return children(serve_pid)


def group_members(pgid: int) -> list[int]:
    """Every live process of a process group (what systemd's KillMode=control-group signals), zombies left out."""
    return _live_processes(2, pgid)


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class Serve:
    """`appliance serve` in a process group of its own; `cgroup`: a cgroup directory it starts in (its workers
    follow it there); `wait`: "ready" (/readyz 200), "up" (/readyz answers at all) or None."""

    def __init__(self, tmp: Path, models: dict, drain_s: float = 10.0, *, engine: dict | None = None,
                 cgroup: Path | None = None, env: dict | None = None, wait: str | None = "ready"):
        self.state_dir = tmp / "state"
        self.port, self.metrics_port = free_ports(2)
        self.endpoint = f"opc.tcp://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}"
        doc = {"server": {"endpoint": self.endpoint, "state_dir": str(self.state_dir), "drain_timeout_s": drain_s},
               "metrics": {"listen": f"127.0.0.1:{self.metrics_port}"}, "watchdog": {"backend": "none"},
               "engine": {"compile": "off", **(engine or {})}, "models": models}
        self.config_path = tmp / "appliance.yaml"
        self.config_path.write_text(yaml.safe_dump(doc))
        self.log_path = tmp / "serve.log"
        self._log = self.log_path.open("w")
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
        procs = str(cgroup / "cgroup.procs") if cgroup is not None else None

        def enter_cgroup() -> None:  # in the child, before exec: serve and all it starts live in that cgroup
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        self.proc = subprocess.Popen([sys.executable, "-m", "appliance", "serve", "--config", str(self.config_path)],
                                     env=full_env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=enter_cgroup if procs else None)
        if wait is not None:
            self.wait(wait)

    def readyz(self) -> int:
        try:
            return urllib.request.urlopen(self.metrics_url + "/readyz", timeout=2).status
        except urllib.error.HTTPError as e:
            return e.code
        except (urllib.error.URLError, ConnectionError, OSError):
            return 0

    def wait(self, what: str = "ready", timeout: float = 180.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            status = self.readyz()
            if status == 200 or (what == "up" and status):
                return
            assert self.proc.poll() is None, self.log_path.read_text()[-5000:]
            time.sleep(0.2)
        raise AssertionError(f"serve did not become {what}:\n" + self.log_path.read_text()[-3000:])

    def issue(self, name: str, role: str):
        import socket

        from certs.pki import PKI
        out = self.state_dir / "clients"
        PKI(self.state_dir).issue(name, role, out, socket.gethostname())
        return out / f"{name}.der", out / f"{name}.key.pem"

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()


def wait_for_gone(pids: list[int], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(process_gone(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False
