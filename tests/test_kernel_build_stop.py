"""The C compiler that kernels/cpu_build.py starts ends with a planned stop and with its parent: a process like a
model worker (SIGTERM and SIGINT ignored: serve stops it itself) builds the torch operator library with the real
compiler; a SIGTERM to the whole process group (what `systemctl stop` sends to the unit) must leave no compiler
behind, and a kill -9 of the worker must end the compiler it started."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_build
from worker_probes import wait_for

ROOT = Path(__file__).resolve().parent.parent

WORKER = """
import signal, sys, time
from pathlib import Path
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as appliance/workers/worker.py: serve stops it once calls are answered
signal.signal(signal.SIGINT, signal.SIG_IGN)
from kernels import cpu_build
try:
    cpu_build.build_many(Path(sys.argv[1]), ["quant_op"])
except Exception as exc:  # the compiler was stopped: the build fails, the worker goes on
    print("build failed:", type(exc).__name__, flush=True)
time.sleep(120)
"""

pytestmark = pytest.mark.skipif(cpu_build.compiler(True) is None, reason="no C++ compiler (c++/g++) on PATH")


def group_members(sid: int) -> dict[int, str]:
    """pid -> command name of every live process of the session the worker leads (zombies left out): the
    worker, what it started, and what those started, orphaned or not, in whatever process group."""
    members = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            members[int(entry.name)] = name
    return members


def compilers(pgid: int, worker: int) -> dict[int, str]:
    return {pid: name for pid, name in group_members(pgid).items() if pid != worker}


@pytest.fixture
def building_worker(tmp_path):
    """A worker-like process in a session (and process group) of its own, with the compiler running."""
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path / "build")], cwd=ROOT,
                              start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        # the compiler proper (cc1plus, started by the c++ driver): the build is under way
        wait_for(lambda: "cc1plus" in compilers(worker.pid, worker.pid).values(), 120,
                 lambda: f"the compiler to start: {compilers(worker.pid, worker.pid)}")
        yield worker
    finally:
        for pid in group_members(worker.pid):  # whatever is left of the session
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        worker.wait(30)


def test_a_group_sigterm_during_a_kernel_build_leaves_no_compiler(building_worker):
    before = compilers(building_worker.pid, building_worker.pid)
    os.killpg(building_worker.pid, signal.SIGTERM)  # the planned stop: the worker's process group
    wait_for(lambda: not compilers(building_worker.pid, building_worker.pid), 5,
             lambda: f"the compilers to stop after SIGTERM: {compilers(building_worker.pid, building_worker.pid)} "
                     f"still running (were {before})")
    assert building_worker.poll() is None  # the worker itself ignores it: serve stops it


def test_a_killed_worker_takes_its_compiler_with_it(building_worker):
    driver = [pid for pid, name in compilers(building_worker.pid, building_worker.pid).items()
              if Path(f"/proc/{pid}/stat").exists() and
              int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == building_worker.pid]
    assert driver, "no compiler started by the worker itself"
    os.kill(building_worker.pid, signal.SIGKILL)
    building_worker.wait(30)
    wait_for(lambda: not group_members(building_worker.pid), 5,  # the driver, and what it started
             lambda: f"the compiler the worker started to go with it: {group_members(building_worker.pid)} outlived it")


def test_a_tied_build_still_builds(tmp_path):
    built = cpu_build.build_many(tmp_path, ["cpu_features"])
    assert len(built) == 1 and built[0].exists() and built[0].stat().st_size > 0
