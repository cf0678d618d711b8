"""The systemd unit: `systemd-analyze verify` prints nothing and `systemd-analyze security --offline=true` scores it
2.0 or better, also with the GPU drop-in (systemd 252 from Debian; no systemd runs as PID 1 here)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SYSTEMD = Path(__file__).resolve().parents[1] / "systemd"
pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                reason="systemd-analyze is not installed (Debian package systemd)")


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


def test_verify_prints_nothing(tmp_path):
    out = subprocess.run(["systemd-analyze", "verify", str(unit_for_test(tmp_path))], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "" and out.stderr == "", out.stdout + out.stderr


def test_security_score(tmp_path):
    assert score(unit_for_test(tmp_path)) <= 2.0


def test_security_score_with_the_gpu_drop_in(tmp_path):
    assert score(unit_for_test(tmp_path, with_gpu=True)) <= 2.0


def test_unit_is_a_notify_service_with_a_watchdog():
    text = (SYSTEMD / "appliance.service").read_text()
    for line in ("Type=notify", "NotifyAccess=main", "Restart=on-failure", "User=appliance", "CapabilityBoundingSet=",
                 "ProtectSystem=strict", "StateDirectory=appliance", "ConfigurationDirectory=appliance"):
        assert f"\n{line}\n" in text, line
    assert re.search(r"\nWatchdogSec=\d+", text) and re.search(r"\nMemoryMax=", text)
