"""Since when the engine's current operation has run: what a liveness check answers.

A worker's event loop stays responsive while a forward pass runs in the engine's thread, so "the loop answers" says
nothing about the model. Each engine operation (a batch, an engine step with its tokenization) is wrapped in
`busy()`; a liveness check reports `busy_since()`, the moment the oldest operation now running began (CLOCK_MONOTONIC,
one clock for every process of the machine). The serve process counts `engine.worker_timeout_s` from there: the
engine's last progress, so one timeout after a hang began its worker is seen hung and replaced. Waiting for work is
not an operation.
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

    def busy_since(self) -> float:
        """When the oldest operation now running began (time.monotonic()); 0.0 when none runs."""
        starts = list(self._running.values())
        return min(starts) if starts else 0.0
