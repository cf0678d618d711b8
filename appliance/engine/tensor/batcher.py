"""A Triton-style dynamic batcher: one per tensor model, merging concurrent requests into one execution.

Requests wait in a bounded FIFO. One batching task takes the oldest request, adds whole requests behind it while the
sample total stays within max_batch_size, for at most max_queue_delay_s, then runs the batch in the executor (never
on the event loop; a lone request of a fast model may, see inline_fast_path) and splits the outputs back. One batch runs at a time per model: while it runs the queue fills,
which is what makes later batches large under load.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from core.errors import DeadlineExceeded, EngineFailure, NotReady, ResourceUnavailable
from appliance.metrics import Metrics

log = logging.getLogger(__name__)

INLINE_BELOW_S = 0.002

Execute = Callable[[np.ndarray], tuple[np.ndarray, Any]]


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_size: int  # samples per executed batch (a larger single request still runs, alone)
    max_queue_delay_s: float  # how long the first request of a batch waits for company
    max_queue_size: int  # requests waiting; one more is refused at once

    def __post_init__(self):
        if self.max_batch_size < 1 or self.max_queue_size < 1 or self.max_queue_delay_s < 0:
            raise ValueError("max_batch_size and max_queue_size must be >= 1, max_queue_delay_s >= 0")


@dataclass(eq=False)
class _Request:
    samples: np.ndarray  # (k, *sample_shape)
    deadline: float  # time.monotonic()
    enqueued: float
    future: asyncio.Future = field(repr=False)

    @property
    def size(self) -> int:
        return len(self.samples)


class DynamicBatcher:
    def __init__(self, model_name: str, policy: BatchPolicy, execute: Execute, metrics: Metrics | None,
                 executor: concurrent.futures.Executor, inline_fast_path: bool = False):
        self.model_name = model_name
        self.policy = policy
        self._execute = execute
        self._metrics = metrics
        self._executor = executor
        # A lone request on an idle model runs on the loop itself when batches take under INLINE_BELOW_S (the
        # thread hop there and back costs more than the TE classifier's 0.05 ms); slower models always run in the
        # executor, so the loop keeps reading requests (and refusing them when the queue is full) meanwhile.
        self._inline_fast_path = inline_fast_path
        self._exec_s = math.inf  # moving average of a batch's execution time; unknown until one ran in the executor
        self._queue: collections.deque[_Request] = collections.deque()
        self._arrived: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._forming: list[_Request] = []  # taken from the queue, batch not started yet
        self._closed = False
        self._running = False  # the batching task holds a batch (forming or executing)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def submit_now(self, samples: np.ndarray, deadline: float) -> tuple[np.ndarray, Any] | None:
        """`samples` run at once on the caller's thread (the inline fast path: a lone request of a fast model on an
        idle batcher), or None when it must wait in the queue (`submit`). Raises what `submit` raises."""
        if self._closed:
            raise NotReady("the model is shutting down")
        if len(samples) < 1:
            raise ValueError("a request needs at least one sample")
        now = time.monotonic()
        if deadline <= now:
            raise DeadlineExceeded("the request's deadline passed before it was queued")
        if len(self._queue) >= self.policy.max_queue_size:
            raise ResourceUnavailable("the model's queue is full")
        if (self._inline_fast_path and self._exec_s < INLINE_BELOW_S and not self._queue and not self._running
                and not self.policy.max_queue_delay_s):
            return self._run_alone(samples, now)
        return None

    async def submit(self, samples: np.ndarray, deadline: float) -> tuple[np.ndarray, Any]:
        """Run `samples` (k, *shape) in some batch; returns (outputs (k, ...), tag of the execution)."""
        answer = self.submit_now(samples, deadline)
        if answer is not None:
            return answer
        now = time.monotonic()
        self._ensure_task()
        request = _Request(samples, deadline, now, asyncio.get_running_loop().create_future())
        self._queue.append(request)
        self._set_depth()
        self._arrived.set()
        try:
            done, _ = await asyncio.wait({request.future}, timeout=deadline - time.monotonic())
        except asyncio.CancelledError:
            self._forget(request)
            raise
        if not done:
            self._forget(request)
            raise DeadlineExceeded("the request's deadline passed")
        return request.future.result()

    def _run_alone(self, samples: np.ndarray, enqueued: float) -> tuple[np.ndarray, Any]:
        if self._metrics is not None:
            self._metrics.queue_wait.labels(self.model_name).observe(time.monotonic() - enqueued)
            self._metrics.batch_size.labels(self.model_name).observe(len(samples))
        try:
            started = time.monotonic()
            outputs, tag = self._execute(samples)
            outputs = self._checked(outputs, len(samples), started)
        except Exception:  # noqa: BLE001 - the model's code failed (any library error): logged, EngineFailure
            log.exception("model %s failed on a batch of %d samples", self.model_name, len(samples))
            raise EngineFailure("the engine failed on this request") from None
        if not np.isfinite(outputs).all():
            raise EngineFailure("the model produced a non-finite value (NaN or Inf)")
        return outputs, tag

    def _checked(self, outputs, rows: int, started: float) -> np.ndarray:
        """A batch's outputs, one row per sample, and its time counted into the moving average."""
        seconds = time.monotonic() - started
        self._exec_s = seconds if math.isinf(self._exec_s) else 0.8 * self._exec_s + 0.2 * seconds
        outputs = np.asarray(outputs)
        if outputs.ndim < 1 or outputs.shape[0] != rows:
            raise RuntimeError(f"execute returned {outputs.shape[:1]} rows for {rows} samples")
        return outputs

    async def close(self) -> None:
        """Refuse new requests, fail the waiting ones with NotReady, let the running batch finish."""
        self._closed = True
        for request in list(self._queue) + self._forming:
            _answer_error(request, NotReady("the model is shutting down"))
        self._queue.clear()
        self._forming = []
        self._set_depth()
        if self._arrived is not None:
            self._arrived.set()
        if self._task is not None:
            await asyncio.shield(self._task)

    # ---- internals ----

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._arrived = self._arrived or asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"batcher-{self.model_name}")

    def _forget(self, request: _Request) -> None:
        """The submitter stopped waiting: drop its request from the queue, and never answer it later."""
        if not request.future.done():
            request.future.cancel()
        elif not request.future.cancelled():
            request.future.exception()  # answered at the same moment: mark it seen, nobody will read it
        try:
            self._queue.remove(request)
        except ValueError:
            pass  # already taken into a batch
        self._set_depth()

    def _set_depth(self) -> None:
        if self._metrics is not None:
            self._metrics.queue_depth.labels(self.model_name).set(len(self._queue))

    def _take_next(self) -> _Request | None:
        """The oldest request still waiting for an answer (cancelled ones are skipped)."""
        while self._queue:
            request = self._queue.popleft()
            if not request.future.done():
                return request
        return None

    async def _run(self) -> None:
        while not self._closed:
            self._forming = []
            first = self._take_next()
            if first is None:
                self._set_depth()
                self._arrived.clear()
                await self._arrived.wait()
                continue
            batch = self._forming = [first]  # _gather appends to it; close() answers it until it runs
            self._running = True
            try:
                await self._gather(first)
                self._set_depth()
                if self._closed:
                    break  # close() answered the forming batch
                self._forming = []  # from here on the batch runs to its end, even through close()
                await self._execute_batch(batch)
            except Exception:  # noqa: BLE001 - a bug here must not stop the model: logged, the batch answered
                log.exception("batcher of model %s failed on a batch", self.model_name)
                for request in batch:
                    _answer_error(request, EngineFailure("the engine failed on this request"))
            finally:
                self._running = False

    async def _gather(self, first: _Request) -> None:
        """Add whole requests behind `first` while they fit, until the delay ends or the batch is full."""
        total = first.size
        limit = self.policy.max_batch_size
        window_end = min(time.monotonic() + self.policy.max_queue_delay_s, first.deadline)
        while total < limit and not self._closed:
            while self._queue and (self._queue[0].future.done() or total + self._queue[0].size <= limit):
                request = self._queue.popleft()
                if not request.future.done():
                    self._forming.append(request)
                    total += request.size
            if self._queue or total >= limit:
                break  # the next one does not fit: keep FIFO order, never split a request
            remaining = window_end - time.monotonic()
            if remaining <= 0:
                break
            self._arrived.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self._arrived.wait()
            except TimeoutError:
                break

    async def _execute_batch(self, batch: list[_Request]) -> None:
        start = time.monotonic()
        live = []
        for request in batch:
            if request.future.done():
                continue  # cancelled while the batch formed
            if request.deadline <= start:
                _answer_error(request, DeadlineExceeded("the request's deadline passed while it waited"))
                continue
            live.append(request)
        if not live:
            return
        inputs = live[0].samples if len(live) == 1 else np.concatenate([r.samples for r in live], axis=0)
        if self._metrics is not None:
            for request in live:
                self._metrics.queue_wait.labels(self.model_name).observe(start - request.enqueued)
            self._metrics.batch_size.labels(self.model_name).observe(len(inputs))
        try:
            outputs, tag = await asyncio.get_running_loop().run_in_executor(self._executor, self._execute, inputs)
            outputs = self._checked(outputs, len(inputs), start)
        except Exception:  # noqa: BLE001 - the model's code failed (any library error): logged, EngineFailure
            log.exception("model %s failed on a batch of %d samples", self.model_name, len(inputs))
            for request in live:
                _answer_error(request, EngineFailure("the engine failed on this request"))
            return
        offset = 0
        for request in live:
            part = outputs[offset:offset + request.size]
            offset += request.size
            if request.future.done():
                continue  # its submitter gave up while the batch ran
            if not np.isfinite(part).all():
                request.future.set_exception(EngineFailure("the model produced a non-finite value (NaN or Inf)"))
            else:
                request.future.set_result((part, tag))


def _answer_error(request: _Request, error: Exception) -> None:
    if not request.future.done():
        request.future.set_exception(error)
