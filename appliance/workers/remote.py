"""The serve process's model objects: core.model_port's interface, answered by the model's worker process.

They count calls and latency (what a client saw, including the trip to the worker), say Loading (and refuse calls)
from a worker's death until its replacement has loaded the model, and remember which generative sessions held state in a worker that died, so that each such session's next
result says ContextLost.
"""
from __future__ import annotations

import asyncio
import math
import time

import numpy as np

from core.errors import EngineFailure, NotReady, ResourceUnavailable, without_paths
from core.model_port import CONVERSATION_PREFIX, ChooseResult, GenerateResult, InferResult, ModelStatus
from appliance.workers import protocol as p
from appliance.workers.supervisor import WorkerSupervisor


class RemoteModel:
    def __init__(self, name: str, kind: str, supervisor: WorkerSupervisor, *, max_samples: int = 0,
                 served_path=None):
        self.name = name
        self.kind = kind
        self.supervisor = supervisor
        self.max_samples = max_samples
        self.served_path = served_path  # () -> ModelSpec as it would be built now: what a reload loads
        self.request_count = 0
        self.error_count = 0
        self.last_latency_ms = 0.0
        self.heartbeat = 0
        self.shedding = False  # the GPU watchdog is Critical: no new generative sessions
        self._sessions_with_state: set[str] = set()  # generative: sessions that hold a slot in the live worker
        self._sessions_lost: set[str] = set()  # ... that held one in a worker that died
        supervisor.on_restart.append(self._worker_lost)

    # ---- status ----

    @property
    def state(self) -> str:
        sup = self.supervisor
        if sup.failed:
            return "Failed"
        if not sup.up or sup.restarting_model(self.name):
            return "Loading"
        return sup.snapshots[self.name].state

    @property
    def max_floats(self) -> int:
        shape = self.supervisor.snapshots[self.name].input_shape
        return self.max_samples * math.prod(shape) if shape else 0

    def status(self) -> ModelStatus:
        sup, snap = self.supervisor, self.supervisor.snapshots[self.name]
        return ModelStatus(
            name=self.name, kind=self.kind, state=self.state, version=snap.version, backend=snap.backend,
            request_count=self.request_count, error_count=self.error_count, last_latency_ms=self.last_latency_ms,
            heartbeat=self.heartbeat, worker_restarts=sup.restarts,
            worker_up=sup.up and not sup.restarting_model(self.name), restarting=sup.restarting_model(self.name),
            failure_reason=without_paths(snap.failure_reason or (sup.death_reason if sup.failed else "")),
            queue_depth=snap.queue_depth, input_shape=tuple(snap.input_shape), output_shape=tuple(snap.output_shape),
            max_samples=self.max_samples, slots_total=snap.slots_total, slots_in_use=snap.slots_in_use,
            conversations_parked=snap.conversations_parked)

    def tick_heartbeat(self) -> None:
        """Called once a second by the serve process: +1 while the worker answers liveness checks, not while it
        hangs, is dead or restarts."""
        if self.supervisor.answering() and not self.supervisor.restarting_model(self.name):
            self.heartbeat = (self.heartbeat + 1) % 2**32

    # ---- calls ----

    def _require_ready(self) -> None:
        state = self.state
        if state != "Ready":
            raise NotReady(f"model {self.name} is {state}")

    async def _counted(self, message, deadline: float | None, on_progress=None):
        started = time.monotonic()
        self.request_count += 1
        try:
            self._require_ready()
            reply = await self.supervisor.requests.call(message, deadline, on_progress)
        except BaseException:  # a cancelled call (client gone) counts too: the model did not answer it
            self.error_count += 1
            raise
        self.last_latency_ms = (time.monotonic() - started) * 1000.0
        return reply

    async def infer(self, samples: np.ndarray, deadline: float) -> InferResult:
        data = np.ascontiguousarray(samples, dtype=np.float32).tobytes()
        reply = await self._counted(p.Infer(id=0, model=self.name, data=data, deadline=deadline), deadline)
        return InferResult(np.frombuffer(reply.data, dtype=np.float32), reply.version)

    async def generate(self, session: str, prompt: str, max_tokens: int, temperature: float,
                       deadline: float, on_progress=None, finish_by: float | None = None,
                       grammar: str | None = None) -> GenerateResult:
        """on_progress(text, tokens): the reply so far, as it grows (jobs). finish_by: a job's bound, where the
        reply ends as it is (FinishReason `deadline`); the call itself is then bounded by `deadline`. session "":
        a one-shot turn (the worker keeps nothing after it). grammar: see model_port.GenerativeModel.generate."""
        if self.shedding and (not session or session not in self._sessions_with_state):
            self.request_count += 1
            self.error_count += 1
            raise ResourceUnavailable("the GPU watchdog is Critical: no new sessions until it recovers")
        message = p.Generate(id=0, model=self.name, session=session, prompt=prompt, max_tokens=int(max_tokens),
                             temperature=float(temperature), deadline=deadline, progress=on_progress is not None,
                             finish_by=finish_by or 0.0, grammar=grammar or "")
        # The session holds state in the worker from the moment its turn is sent: a session that closes while its
        # first turn runs must still send Release (which cancels the turn and frees the slot). A one-shot turn
        # holds nothing after its answer (a cancelled call is rolled back by the worker's Cancel).
        if session:
            self._sessions_with_state.add(session)
        reply = await self._counted(message, deadline, on_progress)
        lost = reply.context_lost or session in self._sessions_lost
        self._sessions_lost.discard(session)
        return GenerateResult(reply.text, reply.token_count, reply.finish_reason, reply.context_tokens, lost,
                              reply.version)

    async def choose(self, prompt: str, options: list[str], deadline: float) -> ChooseResult:
        """See model_port.GenerativeModel.choose: scored in the worker, no state kept there."""
        if self.shedding:
            self.request_count += 1
            self.error_count += 1
            raise ResourceUnavailable("the GPU watchdog is Critical: no new sessions until it recovers")
        message = p.Choose(id=0, model=self.name, prompt=prompt, options=list(options), deadline=deadline)
        reply = await self._counted(message, deadline)
        return ChooseResult(int(reply.index), [float(s) for s in reply.scores], reply.version)

    async def reset(self, session: str) -> None:
        self._require_ready()
        self._sessions_lost.discard(session)
        self._sessions_with_state.discard(session)
        await self.supervisor.requests.call(p.Reset(id=0, model=self.name, session=session), None)

    def shed_load(self, on: bool) -> None:
        self.shedding = on
        if self.kind == "tensor":
            self.supervisor.requests.send(p.ShedLoad(model=self.name, on=on))

    def release(self, session: str) -> None:
        self._sessions_lost.discard(session)
        if session in self._sessions_with_state:
            self._sessions_with_state.discard(session)
            self.supervisor.requests.send(p.Release(model=self.name, session=session))

    async def reload(self) -> str:
        """Load the weights anew from where they serve now (a deployed version may have been switched)."""
        spec = self.supervisor.spec(self.name)
        if self.served_path is not None:
            now = self.served_path()
            if now.refused:
                raise EngineFailure(f"reload failed: {now.refused}")
        else:
            now = spec
        if self.supervisor.failed:  # a Failed worker comes back, loading what serves now
            spec.path, spec.version_label = now.path, now.version_label
            self.supervisor.revive()
            return await self._wait_loaded()
        if not self.supervisor.up:
            raise NotReady(f"model {self.name} is {self.state}")
        reply = await self.supervisor.requests.call(p.Reload(id=0, model=self.name, path=now.path,
                                                    version_label=now.version_label), None)
        spec.path, spec.version_label = now.path, now.version_label  # a restarted worker loads what serves now
        return reply.value  # the engine dropped every conversation and says ContextLost itself

    async def _wait_loaded(self, timeout_s: float = 600.0) -> str:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            state = self.state
            if state in ("Ready", "Failed") and self.supervisor.up:
                snap = self.supervisor.snapshots[self.name]
                if state == "Failed":
                    raise EngineFailure(f"reload failed: {snap.failure_reason}")
                return snap.version
            await asyncio.sleep(0.05)
        raise EngineFailure("reload failed: the model did not load in time")

    def _worker_lost(self) -> None:
        # A Converse conversation is not lost: its engine wrote every answered turn to the state directory
        # (appliance/engine/llm/conversation_files.py) and the new worker recalls it. A UA session's slot is gone.
        self._sessions_lost |= {s for s in self._sessions_with_state if not s.startswith(CONVERSATION_PREFIX)}
        self._sessions_with_state = set()
