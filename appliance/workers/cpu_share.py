"""Each model's CPU share (models.NAME.cpu_share, engine.cpu_shares), enforced by the operating system: where CPUs
are short, a worker gets CPU time in proportion to its share, so one model's callers cannot starve another model
(four PLCs calling the classifier as fast as they can made a 16-token Generate 20x slower, issue 47).

Two mechanisms, the better one that the box allows:

    cgroup  the unit's cgroup v2 is delegated to serve (systemd Delegate=yes): serve moves itself (and whatever else
            runs in that cgroup) into a leaf `serve/` (cgroup v2 lets no process sit in a cgroup whose controllers
            its children use), enables the cpu controller for the children, and puts each worker into
            `worker-<group>/` with cpu.weight = its share. Exact weights, and the worker's forks follow it.
    nice    elsewhere (a shell, a container, a unit without Delegate=): each worker's niceness, WORKER_NICE for the
            largest share and one step more per 1.25x less share (the kernel's weight ratio between neighbouring
            nice levels), at most 19. Only ever lowering a worker's priority needs no privilege.

With engine.threads 0 a worker's engine threads are its share of the cores (at least 1): a team of threads larger
than the CPU time it gets waits at every barrier for a member that is not running. A worker whose share is all the
cores keeps the library's default (0), as with one model.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

from appliance.cgroup_memory import cgroup_directory, cgroup_mounts  # the same mountinfo reading
from appliance.workers.os_setup import WORKER_NICE

log = logging.getLogger(__name__)

NICE_STEP = 1.25  # the kernel's CPU weight ratio between nice n and n+1 (sched_prio_to_weight)
MAX_NICE = 19
SERVE_LEAF = "serve"
# serve's own leaf weighs as the serve process does against a worker at WORKER_NICE with the default share of 100:
# nice 0 (1024) against nice 5 (335), so the OPC UA server still comes first as it does on the nice path
SERVE_WEIGHT = round(100 * 1024 / 335)


@dataclass(frozen=True)
class WorkerCpu:
    """What one worker gets: its weight, the niceness it runs at (above serve's), its engines' thread count."""

    share: int  # its models' cpu_share summed
    nice: int
    threads: int  # 0: the library's default (all cores; ONNX measures one against all)
    mechanism: str  # cgroup | nice | off


def nice_for(share: int, largest: int) -> int:
    """The niceness of a worker with `share` where the largest share is `largest`."""
    steps = round(math.log(largest / share, NICE_STEP))
    return min(MAX_NICE, WORKER_NICE + max(0, steps))


def threads_for(share: int, total: int, cores: int, configured: int) -> int:
    """Engine threads of a worker with `share` of `total`: the YAML's engine.threads where set, else its share of
    the cores (at least 1); 0 (the library's default) where that is every core."""
    if configured > 0:
        return configured
    n = max(1, round(cores * share / total))
    return 0 if n >= cores else n


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def worker_shares(config) -> dict[str, int]:
    """Each worker's share: its models' cpu_share summed (a `worker` group's), an A/B variant's worker its model's."""
    shares: dict[str, int] = {}
    for name, m in config.models.items():
        group = m.worker or name
        shares[group] = shares.get(group, 0) + m.cpu_share
        shares.update({f"{name}@{variant}": m.cpu_share for variant in m.variants})
    return shares


def planned_threads(config, model: str) -> int:
    """The engine threads serve will give `model`'s worker (what `appliance models prepare` measures with)."""
    if config.engine.cpu_shares == "off":
        return config.engine.threads
    shares = worker_shares(config)
    group = config.models[model].worker or model
    return threads_for(shares[group], sum(shares.values()), usable_cores(), config.engine.threads)


class DelegatedCgroup:
    """The serve process's cgroup v2 directory, delegated to it: the leaves it makes there and the processes it
    moves into them."""

    def __init__(self, directory: Path):
        self.directory = directory

    def worker_dir(self, group: str) -> Path:
        return self.directory / f"worker-{group}"

    def take_over(self) -> None:
        """Every process of the cgroup into `serve/`, then the cpu controller (and memory, where offered, so a
        worker's OOM kills stay countable in its own leaf) on for the leaves. Raises OSError where refused."""
        leaf = self.directory / SERVE_LEAF
        leaf.mkdir(exist_ok=True)
        for _ in range(3):  # a process may fork while the others move: until none is left behind
            pids = (self.directory / "cgroup.procs").read_text().split()
            if not pids:
                break
            for pid in pids:
                try:
                    (leaf / "cgroup.procs").write_text(pid)
                except ProcessLookupError:
                    pass  # it ended meanwhile
        offered = (self.directory / "cgroup.controllers").read_text().split()
        wanted = ["cpu"] + (["memory"] if "memory" in offered else [])
        (self.directory / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in wanted))
        (leaf / "cpu.weight").write_text(str(SERVE_WEIGHT))

    def place(self, group: str, pid: int, weight: int) -> None:
        """The worker `pid` into `worker-<group>/` with cpu.weight `weight` (its threads move with it)."""
        leaf = self.worker_dir(group)
        leaf.mkdir(exist_ok=True)
        (leaf / "cpu.weight").write_text(str(weight))
        (leaf / "cgroup.procs").write_text(str(pid))


def delegated_cgroup(proc: Path = Path("/proc")) -> tuple[DelegatedCgroup | None, str]:
    """This process's cgroup where systemd delegated it (and its cpu controller) to us, else None; and why not."""
    try:
        membership = (proc / "self" / "cgroup").read_text().splitlines()
        mounts = (proc / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return None, "no cgroup information in /proc"
    own = next((line.split(":", 2)[2] for line in membership if line.startswith("0::")), None)
    if own is None:
        return None, "no cgroup v2 membership"
    directory = None
    for mount_root, mount_point, fstype, _ in cgroup_mounts(mounts):
        if fstype == "cgroup2":
            directory = cgroup_directory(mount_point, mount_root, own)
            if directory is not None and directory.is_dir():
                break
            directory = None
    if directory is None:
        return None, "no cgroup v2 hierarchy mounted"
    if not _delegated_to_us(directory):
        return None, "the cgroup is not delegated (systemd's Delegate=yes)"
    try:
        controllers = (directory / "cgroup.controllers").read_text().split()
    except OSError:
        return None, "the cgroup's controllers cannot be read"
    if "cpu" not in controllers:
        return None, "the delegated cgroup has no cpu controller"
    if not all(os.access(directory / f, os.W_OK) for f in (".", "cgroup.procs", "cgroup.subtree_control")):
        return None, "the delegated cgroup is read-only here (ProtectControlGroups=)"
    return DelegatedCgroup(directory), ""


def _delegated_to_us(directory: Path) -> bool:
    """systemd marks a delegated cgroup with the xattr trusted.delegate (v251) or user.delegate (readable without
    privilege), and gives a unit's User= its directory. Root with neither is not delegated: restructuring a shell's
    session scope would move the shell."""
    for name in ("user.delegate", "trusted.delegate"):
        try:
            if os.getxattr(directory, name) == b"1":
                return True
        except OSError:
            pass
    uid = os.geteuid()
    try:
        return uid != 0 and directory.stat().st_uid == uid
    except OSError:
        return False


class CpuShares:
    """The CPU plan of every worker of this serve process: made once, before the first worker starts."""

    def __init__(self, shares: dict[str, int], *, enabled: bool = True, threads: int = 0,
                 cores: int | None = None, proc: Path = Path("/proc")):
        self.shares = dict(shares)
        self.threads = threads
        self.cores = cores or usable_cores()
        self.cgroup: DelegatedCgroup | None = None
        if not enabled:
            self.mechanism, why = "off", "engine.cpu_shares is off"
        else:
            self.cgroup, why = delegated_cgroup(proc)
            if self.cgroup is not None:
                try:
                    self.cgroup.take_over()
                except OSError as exc:
                    why, self.cgroup = f"the delegated cgroup refused the leaves ({exc.strerror or exc})", None
            self.mechanism = "cgroup" if self.cgroup is not None else "nice"
        shown = ", ".join(f"{g} {s}" for g, s in sorted(self.shares.items()))
        if self.mechanism == "cgroup":
            log.info("CPU shares by cgroup cpu.weight under %s: %s", self.cgroup.directory.name, shown)
        elif self.mechanism == "nice":
            log.info("CPU shares by nice levels (%s): %s", why, shown)
        else:
            log.info("CPU shares off (%s): every worker at nice %d", why, WORKER_NICE)

    def worker(self, group: str) -> WorkerCpu:
        share = self.shares[group]
        if self.mechanism == "off":
            return WorkerCpu(share, WORKER_NICE, self.threads, "off")
        nice = WORKER_NICE if self.mechanism == "cgroup" else nice_for(share, max(self.shares.values()))
        return WorkerCpu(share, nice, threads_for(share, sum(self.shares.values()), self.cores, self.threads),
                         self.mechanism)

    def place(self, group: str, pid: int) -> None:
        """A worker just started: into its cgroup leaf (on the cgroup path); a refusal leaves it at its nice level."""
        if self.cgroup is None:
            return
        try:
            self.cgroup.place(group, pid, self.shares[group])
        except ProcessLookupError:
            pass  # it died at once: its supervisor sees that
        except OSError as exc:
            log.warning("worker %s could not be put into its cgroup (%s): it runs at nice %d", group,
                        exc.strerror or exc, WORKER_NICE)
