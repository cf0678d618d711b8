"""Jobs: a call started now and fetched later, for PLCs that must not block a cycle on a model (OPC 40100 style:
StartX -> JobId, Get...Result with a wait, CancelJob, ReleaseJob).

A job belongs to the caller's identity (client certificate + user) and to its model, not to the session: a PLC may
start it in one session and fetch it in the next, and closing a session cancels nothing. Another identity's, another
model's or an unknown JobId is NotFound. At most `max_per_client` unreleased jobs per identity; a finished job is kept until released or for
`result_ttl_s`. Runs on the serve process's event loop; UA-free and torch-free.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from core.errors import ApplianceError, Cancelled, EngineFailure, NotFound, ResourceUnavailable
from core.task_set import TaskSet

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Job:
    id: int
    owner: str
    model: str
    kind: str  # infer | generate
    started: float = field(default_factory=time.monotonic)
    result: Any = None  # InferResult | GenerateResult once done
    error: ApplianceError | None = None
    partial_text: str = ""  # generate: the reply so far
    partial_tokens: int = 0
    finished_at: float | None = None
    task: asyncio.Task | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    def progress(self, text: str, tokens: int) -> None:
        if not self.done:
            self.partial_text, self.partial_tokens = text, tokens


class JobStore:
    def __init__(self, *, max_per_client: int, result_ttl_s: float, max_wait_s: float,
                 on_ready: Callable[[Job], None] | None = None):
        self.max_per_client = max_per_client
        self.result_ttl_s = result_ttl_s
        self.max_wait_s = max_wait_s
        self.on_ready = on_ready
        self._jobs: dict[int, Job] = {}
        self._tasks = TaskSet(log, "job")  # a released job's task runs on (cancelled) after it left _jobs

    def counts(self) -> dict[tuple[str, str], int]:
        """(model, running | done | failed) -> jobs, for appliance_jobs{model,state}."""
        out: dict[tuple[str, str], int] = {}
        for job in self._jobs.values():
            state = "running" if not job.done else "failed" if job.error is not None else "done"
            out[(job.model, state)] = out.get((job.model, state), 0) + 1
        return out

    def start(self, owner: str, model: str, kind: str,
              run: Callable[[Callable[[str, int], None]], Awaitable[Any]]) -> Job:
        """Start `run(on_progress)` as a job of `owner`; ResourceUnavailable beyond max_per_client."""
        self.sweep()
        if sum(1 for j in self._jobs.values() if j.owner == owner) >= self.max_per_client:
            raise ResourceUnavailable(f"at most {self.max_per_client} unreleased jobs per client")
        job_id = 0
        while job_id == 0 or job_id in self._jobs:  # random, so ids say nothing about other clients' jobs
            job_id = secrets.randbits(32)
        job = self._jobs[job_id] = Job(job_id, owner, model, kind)
        job.task = self._tasks.start(self._run(job, run), name=f"job-{job_id}")
        return job

    async def _run(self, job: Job, run) -> None:
        try:
            job.result = await run(job.progress)
        except asyncio.CancelledError:
            job.error = job.error or Cancelled("the job was cancelled")
        except ApplianceError as e:
            job.error = e
        except Exception:  # noqa: BLE001 - a job ends with an answer: BadInternalError, as the call would; logged
            log.exception("job %d on model %s failed", job.id, job.model)
            job.error = EngineFailure("the engine failed on this request")
        job.finished_at = time.monotonic()
        job.changed.set()
        if self.on_ready is not None and not isinstance(job.error, Cancelled):
            self.on_ready(job)

    def get(self, owner: str, model: str, job_id: int) -> Job:
        job = self._jobs.get(job_id)
        if job is None or job.owner != owner or job.model != model:
            raise NotFound("no job with that id for this client on this model")
        return job

    async def wait(self, owner: str, model: str, job_id: int, wait_s: float) -> Job:
        """The job once done, or after min(wait_s, max_wait_s), whichever comes first."""
        job = self.get(owner, model, job_id)
        wait_s = min(max(0.0, wait_s), self.max_wait_s)
        if not job.done and wait_s > 0:
            try:
                await asyncio.wait_for(job.changed.wait(), wait_s)
            except TimeoutError:
                pass  # the wait is over: the job is answered as it is now (still running)
        return job

    def cancel(self, owner: str, model: str, job_id: int) -> None:
        job = self.get(owner, model, job_id)
        if not job.done and job.task is not None:
            job.error = Cancelled("the job was cancelled")
            job.task.cancel()

    def release(self, owner: str, model: str, job_id: int) -> None:
        job = self.get(owner, model, job_id)
        if not job.done and job.task is not None:
            job.error = Cancelled("the job was released")
            job.task.cancel()
        del self._jobs[job_id]

    def sweep(self) -> None:
        """Drop finished jobs kept longer than result_ttl_s."""
        now = time.monotonic()
        for job_id in [i for i, j in self._jobs.items()
                       if j.finished_at is not None and now - j.finished_at > self.result_ttl_s]:
            del self._jobs[job_id]

    async def cancel_all(self) -> None:
        """Shutting down: cancel every job still running (released ones included) and wait for them to end."""
        await self._tasks.cancel_all()
