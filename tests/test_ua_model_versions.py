"""Versions on disk with a running appliance: `appliance models deploy` and `rollback` switch what serves, reload
it over OPC UA, and no call of a PLC calling all the while fails."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from harness import RunningAppliance
from onnx_models import affine_model
from uaclient import call, floats, run, session, status_name


def cli(app, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return subprocess.run([sys.executable, "-m", "appliance", *args, "--config", str(app.config_path)],
                          capture_output=True, text=True, timeout=300, env=env)


def test_deploy_and_rollback_under_load(tmp_path):
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    v1.mkdir()
    v2.mkdir()
    affine_model(v1 / "affine.onnx", scale=2.0)
    affine_model(v2 / "affine.onnx", scale=3.0)
    app = RunningAppliance(tmp_path / "state", {"affine": {"kind": "tensor",
                                                           "path": str(affine_model(tmp_path / "a.onnx"))}})
    try:
        plc = app.issue("plc", "operator")
        answers: list[tuple[str, float, str]] = []

        async def plc_loop(stop: asyncio.Event):
            async with session(app, *plc) as c:
                while not stop.is_set():
                    r = await call(c, "affine", "Infer", [floats([1, 1, 1, 1])])
                    out = r.OutputArguments[0].Value[0] if status_name(r) == "Good" else None
                    answers.append((status_name(r), out, r.OutputArguments[1].Value if out else ""))

        async def go():
            stop = asyncio.Event()
            loop_task = asyncio.create_task(plc_loop(stop))
            await asyncio.sleep(0.5)
            p = await asyncio.to_thread(cli, app, "models", "deploy", "affine", str(v1), "--version", "v1")
            assert "reloaded: the appliance now serves version v1" in p.stdout, (p.stdout, p.stderr)
            p = await asyncio.to_thread(cli, app, "models", "deploy", "affine", str(v2), "--version", "v2")
            assert p.returncode == 0, p.stderr
            assert "reloaded: the appliance now serves version v2" in p.stdout, p.stdout
            await asyncio.sleep(0.5)
            n_before_rollback = len(answers)
            started = time.monotonic()
            p = await asyncio.to_thread(cli, app, "models", "rollback", "affine")
            rollback_s = time.monotonic() - started
            assert p.returncode == 0, p.stderr
            assert "reloaded: the appliance now serves version v1" in p.stdout, p.stdout
            await asyncio.sleep(0.5)
            stop.set()
            await loop_task
            return n_before_rollback, rollback_s

        n, rollback_s = run(go())
        print(f"rollback (CLI process, switch + reload) took {rollback_s:.2f} s")
        statuses = {s for s, _, _ in answers}
        assert statuses == {"Good"}, statuses
        outputs = [out for _, out, _ in answers]
        assert 3.0 in outputs and 4.0 in outputs  # 1 * 2 + 1 first, 1 * 3 + 1 after the deploy
        assert outputs[-1] == 3.0 and answers[-1][2] == "v1"  # after the rollback: v1 again
        assert any(v == "v2" for _, out, v in answers if out == 4.0)
        first_v2 = outputs.index(4.0)
        assert all(o == 4.0 for o in outputs[first_v2:n])  # once switched, every answer came from v2
    finally:
        app.stop()
