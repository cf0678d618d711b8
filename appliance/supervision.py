"""What the appliance says about itself: the 1 Hz supervision tick (each model's Heartbeat, the worker and alarm
gauges, the heartbeat timestamp a stall rule watches), whether supervision runs, the alarms, readiness for
/readyz, the status page's snapshot and the one-line status systemd shows.

It reads the models, their workers' supervisors and the few facts of SupervisedFacts, and changes none of them.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from core.alarm_names import DAEMON_ALARMS
from core.model_port import GenerativeModel, TensorModel


class UaView(Protocol):
    """What supervision reads of the OPC UA server (uaserver.server.ApplianceUaServer)."""
    running: bool
    state: str
    device: str
    heartbeat: int

    def audit_failing(self) -> bool: ...


@dataclass(frozen=True)
class SupervisedFacts:
    """The appliance's parts that exist only once it started, each read when needed (None until then)."""
    metrics: Callable[[], Any]  # appliance.metrics.Metrics | None
    watchdog: Callable[[], Any]  # appliance.watchdog.Watchdog | None
    gpu_fault: Callable[[], str | None]  # why the GPU watchdog stopped the GPU workers (Fault), if it did
    audit_torn: Callable[[], bool]  # a torn last audit line was found at start
    cert_expiry_s: Callable[[], float]  # seconds until the server certificate expires
    ua: Callable[[], UaView | None]
    sources: Callable[[], dict] = dict  # source name -> its latest sources.protocol.SourceStatus

TICK_S = 1.0
STALLED_AFTER_S = 2.5  # no tick for this long: supervision stopped (Heartbeat stops, WATCHDOG=1 too)
NO_GPU = {"WatchdogState": "NoGpu", "GpuTemperatureC": 0.0, "GpuMemoryUsedBytes": 0, "GpuEccErrors": 0}


