"""What a test watches beside a real appliance while its workers die, hang or stop: /readyz and /metrics scraped over
HTTP on a thread, OPC UA data changes as a SCADA client receives them (events: uaclient.Events), each stamped with the
time (time.time(), the wall clock the server's event times use too) its request left or its notification arrived."""
from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone


@dataclass
class HttpSample:
    sent: float  # time.time() when the /readyz request left
    sent_mono: float  # the same moment on time.monotonic()
    ready: int  # /readyz status: 200 or 503 (0: nothing listens)
    reasons: list[str]  # /readyz's reasons when 503
    worker_up: dict[str, float]  # appliance_worker_up per model, from /metrics right after


class HttpSampler:
    """Scrapes /readyz and /metrics every `interval_s` until stopped."""

    def __init__(self, base_url: str, interval_s: float = 0.1):
        self.base_url = base_url
        self.interval_s = interval_s
        self.samples: list[HttpSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="http-sampler", daemon=True)

    def __enter__(self) -> "HttpSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            sent, sent_mono, reasons = time.time(), time.monotonic(), []
            try:
                ready = urllib.request.urlopen(self.base_url + "/readyz", timeout=5).status
            except urllib.error.HTTPError as e:
                ready, reasons = e.code, json.loads(e.read()).get("reasons", [])
            except (urllib.error.URLError, OSError):
                ready = 0  # not listening (stopping)
            try:
                text = urllib.request.urlopen(self.base_url + "/metrics", timeout=5).read().decode()
            except (urllib.error.URLError, OSError):
                text = ""
            up = {m: float(v) for m, v in re.findall(r'^appliance_worker_up\{model="([^"]+)"\} (\S+)$', text, re.M)}
            self.samples.append(HttpSample(sent, sent_mono, ready, reasons, up))
            self._stop.wait(self.interval_s)

    def between(self, start: float, end: float, monotonic: bool = False) -> list[HttpSample]:
        return [s for s in self.samples if start <= (s.sent_mono if monotonic else s.sent) <= end]


class DataChanges:
    """asyncua subscription handler: (arrival time, browse name, value) of every data change."""

    def __init__(self):
        self.changes: list[tuple[float, str, object]] = []
        self.names: dict = {}  # node -> name to record it under

    def datachange_notification(self, node, val, data) -> None:
        self.changes.append((time.time(), self.names.get(node, str(node)), val))

    def of(self, name: str, since: float = 0.0) -> list[tuple[float, object]]:
        return [(t, v) for t, n, v in self.changes if n == name and t >= since]


def wall(when: datetime) -> float:
    """An OPC UA DateTime (UTC) as time.time() seconds."""
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


def wait_for(predicate, timeout: float, what):
    """predicate()'s first truthy value within timeout seconds; else an AssertionError naming `what` (a string, or a
    callable for a message made at the timeout, e.g. with what is left)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    value = predicate()
    if value:
        return value
    raise AssertionError(f"timed out after {timeout} s waiting for {what() if callable(what) else what}")


def process_gone(pid: int) -> bool:
    """Dead, or a zombie not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def hook_environment(monkeypatch, hang_file, at: str = "runner") -> None:
    """Worker processes started from now on load tests/hooks/sitecustomize.py, armed with `hang_file`, hanging in
    the engine step (`runner`) or the prompt's tokenization (`tokenizer`); see there."""
    hooks = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hooks")
    current = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", hooks + (os.pathsep + current if current else ""))
    monkeypatch.setenv("APPLIANCE_TEST_HANG_FILE", str(hang_file))
    monkeypatch.setenv("APPLIANCE_TEST_HANG_AT", at)
