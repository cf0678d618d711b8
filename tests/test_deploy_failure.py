"""A deploy that fails: `appliance models deploy` (a real CLI process) of a corrupt file, and of a file that loads but
that the running appliance refuses (other sample shapes), while a PLC calls Infer all the while. No call fails, the
command exits non-zero with the reason, `current` never names the rejected version and its copy is gone; the old
version serves after its worker is killed with kill -9, and after the appliance restarts. A deploy while the
appliance is down is checked the same way. `appliance models list` names the demo's built-in models."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

from harness import RunningAppliance
from onnx_models import affine_model
from uaclient import call, floats, run, session, status_name
from worker_probes import wait_for

from appliance.model_store import ModelStore

ROOT = Path(__file__).resolve().parents[1]


def cli(config: Path | None, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    extra = ["--config", str(config)] if config else []
    return subprocess.run([sys.executable, "-m", "appliance", *args, *extra], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd)


def infer_once(app, plc) -> tuple[str, list, str]:
    async def go():
        async with session(app, *plc) as c:
            r = await call(c, "affine", "Infer", [floats([1, 1, 1, 1])])
            return status_name(r), r.OutputArguments[0].Value, r.OutputArguments[1].Value
    return run(go())


def deploy_under_load(app, plc, *args: str) -> tuple[subprocess.CompletedProcess, list]:
    """Run `appliance models ...` while a PLC calls Infer back to back; answers (status, output, version)."""
    answers = []

    async def go():
        stop = asyncio.Event()

        async def plc_loop():
            async with session(app, *plc) as c:
                while not stop.is_set():
                    r = await call(c, "affine", "Infer", [floats([1, 1, 1, 1])])
                    good = status_name(r) == "Good"
                    answers.append((status_name(r), r.OutputArguments[0].Value[0] if good else None,
                                    r.OutputArguments[1].Value if good else ""))
        caller = asyncio.create_task(plc_loop())
        await asyncio.sleep(0.3)
        p = await asyncio.to_thread(cli, app.config_path, "models", *args)
        await asyncio.sleep(0.3)
        stop.set()
        await caller
        return p
    return run(go(), timeout=300), answers


def test_a_deploy_that_fails_leaves_the_old_version_serving_now_and_after_any_restart(tmp_path):
    v1, corrupt, wider = tmp_path / "v1", tmp_path / "corrupt", tmp_path / "wider"
    for d in (v1, corrupt, wider):
        d.mkdir()
    affine_model(v1 / "affine.onnx", scale=2.0)  # 1 -> 3.0
    (corrupt / "affine.onnx").write_bytes(b"\x0a\xff\xff\xff" + os.urandom(64))  # a length past the end: corrupt
    affine_model(wider / "affine.onnx", width=5)  # loads, but its samples have another shape
    models = {"affine": {"kind": "tensor", "path": str(affine_model(tmp_path / "configured.onnx", scale=5.0))}}
    app = RunningAppliance(tmp_path / "state", models)
    store = ModelStore(app.state_dir)
    try:
        plc = app.issue("plc", "operator")
        p = cli(app.config_path, "models", "deploy", "affine", str(v1), "--version", "v1")
        assert p.returncode == 0 and "reloaded: the appliance now serves version v1" in p.stdout, p.stdout + p.stderr
        assert infer_once(app, plc) == ("Good", [3.0] * 4, "v1")

        for source, label, reason in ((corrupt, "bad", "does not load: the ONNX model could not be loaded"),
                                      (wider, "wide", "the running appliance could not load it: ReloadModel "
                                       "answered BadInternalError: reload failed: the new weights change the sample "
                                       "shapes ([4] -> [5]")):
            p, answers = deploy_under_load(app, plc, "deploy", "affine", str(source), "--version", label)
            assert p.returncode == 2, p.stdout + p.stderr
            assert f"version {label} was not switched in" in p.stderr and reason in p.stderr, p.stderr
            assert "version v1 serves on" in p.stderr and "Traceback" not in p.stderr.split("appliance:")[-1]
            assert len(answers) > 5 and set(answers) == {("Good", 3.0, "v1")}, set(answers)
            assert store.serving_version("affine") == "v1" and store.candidate_version("affine") is None
            assert [v.version for v in store.versions("affine")] == ["v1"]  # the rejected copy is gone
        listed = cli(app.config_path, "models", "list")
        assert listed.returncode == 0 and listed.stdout.splitlines()[:2] == [
            "affine: 1 version(s)", listed.stdout.splitlines()[1]] and "* serving" in listed.stdout.splitlines()[1]

        pid = app.app.services["affine"].supervisor.process.pid
        os.kill(pid, signal.SIGKILL)  # the replacement loads what served: v1
        wait_for(lambda: app.app.services["affine"].supervisor.process.pid != pid
                 and app.app.services["affine"].status().state == "Ready", 30, "the replacement Ready")
        assert infer_once(app, plc) == ("Good", [3.0] * 4, "v1")
    finally:
        app.stop()

    # the appliance down: a corrupt deploy is refused the same way, and a start (a reboot) loads v1
    p = cli(app.config_path, "models", "deploy", "affine", str(corrupt), "--version", "bad")
    assert p.returncode == 2 and "does not load" in p.stderr and store.serving_version("affine") == "v1", p.stderr
    app = RunningAppliance(tmp_path / "state", models)
    try:
        assert infer_once(app, plc) == ("Good", [3.0] * 4, "v1")
        assert app.app.services["affine"].status().state == "Ready"
    finally:
        app.stop()


def test_models_list_names_the_demo_models_as_built_in(tmp_path):
    p = cli(None, "models", "list", cwd=tmp_path)  # no --config, nothing in /etc: the built-in demo
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "te-classifier: built-in (builtin:te-classifier), no version deployed" in lines, lines
    assert any(line.startswith("assistant: built-in (builtin:") for line in lines), lines
    assert not (tmp_path / ".appliance" / "models").exists()  # listing changes nothing
