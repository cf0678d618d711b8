"""`appliance serve` as a real process: SIGTERM drains and exits 0 leaving no process behind; kill -9 of serve takes
its workers down by themselves."""
from __future__ import annotations

import asyncio
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
from onnx_models import affine_model, hang_model, heavy_model
from uaclient import call, floats, session, status_name


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid and fields[0] != "Z":
                    found.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ServeProcess:
    def __init__(self, tmp: Path, models: dict, engine: dict | None = None, drain_s: float = 10.0):
        self.state_dir = tmp / "state"
        self.port, self.metrics_port = free_ports(2)
        self.endpoint = f"opc.tcp://127.0.0.1:{self.port}"
        doc = {"server": {"endpoint": self.endpoint, "state_dir": str(self.state_dir), "drain_timeout_s": drain_s},
               "metrics": {"listen": f"127.0.0.1:{self.metrics_port}"}, "watchdog": {"backend": "none"},
               "engine": engine or {}, "models": models}
        config = tmp / "appliance.yaml"
        config.write_text(yaml.safe_dump(doc))
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        self.proc = subprocess.Popen([sys.executable, "-m", "appliance", "serve", "--config", str(config)], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        end = time.monotonic() + 120
        while time.monotonic() < end:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/readyz", timeout=2).status == 200:
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            assert self.proc.poll() is None, self.proc.stdout.read()
            time.sleep(0.2)
        else:
            raise AssertionError("serve did not become ready")

    def issue(self, name: str, role: str):
        from certs.pki import PKI
        import socket
        out = self.state_dir / "clients"
        PKI(self.state_dir).issue(name, role, out, socket.gethostname())
        return out / f"{name}.der", out / f"{name}.key.pem"

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def test_sigterm_answers_every_call_and_exits_0_without_leftovers(tmp_path):
    models = {"stuck": {"kind": "tensor", "path": str(hang_model(tmp_path / "s.onnx"))},  # never returns
              # each batch takes tens of ms and runs alone: calls queue behind each other
              "slow": {"kind": "tensor", "path": str(heavy_model(tmp_path / "h.onnx", size=512, products=4)),
                       "max_batch_size": 1}}
    serve = ServeProcess(tmp_path, models, drain_s=2.0)
    try:
        workers = children(serve.proc.pid)
        assert len(workers) == 2
        operator = serve.issue("plc", "operator")

        async def go():
            async with session(serve, *operator) as c:
                calls = [asyncio.create_task(call(c, "stuck", "Infer", [floats([1, 1, 1, 1])]))]
                calls += [asyncio.create_task(call(c, "slow", "Infer", [floats([1, 1, 1, 1])])) for _ in range(4)]
                await asyncio.sleep(0.3)
                serve.proc.send_signal(signal.SIGTERM)
                results = await asyncio.gather(*calls, return_exceptions=True)
                return results
        results = asyncio.run(asyncio.wait_for(go(), 60))
        statuses = [status_name(r) if not isinstance(r, BaseException) else type(r).__name__ for r in results]
        # every call answered: those that finished in the drain window Good, the one still running BadTimeout
        assert statuses == ["BadTimeout"] + ["Good"] * 4, statuses
        assert serve.proc.wait(30) == 0
        end = time.monotonic() + 5
        while any(alive(w) for w in workers) and time.monotonic() < end:
            time.sleep(0.05)
        assert not any(alive(w) for w in workers)
        audit = (serve.state_dir / "audit" / "audit.jsonl").read_text()
        assert audit.count('"BadTimeout"') == statuses.count("BadTimeout")  # flushed before exit
    finally:
        serve.kill()


def test_workers_exit_when_serve_is_killed(tmp_path):
    models = {"fast": {"kind": "tensor", "path": str(affine_model(tmp_path / "a.onnx"))},
              "other": {"kind": "tensor", "path": str(affine_model(tmp_path / "b.onnx"))}}
    serve = ServeProcess(tmp_path, models)
    try:
        workers = children(serve.proc.pid)
        assert len(workers) == 2
        os.kill(serve.proc.pid, signal.SIGKILL)
        serve.proc.wait(10)
        end = time.monotonic() + 5
        while any(alive(w) for w in workers) and time.monotonic() < end:
            time.sleep(0.05)
        assert not any(alive(w) for w in workers), "a worker outlived its serve process"
    finally:
        serve.kill()
