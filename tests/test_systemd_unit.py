"""The systemd unit: `systemd-analyze verify` prints nothing and `systemd-analyze security --offline=true` scores it
2.0 or better, also with the GPU drop-in (systemd 252 from Debian); the /proc its sandbox mounts shows the service the
same CPU features and memory as a shell (a /proc mounted with the unit's own ProtectProc= / ProcSubset= values).
The installed unit under systemd as PID 1: scripts/acceptance.sh."""
from __future__ import annotations

import ast
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SYSTEMD = Path(__file__).resolve().parents[1] / "systemd"
CPU_VIEW = Path(__file__).with_name("cpu_view.py")
needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze is not installed (Debian package systemd)")
needs_namespaces = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                      reason="mounting a /proc of its own needs root and unshare (util-linux)")


def unit_for_test(tmp_path: Path, with_gpu: bool = False) -> Path:
    """The unit as installed, with ExecStart pointing at an executable that exists here (verify checks it)."""
    text = (SYSTEMD / "appliance.service").read_text()
    text = text.replace("/opt/appliance/venv/bin/appliance", shutil.which("true") or "/bin/true")
    if with_gpu:  # a drop-in's lines apply after the unit's: append them to its [Service] section
        gpu = (SYSTEMD / "appliance.service.d" / "gpu.conf").read_text().replace("[Service]\n", "")
        text = text.replace("\n[Install]", "\n" + gpu + "\n[Install]")
    path = tmp_path / "appliance.service"
    path.write_text(text)
    return path


def score(unit: Path) -> float:
    out = subprocess.run(["systemd-analyze", "security", "--offline=true", str(unit)], capture_output=True,
                         text=True, timeout=120)
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", out.stdout)
    assert match, out.stdout + out.stderr
    return float(match.group(1))


def unit_setting(name: str) -> str:
    """The value the unit gives a [Service] setting (the last assignment wins, as in systemd); '' when unset."""
    values = re.findall(rf"^{name}=(.*)$", (SYSTEMD / "appliance.service").read_text(), re.MULTILINE)
    return values[-1].strip() if values else ""


def proc_mount_options(protect_proc: str, proc_subset: str) -> str:
    """The mount options systemd gives the service's /proc for ProtectProc= and ProcSubset= (systemd.exec(5))."""
    options = []
    if protect_proc not in ("", "default"):
        options.append(f"hidepid={protect_proc}")  # noaccess | invisible | ptraceable
    if proc_subset == "pid":
        options.append("subset=pid")
    return ",".join(options) or "defaults"


def cpu_view(tmp_path: Path, proc_options: str | None = None) -> dict:
    """tests/cpu_view.py in a plain shell, or in new mount and PID namespaces whose /proc has proc_options."""
    command = [sys.executable, str(CPU_VIEW), str(tmp_path / "cache")]
    if proc_options is not None:
        script = f"mount -t proc -o {proc_options} proc /proc && exec \"$@\""
        command = ["unshare", "-m", "-p", "-f", "--mount-proc", "sh", "-c", script, "sh", *command]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=CPU_VIEW.parents[1])
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_namespaces
def test_the_service_sees_the_cpu_and_memory_a_shell_sees(tmp_path):
    options = proc_mount_options(unit_setting("ProtectProc"), unit_setting("ProcSubset"))
    shell, service = cpu_view(tmp_path), cpu_view(tmp_path, options)
    assert service["cpuinfo_readable"], options
    for key in ("capability", "avx2", "weights", "cpu_kernels"):
        assert service[key] == shell[key], (key, options, service, shell)
    assert set(service["meminfo"]) == {"MemTotal", "MemAvailable"}
    assert service["meminfo"]["MemTotal"] == shell["meminfo"]["MemTotal"]


@needs_namespaces
def test_the_check_sees_what_procsubset_pid_hides(tmp_path):
    """The check above can fail: ProcSubset=pid (as the unit had it) hides cpuinfo and meminfo, and torch then
    reports DEFAULT. The weight paths do not follow torch's view: our kernels read the CPU's features with cpuid,
    so a hidden /proc leaves the loader the same paths (no silent fall back to float32 where the CPU has AVX2)."""
    shell, hidden = cpu_view(tmp_path), cpu_view(tmp_path, proc_mount_options("invisible", "pid"))
    assert not hidden["cpuinfo_readable"] and hidden["meminfo"] == {}
    assert hidden["capability"] == "DEFAULT"
    assert isinstance(shell["weights"], list) and "float32" in shell["weights"]
    assert hidden["weights"] == shell["weights"] and hidden["avx2"] == shell["avx2"], (hidden, shell)
    if shell["avx2"]:
        assert "blocks/int8/avx2" in hidden["weights"] and hidden["cpu_kernels"], hidden


def test_cpu_view_imports_only_what_exists():
    """tests/cpu_view.py once caught an ImportError of functions that no longer existed and reported another
    view instead: every name it imports must exist, and it catches no ImportError."""
    tree = ast.parse(CPU_VIEW.read_text())
    imported = [(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names if node.module != "__future__"]
    assert ("appliance.engine.llm.weight_plan", "cpu_paths") in imported
    for module, name in imported:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"
    caught = [ast.unparse(h.type) for h in ast.walk(tree) if isinstance(h, ast.ExceptHandler) and h.type is not None]
    assert not any("ImportError" in c for c in caught), caught


@needs_analyze
def test_verify_prints_nothing(tmp_path):
    out = subprocess.run(["systemd-analyze", "verify", str(unit_for_test(tmp_path))], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "" and out.stderr == "", out.stdout + out.stderr


@needs_analyze
def test_security_score(tmp_path):
    assert score(unit_for_test(tmp_path)) <= 2.0


@needs_analyze
def test_security_score_with_the_gpu_drop_in(tmp_path):
    assert score(unit_for_test(tmp_path, with_gpu=True)) <= 2.0


def test_unit_is_a_notify_service_with_a_watchdog():
    text = (SYSTEMD / "appliance.service").read_text()
    for line in ("Type=notify", "NotifyAccess=main", "Restart=on-failure", "User=appliance", "CapabilityBoundingSet=",
                 "ProtectSystem=strict", "StateDirectory=appliance", "ConfigurationDirectory=appliance"):
        assert f"\n{line}\n" in text, line
    assert re.search(r"\nWatchdogSec=\d+", text) and re.search(r"\nMemoryMax=", text)


def test_directory_modes_agree_with_tmpfiles():
    """postinst applies the tmpfiles entries before the first start; the unit's directory settings must give the
    same modes, or the first start silently changes them (StateDirectoryMode=, ConfigurationDirectoryMode=)."""
    entries = {}
    for line in (SYSTEMD / "appliance.tmpfiles").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            kind, path, mode, user, group = line.split()[:5]
            entries[path] = (kind, mode, user, group)
    default = "0755"  # systemd.exec(5): every *DirectoryMode= defaults to 0755
    assert entries["/var/lib/appliance"] == ("d", unit_setting("StateDirectoryMode") or default, "appliance",
                                             "appliance")
    assert unit_setting("StateDirectory") == "appliance" and unit_setting("ConfigurationDirectory") == "appliance"
    assert entries["/etc/appliance"][:2] == ("d", unit_setting("ConfigurationDirectoryMode") or default)
    assert entries["/etc/appliance"][3] == "appliance"  # the service reads its YAML through the group
