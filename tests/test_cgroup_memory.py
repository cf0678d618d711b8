"""A memory cap (systemd's MemoryMax=, a pod's memory limit): the KV cache is sized from the smaller of the host's
MemAvailable and what the process's cgroup still allows, Backend and the log say which bounded it, and a worker the
cgroup's OOM killer ends is reported as such, not as an anonymous SIGKILL.

Under a real cgroup the test makes: a child of this process's own memory cgroup with a limit, and a real
`appliance serve` started inside it (its workers follow it there, as a systemd unit's do). Where this machine's cgroup
v2 has no memory controller (here: only v1 has one), the v1 cgroup is used, and the v2 files are read from a
directory shaped like cgroupfs instead (tests below, marked so).
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from appliance.cgroup_memory import memory_cgroup
from serve_process import ROOT, Serve
from uaclient import read, session

CAP = 1536 << 20  # 1.50 GiB: serve and a tiny model's worker fit, a 2 GiB KV cache does not
HOOKS = Path(__file__).resolve().parent / "hooks"


def own_memory_cgroup() -> tuple[int, Path] | None:
    """(version, directory) of this process's memory cgroup, found without the code under test."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0":
            for mount in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
                d = mount / path.lstrip("/")
                if "memory" in (d / "cgroup.controllers").read_text().split() if (d / "cgroup.controllers").exists() \
                        else False:
                    return 2, d
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            d = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if (d / "memory.limit_in_bytes").exists():
                return 1, d
    return None


