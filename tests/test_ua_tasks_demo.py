"""The done-when on the demo model, small: a PLC-profile client (user name, Basic256Sha256 SignAndEncrypt, 8 KiB
buffers, a session per call) calls the built-in demo's task alarm-triage on builtin:smollm2 twenty times and every
answer validates. bench/plc_tasks.py runs the same check with 1,000 calls."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from core.config import demo_config
from appliance.users import UserStore
from harness import RunningAppliance
from uaclient import run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from plc_tasks import ALARMS, MODEL, OBJECT, PASSWORD, TASK, USER, invalid_reason  # noqa: E402

from asyncua import ua  # noqa: E402
from plc_client import s7_call  # noqa: E402


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    state = tmp_path_factory.mktemp("ua_tasks_demo") / "state"
    state.mkdir()
    UserStore(state).add(USER, "operator", PASSWORD)
    demo = demo_config()
    # the demo's own YAML text of the model, tasks included, read back from the demo file
    import yaml
    from core.config import demo_yaml_text
    model = yaml.safe_load(demo_yaml_text())["models"][MODEL]
    assert model["tasks"][TASK]["output"]  # the demo's definition, not one written here
    # the default engine.worker_timeout_s (5 s): an answer under a grammar must not stall the engine's liveness
    a = RunningAppliance(state, {MODEL: model}, {"engine": {"kv_slots": 2}})
    a.task = demo.models[MODEL].tasks[TASK]
    a.cert = a.issue("plc-demo", "operator")
    yield a
    a.stop()


def test_twenty_plc_calls_of_the_demo_task_all_validate(app):
    async def go():
        problems = []
        for i in range(20):
            method = f"Types/{MODEL}.{TASK}.TaskType/Run" if i % 2 else f"{OBJECT}/Run"
            r = await s7_call(app.endpoint, *app.cert, USER, PASSWORD, OBJECT, method,
                              [ua.Variant(f"{ALARMS[i % len(ALARMS)]} (event {i})", ua.VariantType.String)])
            why = invalid_reason(app.task, r)
            if why:
                problems.append(f"call {i}: {why}")
        return problems
    assert run(go(), timeout=900) == []
