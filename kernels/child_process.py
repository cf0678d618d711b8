"""Starting a helper process (the C compiler) that ends with the process that started it and obeys the planned stop.

subprocess.Popen runs no os.register_at_fork hook, so its child inherits what the starter set: a model worker ignores
SIGTERM and SIGINT (serve stops it once its calls are answered), an ignored signal stays ignored across exec, and a
compiler started from a worker outlived `systemctl stop` (which then waits TimeoutStopSec and kills) and a kill -9 of
its worker. `popen_tied` gives the child SIGTERM and SIGINT back (their default: end) and asks Linux for a SIGTERM
when its starter dies (PR_SET_PDEATHSIG; elsewhere only the signals are restored).

Linux sends the parent-death signal when the *thread* that started the child ends: start it from a thread that
waits for it (as kernels/cpu_quant.py's build does).
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess

PR_SET_PDEATHSIG = 1

# Resolved here, in the parent: between fork and exec the child only calls these (no dlopen, no import), which is
# what makes a preexec_fn safe enough in a process with threads.
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _c_signal = _libc.signal
    _c_signal.argtypes, _c_signal.restype = (ctypes.c_int, ctypes.c_void_p), ctypes.c_void_p
    _c_prctl = _libc.prctl
    _c_prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
except (OSError, AttributeError):  # no libc prctl/signal by these names (not Linux): Python's signal then
    _c_signal = _c_prctl = None

_STOP_SIGNALS = (int(signal.SIGTERM), int(signal.SIGINT))


def _tie_to(parent: int):
    def in_child() -> None:
        for sig in _STOP_SIGNALS:
            if _c_signal is not None:
                _c_signal(sig, None)  # NULL: SIG_DFL
            else:
                signal.signal(sig, signal.SIG_DFL)
        if _c_prctl is not None:
            _c_prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the starter died before the request took effect
            os._exit(1)
    return in_child


def popen_tied(args: list[str], **kwargs) -> subprocess.Popen:
    """subprocess.Popen(args, **kwargs), the child ending on SIGTERM/SIGINT and when its starter dies."""
    return subprocess.Popen(args, preexec_fn=_tie_to(os.getpid()), **kwargs)
