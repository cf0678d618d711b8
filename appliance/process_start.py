"""How serve starts a child process of its own (a model worker, the sources client) and ends it: `python -m
<module> --fd N --parent-pid P ...` over a Unix socket pair, importing the same appliance package as serve, with
SIGTERM blocked from its first instruction (`systemctl stop` signals every process of the unit, and serve decides
when its children stop, after draining calls); reaped with a kill where it does not exit within 5 s."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

REAP_WAIT_S = 5.0


def start_child(module: str, *args: str) -> tuple[subprocess.Popen, socket.socket]:
    """The child running `module`, and serve's end of the socket pair that joins them."""
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        cmd = [sys.executable, "-m", module, "--fd", str(child_sock.fileno()), "--parent-pid", str(os.getpid()),
               *args]
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            process = subprocess.Popen(cmd, pass_fds=(child_sock.fileno(),), stdin=subprocess.DEVNULL,
                                       env=child_environment())
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    except BaseException:
        parent_sock.close()
        raise
    finally:
        child_sock.close()
    return process, parent_sock


def child_environment() -> dict:
    env = dict(os.environ)
    # The child imports the same appliance package as this process, wherever that came from.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def reap(process: subprocess.Popen | None) -> int | None:
    """The child's exit status (blocking: run it in a thread), killed where it has not ended within REAP_WAIT_S."""
    if process is None:
        return None
    try:
        return process.wait(timeout=REAP_WAIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()