@pytest.fixture
def capped_cgroup():
    """A child cgroup of ours with memory capped at CAP; removed (its processes killed) afterwards."""
    found = own_memory_cgroup()
    if found is None:
        pytest.skip("no memory cgroup to make a child of (neither v2 with the memory controller nor v1)")
    version, parent = found
    child = parent / f"appliance-test-{os.getpid()}"
    try:
        child.mkdir()
        if version == 2:
            (child / "memory.max").write_text(str(CAP))
            (child / "memory.swap.max").write_text("0")
        else:
            (child / "memory.limit_in_bytes").write_text(str(CAP))
    except OSError as e:
        if child.exists():
            child.rmdir()
        pytest.skip(f"this machine does not let the test make a capped cgroup: {e}")
    yield version, child
    for _ in range(100):
        pids = [int(p) for p in (child / "cgroup.procs").read_text().split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            child.rmdir()
            return
        except OSError:
            time.sleep(0.1)


# ---- reading the cap: a real cgroup ----------------------------------------------------------------------------


def test_a_process_in_a_capped_cgroup_reads_its_cap(capped_cgroup):
    version, child = capped_cgroup
    procs = str(child / "cgroup.procs")

    def enter() -> None:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    sleeper = subprocess.Popen(["sleep", "60"], preexec_fn=enter)
    try:
        cgroup = memory_cgroup(sleeper.pid)
        assert cgroup is not None and cgroup.version == version and cgroup.path == child
        cap = cgroup.limit()
        assert cap is not None and cap.limit == CAP and 0 < cap.available <= CAP
        assert cap.describe() == ("the cgroup's memory limit of 1.50 GiB (cgroup v1 memory.limit_in_bytes)"
                                  if version == 1 else "the cgroup's memory limit of 1.50 GiB (cgroup v2 memory.max)")
        assert cgroup.oom_kills() == 0
    finally:
        sleeper.kill()
        sleeper.wait()


# ---- the appliance under the cap ---------------------------------------------------------------------------------


def failed_reason(serve: Serve, model: str, timeout: float = 120) -> str:
    """The /readyz reason of a model once it is Failed (or the test fails with the log)."""
    import json
    import urllib.error
    import urllib.request
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            urllib.request.urlopen(serve.metrics_url + "/readyz", timeout=2)
        except urllib.error.HTTPError as e:
            for reason in json.loads(e.read()).get("reasons", []):
                if reason.startswith(f"model {model} is Failed"):
                    return reason
        except (urllib.error.URLError, OSError):
            pass
        assert serve.proc.poll() is None, serve.log_path.read_text()[-4000:]
        time.sleep(0.3)
    raise AssertionError(f"model {model} never Failed:\n" + serve.log_path.read_text()[-4000:])


def test_a_kv_cache_the_cap_cannot_hold_is_refused_naming_the_cgroup(capped_cgroup, tmp_path):
    """2 GiB of KV cache: the host has far more free (MemAvailable), the cgroup 1.5 GiB: the load is refused with
    the cgroup named, instead of the worker being OOM-killed once the cache fills."""
    pytest.importorskip("transformers")
    from tiny_llm import make_model_dir
    _, child = capped_cgroup
    make_model_dir(tmp_path / "chat", max_positions=65536)
    host_free = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemAvailable:"))
    need = 2 * 2 * 64 * 2 * 65537 * 16 * 4  # layers x (k, v) x slots x kv heads x positions x head_dim x fp32
    assert need < 0.8 * host_free, "this machine has too little memory for the check to mean anything"
    serve = Serve(tmp_path, {"chat": {"kind": "generative", "path": str(tmp_path / "chat")}},
                  engine={"kv_slots": 64, "max_seq_len": 65536, "kv_dtype": "float32"}, cgroup=child, wait="up")
    try:
        reason = failed_reason(serve, "chat")
        assert re.search(r"the KV cache for kv_slots=64 x max_seq_len=65536 needs 2\.00 GiB but only [0-9.]+ GiB "
                         r"of memory is available, bounded by the cgroup's memory limit of 1\.50 GiB \(cgroup v[12] "
                         r"memory\.(limit_in_bytes|max)\)", reason), reason
        assert "/" not in reason.split("bounded by")[1].replace("v1 memory", "").replace("v2 memory", ""), reason
        log = serve.log_path.read_text()
        assert "the cgroup's memory limit of 1.50 GiB" in log and "killed by signal SIGKILL" not in log
    finally:
        serve.close()


def test_backend_names_the_cap_and_an_oom_killed_worker_is_reported_as_such(capped_cgroup, tmp_path):
    pytest.importorskip("transformers")
    from tiny_llm import make_model_dir
    version, child = capped_cgroup
    make_model_dir(tmp_path / "chat")
    bloat = tmp_path / "bloat-now"
    serve = Serve(tmp_path, {"chat": {"kind": "generative", "path": str(tmp_path / "chat")}},
                  engine={"kv_slots": 2, "max_seq_len": 256, "max_new_tokens": 64, "worker_restart_backoff_s": 0.5}, cgroup=child,
                  env={"PYTHONPATH": f"{HOOKS}{os.pathsep}{ROOT}", "APPLIANCE_TEST_BLOAT_FILE": str(bloat)})
    try:
        monitor = serve.issue("monitor", "monitor")

        async def backend_and_restarts():
            async with session(serve, *monitor) as c:
                return (await read(c, "Models", "chat", "Backend"), await read(c, "Models", "chat", "WorkerRestarts"))
        backend, restarts = asyncio.run(backend_and_restarts())
        file = "memory.limit_in_bytes" if version == 1 else "memory.max"
        assert backend.endswith(f"memory bounded by the cgroup's memory limit of 1.50 GiB (cgroup v{version} {file})"), \
            backend
        assert restarts == 0
        worker = next(pid for pid in map(int, (child / "cgroup.procs").read_text().split())
                      if "appliance.workers.worker" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"))
        bloat.write_text("")  # the worker allocates until the cgroup's OOM killer ends it
        end = time.monotonic() + 60
        while "was replaced" not in serve.log_path.read_text() and time.monotonic() < end:
            time.sleep(0.2)
        log = serve.log_path.read_text()
        events = "memory.oom_control" if version == 1 else "memory.events"
        assert re.search(rf"worker of model chat was replaced: it was killed by the OOM killer: the cgroup's memory "
                         rf"limit of 1\.50 GiB \(cgroup v{version} {file}\) was reached \({events} oom_kill 0 -> 1\)",
                         log), log[-4000:]
        assert serve.proc.poll() is None and not Path(f"/proc/{worker}").exists()  # serve lives; the worker is gone
        serve.wait("ready", 120)  # its replacement (which does not bloat) serves

        async def restarts_now():
            async with session(serve, *monitor) as c:
                return await read(c, "Models", "chat", "WorkerRestarts")
        assert asyncio.run(restarts_now()) == 1
    finally:
        serve.close()


# ---- reading the cap: cgroupfs-shaped directories (cgroup v2's memory controller is not on here) ------------------


def fake_proc(tmp_path: Path, membership: str, mounts: list[str]) -> Path:
    proc = tmp_path / "proc"
    (proc / "4242").mkdir(parents=True)
    (proc / "self").mkdir()
    (proc / "4242" / "cgroup").write_text(membership)
    (proc / "self" / "mountinfo").write_text("\n".join(mounts) + "\n")
    return proc


def write(directory: Path, files: dict[str, str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)


def test_cgroup_v2_shaped_the_tightest_level_and_the_oom_kills(tmp_path):
    """Read as from a real cgroupfs, but from a directory shaped like one: v2 (pure, as systemd 252 mounts it)."""
    fs = tmp_path / "cgroup2"
    write(fs, {"cgroup.controllers": "cpu memory pids"})  # the root has no memory.max
    write(fs / "system.slice", {"memory.max": str(6 << 30), "memory.current": str(5 << 30),
                                "memory.stat": "anon 1\ninactive_file 536870912\n", "memory.events": "oom_kill 0\n"})
    unit = fs / "system.slice" / "appliance.service"
    write(unit, {"memory.max": str(8 << 30), "memory.current": str(1 << 30),
                 "memory.stat": "anon 1\nfile 9\ninactive_file 0\n",
                 "memory.events": "low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\noom_group_kill 0\n"})
    proc = fake_proc(tmp_path, "0::/system.slice/appliance.service\n",
                     [f"35 24 0:30 / {fs} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"])
    cgroup = memory_cgroup(4242, proc)
    assert cgroup is not None and (cgroup.version, cgroup.path) == (2, unit)
    cap = cgroup.limit()
    # the slice's 6 GiB binds, not the unit's 8; free there: 6 - 5 + 0.5 (reclaimable cache) = 1.5 GiB
    assert (cap.limit, cap.available) == (6 << 30, 1536 << 20)
    assert cap.describe() == "the cgroup's memory limit of 6.00 GiB (cgroup v2 memory.max)"
    assert cap.cgroup == "/system.slice"
    assert cgroup.oom_kills() == 2
    (fs / "system.slice" / "memory.max").write_text("max\n")  # no cap above: the unit's own binds
    assert cgroup.limit().limit == 8 << 30 and cgroup.limit().available == 7 << 30
    (unit / "memory.max").write_text("max\n")
    assert cgroup.limit() is None


def test_cgroup_v1_shaped_in_a_cgroup_namespace(tmp_path):
    """v1 with a container's cgroup namespace: the mount's root is the container's cgroup, /proc shows "/"."""
    fs = tmp_path / "memory"
    write(fs, {"memory.limit_in_bytes": str((1 << 63) - 4096), "memory.usage_in_bytes": str(3 << 30),
               "memory.stat": "cache 1\ntotal_inactive_file 1073741824\n",
               "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n"})
    write(fs / "worker", {"memory.limit_in_bytes": str(2 << 30), "memory.usage_in_bytes": str(1 << 30),
                          "memory.stat": "total_inactive_file 0\n", "memory.oom_control": "oom_kill 0\n"})
    proc = fake_proc(tmp_path, "12:pids:/\n4:memory:/worker\n0::/\n",
                     [f"41 31 0:38 / {tmp_path}/unified rw - cgroup2 cgroup2 rw",
                      f"35 31 0:32 / {fs} rw,relatime - cgroup cgroup rw,memory"])
    cgroup = memory_cgroup(4242, proc)
    assert cgroup is not None and (cgroup.version, cgroup.path) == (1, fs / "worker")  # v2 has no memory.max
    cap = cgroup.limit()
    assert (cap.limit, cap.available) == (2 << 30, 1 << 30)  # the root's 2^63 - 4096 is no cap
    assert cap.describe() == "the cgroup's memory limit of 2.00 GiB (cgroup v1 memory.limit_in_bytes)"
    assert cgroup.oom_kills() == 0
    # a namespace: the mount's root is /kubepods/pod1, the process sees itself at /kubepods/pod1/worker
    proc2 = fake_proc(tmp_path / "ns", "4:memory:/kubepods/pod1/worker\n",
                      [f"35 31 0:32 /kubepods/pod1 {fs} rw - cgroup cgroup rw,memory"])
    assert memory_cgroup(4242, proc2).path == fs / "worker"


def test_no_cgroup_filesystem_means_no_cap(tmp_path):
    proc = fake_proc(tmp_path, "0::/\n", [])
    assert memory_cgroup(4242, proc) is None
    assert memory_cgroup(99999999, tmp_path / "nowhere") is None
