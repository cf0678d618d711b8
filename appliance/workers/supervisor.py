"""The serve side of one worker process: spawn it, check it, replace it. (The calls made of it: appliance/workers/
requests.py; how a child process starts: appliance/process_start.py.)

Liveness. Every `ping_interval` the supervisor sends a Ping; each Pong says since when the worker's oldest engine
operation has run (engine/liveness.py). The engine's last progress is that moment, or the Pong's arrival when nothing
runs; a worker that answers nothing (stopped, or its loop blocked) has made none since its last Pong. The worker
answers liveness checks while its engine progressed within `timeout_s` and its loop answered within a second: each
model's Heartbeat and /readyz follow that. Once the last progress is `timeout_s` old the worker is killed (SIGKILL)
and replaced, so a hang is caught one timeout after it began. A worker past `memory_mb` is killed too, and one that
exits by itself is replaced as well.

Restarts. From a worker's death (or its kill) until its replacement has loaded a model (Ready, or Failed), that model
is restarting: State Loading, WorkerRestarting active, appliance_worker_up 0, no Heartbeat, calls refused. Every call
in flight on a worker that died is answered EngineFailure at once (the socket's EOF is seen within milliseconds of a
kill -9). Restarts back off (`backoff_s` doubling up to `backoff_max_s`); more than `max_restarts` within
`restart_window_s` leaves the models Failed until an engineer reloads one.

A planned stop (`begin_stop`, at SIGTERM) is no death: a worker that ends from then on is not restarted, and nothing
is raised or logged as an error.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable

from appliance.cgroup_memory import MemoryCgroup, memory_cgroup
from core.errors import ApplianceError, EngineFailure, NotReady
from appliance.process_start import reap, start_child
from appliance.workers import protocol as p
from appliance.workers.cpu_share import CpuShares
from appliance.workers.requests import WorkerRequests
from appliance.workers.worker import MEMORY_EXIT

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerPolicy:
    timeout_s: float = 5.0
    memory_mb: int = 0
    max_restarts: int = 5
    restart_window_s: float = 300.0
    backoff_s: float = 0.25
    backoff_max_s: float = 30.0
    threads: int = 0
    log_level: str = "INFO"
    log_format: str = "text"  # text | json, as the YAML's logging.format

    @property
    def ping_interval_s(self) -> float:
        return min(0.25, self.timeout_s / 4)

    @property
    def answer_window_s(self) -> float:
        """A worker whose loop has not answered a Ping for this long does not answer liveness checks."""
        return 2 * self.ping_interval_s + 0.5


class WorkerSupervisor:
    """One worker process (a group of models) and its life."""

    def __init__(self, group: str, specs: list[p.ModelSpec], policy: WorkerPolicy,
                 on_event: Callable[[str, str, str], None] | None = None, metrics=None,
                 cpu_shares: CpuShares | None = None):
        self.group = group
        self.specs = specs
        self.policy = policy
        self.cpu_shares = cpu_shares  # its CPU share: nice level, cgroup leaf, threads (None: as policy.threads)
        self.on_event = on_event  # (model, kind, message)
        self.metrics = metrics
        self.snapshots: dict[str, p.ModelSnapshot] = {s.name: p.ModelSnapshot(s.name, "Loading") for s in specs}
        self.process: subprocess.Popen | None = None
        self.up = False  # connected and answering
        self.failed = False  # too many restarts: given up
        self.restarts = 0
        self.last_tick = time.monotonic()  # the supervision loop's own heartbeat
        self.death_reason = ""  # why the worker last died or was killed
        self._cgroup: MemoryCgroup | None = None  # the worker's memory cgroup, read at its start
        self._oom_kills: int | None = None  # that cgroup's OOM kill count then
        self.on_restart: list[Callable[[], None]] = []  # listeners (remote models drop session state)
        self.on_change: list[Callable[[], None]] = []  # listeners: a model started or ended restarting, or failed
        self._recovering: set[str] = set()  # models whose worker died and whose replacement has not loaded them
        self._pong_at = 0.0  # monotonic time of the last Pong
        self._progress_at = 0.0  # monotonic time of the worker's engine's last progress (see the module's doc)
        self._kill_reason = ""
        self._channel: p.Channel | None = None
        self._ended: asyncio.Future | None = None  # set when the current worker's connection ends
        self.requests = WorkerRequests()  # the calls made of the worker that is up (appliance/workers/requests.py)
        self._ping_seq = itertools.count(1)
        self._deaths: collections.deque[float] = collections.deque()
        self._task: asyncio.Task | None = None
        self._revive: asyncio.Event | None = None
        self._stopping = False

    def spec(self, model: str) -> p.ModelSpec:
        return next(s for s in self.specs if s.name == model)

    # ---- what the models show ----

    def restarting_model(self, model: str) -> bool:
        """The model's worker died (or was killed) and its replacement has not loaded it yet."""
        return model in self._recovering and not self.failed and not self._stopping

    @property
    def restarting(self) -> bool:
        return any(self.restarting_model(name) for name in self.snapshots)

    @property
    def supervising(self) -> bool:
        """Its supervision task runs (started, not ended)."""
        return self._task is not None and not self._task.done()

    def answering(self) -> bool:
        """The worker answers liveness checks: its loop answered within `answer_window_s` and its engine made
        progress within `timeout_s`."""
        now = time.monotonic()
        return (self.up and now - self._pong_at <= self.policy.answer_window_s
                and now - self._progress_at <= self.policy.timeout_s)

    # ---- life cycle ----

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"supervise-{self.group}")

    def begin_stop(self) -> None:
        """The appliance is stopping (SIGTERM): a worker that ends from now on ended as planned, and none starts."""
        self._stopping = True

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the worker to stop (its models answer what they hold), then kill what is left."""
        self._stopping = True
        if self.up and self._channel is not None:
            try:
                await asyncio.wait_for(self.requests.request(p.Stop(id=self.requests.next_id())), timeout_s)
            except (TimeoutError, ApplianceError) as e:  # gone or stuck: it is killed below all the same
                log.info("worker %s did not confirm its stop (%s): killing it", self.group, type(e).__name__)
        self._kill("stopping")
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.fail_pending(NotReady("the appliance is shutting down"))

    async def give_up(self, reason: str) -> None:
        """The models are Failed with `reason` (the GPU watchdog stopped the engine) and the worker stops."""
        self.failed, self.death_reason = True, reason
        self._changed()
        await self.stop()

    def fail_pending(self, error: Exception) -> None:
        """Every call waiting for the worker's answer ends with `error` (shutdown, or the worker died)."""
        self.requests.fail_pending(error)

    async def _run(self) -> None:
        while not self._stopping:
            started = time.monotonic()
            try:
                await self._spawn()
                reason = await self._watch()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the supervision goes on whatever broke; logged with its trace
                log.exception("worker %s could not be started or watched", self.group)
                reason = f"could not start ({type(exc).__name__})"
            if self._stopping:
                break
            self._after_death(reason)
            now = time.monotonic()
            self._deaths.append(now)
            while self._deaths and now - self._deaths[0] > self.policy.restart_window_s:
                self._deaths.popleft()
            if len(self._deaths) > self.policy.max_restarts:
                self.failed = True
                self._changed()
                message = (f"worker of {', '.join(self.snapshots)} died {len(self._deaths)} times within "
                           f"{self.policy.restart_window_s:g} s (last: {reason}); the model is Failed until "
                           "reloaded")
                log.error("%s", message)
                self._emit("WorkerFailed", message)
                await self._wait_for_revival()
                continue
            delay = min(self.policy.backoff_max_s, self.policy.backoff_s * 2 ** (len(self._deaths) - 1))
            if now - started > self.policy.restart_window_s:
                delay = 0.0  # it ran well for a long while: come back at once
            self.restarts += 1
            if self.metrics is not None:
                for name in self.snapshots:
                    self.metrics.worker_restarts.labels(name).inc()
            log.warning("worker %s restarts in %.2f s (restart %d)", self.group, delay, self.restarts)
            await asyncio.sleep(delay)

    async def _wait_for_revival(self) -> None:
        self._revive = asyncio.Event()
        await self._revive.wait()
        self.failed = False
        self._deaths.clear()
        self._changed()  # restarting again, until the replacement has loaded its models

    def revive(self) -> bool:
        """An engineer reloads a Failed model: try its worker again. True when it was Failed."""
        if self.failed and self._revive is not None:
            self._revive.set()
            return True
        return False

    async def _spawn(self) -> None:
        # The worker starts with SIGTERM blocked and ignores it once running (appliance/process_start.py).
        cpu = self.cpu_shares.worker(self.group) if self.cpu_shares is not None else None
        self.process, parent_sock = start_child("appliance.workers.worker", "--group", self.group,
                                                *(("--nice", str(cpu.nice)) if cpu is not None else ()))
        if self.cpu_shares is not None:
            self.cpu_shares.place(self.group, self.process.pid)  # before its cgroup's OOM count is read below
        channel = await p.Channel.open(parent_sock, p.FromWorker)
        self._channel = channel
        channel.listen(self._on_message, lambda reason: self._connection_ended(channel))
        self._channel.send(p.Start(models=self.specs, memory_mb=self.policy.memory_mb,
                                   threads=cpu.threads if cpu is not None else self.policy.threads,
                                   log_level=self.policy.log_level, log_format=self.policy.log_format))
        for name in self.snapshots:
            self.snapshots[name] = p.ModelSnapshot(name, "Loading")
        self.up = True
        self.requests.channel = channel
        self._pong_at = self._progress_at = time.monotonic()
        if self.metrics is not None:
            for name in self.snapshots:
                self.metrics.worker_up.labels(name).set(0 if name in self._recovering else 1)
                if cpu is not None:
                    self.metrics.worker_cpu_share.labels(name, cpu.mechanism).set(cpu.share)
                    self.metrics.worker_threads.labels(name).set(cpu.threads)
        # its cgroup's OOM kills so far: a SIGKILL with more of them is the OOM killer's (a memory cap), not anonymous
        self._cgroup = memory_cgroup(self.process.pid)
        self._oom_kills = self._cgroup.oom_kills() if self._cgroup is not None else None
        log.info("worker %s started (pid %d)", self.group, self.process.pid)

    async def _watch(self) -> str:
        """Ping the worker until it dies or is killed (its messages arrive through _on_message meanwhile);
        returns why it ended."""
        timeout = self.policy.timeout_s
        ended = self._ended = asyncio.get_running_loop().create_future()
        if self._channel.closed_reason:
            ended.set_result(None)
        while not ended.done():
            now = time.monotonic()
            self.last_tick = now
            stalled = now - self._progress_at
            if stalled > timeout:
                self._kill(f"its engine made no progress for {stalled:.1f} s, more than engine.worker_timeout_s "
                           f"= {timeout:g} (hung or stopped)")
                break
            rss_mb = _rss_mb(self.process.pid)
            if self.policy.memory_mb and rss_mb > self.policy.memory_mb:
                self._kill(f"it used {rss_mb:.0f} MB, above engine.worker_memory_mb")
                break
            try:
                self._channel.send(p.Ping(seq=next(self._ping_seq)))
            except ConnectionError:
                break
            # the next Ping, or the moment the engine's last progress becomes `timeout` old, whichever is first
            wake = min(self.policy.ping_interval_s, self._progress_at + timeout - time.monotonic() + 0.001)
            await asyncio.wait({ended}, timeout=max(0.0, wake))
        code = await asyncio.to_thread(reap, self.process)
        if self._kill_reason:
            reason, self._kill_reason = self._kill_reason, ""
        elif code == MEMORY_EXIT:
            reason = "it exceeded engine.worker_memory_mb"
        elif code == -signal.SIGKILL and (oom := self._oom_killed()):
            reason = oom
        elif code is not None and code < 0:
            reason = f"it was killed by signal {signal.Signals(-code).name}"
        else:
            reason = f"it exited with status {code}"
        return reason

    def _oom_killed(self) -> str:
        """Why a worker killed by SIGKILL died, where its cgroup's OOM kill count rose since it started; else ""."""
        if self._cgroup is None or self._oom_kills is None:
            return ""
        now = self._cgroup.oom_kills()
        if now is None or now <= self._oom_kills:
            return ""
        cap = self._cgroup.limit()
        events = "memory.events" if self._cgroup.version == 2 else "memory.oom_control"
        return (f"it was killed by the OOM killer: {cap.describe() if cap else 'its cgroup'} was reached "
                f"({events} oom_kill {self._oom_kills} -> {now}); lower kv_slots or max_seq_len, or raise the "
                "limit (MemoryMax= of the unit, the pod's memory limit)")

    def _on_message(self, message) -> None:
        """Each message from the worker, as it is decoded (see protocol.Channel)."""
        if isinstance(message, p.Pong):
            self._on_pong(message)
        elif isinstance(message, p.Event):
            self._emit(message.kind, message.message, message.model)
        else:
            self.requests.on_answer(message)

    def _connection_ended(self, channel: p.Channel) -> None:
        if channel is not self._channel:
            return  # an earlier worker's connection, closed when it was killed
        self._went_down()  # answer what is in flight at once, before the process is reaped
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)

    def _on_pong(self, pong: p.Pong) -> None:
        now = time.monotonic()
        self._pong_at = now
        self._progress_at = min(pong.busy_since, now) if pong.busy_since else now
        for snap in pong.models:
            self.snapshots[snap.name] = snap
        if self.metrics is not None and pong.records:
            from appliance.engine.engine_metrics import apply_records
            apply_records(self.metrics, pong.records)
        loaded = {snap.name for snap in pong.models if snap.name in self._recovering and snap.state != "Loading"}
        if loaded:  # the restart of these models is over
            self._recovering -= loaded
            if self.metrics is not None:
                for name in loaded:
                    self.metrics.worker_up.labels(name).set(1)
            log.info("worker %s: %s %s again after the restart", self.group, ", ".join(sorted(loaded)),
                     "/".join(sorted({self.snapshots[n].state for n in loaded})))
            self._changed()

    def _went_down(self) -> None:
        """The worker died or is being killed: its calls in flight are answered now and, unless the appliance
        stops, its models restart from this moment until the replacement has loaded them."""
        was_up, self.up = self.up, False
        self.requests.channel = None
        self.fail_pending(EngineFailure("the model's worker stopped while running this request"))
        if self._stopping:
            return
        restarting = set(self.snapshots) - self._recovering
        self._recovering |= set(self.snapshots)
        if self.metrics is not None:
            for name in self.snapshots:
                self.metrics.worker_up.labels(name).set(0)
        if was_up:
            for listener in self.on_restart:
                listener()
        if restarting:
            self._changed()

    def _after_death(self, reason: str) -> None:
        self._went_down()
        for name in self.snapshots:
            self.snapshots[name] = p.ModelSnapshot(name, "Loading")
        self.death_reason = reason
        message = f"worker of model {', '.join(self.snapshots)} was replaced: {reason}"
        log.error("%s", message)
        self._emit("WorkerRestarting", message)

    def _kill(self, why: str) -> None:
        proc = self.process
        if proc is not None and proc.poll() is None:
            if not self._stopping:
                log.error("killing worker %s (pid %d): %s", self.group, proc.pid, why)
                self._kill_reason = why
            self._went_down()  # the restart begins with the kill, not with the process's exit
            try:
                proc.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._channel is not None:
            self._channel.close()

    def _changed(self) -> None:
        for listener in self.on_change:
            listener()

    def _emit(self, kind: str, message: str, model: str | None = None) -> None:
        if self.on_event is None:
            return
        for name in ([model] if model else list(self.snapshots)):
            try:
                self.on_event(name, kind, message)
            except Exception:  # noqa: BLE001 - a broken listener must not stop the supervision; logged
                log.exception("event listener failed")


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0
