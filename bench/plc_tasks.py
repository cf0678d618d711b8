"""Issue 46's done-when, runnable: PLC-profile clients call the demo model's configured task and every answer must
validate. The appliance runs the built-in demo's `assistant` (builtin:smollm2) with the demo's task `alarm-triage`
(the demo YAML's own definition); each client is an S7-1500 profile (tests/plc_client.py: user name over
Basic256Sha256 SignAndEncrypt, 8 KiB buffers, a new session for every call) and calls
Appliance/Models/assistant/Tasks/alarm-triage/Run, alternating the instance's and the type's method NodeId.

An answer is valid when the call is Good, the output arguments are the declared ones with their declared types, every
value is within the schema (Severity one of the enum, StopLine a Boolean, Reason at most its max_length) and
FinishReason is stop. Any other outcome (a Bad status included) counts as invalid. Prints each 100 calls as they
finish, then calls, invalid, wall time and calls/s.

    .venv/bin/python bench/plc_tasks.py [--calls 1000] [--plcs 1] [--worker-timeout-s 5]
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from asyncua import ua  # noqa: E402

ALARMS = ["Pressure high in line four", "Pump P-101 motor overtemperature", "Tank T-3 level low",
          "Conveyor belt misalignment detected", "Cooling water flow low on reactor two", "Door of cell 5 open",
          "Valve V-12 did not reach its end position", "Vibration of fan F-2 above limit", "Air pressure low",
          "Emergency stop pressed at station 3", "Filter differential pressure high", "Oil temperature rising"]
MODEL, TASK, USER, PASSWORD = "assistant", "alarm-triage", "plc-bench", "plc-bench-password-1"
OBJECT = f"Appliance/Models/{MODEL}/Tasks/{TASK}"
TYPES = {"String": ua.VariantType.String, "enum": ua.VariantType.String, "Boolean": ua.VariantType.Boolean,
         "Int32": ua.VariantType.Int32, "Double": ua.VariantType.Double}


def invalid_reason(task, r) -> str:
    """"" for a valid answer, else what is wrong with it."""
    if r.StatusCode.name != "Good":
        return r.StatusCode.name
    fields = list(task.output.items())
    if len(r.OutputArguments) != len(fields) + 2:
        return f"{len(r.OutputArguments)} output arguments"
    for (name, f), v in zip(fields, r.OutputArguments):
        if v.VariantType != TYPES[f.type]:
            return f"{name}: type {v.VariantType.name}"
        value = v.Value
        if f.type == "enum" and value not in f.values:
            return f"{name}: {value!r} is not one of {f.values}"
        if f.type == "String" and len(value) > f.effective_max_length:
            return f"{name}: {len(value)} characters"
        if f.type in ("Int32", "Double") and ((f.minimum is not None and value < f.minimum)
                                             or (f.maximum is not None and value > f.maximum)):
            return f"{name}: {value} out of bounds"
    finish, version = r.OutputArguments[-2:]
    if finish.Value != "stop" or not version.Value:
        return f"FinishReason {finish.Value!r}"
    return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--plcs", type=int, default=1, help="PLCs calling at once (each a session per call)")
    ap.add_argument("--worker-timeout-s", type=float, default=5.0,
                    help="engine.worker_timeout_s (the default 5: a stalled engine step has its worker replaced)")
    args = ap.parse_args()
    import logging
    logging.getLogger("asyncua").setLevel(logging.ERROR)  # a line per session (certificate, timeout) otherwise

    from core.config import demo_config
    from appliance.users import UserStore
    from harness import RunningAppliance
    from plc_client import s7_call

    demo = demo_config()
    task = demo.models[MODEL].tasks[TASK]
    model_yaml = {"kind": "generative", "path": "builtin:smollm2",
                  "tasks": {TASK: {"prompt": task.prompt,
                                   "inputs": {n: {"type": c.type, "max_length": c.max_length}
                                              for n, c in task.inputs.items()},
                                   "output": {n: {k: v for k, v in (("type", f.type), ("values", f.values or None),
                                                                    ("max_length", f.max_length),
                                                                    ("required", f.required)) if v is not None}
                                              for n, f in task.output.items()},
                                   "max_tokens": task.max_tokens, "temperature": task.temperature}}}
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state"
        state.mkdir()
        UserStore(state).add(USER, "operator", PASSWORD)
        t0 = time.perf_counter()
        app = RunningAppliance(state, {MODEL: model_yaml},
                               {"engine": {"kv_slots": max(4, args.plcs), "compile": "off",
                                           "worker_timeout_s": args.worker_timeout_s}})
        print(f"appliance Ready in {time.perf_counter() - t0:.1f} s (demo task {TASK} on builtin:smollm2)",
              flush=True)
        cert, key = app.issue("plc-bench", "operator")
        try:
            invalid: list[str] = []
            latencies: list[float] = []
            done = 0
            next_call = 0
            started = time.perf_counter()

            async def plc() -> None:
                nonlocal done, next_call
                while next_call < args.calls:
                    i = next_call
                    next_call += 1
                    method = f"Types/{MODEL}.{TASK}.TaskType/Run" if i % 2 else f"{OBJECT}/Run"
                    text = f"{ALARMS[i % len(ALARMS)]} (event {i})"
                    t = time.perf_counter()
                    try:
                        r = await s7_call(app.endpoint, cert, key, USER, PASSWORD, OBJECT, method,
                                          [ua.Variant(text, ua.VariantType.String)])
                        why = invalid_reason(task, r)
                    except Exception as e:  # noqa: BLE001 - a failed call is an invalid answer, counted
                        why = f"{type(e).__name__}: {e}"
                    latencies.append(time.perf_counter() - t)
                    if why:
                        invalid.append(f"call {i}: {why}")
                        print(f"invalid: call {i}: {why} ({time.perf_counter() - t:.1f} s)", flush=True)
                    done += 1
                    if done % 100 == 0:
                        print(f"{done} calls, {len(invalid)} invalid, {time.perf_counter() - started:.1f} s",
                              flush=True)

            async def run_all() -> None:
                await asyncio.gather(*(plc() for _ in range(args.plcs)))
            asyncio.run(run_all())
            wall = time.perf_counter() - started
            latencies.sort()
            print(f"calls {args.calls}  invalid {len(invalid)}  PLCs {args.plcs}  wall {wall:.1f} s  "
                  f"{args.calls / wall:.2f} calls/s  latency p50 {latencies[len(latencies) // 2] * 1000:.0f} ms  "
                  f"p99 {latencies[int(len(latencies) * 0.99) - 1] * 1000:.0f} ms", flush=True)
            for line in invalid[:20]:
                print("  " + line)
            restarts = app.app.services[MODEL].status().worker_restarts
            print(f"worker restarts during the run: {restarts} (engine.worker_timeout_s {args.worker_timeout_s:g})")
        finally:
            app.stop()
    sys.exit(1 if invalid else 0)


if __name__ == "__main__":
    main()
