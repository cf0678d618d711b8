"""What a worker process sets up of the operating system for itself: it dies with serve (PR_SET_PDEATHSIG), so do
the processes it forks, it runs below serve in CPU priority and above it as the OOM killer's victim; it keeps Triton
out where no GPU can be used, gives freed heap back, and reads its own peak memory."""
from __future__ import annotations

import ctypes
import logging
import os
import resource
import signal
import sys

from appliance.workers import protocol as p

log = logging.getLogger("appliance.worker")

PR_SET_PDEATHSIG = 1


def keep_triton_out(specs: list[p.ModelSpec]) -> None:
    """A worker whose models all run on the CPU never launches a Triton kernel, but importing torch's Inductor (which
    builds the compiled decode step, in a forked child of the worker since the step became a package) imports
    triton: 66 MB more while it builds. Here `import triton` then fails as it would where triton is not installed,
    which Inductor handles. Not under TRITON_INTERPRET=1 (Triton kernels on
    CPU tensors, for tests) or where a model may run on a GPU."""
    if os.environ.get("TRITON_INTERPRET") == "1" or "triton" in sys.modules:
        return
    devices = {str(spec.settings.get("device", "auto")) for spec in specs}
    if any(d.startswith("cuda") for d in devices):
        return
    if "auto" in devices:
        import torch
        if torch.cuda.is_available():
            return
    sys.modules["triton"] = None  # the import system's own "not importable" marker


def release_free_heap() -> None:
    """Give the heap that loading freed back to the OS: glibc keeps freed memory in each thread's arena (the
    loader's and torch's threads). Measured on the 1B model's worker at Ready: 11 MB returned."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; musl's allocator returns memory by itself
    if trim is not None:
        trim(0)


def peak_rss_mb() -> float:
    """This process image's peak resident memory (VmHWM). Not getrusage's ru_maxrss: that keeps the high-water
    mark of the serve process's memory image from before exec, so a big parent made every worker look too big."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB; elsewhere than Linux



WORKER_NICE = 5  # added to the serve process's niceness (see main)


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """`sig` to this process when its parent dies, even by kill -9 (Linux); elsewhere the socket's EOF does."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def forked_children_end_with_the_worker() -> None:
    """A process this worker forks (the decode step's compiler, loader/compiled_decode.py, or a helper a library
    forks) ends with the planned stop and with the worker: fork keeps the worker's ignored SIGTERM and SIGINT (and
    exec keeps an ignored signal ignored, for the compiler's own g++) but drops PR_SET_PDEATHSIG, so such a child
    outlived a `systemctl stop` (which then waited TimeoutStopSec) and a kill -9 of serve (a core busy for
    minutes). In each child: SIGTERM and SIGINT back to their default, and SIGTERM when the worker dies."""
    worker = os.getpid()

    def in_child() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (ValueError, OSError):  # not this interpreter's main thread: at the C level then
                ctypes.CDLL(None).signal(int(sig), 0)  # 0: SIG_DFL
        die_with_parent(worker, signal.SIGTERM)
    os.register_at_fork(after_in_child=in_child)


WORKER_OOM_SCORE_ADJ = 500  # added to the kernel's OOM badness: a worker goes before the serve process


def prefer_as_oom_victim() -> None:
    """Where the cgroup's memory cap is reached, the OOM killer takes a worker (which serve reports and replaces),
    not the serve process (which would take the OPC UA server and every model with it). Raising one's own
    oom_score_adj needs no privilege."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(WORKER_OOM_SCORE_ADJ))
    except OSError as exc:
        log.info("the worker could not raise its oom_score_adj: %s", exc)
