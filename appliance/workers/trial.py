"""Load one model once in a worker process of its own, with the serving code and the configuration's settings, and
say whether it loads: the check `appliance models deploy` and `rollback` make before a version is switched in. The
reason of a failure is exact, and a file that crashes its loader crashes this process, not a serving worker."""
from __future__ import annotations

import asyncio
import dataclasses
import time

from appliance.workers import protocol as p
from appliance.workers.supervisor import WorkerPolicy, WorkerSupervisor


class LoadFailed(Exception):
    """The model did not load; the message says why."""


def trial_policy(config) -> WorkerPolicy:
    """The configuration's worker settings, without restarts: one death is the answer."""
    eng = config.engine
    return WorkerPolicy(timeout_s=eng.worker_timeout_s, memory_mb=eng.worker_memory_mb, max_restarts=0,
                        threads=eng.threads, log_level="WARNING")


def trial_load(spec: p.ModelSpec, policy: WorkerPolicy, timeout_s: float = 600.0) -> str:
    """The version the model loads as; raises LoadFailed with the reason."""
    return asyncio.run(_trial(_for_trial(spec), policy, timeout_s))


def _for_trial(spec: p.ModelSpec) -> p.ModelSpec:
    """A generative model loads with one KV slot and touches no conversation of the serving appliance."""
    if spec.kind != "generative":
        return spec
    settings = {**spec.settings, "kv_slots": 1, "conversation_dir": None, "compile": "off"}
    return dataclasses.replace(spec, settings=settings)


async def _trial(spec: p.ModelSpec, policy: WorkerPolicy, timeout_s: float) -> str:
    sup = WorkerSupervisor(f"trial-{spec.name}", [spec], dataclasses.replace(policy, max_restarts=0))
    await sup.start()
    try:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            snap = sup.snapshots[spec.name]
            if sup.failed:
                raise LoadFailed(f"its worker process died while loading it ({sup.death_reason})")
            if sup.up and snap.state == "Ready":
                return snap.version
            if sup.up and snap.state == "Failed":
                raise LoadFailed(snap.failure_reason or "it failed to load")
            await asyncio.sleep(0.05)
        raise LoadFailed(f"it did not load within {timeout_s:g} s")
    finally:
        await sup.stop()
