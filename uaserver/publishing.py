"""The values a PLC and SCADA read, kept at most one second old: every 0.25 s the appliance's State and Heartbeat,
each model's status, the engine's queue and slots, the GPU health, the daemon's alarms and drift are written to the
address space (and the session and job gauges to /metrics); expired jobs and conversations are let go.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from asyncua import Server, ua

from .address_space import ApplianceNodes, write
from .alarms import Alarms
from .asyncua_internals import external_sessions
from .conversations import Conversations
from .governance import Governance
from .job_methods import JobMethods

log = logging.getLogger(__name__)
V = ua.VariantType
INTERVAL_S = 0.25
NO_GPU = {"WatchdogState": "NoGpu", "GpuTemperatureC": 0.0, "GpuMemoryUsedBytes": 0, "GpuEccErrors": 0}


@dataclass
class Sources:
    """What the daemon tells the server, each a callable read once a tick."""
    health: Callable[[], dict] = lambda: NO_GPU  # WatchdogState and the GPU's figures
    supervision_alive: Callable[[], bool] = lambda: True  # the supervision of the workers runs
    alarms: Callable[[], dict[str, bool]] = dict  # the daemon's alarms: name -> active


class Publisher:
    def __init__(self, services: dict, sources: Sources, alarms: Alarms, governance: Governance, jobs: JobMethods,
                 conversations: Conversations, metrics, describe: Callable[[object], dict] | None = None):
        self.services = services
        self.sources = sources
        self.alarms = alarms
        self.governance = governance
        self.jobs = jobs
        self.conversations = conversations
        self.metrics = metrics
        self.describe = describe  # a model's draft AI properties (ai_properties.py): name -> (value, VariantType)
        self._described: dict[tuple[str, str], object] = {}  # the values written (most change rarely)
        self.server: Server | None = None
        self.nodes: ApplianceNodes | None = None
        self.heartbeat = 0
        self.state = "Starting"
        self._jobs_published: set[tuple[str, str]] = set()  # appliance_jobs series that exist
        self._task: asyncio.Task | None = None

    def start(self, server: Server, nodes: ApplianceNodes) -> None:
        self.server, self.nodes = server, nodes
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="ua-publishing")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def appliance_state(self, statuses: list | None = None) -> str:
        statuses = statuses if statuses is not None else [m.status() for m in self.services.values()]
        states = [st.state for st in statuses]
        wd = self.sources.health().get("WatchdogState", "NoGpu")
        restarted = any(st.restarting or st.worker_restarts for st in statuses)
        if not restarted and any(s == "Loading" for s in states) and not any(s == "Ready" for s in states):
            return "Starting"
        if self.sources.alarms().get("EngineFault"):  # the watchdog stopped the engine; a Failed model degrades
            return "Fault"
        if wd in ("Warning", "Critical") or any(s != "Ready" for s in states):
            return "Degraded"
        return "Ready"

    async def _loop(self) -> None:
        last_beat = time.monotonic()
        while True:
            now = time.monotonic()
            if now - last_beat >= 1.0:
                last_beat = now
                if self.sources.supervision_alive():
                    self.heartbeat = (self.heartbeat + 1) % 2**32
            try:
                await self.publish()
                self.jobs.store.sweep()
                self.conversations.expire()
            except Exception:  # noqa: BLE001 - the values PLCs watch must go on: logged, tried again next tick
                log.exception("address-space update failed")
            await asyncio.sleep(INTERVAL_S)

    async def publish(self) -> None:
        s, n = self.server, self.nodes
        statuses = [model.status() for model in self.services.values()]
        self.state = self.appliance_state(statuses)
        await write(s, n.values["State"], self.state, V.String)
        await write(s, n.values["Heartbeat"], self.heartbeat, V.UInt32)
        queue = slots_total = slots_used = 0
        for st in statuses:
            m = n.models[st.name]
            await write(s, m.values["Version"], st.version, V.String)
            await write(s, m.values["Backend"], st.backend, V.String)
            await write(s, m.values["State"], st.state, V.String)
            await write(s, m.values["RequestCount"], int(st.request_count), V.UInt64)
            await write(s, m.values["ErrorCount"], int(st.error_count), V.UInt64)
            await write(s, m.values["LastLatencyMs"], float(st.last_latency_ms), V.Double)
            await write(s, m.values["Heartbeat"], int(st.heartbeat), V.UInt32)
            await write(s, m.values["WorkerRestarts"], int(st.worker_restarts) % 2**32, V.UInt32)
            for key, (value, vtype) in (self.describe(st) if self.describe else {}).items():
                if self._described.get((st.name, key)) != value:
                    await write(s, m.values[f"AI/{key}"], value, vtype)
                    self._described[(st.name, key)] = value
            if st.kind == "tensor":
                await write(s, m.values["InputShape"], [int(d) for d in st.input_shape], V.UInt32)
                await write(s, m.values["OutputShape"], [int(d) for d in st.output_shape], V.UInt32)
            else:
                slots_total += st.slots_total
                slots_used += st.slots_in_use
            queue += st.queue_depth
        for alarm, active in self.sources.alarms().items():
            if alarm in n.alarms:
                await self.alarms.set_alarm(alarm, bool(active))
        await self.governance.publish_drift(s, n, self._drift_alarm)
        await write(s, n.values["Engine/QueueDepth"], queue, V.UInt32)
        await write(s, n.values["Engine/SlotsTotal"], slots_total, V.UInt32)
        await write(s, n.values["Engine/SlotsInUse"], slots_used, V.UInt32)
        h = self.sources.health()
        await write(s, n.values["Health/WatchdogState"], h["WatchdogState"], V.String)
        await write(s, n.values["Health/GpuTemperatureC"], float(h["GpuTemperatureC"]), V.Double)
        await write(s, n.values["Health/GpuMemoryUsedBytes"], int(h["GpuMemoryUsedBytes"]), V.UInt64)
        await write(s, n.values["Health/GpuEccErrors"], int(h["GpuEccErrors"]), V.UInt64)
        if self.metrics is not None:
            self.metrics.ua_sessions.set(len(external_sessions(s)))
            counts = self.jobs.store.counts()
            for name in self.services:
                for state in ("running", "done", "failed"):
                    if counts.get((name, state)) or (name, state) in self._jobs_published:
                        self.metrics.jobs.labels(name, state).set(counts.get((name, state), 0))
                        self._jobs_published.add((name, state))

    async def _drift_alarm(self, name: str, active: bool, message: str) -> None:
        await self.alarms.set_alarm(name, active, message)
        if self.metrics is not None:
            self.metrics.alarm_active.labels(name).set(1 if active else 0)
