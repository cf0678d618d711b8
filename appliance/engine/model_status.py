"""What every served model shows the address space and the metrics, whatever its kind: state, counters, events."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Callable

from appliance.metrics import Metrics

log = logging.getLogger(__name__)


class ModelStatus:
    kind = ""

    def __init__(self, name: str, path: Path, *, version_label: str | None, metrics: Metrics | None,
                 on_event: Callable[[str, str], None] | None):
        self.name = name
        self.path = Path(path)
        self.version_label = version_label
        self.metrics = metrics
        self.on_event = on_event
        self.state = "Loading"  # Loading | Ready | Failed
        self.failure_reason: str | None = None
        self.request_count = 0
        self.error_count = 0
        self.last_latency_ms = 0.0
        self._stopped = False
        self._reload_lock = asyncio.Lock()

    def _set_state(self, state: str) -> None:
        self.state = state
        if self.metrics is not None:
            self.metrics.model_ready.labels(self.name).set(1 if state == "Ready" else 0)

    def refuse(self, reason: str) -> None:
        """The model will not be loaded here (its worker refused the spec, e.g. a device it cannot use): Failed with
        `reason`, as a failed first load."""
        self._load_failed(reason)

    def _load_failed(self, reason: str) -> None:
        """A first load failed: the model is Failed with a reason safe to show clients, and an event says so."""
        self.failure_reason = reason
        self._set_state("Failed")
        log.error("model %s failed to load: %s", self.name, reason)
        self._emit("ModelLoadFailed", reason)

    def _log_load_exception(self, what: str, exc: BaseException) -> None:
        """Every failed load or reload, with its traceback: the reason clients see keeps only what is safe to show
        (often just the exception's type), so the log is where the cause is found."""
        log.error("model %s: %s failed", self.name, what, exc_info=exc)

    def _emit(self, event: str, reason: str) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(event, reason)
        except Exception:  # noqa: BLE001 - a broken listener must not turn a handled failure into a crash; logged
            log.exception("event listener failed for %s", event)
