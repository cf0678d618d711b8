"""Names that would collide under Objects/Appliance/Alarms: every alarm class adds Alarms/<label> and every alarm
source a folder Alarms/<source>, beside the built-in alarms (EngineFault, WorkerRestarting, ModelFailed, GpuWarning,
GpuCritical, AuditLogFailed, AuditLogTorn) and the Drift folder. Two siblings with one BrowseName would leave a
client browsing by name with one of them; `appliance check-config` refuses each such YAML file with its file, line
and key, and exits 2. Run as an engineer runs it: the CLI in a subprocess, on a file."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.config.checks import BUILTIN_ALARMS
from appliance.supervision import SupervisedFacts, Supervision

ROOT = Path(__file__).resolve().parents[1]
LABELS = ["normal"] + [f"f{i}" for i in range(1, 22)]  # the te-classifier answers 22 classes


def classifier(name: str, labels: list[str], extra: str = "") -> str:
    return (f"  {name}:\n    kind: tensor\n    path: builtin:te-classifier\n    labels: [{', '.join(labels)}]\n"
            + extra)


def check_config(tmp_path: Path, text: str) -> subprocess.CompletedProcess:
    file = tmp_path / "appliance.yaml"
    file.write_text(text)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "appliance", "check-config", str(file)], capture_output=True,
                          text=True, timeout=120, env=env)


def refused(tmp_path: Path, text: str) -> str:
    out = check_config(tmp_path, text)
    assert out.returncode == 2, out.stdout + out.stderr
    return out.stdout + out.stderr


def test_two_classifiers_sharing_an_alarm_label_are_refused_at_the_second(tmp_path):
    text = ("models:\n"
            + classifier("te", LABELS, "    alarm_classes: [f3]\n")  # lines 2-6
            + classifier("te2", LABELS, "    alarm_classes: [f4, f3]\n"))  # lines 7-11
    out = refused(tmp_path, text)
    assert (f"{tmp_path / 'appliance.yaml'}:11: models.te2.alarm_classes[1]: the alarm class 'f3' would be "
            "Alarms/f3, which is already an alarm class of model 'te': give the class another label") in out


@pytest.mark.parametrize("builtin", ["EngineFault", "WorkerRestarting", "ModelFailed", "GpuWarning", "GpuCritical",
                                     "Drift"])
def test_a_label_named_like_a_built_in_alarm_is_refused(tmp_path, builtin):
    labels = ["normal", builtin] + LABELS[2:]
    out = refused(tmp_path, "models:\n" + classifier("te", labels, "    alarm_classes: [1]\n"))
    assert (f"appliance.yaml:6: models.te.alarm_classes[0]: the alarm class '{builtin}' would be Alarms/{builtin}, "
            "which is already a built-in alarm of the appliance") in out


def test_a_label_named_like_a_built_in_alarm_is_fine_when_it_raises_no_alarm(tmp_path):
    labels = ["normal", "EngineFault"] + LABELS[2:]
    out = check_config(tmp_path, "models:\n" + classifier("te", labels, "    alarm_classes: [2]\n"))
    assert out.returncode == 0, out.stdout + out.stderr


def test_sources_named_drift_like_a_label_or_like_another_models_source_are_refused(tmp_path):
    text = ("models:\n"
            + classifier("te", LABELS, "    alarm_classes: [f3]\n    alarm_sources:\n"  # 2-7
                         "      Drift: box1\n"  # 8
                         "      f3: box2\n"  # 9
                         "      line1: box3\n")  # 10
            + classifier("te2", LABELS, "    alarm_classes: [f4]\n    alarm_sources:\n"  # 11-16
                         "      line1: box4\n"  # 17
                         "      f4: box5\n")  # 18
            + "mailboxes:\n  box1: {model: te}\n  box2: {model: te}\n  box3: {model: te}\n  box4: {model: te2}\n"
              "  box5: {model: te2}\n")
    out = refused(tmp_path, text)
    errors = [line for line in out.splitlines() if "would be the folder" in line]
    assert [e.split("appliance.yaml:", 1)[1] for e in errors] == [
        "8: models.te.alarm_sources.Drift: the source 'Drift' would be the folder Alarms/Drift, which is already a "
        "built-in alarm of the appliance: give the source another name",
        "9: models.te.alarm_sources.f3: the source 'f3' would be the folder Alarms/f3, which is already an alarm "
        "class of model 'te': give the source another name",
        "17: models.te2.alarm_sources.line1: the source 'line1' would be the folder Alarms/line1, which is already an "
        "alarm source of model 'te': give the source another name",
        "18: models.te2.alarm_sources.f4: the source 'f4' would be the folder Alarms/f4, which is already an alarm "
        "class of model 'te2': give the source another name"]


def test_distinct_names_pass(tmp_path):
    text = ("models:\n"
            + classifier("te", LABELS, "    alarm_classes: [f3]\n    alarm_sources: {line1: box1}\n")
            + classifier("te2", LABELS, "    alarm_classes: [f4]\n    alarm_sources: {line2: box2}\n")
            + "mailboxes:\n  box1: {model: te}\n  box2: {model: te2}\n")
    out = check_config(tmp_path, text)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_reserved_names_are_the_alarms_the_appliance_raises():
    # the check's list follows the Booleans supervision puts under Alarms (plus the Drift and SourceFault folders)
    none = lambda: None  # noqa: E731 - an appliance that has not started its parts
    facts = SupervisedFacts(metrics=none, watchdog=none, gpu_fault=none, audit_torn=lambda: False,
                            cert_expiry_s=lambda: 0.0, ua=none)
    assert set(Supervision({}, [], facts).alarms()) | {"Drift", "SourceFault"} == set(BUILTIN_ALARMS)