class Supervision:
    def __init__(self, services: dict[str, TensorModel | GenerativeModel], supervisors: list, facts: SupervisedFacts):
        self.services = services  # the appliance's own dict and list, filled as it starts
        self.supervisors = supervisors
        self.facts = facts
        self._last_tick = time.monotonic()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._last_tick = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="supervision")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            self._last_tick = time.monotonic()
            for model in self.services.values():
                model.tick_heartbeat()
            if self.facts.metrics() is not None:
                self._publish_metrics()
            await asyncio.sleep(TICK_S)

    def alive(self) -> bool:
        """The appliance's own 1 Hz loop and every worker's supervision run (Appliance/Heartbeat follows this)."""
        task = self._task
        if task is None or task.done() or time.monotonic() - self._last_tick > STALLED_AFTER_S:
            return False
        return all(s.supervising for s in self.supervisors)

    def _publish_metrics(self) -> None:
        m = self.facts.metrics()
        m.heartbeat_timestamp.set_to_current_time()  # this tick (a stall rule watches it)
        slots_total = slots_used = parked = 0
        for name, model in self.services.items():
            st = model.status()
            m.queue_depth.labels(name).set(st.queue_depth)
            m.model_ready.labels(name).set(1 if st.state == "Ready" else 0)
            m.worker_up.labels(name).set(1 if st.worker_up else 0)
            if st.version:
                m.set_model_info(name, st.version, st.backend)
            slots_total += st.slots_total
            slots_used += st.slots_in_use
            parked += st.conversations_parked
        m.conversations_parked.set(parked)
        m.kv_slots_total.set(slots_total)
        m.kv_slots_used.set(slots_used)
        for alarm, active in self.alarms().items():
            m.alarm_active.labels(alarm).set(1 if active else 0)

    def alarms(self) -> dict[str, bool]:
        facts = self.facts
        statuses = [m.status() for m in self.services.values()]
        watchdog, ua = facts.watchdog(), facts.ua()
        wd = watchdog.state if watchdog is not None else "NoGpu"
        active = {"EngineFault": facts.gpu_fault() is not None,
                  "WorkerRestarting": any(st.restarting for st in statuses),
                  "ModelFailed": any(st.state == "Failed" for st in statuses), "GpuWarning": wd == "Warning",
                  "GpuCritical": wd == "Critical", "AuditLogFailed": bool(ua is not None and ua.audit_failing()),
                  "AuditLogTorn": bool(facts.audit_torn())}
        return {name: active[name] for name in DAEMON_ALARMS}  # every one named, in the published order

    def health(self) -> dict:
        wd = self.facts.watchdog()
        if wd is None:
            return NO_GPU
        return {"WatchdogState": wd.state, "GpuTemperatureC": wd.temperature_c,
                "GpuMemoryUsedBytes": wd.memory_used_bytes, "GpuEccErrors": wd.ecc_errors}

    def readiness(self) -> tuple[bool, list[str]]:
        reasons: list[str] = []
        for name, model in self.services.items():
            st = model.status()
            if st.state != "Ready":
                reasons.append(f"model {name} is {st.state}" + (f": {st.failure_reason}" if st.failure_reason
                                                                 else " (its worker is restarting)"
                                                                 if st.restarting else ""))
            elif not model.supervisor.answering():
                reasons.append(f"model {name}: its worker does not answer liveness checks")
        ua, watchdog = self.facts.ua(), self.facts.watchdog()
        if ua is None or not ua.running:
            reasons.append("OPC UA server is not running")
        if watchdog is not None and watchdog.state == "Critical":
            reasons.append("watchdog is Critical")
        if not self.alive():
            reasons.append("worker supervision has stopped")
        return (not reasons), reasons

    def status_snapshot(self) -> dict:
        """What the status page shows (no secrets: no paths, thumbprints or user names)."""
        statuses = [m.status() for m in self.services.values()]
        buckets: dict[str, dict[float, float]] = {}
        for family in self.facts.metrics().request_duration.collect():
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    per = buckets.setdefault(sample.labels["model"], {})
                    per[le] = per.get(le, 0.0) + sample.value
        ua = self.facts.ua()
        return {
            "state": ua.state if ua is not None else "Starting",
            "device": ua.device if ua is not None else "",
            "heartbeat": ua.heartbeat if ua is not None else 0,
            "models": [{"name": st.name, "kind": st.kind, "state": st.state, "version": st.version,
                        "backend": st.backend, "requests": st.request_count, "errors": st.error_count,
                        "last_latency_ms": st.last_latency_ms, "worker_up": st.worker_up,
                        "restarting": st.restarting, "worker_restarts": st.worker_restarts,
                        "heartbeat": st.heartbeat, "failure_reason": st.failure_reason} for st in statuses],
            "engine": {"queue_depth": sum(st.queue_depth for st in statuses),
                       "slots_total": sum(st.slots_total for st in statuses),
                       "slots_in_use": sum(st.slots_in_use for st in statuses)},
            "alarms": self.alarms(),
            "certificate_expiry_s": self.facts.cert_expiry_s(),
            "calls": {st.name: float(st.request_count) for st in statuses},
            "latency_buckets": {m: sorted(b.items()) for m, b in buckets.items()},
            "sources": [{"name": name, "state": st.state, "error": st.error, "samples": st.samples,
                         "windows": st.windows, "skipped": sum(st.skipped.values()), "reconnects": st.reconnects}
                        for name, st in self.facts.sources().items()],
        }

    def sources_down(self) -> dict:
        """/readyz's extra field: the sources that are not Connected (a source is the line's, not the appliance's:
        it never makes the appliance not ready, but the JSON names it)."""
        down = {name: f"{st.state}" + (f": {st.error}" if st.error else "")
                for name, st in self.facts.sources().items() if st.state not in ("Connected", "Disabled")}
        return {"sources_down": down} if down else {}

    def status_line(self) -> str:
        """One line for `systemctl status`: the appliance's state and each model's."""
        ua = self.facts.ua()
        state = ua.state if ua is not None else "Starting"
        models = ", ".join(f"{n} {m.status().state}" + (" (worker restarting)" if m.status().restarting else "")
                           for n, m in self.services.items())
        return f"{state}: {models}"
