"""A feed's windows, cut from the samples of a source's nodes: torch- and network-free, so it is tested alone.

Alignment. Samples of the feed's columns form a row when their SourceTimestamps lie within `tolerance_s` of the
row's first sample. A row closes as soon as every column has a sample (no waiting for the next row: the window's
delay is the slowest column's), or when a later row is whole, or when more than OPEN_ROWS rows are open; a sample of
a row already closed is late and dropped. A column missing from a closed row is held from its last value (`missing: hold`, unless that value is
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
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

SKIP_REASONS = ("bad", "uncertain", "type", "missing", "stale", "gap")
OPEN_ROWS = 16  # rows being assembled at once (a late publish may carry several rows, item by item)


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
    late: int = 0  # samples of a row already closed (or older), dropped

    def __post_init__(self) -> None:
        self._rows: deque[np.ndarray] = deque(maxlen=self.spec.window)
        self._row_times: deque[float] = deque(maxlen=self.spec.window)
        self._new_rows = 0  # rows since the last window (or stride point)
        self._restart_reason = ""  # why the rows were last thrown away ("" at the start: warming up is no skip)
        self._last = [math.nan] * self.spec.columns  # each column's last good value and its time, for `hold`
        self._last_time = [-math.inf] * self.spec.columns
        self._trigger_last = None
        self._open: list[_Row] = []  # rows not closed yet, oldest first
        self._closed_time = -math.inf  # the SourceTimestamp of the last row closed
        self._closed_at = -math.inf  # when (time.monotonic()) the last row was added: a PLC's clock may be off

    # ---- samples ----

    def sample(self, column: int, value, status: int, source_time: float) -> list[Window]:
        """One sample of a column (its DataValue's value, StatusCode and SourceTimestamp in Unix seconds); returns
        the windows this sample completed (usually none or one).

        A server may send the samples of two rows item by item (every sample of node A, then every sample of node
        B) in one publish: up to OPEN_ROWS rows stay open at once, and a row that becomes whole closes the older
        ones first (those lack a column for good: held or skipped)."""
        tol = self.spec.tolerance_s
        if source_time <= self._closed_time + tol:  # its row is closed already (or older)
            self.late += 1
            return []
        row = next((r for r in self._open if abs(source_time - r.time) <= tol), None)
        out: list[Window] = []
        if row is None:
            row = _Row(source_time, self.spec.columns)
            self._open.append(row)
            self._open.sort(key=lambda r: r.time)
            while len(self._open) > OPEN_ROWS:
                out += self._close(self._open[0])
        if not row.seen[column]:
            row.seen[column] = True
            row.seen_count += 1
        problem = _problem(value, status, self.spec.accept_uncertain)
        if problem:
            row.problem = row.problem or problem
        elif not row.filled[column]:
            row.values[column] = float(value)
            row.filled[column] = True
        if row.seen_count == self.spec.columns and row in self._open:  # whole, usable or not
            while self._open and self._open[0] is not row:
                out += self._close(self._open[0])
            if row in self._open:
                out += self._close(row)
        return out

    def _close(self, r: "_Row") -> list[Window]:
        spec, when = self.spec, r.time
        self._open.remove(r)
        self._closed_time = max(self._closed_time, when)
        row, filled, problem = r.values, r.filled, r.problem
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
            return []
        for c, ok in enumerate(filled):
            if ok:
                self._last[c], self._last_time[c] = row[c], when
        self._rows.append(np.asarray(row, dtype=np.float32))
        self._row_times.append(when)
        self._closed_at = time.monotonic()
        if spec.triggered:
            return []
        w = self._stride_point()
        return [w] if w is not None else []

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

    def restart(self, reason: str, drop_open: bool = False) -> None:
        """Throw the rows away: the next window begins after this point (a gap, a bad sample); drop_open: the rows
        being assembled too (the data stopped)."""
        self._rows.clear()
        self._row_times.clear()
        self._restart_reason = reason
        if reason in ("gap", "stale"):  # nothing is held across a gap
            self._last = [math.nan] * self.spec.columns
            self._last_time = [-math.inf] * self.spec.columns
            self._trigger_last = None
        if drop_open:
            self._open = []

    def gap(self) -> None:
        """The source's data stopped (disconnected, subscription lost): counted once as a skipped window."""
        had_rows = bool(self._rows) or bool(self._open)
        self.restart("gap", drop_open=True)
        self._closed_time = -math.inf  # the source may restart its clock
        if had_rows:
            self.skipped["gap"] = self.skipped.get("gap", 0) + 1

    def check_stale(self, now: float | None = None) -> bool:
        """No row for `stale_after_s` (now: time.monotonic(); measured here, not by SourceTimestamps, since a
        PLC's clock may be off): the rows so far are stale and thrown away. True when that happened."""
        now = time.monotonic() if now is None else now
        if self._row_times and now - self._closed_at > self.spec.stale_after_s:
            self.restart("stale", drop_open=True)
            self.skipped["stale"] = self.skipped.get("stale", 0) + 1
            return True
        return False


class _Row:
    """A row being assembled: its SourceTimestamp, values, which columns have a usable value, which a sample."""

    __slots__ = ("time", "values", "filled", "seen", "seen_count", "problem")

    def __init__(self, time: float, columns: int):
        self.time = time
        self.values = [math.nan] * columns
        self.filled = [False] * columns
        self.seen = [False] * columns
        self.seen_count = 0
        self.problem = ""


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
