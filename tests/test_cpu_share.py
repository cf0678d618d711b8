"""Each model's CPU share (models.NAME.cpu_share, engine.cpu_shares): a real `appliance serve` with the TE classifier
and a generative model at different shares runs their workers at the nice levels the shares give (read from
/proc/<pid>/stat), with engine threads sized to the shares, says so in its metrics and log, and serves both models
over SignAndEncrypt; with engine.cpu_shares off every worker is at one level, as before.

This machine's cgroup v2 has no cpu controller (cpu is on v1) and its cgroup is not delegated, so the nice path is
what a real serve runs here; the cgroup path (a delegated cgroup v2: serve/ and worker-<group>/ leaves, cpu.weight)
runs against a directory laid out like cgroupfs, found through a /proc laid out like the kernel's."""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from pathlib import Path

import pytest
from asyncua import ua

from appliance.workers.cpu_share import SERVE_WEIGHT, CpuShares, delegated_cgroup, nice_for, threads_for
from appliance.workers.os_setup import WORKER_NICE
from core.config import ConfigError, load_config_text
from serve_process import Serve, command_line, worker_pids
from test_sources_te import metric
from uaclient import call, floats, session, status_name

V = ua.VariantType


def nice_of(pid: int) -> int:
    """Field 19 of /proc/<pid>/stat (the process's niceness)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[16])  # fields[0] is field 3 (state)


def worker_of(serve: Serve, group: str) -> int:
    (pid,) = [p for p in worker_pids(serve.proc.pid) if f"--group {group} " in command_line(p) + " "]
    return pid


def two_models(tmp_path: Path, classifier: int | None, chat: int | None) -> dict:
    from tiny_llm import make_model_dir
    make_model_dir(tmp_path / "chat")
    models = {"te": {"kind": "tensor", "path": "builtin:te-classifier"},
              "chat": {"kind": "generative", "path": str(tmp_path / "chat")}}
    for name, share in (("te", classifier), ("chat", chat)):
        if share is not None:
            models[name]["cpu_share"] = share
    return models


async def both_answer(serve: Serve, cert) -> tuple[str, str]:
    async with session(serve, *cert) as c:
        infer = await call(c, "te", "Infer", [floats([0.1] * 20 * 52)])
        generate = await call(c, "chat", "Generate", [ua.Variant("The pump", V.String), ua.Variant(4, V.UInt32),
                                                      ua.Variant(0.0, V.Float)])
        return status_name(infer), status_name(generate)


def test_shares_set_each_workers_nice_level_and_threads(tmp_path):
    pytest.importorskip("transformers")
    serve = Serve(tmp_path, two_models(tmp_path, classifier=300, chat=100))
    try:
        te, chat = worker_of(serve, "te"), worker_of(serve, "chat")
        # serve's own niceness plus WORKER_NICE for the larger share; 3x less share: round(log 3 / log 1.25) = 5
        # steps more (the kernel's weights: 1.25x a step, 3.05x for five)
        base = os.getpriority(os.PRIO_PROCESS, serve.proc.pid)
        assert nice_of(te) == base + WORKER_NICE
        assert nice_of(chat) == base + WORKER_NICE + 5
        cores = len(os.sched_getaffinity(serve.proc.pid))
        expect_chat = max(1, round(cores * 100 / 400))
        assert metric(serve, "appliance_worker_threads", model="chat") == (0 if expect_chat >= cores else expect_chat)
        assert metric(serve, "appliance_worker_cpu_share", model="te", mechanism="nice") == 300
        assert metric(serve, "appliance_worker_cpu_share", model="chat", mechanism="nice") == 100
        assert "CPU shares by nice levels" in serve.log_path.read_text()
        assert asyncio.run(asyncio.wait_for(both_answer(serve, serve.issue("plc", "operator")), 120)) == ("Good",
                                                                                                          "Good")
    finally:
        serve.close()


def test_shares_off_keep_every_worker_at_one_level(tmp_path):
    pytest.importorskip("transformers")
    serve = Serve(tmp_path, two_models(tmp_path, classifier=300, chat=100), engine={"cpu_shares": "off"},
                  wait="up")
    try:
        base = os.getpriority(os.PRIO_PROCESS, serve.proc.pid)
        assert [nice_of(worker_of(serve, g)) for g in ("te", "chat")] == [base + WORKER_NICE] * 2
        assert metric(serve, "appliance_worker_threads", model="chat") == 0  # engine.threads as the YAML says
        assert metric(serve, "appliance_worker_cpu_share", model="chat", mechanism="off") == 100
    finally:
        serve.close()


@pytest.mark.parametrize("value, message", [(0, "expected an integer in [1, 10000], got 0"),
                                            ("half", "expected an integer in [1, 10000], got 'half'")])
def test_a_bad_share_names_file_line_and_key(value, message):
    text = f"models:\n  te:\n    kind: tensor\n    path: builtin:te-classifier\n    cpu_share: {value}\n"
    with pytest.raises(ConfigError) as info:
        load_config_text(text, source="t.yaml")
    (error,) = info.value.errors
    assert error.startswith("t.yaml:5: models.te.cpu_share: ") and message in error, error


def test_the_default_share_is_equal():
    config = load_config_text("models:\n  a:\n    kind: tensor\n    path: builtin:te-classifier\n  b:\n"
                              "    kind: tensor\n    path: builtin:te-classifier\n", source="t.yaml")
    assert config.models["a"].cpu_share == config.models["b"].cpu_share
    assert config.engine.cpu_shares == "auto"


def test_nice_levels_and_threads_follow_the_shares():
    assert nice_for(100, 100) == WORKER_NICE
    assert nice_for(50, 100) == WORKER_NICE + 3  # 1.25^3 = 1.95
    assert nice_for(1, 10000) == 19  # never past the kernel's lowest priority
    assert threads_for(100, 200, cores=8, configured=0) == 4
    assert threads_for(1, 1000, cores=8, configured=0) == 1  # never below one
    assert threads_for(100, 100, cores=8, configured=0) == 0  # every core: the library's default
    assert threads_for(1, 1000, cores=8, configured=3) == 3  # engine.threads set: as the YAML says


def test_a_worker_groups_share_is_its_models_and_prepare_measures_with_the_workers_threads(tmp_path, monkeypatch):
    from appliance.workers import cpu_share
    (tmp_path / "b.onnx").write_bytes(b"")  # a variant's weights must exist; the config does not read them
    config = load_config_text(
        "models:\n"
        "  a:\n    kind: tensor\n    path: builtin:te-classifier\n    worker: line\n    cpu_share: 200\n"
        "  b:\n    kind: tensor\n    path: builtin:te-classifier\n    worker: line\n"
        "  c:\n    kind: tensor\n    path: builtin:te-classifier\n    cpu_share: 100\n"
        "    variants:\n      next: {path: b.onnx, weight: 10}\n", source="t.yaml", base_dir=tmp_path)
    assert cpu_share.worker_shares(config) == {"line": 300, "c": 100, "c@next": 100}
    monkeypatch.setattr(cpu_share, "usable_cores", lambda: 10)
    assert cpu_share.planned_threads(config, "b") == 6 and cpu_share.planned_threads(config, "c") == 2
    config.engine.cpu_shares = "off"
    assert cpu_share.planned_threads(config, "c") == 0


def own_cgroup_v2() -> Path | None:
    """This process's cgroup v2 directory, found without the code under test."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            for mount in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
                d = mount / line[3:].lstrip("/")
                if (d / "cgroup.procs").exists() and (mount / "cgroup.controllers").exists():
                    return d
    return None


