"""A feed's windows (appliance/sources/windows.py), alone: rows aligned by SourceTimestamp, stride and trigger, and
every kind of bad data restarting the window so that no model sees it and no window spans it."""
from __future__ import annotations

import numpy as np

from appliance.sources.windows import FeedSpec, FeedWindows

GOOD, UNCERTAIN, BAD = 0, 0x40000000, 0x80000000


def feed(**kw) -> FeedWindows:
    spec = dict(name="f", columns=2, window=3, stride=1, tolerance_s=0.01, stale_after_s=5.0)
    spec.update(kw)
    return FeedWindows(FeedSpec(**spec))


def rows(fw: FeedWindows, values, start: float = 100.0, status=GOOD, dt: float = 0.1) -> list:
    """Each row's columns as samples (column order), row i at start + i*dt; the windows that came out."""
    out = []
    for i, row in enumerate(values):
        for c, v in enumerate(row):
            out += fw.sample(c, v, status if not callable(status) else status(i, c), start + i * dt)
    return out


def test_rows_close_when_whole_and_windows_come_every_stride_rows():
    fw = feed(stride=2)
    out = rows(fw, [[i, 10 * i] for i in range(7)])
    # rows 0..6: the window is full at row 2; stride 2 from the first stride point on (rows 1, 3, 5)
    assert [w.data[:, 0].tolist() for w in out] == [[1, 2, 3], [3, 4, 5]]
    assert out[0].data.dtype == np.float32 and out[0].data.shape == (3, 2)
    assert out[-1].last_source_time == 100.5
    assert fw.skipped == {}  # warming up is no skip


def test_a_bad_or_uncertain_sample_restarts_the_window_and_counts_the_windows_it_cost():
    fw = feed()
    out = rows(fw, [[i, i] for i in range(10)], status=lambda i, c: BAD if i == 4 and c == 1 else GOOD)
    ends = [w.data[-1, 0] for w in out]
    assert ends == [2, 3, 7, 8, 9]  # no window holds row 4; rows 5 and 6 only refill
    assert all(4 not in w.data[:, 0] for w in out)
    assert fw.skipped == {"bad": 3}  # the bad row's own window and the two while refilling
    fw = feed()
    rows(fw, [[i, i] for i in range(5)], status=lambda i, c: UNCERTAIN if i == 3 else GOOD)
    assert fw.skipped == {"uncertain": 2}
    fw = feed(accept_uncertain=True)
    assert len(rows(fw, [[i, i] for i in range(5)], status=lambda i, c: UNCERTAIN if i == 3 else GOOD)) == 3


def test_a_value_that_is_not_a_finite_number_never_reaches_a_window():
    fw = feed()
    out = rows(fw, [[0, 0], [1, float("nan")], [2, 2], [3, 3], [4, 4]])
    assert [w.data[-1, 0] for w in out] == [4]
    assert fw.skipped == {"type": 3}  # the row's own window and the two refilling
    fw = feed()
    rows(fw, [[0, 0], [1, "text"], [2, 2]])
    assert fw.skipped == {"type": 2}


def test_a_gap_restarts_the_window_so_that_none_spans_it():
    fw = feed()
    before = rows(fw, [[i, i] for i in range(4)])
    fw.gap()
    after = rows(fw, [[i, i] for i in range(100, 104)], start=200.0)
    assert [w.data[:, 0].tolist() for w in before] == [[0, 1, 2], [1, 2, 3]]
    assert [w.data[:, 0].tolist() for w in after] == [[100, 101, 102], [101, 102, 103]]
    assert fw.skipped["gap"] == 1 + 2  # the gap, and the two rows refilling after it


def test_missing_columns_are_held_unless_stale_or_skipped_when_asked():
    # column 1 sends nothing in row 2: `hold` keeps its last value, `skip` restarts the window
    def samples(fw):
        out = []
        for i in range(5):
            t = 100 + i * 0.1
            for c in range(2):
                if not (i == 2 and c == 1):
                    out += fw.sample(c, float(i), GOOD, t)
        return out
    held = samples(feed(missing="hold"))
    assert [w.data[:, 1].tolist() for w in held] == [[0, 1, 1], [1, 1, 3], [1, 3, 4]]
    fw = feed(missing="skip")
    assert [w.data[-1, 0] for w in samples(fw)] == []
    assert fw.skipped == {"missing": 3}
    fw = feed(missing="hold", stale_after_s=0.05)  # the held value is 0.1 s old: too old
    samples(fw)
    assert fw.skipped.get("stale", 0) >= 1


def test_late_samples_are_dropped_and_rows_align_within_the_tolerance():
    fw = feed(tolerance_s=0.02)
    assert fw.sample(0, 1.0, GOOD, 100.0) == []
    assert fw.sample(1, 1.0, GOOD, 100.015) == []  # same row, within 20 ms: the row is whole
    assert fw.sample(0, 2.0, GOOD, 100.1) == []
    assert fw.sample(1, 9.0, GOOD, 99.9) == []  # its row is closed: late
    assert fw.late == 1


def test_rows_sent_item_by_item_in_one_publish_are_put_back_together():
    # a server's publish with two rows, node by node: a0 a1 b0 b1 (not a0 b0 a1 b1)
    fw = feed(window=2)
    out = []
    for c in range(2):
        for i in range(2):
            out += fw.sample(c, float(10 * c + i), GOOD, 100 + i * 0.1)
    assert [w.data.tolist() for w in out] == [[[0, 10], [1, 11]]]
    assert fw.skipped == {}


def test_no_row_for_stale_after_s_throws_the_rows_away():
    import time
    fw = feed(stale_after_s=1.0)
    rows(fw, [[0, 0], [1, 1]])
    assert not fw.check_stale(time.monotonic() + 0.5)  # by this box's clock: a PLC's may be off
    assert fw.check_stale(time.monotonic() + 10.0)
    assert [w.data[:, 0].tolist() for w in rows(fw, [[5, 5], [6, 6], [7, 7]], start=111.0)] == [[5, 6, 7]]


def test_a_trigger_cuts_the_latest_rows_at_a_rising_edge_or_a_counter_change():
    fw = feed(triggered=True)
    assert rows(fw, [[i, i] for i in range(5)]) == []  # no stride windows with a trigger
    assert fw.trigger(False, GOOD) is None  # the first value is no edge
    assert fw.trigger(False, GOOD) is None
    w = fw.trigger(True, GOOD)
    assert w.data[:, 0].tolist() == [2, 3, 4]
    assert fw.trigger(True, GOOD) is None  # still high: no new edge
    fw = feed(triggered=True, trigger_kind="change")
    rows(fw, [[i, i] for i in range(3)])
    assert fw.trigger(7, GOOD) is None
    assert fw.trigger(8, GOOD) is not None
    assert fw.trigger(8, GOOD) is None
