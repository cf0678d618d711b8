"""logging.format: json holds for every process of the appliance: serve's lines and its workers' lines are each one
JSON object (what the journal keeps and a log shipper parses), a worker's naming its worker group. Run as a plant runs
it: `appliance serve` as a process, its stderr read as the journal would."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from harness import free_ports
from onnx_models import affine_model

ROOT = Path(__file__).resolve().parent.parent


def test_serve_and_its_workers_log_json_lines(tmp_path):
    model = affine_model(tmp_path / "affine.onnx")
    config = tmp_path / "appliance.yaml"
    port, metrics_port = free_ports(2)
    config.write_text(yaml.safe_dump({
        "server": {"endpoint": f"opc.tcp://127.0.0.1:{port}", "state_dir": str(tmp_path / "state")},
        "metrics": {"listen": f"127.0.0.1:{metrics_port}"}, "watchdog": {"backend": "none"},
        "logging": {"format": "json", "level": "INFO"},
        "models": {"affine": {"kind": "tensor", "path": str(model)}}}))
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "serve", "--config", str(config)], cwd=ROOT,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line.rstrip("\n")) for line in proc.stderr], daemon=True)
    reader.start()
    seen = []
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end and not any('"worker"' in line and "is Ready" in line for line in seen):
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                pass
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        reader.join(10)
        while not lines.empty():
            seen.append(lines.get())
    records = [json.loads(line) for line in seen if line.strip()]  # every line is one JSON object
    worker = [r for r in records if r.get("worker") == "affine"]
    assert any(r["message"].startswith("model affine is Ready") for r in worker), seen[-20:]
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    assert any(r["logger"].startswith("appliance.") and "worker" not in r for r in records)  # serve's own
