"""A real appliance on loopback for tests: YAML parsed from a file, PKI created on first start, the OPC UA server and
the monitoring endpoint listening on free ports, all in a background thread with its own event loop (as a separate
process would be). Tests talk to it with real clients over SignAndEncrypt."""
from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path

import yaml

from core.config import load_config
from appliance.daemon import Appliance
from ports import free_ports


class RunningAppliance:
    def __init__(self, state_dir: Path, models: dict, extra: dict | None = None, wait_ready: bool = True):
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.port, self.metrics_port = free_ports(2)
        doc = {
            "server": {"endpoint": f"opc.tcp://127.0.0.1:{self.port}", "state_dir": str(self.state_dir)},
            "metrics": {"listen": f"127.0.0.1:{self.metrics_port}"},
            "watchdog": {"backend": "none"},
            "models": models,
        }
        # Decode stays eager unless a test asks: the background compile (engine.compile: auto) of every appliance
        # a test starts would take both cores of a CI machine. tests/test_compiled_decode.py compiles, over OPC UA too.
        doc["engine"] = {"compile": "off"}
        for section, values in (extra or {}).items():
            if isinstance(values, dict):
                doc.setdefault(section, {}).update(values)
            else:
                doc[section] = values
        self.config_path = self.state_dir / "appliance.yaml"
        self.config_path.write_text(yaml.safe_dump(doc, sort_keys=False))
        self.config = load_config(self.config_path)
        self.endpoint = f"opc.tcp://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}"
        self.app = Appliance(self.config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="appliance", daemon=True)
        self._thread.start()
        self.run(self.app.start(), timeout=60)
        if wait_ready:
            self.run(self.app.wait_ready(180), timeout=200)
            self.run(self.app.ua.publish_values())  # the address space shows it now, not within 0.25 s

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def pki(self):
        from certs.pki import PKI
        return PKI(self.state_dir)

    def issue(self, name: str, role: str) -> tuple[Path, Path]:
        out = self.state_dir / "clients"
        self.pki.issue(name, role, out, socket.gethostname())
        return out / f"{name}.der", out / f"{name}.key.pem"

    def stop(self) -> None:
        try:
            self.run(self.app.stop(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()
