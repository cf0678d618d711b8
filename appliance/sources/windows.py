"""A feed's windows, cut from the samples of a source's nodes: torch- and network-free, so it is tested alone.

Alignment. Samples of the feed's columns form a row when their SourceTimestamps lie within `tolerance_s` of the
row's first sample. A row closes as soon as every column has a value (no waiting for the next row: the window's
delay is the slowest column's), or when a sample of a later row arrives; a sample older than the open row is late
and dropped. A column missing from a closed row is held from its last value (`missing: hold`, unless that value is
older than `stale_after_s`) or makes the row unusable (`missing: skip`).

Quality. A row holding a Bad sample (StatusCode severity Bad), an Uncertain one (unless `accept_uncertain`), a value
that is not a finite number, a missing or stale column, restarts the window: no model ever sees it, and no window
spans it. A gap (the source disconnected, its subscription was lost, the client process restarted) restarts it too.
Each window that would have run at that point (a stride point or a trigger) but could not is counted as skipped,
by reason: bad, uncertain, type, missing, stale, gap.

Cutting. Every `stride` new rows once `window` rows are there, or at a trigger: a Boolean's rising edge or any
change of a counter (the window then holds the latest `window` rows).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

SKIP_REASONS = ("bad", "uncertain", "type", "missing", "stale", "gap", "busy")


def severity(status_code: int) -> str:
    """Good | Uncertain | Bad, from a StatusCode's top two bits (Part 4 7.39)."""
    top = (status_code >> 30) & 0x3
    return "Good" if top == 0 else "Uncertain" if top == 1 else "Bad"


@dataclass(frozen=True)
class FeedSpec:
    name: str
    columns: int  # values per row
    window: int  # rows per window
    stride: int = 1  # run every `stride` new rows (ignored with a trigger)
    triggered: bool = False  # windows are cut at the trigger's edges instead
    trigger_kind: str = "rising"  # rising (a Boolean) | change (a counter)
    tolerance_s: float = 0.05
    missing: str = "skip"  # skip | hold
    stale_after_s: float = 5.0
    accept_uncertain: bool = False


@dataclass
class Window:
    feed: str
    data: np.ndarray  # float32, (window, columns)
    last_source_time: float  # the window's last SourceTimestamp (Unix seconds)


@dataclass
class FeedWindows:
    spec: FeedSpec
    windows: int = 0  # windows cut
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> windows skipped
    late: int = 0  # samples older than the open row, dropped

    def __post_init__(self) -> None:
        self._rows: deque[np.ndarray] = deque(maxlen=self.spec.window)
        self._row_times: deque[float] = deque(maxlen=self.spec.window)
        self._new_rows = 0  # rows since the last window (or stride point)
        self._restart_reason = ""  # why the rows were last thrown away ("" at the start: warming up is no skip)
        self._last = [math.nan] * self.spec.columns  # each column's last good value and its time, for `hold`
        self._last_time = [-math.inf] * self.spec.columns
        self._trigger_last = None
        self._open_row()
        self._row_time: float | None = None

    def _open_row(self) -> None:
        self._row = [math.nan] * self.spec.columns
        self._filled = [False] * self.spec.columns
        self._count = 0
        self._seen = [False] * self.spec.columns  # a sample of the column arrived in this row, usable or not
        self._seen_count = 0
        self._row_time = None
        self._row_problem = ""

    # ---- samples ----

    def sample(self, column: int, value, status: int, source_time: float) -> Window | None:
        """One sample of a column (its DataValue's value, StatusCode and SourceTimestamp in Unix seconds); returns
        a window when this sample completed one."""
        tol = self.spec.tolerance_s
        out = None
        if self._row_time is None:
            self._row_time = source_time
        elif source_time > self._row_time + tol:
            out = self._close_row()
            self._row_time = source_time
        elif source_time < self._row_time - tol:
            self.late += 1
            return None
        if not self._seen[column]:
            self._seen[column] = True
            self._seen_count += 1
        problem = _problem(value, status, self.spec.accept_uncertain)
        if problem:
            self._row_problem = self._row_problem or problem
        elif not self._filled[column]:
            self._row[column] = float(value)
            self._filled[column] = True
            self._count += 1
        if self._seen_count == self.spec.columns:  # every column has its sample: the row is whole, usable or not
            return self._close_row() or out
        return out

    def _close_row(self) -> Window | None:
        spec, when = self.spec, self._row_time
        row, filled, problem = self._row, self._filled, self._row_problem
        self._open_row()
        if not problem and not all(filled):
            if spec.missing == "hold":
                for c, ok in enumerate(filled):
                    if ok:
                        continue
                    if math.isnan(self._last[c]):
                        problem = "missing"
                    elif when - self._last_time[c] > spec.stale_after_s:
                        problem = "stale"
                    else:
                        row[c] = self._last[c]
            else:
                problem = "missing"
        if problem:
            self.restart(problem)
            self._stride_point()  # the row itself was a point where a window might have run
            return None
        for c, ok in enumerate(filled):
            if ok:
                self._last[c], self._last_time[c] = row[c], when
        self._rows.append(np.asarray(row, dtype=np.float32))
        self._row_times.append(when)
        if spec.triggered:
            return None
        return self._stride_point()

    def _stride_point(self) -> Window | None:
        self._new_rows += 1
        if self._new_rows < self.spec.stride:
            return None
        self._new_rows = 0
        return self._cut()

    def _cut(self) -> Window | None:
        if len(self._rows) == self.spec.window:
            self.windows += 1
            return Window(self.spec.name, np.stack(self._rows), self._row_times[-1])
        if self._restart_reason:
            self.skipped[self._restart_reason] = self.skipped.get(self._restart_reason, 0) + 1
        return None

    def trigger(self, value, status: int) -> Window | None:
        """A sample of the trigger node: a window at a Boolean's rising edge or a counter's change."""
        if _problem(value, status, self.spec.accept_uncertain):
            return None
        previous, self._trigger_last = self._trigger_last, value
        if previous is None:
            return None  # the first value is no edge
        edge = (bool(value) and not bool(previous)) if self.spec.trigger_kind == "rising" else value != previous
        return self._cut() if edge else None

    # ---- gaps ----

    def restart(self, reason: str) -> None:
        """Throw the rows away: the next window begins after this point (a gap, a bad sample)."""
        self._rows.clear()
        self._row_times.clear()
        self._restart_reason = reason
        if reason in ("gap", "stale"):  # nothing is held across a gap
            self._last = [math.nan] * self.spec.columns
            self._last_time = [-math.inf] * self.spec.columns
            self._open_row()
            self._trigger_last = None

    def gap(self) -> None:
        """The source's data stopped (disconnected, subscription lost): counted once as a skipped window."""
        had_rows = bool(self._rows) or self._count
        self.restart("gap")
        if had_rows:
            self.skipped["gap"] = self.skipped.get("gap", 0) + 1

    def check_stale(self, now: float) -> bool:
        """No row for `stale_after_s` (by SourceTimestamp against `now`, Unix seconds): the rows so far are
        stale and thrown away. True when that happened."""
        if self._row_times and now - self._row_times[-1] > self.spec.stale_after_s:
            self.restart("stale")
            self.skipped["stale"] = self.skipped.get("stale", 0) + 1
            return True
        return False


def _problem(value, status: int, accept_uncertain: bool) -> str:
    sev = severity(status)
    if sev == "Bad":
        return "bad"
    if sev == "Uncertain" and not accept_uncertain:
        return "uncertain"
    if isinstance(value, bool):
        return ""
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return "type"
    return ""
