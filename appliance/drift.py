"""Drift of a tensor model's inputs and predictions away from its reference data: engine-independent.

Reference statistics are a JSON file beside the model (`<model>.drift.json`, made offline by appliance/
drift_reference.py's `build_reference` from the data the model was trained on): per-feature bin edges with the
reference proportions (for PSI) and quantiles (for a KS distance), and the distribution of predicted classes and
confidences on the reference data.

Online, `DriftDetector.update(inputs, probabilities)` takes each Infer call's samples and keeps the last `window` of
them. Per feature it compares the window with the reference, by the population stability index (PSI, the usual
measure in credit and process monitoring: < 0.1 stable, 0.1-0.25 a shift, > 0.25 a large shift) or by the
Kolmogorov-Smirnov distance to the reference distribution. The score is the largest feature's value and names that
feature. Beside it, ADWIN (Bifet & Gavaldà 2007; a small implementation of its own here, because `river` pulls pandas
and scipy for one class) watches the stream of predicted confidences for a change in its mean. State is
Drifting while the score exceeds the threshold or ADWIN saw a change within the last window, else Ok; NoReference
without a reference file. numpy only; runs on the event loop (no threads, no locks).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REFERENCE_FORMAT = "appliance-drift-reference/1"
PSI_FLOOR = 1e-4  # proportions are floored so an empty bin gives a large, finite PSI


class DriftReferenceError(ValueError):
    """A reference file that cannot be used; the message names the file and what is wrong."""


# ----------------------------------------------------------------------------------------------------------------
# The reference file, as the detector reads it


def sample_features(inputs: np.ndarray, sample_shape: list[int]) -> np.ndarray:
    """(k, F) feature values of k samples: for a 2-D sample (time x variables, e.g. the TE window [20, 52]) the
    newest row, so that successive windows of one process contribute each process sample once; else the sample
    flattened."""
    x = np.asarray(inputs, dtype=np.float64).reshape(-1, *sample_shape)
    return x[:, -1, :] if len(sample_shape) == 2 else x.reshape(len(x), -1)


def load_reference(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DriftReferenceError(f"{path}: cannot read the drift reference ({type(e).__name__})") from None
    if not isinstance(data, dict) or data.get("format") != REFERENCE_FORMAT:
        raise DriftReferenceError(f"{path}: not a drift reference file (format {REFERENCE_FORMAT!r} expected)")
    n = len(data.get("features", []))
    lists = [data.get(k, []) for k in ("psi_edges", "psi_proportions", "quantiles")]
    lists += [data.get("natural_levels", {}).get(t, []) for t in ("psi", "ks")]
    if not n or any(len(x) != n for x in lists):
        raise DriftReferenceError(f"{path}: features, psi_edges, psi_proportions, quantiles and natural_levels "
                                  "differ in length")
    return data


def reference_mismatch(reference: dict, model_file: Path) -> str | None:
    """Why a reference does not belong to the model file (another file or other weights), or None when it does or
    the reference names no model. A model deployed without a fresh reference keeps the old one: say so."""
    digest = reference.get("model_sha256")
    if digest is None:
        return None
    if hashlib.sha256(Path(model_file).read_bytes()).hexdigest() != digest:
        return (f"the drift reference was made for other weights ({reference.get('model_file', '?')} sha256 "
                f"{digest[:12]}); rebuild it for {Path(model_file).name}")
    return None


# ----------------------------------------------------------------------------------------------------------------
# ADWIN


class Adwin:
    """ADWIN (ADaptive WINdowing, Bifet & Gavaldà 2007) over values in [0, 1]: keeps the longest recent window
    whose two parts' means do not differ by more than the bound for confidence `delta`; when they do, the older
    part is dropped and `update` answers True (a change). Exact version over a bounded window (`max_len`), every
    split checked with prefix sums every `clock` values (as river's ADWIN does, default 32 there): about 80 µs
    per check at 1000 values here, so 4 spreads it to ~20 µs per value for at most 3 values of extra delay."""

    def __init__(self, delta: float = 0.002, max_len: int = 1000, min_part: int = 5, clock: int = 4):
        self.delta, self.max_len, self.min_part, self.clock = delta, max_len, min_part, clock
        self.values: list[float] = []
        self.seen = 0

    def update(self, value: float) -> bool:
        self.values.append(float(value))
        if len(self.values) > self.max_len:
            del self.values[0]
        self.seen += 1
        if self.seen % self.clock or len(self.values) < 2 * self.min_part:
            return False
        changed = False
        while len(self.values) >= 2 * self.min_part:
            cut = self._cut()
            if cut is None:
                break
            del self.values[:cut]
            changed = True
        return changed

    def _cut(self) -> int | None:
        x = np.asarray(self.values)
        n = len(x)
        variance = float(x.var())
        prefix = np.cumsum(x)
        n0 = np.arange(self.min_part, n - self.min_part + 1)
        n1 = n - n0
        mean0 = prefix[n0 - 1] / n0
        mean1 = (prefix[-1] - prefix[n0 - 1]) / n1
        m = 1.0 / (1.0 / n0 + 1.0 / n1)
        log_term = math.log(2.0 * math.log(n) / self.delta) if n > 1 else 0.0
        bound = np.sqrt(2.0 / m * variance * log_term) + 2.0 / (3.0 * m) * log_term
        over = np.nonzero(np.abs(mean0 - mean1) > bound)[0]
        return int(n0[over[-1]]) if len(over) else None

    @property
    def mean(self) -> float:
        return float(np.mean(self.values)) if self.values else 0.0


# ----------------------------------------------------------------------------------------------------------------
# The online detector


@dataclass(frozen=True)
class DriftStatus:
    """What the address space shows under Models/<name>/Drift (CONTRACT.md)."""

    state: str  # Ok | Drifting | NoReference
    score: float  # 0 = like the reference data
    feature: str  # the input that drifts most ("" when none, "prediction confidence" when only ADWIN fired)
    since: datetime.datetime | None  # when State became Drifting


def psi(proportions: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Population stability index per row: sum over bins of (p - q) ln(p / q), proportions floored at PSI_FLOOR."""
    p = np.maximum(proportions, PSI_FLOOR)
    q = np.maximum(reference, PSI_FLOOR)
    return ((p - q) * np.log(p / q)).sum(axis=-1)


class PerFeatureTables:
    """One sorted table per feature (bin edges or quantiles), searched for a whole row of feature values in one
    numpy call: each table is scaled into its own band [4 i, 4 i + 1] and the bands concatenated; a value is
    scaled the same way (clipped to its band's margin) and searched once. About 50x faster than 52 searchsorted
    calls, which matters on the event loop (see bench/governance.py)."""

    def __init__(self, tables: list[list[float]]):
        self.tables = [np.asarray(t, dtype=np.float64) for t in tables]
        self.lo = np.array([t[0] if len(t) else 0.0 for t in self.tables])
        spread = np.array([t[-1] - t[0] if len(t) else 0.0 for t in self.tables])
        self.scale = np.where(spread > 0, spread, 1.0)
        self.offset = 4.0 * np.arange(len(self.tables))
        self.starts = np.concatenate([[0], np.cumsum([len(t) for t in self.tables])[:-1]]).astype(np.int64)
        self.bands = np.concatenate([(t - lo) / sc + off for t, lo, sc, off
                                     in zip(self.tables, self.lo, self.scale, self.offset)])

    def searchsorted_right(self, row: np.ndarray) -> np.ndarray:
        """Per feature i: np.searchsorted(tables[i], row[i], side="right")."""
        z = np.clip((np.asarray(row, dtype=np.float64) - self.lo) / self.scale, -1.0, 2.0) + self.offset
        return np.searchsorted(self.bands, z, side="right") - self.starts


class FeatureWindow:
    """The last `window` feature rows and their per-feature PSI or KS score against reference statistics."""

    def __init__(self, stats: dict, window: int, test: str):
        self.window, self.test = window, test
        self._edges = PerFeatureTables(stats["psi_edges"])
        n_features = len(self._edges.tables)
        width = max(len(e) for e in self._edges.tables) + 1
        self._ref_props = np.zeros((n_features, width))
        for i, props in enumerate(stats["psi_proportions"]):
            self._ref_props[i, :len(props)] = props
        self._quantiles = PerFeatureTables(stats["quantiles"])
        self._q = np.asarray(stats["quantiles"], dtype=np.float64)  # (F, QUANTILES), all the same length
        self._levels = np.linspace(0, 1, self._q.shape[1])
        self._cdf = np.zeros((window, n_features))  # reference CDF at each held sample's value (for KS)
        self._bins = np.zeros((window, n_features), dtype=np.int64)
        self._counts = np.zeros((n_features, width), dtype=np.int64)
        self._rows = np.arange(n_features)
        self.filled = 0
        self._next = 0

    def reference_cdf(self, row: np.ndarray) -> np.ndarray:
        """The reference CDF at each feature's value: linear between the stored quantiles, 0 below, 1 above."""
        k = self._quantiles.searchsorted_right(row)  # q[k-1] <= v < q[k]
        n = self._q.shape[1]
        inside = (k > 0) & (k < n)
        cdf = np.where(k >= n, 1.0, 0.0)
        i = self._rows[inside]
        lo, hi = self._q[i, k[inside] - 1], self._q[i, k[inside]]
        cdf[inside] = self._levels[k[inside] - 1] + (row[inside] - lo) / (hi - lo) * (self._levels[1] - self._levels[0])
        return cdf

    def add(self, row: np.ndarray) -> None:
        slot = self._next
        if self.filled == self.window:  # the oldest sample leaves the window
            self._counts[self._rows, self._bins[slot]] -= 1
        bins = self._edges.searchsorted_right(row)
        self._bins[slot] = bins
        self._counts[self._rows, bins] += 1
        if self.test == "ks":
            self._cdf[slot] = self.reference_cdf(np.asarray(row, dtype=np.float64))
        self._next = (slot + 1) % self.window
        self.filled = min(self.filled + 1, self.window)

    def scores(self) -> np.ndarray:
        """Per-feature PSI, or KS distance (sup |window ECDF - reference CDF|), of the held samples."""
        if self.test == "psi":
            return psi(self._counts / max(self.filled, 1), self._ref_props)
        u = np.sort(self._cdf[:self.filled], axis=0)
        n = len(u)
        steps = np.arange(1, n + 1)[:, None] / n
        return np.maximum((steps - u).max(axis=0), (u - (steps - 1.0 / n)).max(axis=0))


class DriftDetector:
    """Sliding-window drift state of one model; `update` after each Infer/Classify call with its inputs and
    probabilities. Score: the largest per-feature PSI (or KS) divided by that feature's natural level (the score
    between two stretches of the reference data, see appliance/drift_reference.py's natural_levels), so 1 means
    "as different as normal operation is from itself". The score is computed once the window is full (fewer
    samples make PSI noisy)."""

    def __init__(self, reference: dict | None, window: int = 100, test: str = "ks", threshold: float = 2.0,
                 adwin_delta: float = 0.002, clock=None):
        if test not in ("psi", "ks"):
            raise ValueError(f"test must be psi or ks, got {test!r}")
        self.reference, self.window, self.test, self.threshold = reference, window, test, threshold
        self._clock = clock or (lambda: datetime.datetime.now(datetime.timezone.utc))
        self.status = DriftStatus("NoReference" if reference is None else "Ok", 0.0, "", None)
        if reference is None:
            return
        self.sample_shape = list(reference["sample_shape"])
        self.features = list(reference["features"])
        self._natural = np.asarray(reference["natural_levels"][test])
        self.inputs = FeatureWindow(reference, window, test)
        self.adwin = Adwin(delta=adwin_delta)
        self._adwin_change_at = -1  # sample count at ADWIN's last change
        self.samples = 0

    @classmethod
    def from_file(cls, path: Path | None, **settings) -> "DriftDetector":
        """NoReference when the file does not exist; a broken file raises DriftReferenceError."""
        if path is None or not Path(path).exists():
            return cls(None, **settings)
        return cls(load_reference(Path(path)), **settings)

    @classmethod
    def for_model(cls, model) -> "DriftDetector | None":
        """The detector a model's YAML asks for (`drift:`), or None when drift detection is off. A reference made
        for other weights counts as none (NoReference; `mismatch` says why), so a deployed version without a fresh
        reference never compares against the wrong statistics."""
        if model.drift is None:
            return None
        settings = dict(window=model.drift.window, test=model.drift.test, threshold=model.drift.threshold,
                        adwin_delta=model.drift.adwin_delta)
        path = model.drift_reference_path
        detector = cls.from_file(path, **settings)
        model_file = model.resolved_path
        if detector.reference is not None and model_file is not None and model_file.is_file():
            why = reference_mismatch(detector.reference, model_file)
            if why is not None:
                detector = cls(None, **settings)
                detector.mismatch = why
        return detector

    mismatch: str | None = None  # why a reference file beside the model was not used

    @property
    def warm(self) -> bool:
        """True once the window is full and the status is a judgement."""
        return self.reference is not None and self.inputs.filled == self.window

    def update(self, inputs, probabilities) -> DriftStatus:
        if self.reference is None:
            return self.status
        feats = sample_features(inputs, self.sample_shape)
        probs = np.asarray(probabilities, dtype=np.float64).reshape(len(feats), -1)
        for row, confidence in zip(feats, probs.max(axis=1)):
            self.inputs.add(row)
            self.samples += 1
            if self.adwin.update(float(confidence)):
                self._adwin_change_at = self.samples
        return self._judge()

    def feature_scores(self) -> np.ndarray:
        """Per-feature score: PSI or KS of the window against the reference, over the feature's natural level."""
        return self.inputs.scores() / self._natural

    def _judge(self) -> DriftStatus:
        if not self.warm:
            return self.status
        scores = self.feature_scores()
        worst = int(np.argmax(scores))
        score = float(scores[worst])
        adwin_recent = self._adwin_change_at >= 0 and self.samples - self._adwin_change_at < self.window
        drifting = score > self.threshold or adwin_recent
        feature = self.features[worst] if score > self.threshold or not adwin_recent else "prediction confidence"
        since = self.status.since if self.status.state == "Drifting" else (self._clock() if drifting else None)
        self.status = DriftStatus("Drifting" if drifting else "Ok", score, feature, since)
        return self.status
