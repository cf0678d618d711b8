"""Starting a helper program (the C compiler) that ends, with everything it starts, when the process that started it
dies and at the planned stop.

subprocess.Popen runs no os.register_at_fork hook, so its child inherits what the starter set: a model worker ignores
SIGTERM and SIGINT (serve stops it once its calls are answered), an ignored signal stays ignored across exec, and a
compiler started from a worker outlived `systemctl stop` (which then waits TimeoutStopSec and kills) and a kill -9 of
its worker. `popen_tied` starts the program under a few lines of Python (a fresh interpreter, so no hook of the
starter runs between fork and exec in a process with threads) that
- ask Linux for a SIGTERM when the starter dies (PR_SET_PDEATHSIG),
- run the program in a process group of its own with SIGTERM and SIGINT at their default, and
- on SIGTERM or SIGINT (the parent-death signal, or the planned stop's signal to every process) end that whole
  group: the compiler driver and the compiler proper it started (a parent-death signal reaches one process only),
- exit with the program's status.

Linux sends the parent-death signal when the *thread* that started the child ends: start it from a thread that
waits for it (as kernels/cpu_quant.py's build does).
"""
from __future__ import annotations

import os
import subprocess
import sys

PR_SET_PDEATHSIG = 1
_TIED = f"""
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None).prctl({PR_SET_PDEATHSIG}, int(signal.SIGTERM), 0, 0, 0)
except (OSError, AttributeError):  # not Linux: the planned stop still ends the program
    pass
if os.getppid() != int(sys.argv[1]):  # the starter died before the request took effect
    sys.exit(1)
pending, child = [], 0
def stop(signum, frame):  # the program's whole group: the driver and the compiler proper it started
    pending.append(signum)
    if child:
        try:
            os.killpg(child, signal.SIGTERM)
        except ProcessLookupError:
            pass
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, stop)
child = os.fork()
if child == 0:
    os.setpgid(0, 0)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    os.execvp(sys.argv[2], sys.argv[2:])
try:
    os.setpgid(child, child)
except OSError:  # it already did, or already ended
    pass
if pending:  # a signal before the fork
    stop(pending[0], None)
try:
    _, status = os.waitpid(child, 0)  # retried after a signal's handler (PEP 475)
except ChildProcessError:
    status = 1 << 8
sys.exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
"""


def popen_tied(args: list[str], **kwargs) -> subprocess.Popen:
    """subprocess.Popen(args, **kwargs): the program, and what it starts, end at SIGTERM/SIGINT and when the
    starter dies; its exit status is the program's."""
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", _TIED, str(os.getpid()), *args], **kwargs)
