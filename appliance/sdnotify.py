"""systemd's notify protocol (sd_notify(3)): the ten lines it needs, no library.

`Type=notify` units get `NOTIFY_SOCKET` (a path, or '@name' for the abstract namespace) and, with `WatchdogSec=`,
`WATCHDOG_USEC` (+ `WATCHDOG_PID`). Without NOTIFY_SOCKET every call is a no-op, so the daemon calls it
unconditionally. Messages are newline-separated KEY=VALUE datagrams.
"""
from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, environ: dict | None = None):
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):
            address = "\0" + address[1:]
        self.address = address or None
        watchdog_usec = int(env.get("WATCHDOG_USEC", "0") or 0)
        pid = env.get("WATCHDOG_PID")
        if pid and pid.isdigit() and int(pid) != os.getpid():
            watchdog_usec = 0  # meant for another process
        self.watchdog_interval_s = watchdog_usec / 1e6 / 2 if watchdog_usec else None  # ping at half the timeout
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> bool:
        if self.address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(fields).encode(), self.address)
            return True
        except OSError as exc:  # systemd gone or the socket unreachable: never fatal to the appliance
            log.warning("sd_notify failed: %s", exc)
            return False

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> bool:
        return self.send(f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        """During a long load or compilation: systemd waits this much longer for READY=1."""
        return self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def reloading(self) -> bool:
        return self.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self) -> bool:
        return self.send("STOPPING=1", "STATUS=stopping")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
