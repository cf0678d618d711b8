"""How long the engine's current operation has run: what a liveness check answers.

A worker's event loop stays responsive while a forward pass runs in the engine's thread, so "the loop answers" says
nothing about the model. Each engine operation (a batch, an engine step with its tokenization) is wrapped in
`busy()`; a liveness check reports `stalled_s()`, and the serve process replaces a worker whose operation has run
longer than `engine.worker_timeout_s`. Waiting for work is not an operation.
"""
from __future__ import annotations

import contextlib
import itertools
import time


class Liveness:
    def __init__(self) -> None:
        self._running: dict[int, float] = {}  # token -> start (monotonic); dict operations are atomic under the GIL
        self._tokens = itertools.count()

    @contextlib.contextmanager
    def busy(self):
        token = next(self._tokens)
        self._running[token] = time.monotonic()
        try:
            yield
        finally:
            self._running.pop(token, None)

    def stalled_s(self) -> float:
        """Seconds the oldest operation now running has run; 0 when none runs."""
        starts = list(self._running.values())
        return max(0.0, time.monotonic() - min(starts)) if starts else 0.0