def test_a_real_delegated_cgroup_without_the_cpu_controller_keeps_the_nice_levels(tmp_path):
    """A cgroup v2 child of ours marked delegated as systemd marks one (trusted.delegate), where this machine's
    cgroup v2 has no cpu controller: serve, started inside it, reads all that from the kernel's own files, says why it
    uses nice levels, and leaves the cgroup as it was (no serve/ leaf, its processes where they started)."""
    pytest.importorskip("transformers")
    parent = own_cgroup_v2()
    if parent is None:
        pytest.skip("no cgroup v2 hierarchy here")
    child = parent / f"appliance-cpu-test-{os.getpid()}"
    try:
        child.mkdir()
        os.setxattr(child, "trusted.delegate", b"1")
    except OSError as e:
        if child.exists():
            child.rmdir()
        pytest.skip(f"this machine does not let the test make a delegated cgroup: {e}")
    if "cpu" in (child / "cgroup.controllers").read_text().split():
        child.rmdir()
        pytest.skip("this machine's cgroup v2 has the cpu controller: the nice fallback is not what runs here")
    serve = None
    try:
        serve = Serve(tmp_path, two_models(tmp_path, classifier=100, chat=200), cgroup=child, wait="up")
        base = os.getpriority(os.PRIO_PROCESS, serve.proc.pid)
        assert nice_of(worker_of(serve, "te")) == base + WORKER_NICE + 3
        assert nice_of(worker_of(serve, "chat")) == base + WORKER_NICE
        assert "CPU shares by nice levels (the delegated cgroup has no cpu controller)" in serve.log_path.read_text()
        assert metric(serve, "appliance_worker_cpu_share", model="te", mechanism="nice") == 100
        assert not (child / "serve").exists()
        assert str(serve.proc.pid) in (child / "cgroup.procs").read_text().split()
    finally:
        if serve is not None:
            serve.close()
        for _ in range(100):
            for pid in (child / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            try:
                child.rmdir()
                break
            except OSError:
                time.sleep(0.1)


# ---- the cgroup path, against a cgroupfs and /proc laid out like the kernel's ----

UNIT = "system.slice/appliance.service"


def fake_box(tmp_path: Path, *, delegated: bool = True, controllers: str = "cpu memory pids") -> tuple[Path, Path]:
    """(/proc, the unit's cgroup directory): serve (and a helper) in the unit's cgroup v2."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    unit = root / UNIT
    (proc / "self").mkdir(parents=True)
    unit.mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(f"0::/{UNIT}\n")
    (proc / "self" / "mountinfo").write_text(
        f"30 24 0:26 / {root} rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
        "24 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n")
    (unit / "cgroup.controllers").write_text(controllers + "\n")
    (unit / "cgroup.procs").write_text("4242\n4243\n")
    (unit / "cgroup.subtree_control").write_text("")
    if delegated:
        os.setxattr(unit, "user.delegate", b"1")
    return proc, unit


class LeafFiles:
    """What was written to each leaf's files (a real cgroupfs moves a pid out of the parent's cgroup.procs)."""

    def __init__(self, unit: Path):
        self.unit = unit

    def __call__(self, leaf: str, name: str) -> str:
        return (self.unit / leaf / name).read_text()


def test_a_delegated_cgroup_gets_a_serve_leaf_and_a_weighted_leaf_per_worker(tmp_path, caplog):
    proc, unit = fake_box(tmp_path)
    caplog.set_level("INFO", logger="appliance.workers.cpu_share")
    shares = CpuShares({"te": 300, "chat": 100}, proc=proc, cores=2)
    assert shares.mechanism == "cgroup"
    leaf = LeafFiles(unit)
    assert leaf("serve", "cgroup.procs") == "4243"  # each process of the unit moved (the fake keeps the last)
    assert leaf("serve", "cpu.weight") == str(SERVE_WEIGHT)
    assert (unit / "cgroup.subtree_control").read_text() == "+cpu +memory"
    shares.place("chat", 5151)
    assert leaf("worker-chat", "cpu.weight") == "100" and leaf("worker-chat", "cgroup.procs") == "5151"
    shares.place("te", 5152)
    assert leaf("worker-te", "cpu.weight") == "300"
    # the weights do the sharing: every worker at one nice level, threads still sized to the share
    assert shares.worker("chat").nice == shares.worker("te").nice == WORKER_NICE
    assert shares.worker("chat").threads == 1 and shares.worker("te").threads == 0
    assert re.search(r"CPU shares by cgroup cpu.weight under appliance.service: chat 100, te 300", caplog.text)


@pytest.mark.parametrize("change, why", [
    (lambda unit: None, "not delegated"),
    (lambda unit: (unit / "cgroup.controllers").write_text("memory pids\n"), "no cpu controller"),
])
def test_elsewhere_the_nice_levels_do_it(tmp_path, change, why):
    proc, unit = fake_box(tmp_path, delegated=why != "not delegated")
    change(unit)
    assert why in delegated_cgroup(proc)[1]
    shares = CpuShares({"te": 300, "chat": 100}, proc=proc, cores=2)
    assert shares.mechanism == "nice" and shares.worker("chat").nice == WORKER_NICE + 5
    assert not (unit / "serve").exists()  # the cgroup left as it was
    shares.place("chat", 5151)
    assert not (unit / "worker-chat").exists()


def test_a_worker_the_cgroup_refuses_keeps_its_nice_level(tmp_path, caplog):
    proc, unit = fake_box(tmp_path)
    shares = CpuShares({"te": 100}, proc=proc, cores=2)
    (unit / "worker-te").mkdir()
    (unit / "worker-te" / "cgroup.procs").mkdir()  # writing it fails as a refused move does
    shares.place("te", 5151)
    assert "worker te could not be put into its cgroup" in caplog.text
