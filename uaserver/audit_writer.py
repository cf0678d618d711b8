"""The audit writer thread of the method handlers (see AuditWriter)."""
from __future__ import annotations

import asyncio
import queue
import threading

HAND_OVER_S = 0.02  # a record waits at most this long before the writer thread has it


class AuditWriter:
    """Writes audit records in call order on one thread, off the event loop. Records go over in batches, at most one
    every HAND_OVER_S: a hand-over wakes the thread, which then fights the event loop for the GIL; once per record
    that was a fifth of the serve process's CPU at 16 clients, and once per loop turn still 7 % of it (py-spy), most
    of it at one client, where every call is a loop turn of its own. At most `max_pending` records wait: beyond, a
    record is dropped, counted as a write failure and marked in the log by an audit_lost record (`full` is true until
    the thread catches up)."""

    def __init__(self, audit, max_pending: int = 10000, metrics=None):
        self._audit = audit
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._batch: list[dict] = []
        self._pending = 0  # records put and not yet written; on the loop += , in the thread -= (under the lock)
        self._lock = threading.Lock()
        self.max_pending = max_pending
        self.dropped = 0
        self._metrics = metrics
        self._thread = threading.Thread(target=self._run, name="audit", daemon=True)
        self._thread.start()

    @property
    def full(self) -> bool:
        return self._pending >= self.max_pending

    def put(self, fields: dict) -> bool:
        """On the event loop. False when the queue is full: the record is dropped, and a note of it takes its place
        in the batch (consecutive drops share one), which the log writes as an audit_lost record, in order."""
        with self._lock:
            full = self._pending >= self.max_pending
            if full:
                self.dropped += 1
            else:
                self._pending += 1
        if full:
            if self._metrics is not None:
                self._metrics.audit_errors.inc()
            last = self._batch[-1] if self._batch else None
            if last is not None and "lost" in last:
                last["lost"] += 1
                return False
            fields = {"lost": 1, "cause": "the audit queue was full"}
        if not self._batch:
            asyncio.get_running_loop().call_later(HAND_OVER_S, self._hand_over)
        self._batch.append(fields)
        return not full

    def _hand_over(self) -> None:
        batch, self._batch = self._batch, []
        self._queue.put(batch)

    def close(self) -> None:
        """Write what is queued, then stop."""
        if self._batch:
            self._hand_over()
        self._queue.put(None)
        self._thread.join(30)

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            self._audit.record_many(batch)
            with self._lock:
                self._pending -= sum(1 for fields in batch if "lost" not in fields)
