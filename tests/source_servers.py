"""The plant's OPC UA servers of the sources tests, as processes a test starts, feeds "go", kills and restarts:
tests/te_source_server.py (asyncua) and tests/node/te_source.js (node-opcua). Their stdout lines are kept with the
wall-clock time each arrived (a row's time, to relate an alarm to the row that raised it)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from cryptography.x509.oid import ExtendedKeyUsageOID

from certificates import make_test_certificate

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def server_certificate(folder: Path, stem: str, uri: str = "urn:te-plant:server") -> tuple[Path, Path]:
    """A self-signed application certificate for a plant server (what a PLC makes for itself)."""
    made = make_test_certificate(stem, application_uri=uri,
                                 extended_key_usage=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    folder.mkdir(parents=True, exist_ok=True)
    return made.write(folder, stem)


class PlantServer:
    def __init__(self, cmd: list[str], cwd: Path = ROOT, env: dict | None = None):
        self.lines: list[tuple[float, str]] = []
        self._seen = threading.Condition()
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
        threading.Thread(target=self._read, daemon=True).start()
        self.wait_for("listening", 60)

    @classmethod
    def asyncua(cls, port: int, cert: Path, key: Path, **options) -> "PlantServer":
        cmd = [sys.executable, str(HERE / "te_source_server.py"), "--port", str(port), "--cert", str(cert),
               "--key", str(key)]
        for name, value in options.items():
            cmd += [f"--{name.replace('_', '-')}", str(value)]
        return cls(cmd)

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._seen:
                self.lines.append((time.time(), line.strip()))
                self._seen.notify_all()

    def wait_for(self, prefix: str, timeout: float = 60) -> str:
        end = time.monotonic() + timeout
        with self._seen:
            while True:
                for _, line in self.lines:
                    if line.startswith(prefix):
                        return line
                left = end - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(f"the plant server did not print {prefix!r}:\n"
                                         + "\n".join(line for _, line in self.lines[-30:]))
                self._seen.wait(min(left, 0.5))

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def row_at(self, when: float) -> int:
        """The last row written at or before `when` (wall clock), -1 if none."""
        rows = [int(line.split()[1]) for t, line in self.lines if line.startswith("row ") and t <= when]
        return rows[-1] if rows else -1

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
