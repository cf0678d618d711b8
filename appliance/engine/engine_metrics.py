"""The metrics an engine records inside a worker process, relayed to the serve process's Prometheus registry.

The engine services call the same `metrics.<name>.labels(...).observe/inc/set` as on appliance.metrics.Metrics;
here the relayed series (histograms and counters of engine work) are recorded and shipped with each liveness answer,
and gauges are dropped: the serve process derives queue depth, slots and model info from the worker's snapshots, so
they can never be left stale by a worker that died.
"""
from __future__ import annotations

import collections

RELAYED = ("batch_size", "queue_wait", "time_to_first_token", "tokens_total", "prefix_cache_hits_total")
DERIVED = ("queue_depth", "kv_slots_total", "kv_slots_used", "model_ready")

Record = tuple[str, list[str], str, float]


class _Series:
    def __init__(self, name: str, sink: collections.deque | None, values: tuple[str, ...] = ()):
        self._name, self._sink, self._values = name, sink, values

    def labels(self, *values: str) -> "_Series":
        return _Series(self._name, self._sink, tuple(str(v) for v in values))

    def _record(self, op: str, value: float) -> None:
        if self._sink is not None:
            self._sink.append((self._name, list(self._values), op, float(value)))

    def observe(self, value: float) -> None:
        self._record("observe", value)

    def inc(self, value: float = 1.0) -> None:
        self._record("inc", value)

    def set(self, value: float) -> None:
        self._record("set", value)


class EngineMetrics:
    def __init__(self) -> None:
        self._records: collections.deque[Record] = collections.deque()  # engine thread appends, loop drains
        for name in RELAYED:
            setattr(self, name, _Series(name, self._records))
        for name in DERIVED:
            setattr(self, name, _Series(name, None))

    def set_model_info(self, model: str, version: str, backend: str) -> None:
        """Derived in the serve process from the worker's snapshot."""

    def drain(self) -> list[Record]:
        records = []
        try:
            while True:
                records.append(self._records.popleft())
        except IndexError:
            return records


def apply_records(metrics, records: list[Record]) -> None:
    """In the serve process: replay a worker's records on the real registry (relayed names only)."""
    for name, values, op, value in records:
        if name not in RELAYED:
            continue
        series = getattr(metrics, name).labels(*values)
        if op == "observe":
            series.observe(value)
        elif op == "inc":
            series.inc(value)
