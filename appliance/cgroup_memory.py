"""The memory cap of the cgroup a process runs in (systemd's MemoryMax=, a container's memory limit): its limit,
what is still free under it, and how many of its processes the OOM killer has killed.

    cgroup v2   memory.max             memory.current         memory.stat inactive_file        memory.events oom_kill
    cgroup v1   memory.limit_in_bytes  memory.usage_in_bytes  memory.stat total_inactive_file  memory.oom_control oom_kill

A limit set on an ancestor binds as well: every level from the process's own cgroup up to the hierarchy's mount
counts, and the tightest wins. The cgroup comes from /proc/<pid>/cgroup and the hierarchy's mount from
/proc/self/mountinfo (inside a container's cgroup namespace both show the container's own root). Reclaimable page
cache (inactive files) counts as free, as the kernel reclaims it before it kills.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

V1_UNLIMITED = 1 << 62  # v1 shows "no limit" as 2^63-1 rounded to a page; anything this large is no cap


@dataclass(frozen=True)
class MemoryLimit:
    limit: int  # bytes: the tightest cap from the cgroup up
    available: int  # bytes still free under it (the least over the capped levels), reclaimable cache counted free
    where: str  # which file sets it, e.g. "cgroup v2 memory.max"
    cgroup: str  # at which level, e.g. "/system.slice/appliance.service" (for the log; no status text shows it)

    def describe(self) -> str:
        return f"the cgroup's memory limit of {self.limit / 2**30:.2f} GiB ({self.where})"


@dataclass(frozen=True)
class MemoryCgroup:
    version: int  # 1 or 2
    path: Path  # the directory of the process's own cgroup
    mount: Path  # the hierarchy's mount point: no level above it is ours to read
    name: str  # the cgroup's path inside the hierarchy, for messages (e.g. /system.slice/appliance.service)

    def _levels(self) -> list[Path]:
        levels, level = [], self.path
        while True:
            levels.append(level)
            if level == self.mount or self.mount not in level.parents:
                return levels
            level = level.parent

    def limit(self) -> MemoryLimit | None:
        """The tightest cap from this cgroup up and what is free under it; None when no level is capped."""
        found: list[tuple[int, int, Path]] = []
        for level in self._levels():
            cap = _read_limit(level, self.version)
            if cap is None:
                continue
            used = _read_int(level / ("memory.current" if self.version == 2 else "memory.usage_in_bytes"))
            cache = _stat(level, "inactive_file" if self.version == 2 else "total_inactive_file")
            free = max(0, cap - (used or 0) + (cache or 0)) if used is not None else cap
            found.append((cap, min(free, cap), level))
        if not found:
            return None
        cap, _, level = min(found)
        key = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        inside = "/" + str(level.relative_to(self.mount)).strip(".").strip("/")
        return MemoryLimit(cap, min(free for _, free, _ in found), f"cgroup v{self.version} {key}", inside)

    def oom_kills(self) -> int | None:
        """How many processes of this cgroup (and below) the OOM killer has killed; None where it does not say."""
        if self.version == 2:
            return _keyed(self.path / "memory.events", "oom_kill")
        return _keyed(self.path / "memory.oom_control", "oom_kill")


def memory_cgroup(pid: int | str = "self", proc: Path = Path("/proc")) -> MemoryCgroup | None:
    """The memory cgroup of a process (v2 where the memory controller is on v2, else v1), or None where there is
    none to read (no cgroup filesystem, or the process is gone)."""
    try:
        membership = (proc / str(pid) / "cgroup").read_text().splitlines()
        mounts = (proc / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in membership:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    for mount_root, mount_point, fstype, options in cgroup_mounts(mounts):
        if fstype == "cgroup2" and v2 is not None:
            directory = cgroup_directory(mount_point, mount_root, v2)
            if directory is not None and (directory / "memory.max").exists():
                return MemoryCgroup(2, directory, Path(mount_point), v2)
    for mount_root, mount_point, fstype, options in cgroup_mounts(mounts):
        if fstype == "cgroup" and v1 is not None and "memory" in options.split(","):
            directory = cgroup_directory(mount_point, mount_root, v1)
            if directory is not None and (directory / "memory.limit_in_bytes").exists():
                return MemoryCgroup(1, directory, Path(mount_point), v1)
    return None


def cgroup_mounts(mountinfo: list[str]):
    """(root inside the hierarchy, mount point, filesystem type, super options) of each cgroup mount."""
    for line in mountinfo:
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        fstype, options = fields[dash + 1], fields[dash + 3] if len(fields) > dash + 3 else ""
        if fstype in ("cgroup", "cgroup2"):
            yield fields[3], _unescape(fields[4]), fstype, options


def cgroup_directory(mount_point: str, mount_root: str, cgroup_path: str) -> Path | None:
    """The directory of cgroup_path under a hierarchy mounted at mount_point whose root is mount_root."""
    rel = os.path.relpath(cgroup_path, mount_root) if mount_root != "/" else cgroup_path.lstrip("/")
    if rel.startswith(".."):
        return None  # the process's cgroup is not under this mount
    return Path(mount_point) / ("" if rel == "." else rel)


def _unescape(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _read_limit(level: Path, version: int) -> int | None:
    if version == 2:
        try:
            text = (level / "memory.max").read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None  # "max": no cap
    value = _read_int(level / "memory.limit_in_bytes")
    return value if value is not None and value < V1_UNLIMITED else None


def _keyed(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        return None
    return None


def _stat(level: Path, key: str) -> int | None:
    return _keyed(level / "memory.stat", key)
