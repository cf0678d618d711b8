"""Building a tensor model's drift reference offline, from the data it was trained on: per-feature bin edges with
the reference proportions (for PSI), quantiles (for a KS distance), the natural level of each feature's score
between stretches of normal operation, and the distribution of predicted classes and confidences. The detector that
reads the file online is appliance/drift.py; `python -m tools.te_classifier.drift_reference` builds the demo's."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from appliance.drift import REFERENCE_FORMAT, FeatureWindow

PSI_BINS = 10  # deciles of the reference data
QUANTILES = 101  # 0, 1, ..., 100 %
# Lowest natural level per test: PSI 0.1 is the textbook "no shift"; KS 0.1 is about its 5 % critical value at 200
NATURAL_FLOOR = {"psi": 0.1, "ks": 0.1}
# Natural level across other runs: this quantile of their per-feature scores (robust to the quarter of runs in which
# a fault moves that variable)
RUN_QUANTILE = 0.75


def distribution_stats(features: np.ndarray) -> dict:
    """Per-feature PSI bin edges (reference deciles) with the reference proportions, and quantiles (for KS)."""
    features = np.asarray(features, dtype=np.float64)
    edges, proportions = [], []
    for column in features.T:
        inner = _midpoint_edges(column, np.quantile(column, np.linspace(0, 1, PSI_BINS + 1)[1:-1]))
        counts = np.bincount(np.searchsorted(inner, column, side="right"), minlength=len(inner) + 1)
        edges.append(inner.tolist())
        proportions.append((counts / counts.sum()).tolist())
    return {"psi_edges": edges, "psi_proportions": proportions,
            "quantiles": np.quantile(features, np.linspace(0, 1, QUANTILES), axis=0).T.tolist()}


def _midpoint_edges(column: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """Bin edges halfway between the data values around each cut: process values are often quantized (TE's
    reactor temperature moves in steps of 0.01), and an edge equal to a value would bin it by float rounding."""
    values = np.unique(column)
    above = np.searchsorted(values, cuts, side="right")
    inside = above < len(values)
    edges = cuts.copy()
    edges[inside] = (values[above[inside] - 1] + values[above[inside]]) / 2
    return np.unique(edges)


def natural_levels(features: np.ndarray, window: int, other_runs: list[np.ndarray] = ()) -> dict[str, list[float]]:
    """How far one stretch of the reference data is from another, per feature and test: each half of the data is
    scored (its last `window` samples) against statistics of the other half, and the larger score is kept. Process
    variables wander slowly, so two stretches of normal operation differ far more than PSI's textbook thresholds
    assume (on the TE file d00.dat, XMV(9) scores a PSI of 3.6 between its halves); scores are divided by these
    levels, floored at NATURAL_FLOOR."""
    features = np.asarray(features, dtype=np.float64)
    half = len(features) // 2
    if half < 10:
        raise ValueError(f"at least 20 reference samples are needed, got {len(features)}")
    levels = {test: np.zeros(features.shape[1]) for test in ("psi", "ks")}
    for ref_part, other in ((features[:half], features[half:]), (features[half:], features[:half])):
        stats = distribution_stats(ref_part)
        tail = other[-min(window, len(other)):]
        for test in levels:
            scorer = FeatureWindow(stats, len(tail), test)
            for row in tail:
                scorer.add(row)
            levels[test] = np.maximum(levels[test], scorer.scores())
    if other_runs:
        stats = distribution_stats(features)
        for test in levels:
            per_run = []
            for run in other_runs:
                tail = np.asarray(run, dtype=np.float64)[-window:]
                scorer = FeatureWindow(stats, len(tail), test)
                for row in tail:
                    scorer.add(row)
                per_run.append(scorer.scores())
            levels[test] = np.maximum(levels[test], np.quantile(per_run, RUN_QUANTILE, axis=0))
    return {test: np.maximum(level, NATURAL_FLOOR[test]).tolist() for test, level in levels.items()}


def build_reference(features: np.ndarray, feature_names: list[str], probabilities: np.ndarray,
                    sample_shape: list[int], model_file: Path | None = None,
                    class_counts: list[int] | None = None, source: str = "", window: int = 100,
                    other_runs: list[np.ndarray] = ()) -> dict:
    """The reference statistics of one model from its reference data: `features` (n, F) as `sample_features` gives
    them, the model's `probabilities` (n, C) on the same samples, and optionally the training label counts.
    `window`: the detector window the natural levels are measured for (the YAML's default)."""
    features = np.asarray(features, dtype=np.float64)
    probabilities = np.asarray(probabilities, dtype=np.float64)
    if features.ndim != 2 or features.shape[1] != len(feature_names) or len(features) != len(probabilities):
        raise ValueError("features must be (n, len(feature_names)) and probabilities (n, classes)")
    predicted = probabilities.argmax(axis=1)
    confidence = probabilities.max(axis=1)
    n_classes = probabilities.shape[1]
    reference = {
        "format": REFERENCE_FORMAT,
        "source": source,
        "samples": int(len(features)),
        "sample_shape": list(sample_shape),
        "feature_rule": "newest row of each sample" if len(sample_shape) == 2 else "sample flattened",
        "features": list(feature_names),
        **distribution_stats(features),
        "natural_window": window,
        "natural_levels": natural_levels(features, window, other_runs),
        "predicted_class_distribution": (np.bincount(predicted, minlength=n_classes) / len(predicted)).tolist(),
        "confidence_mean": float(confidence.mean()),
        "confidence_quantiles": np.quantile(confidence, [0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99]).tolist(),
    }
    if class_counts is not None:
        reference["training_class_distribution"] = (np.asarray(class_counts) / np.sum(class_counts)).tolist()
    if model_file is not None:
        reference["model_file"] = Path(model_file).name
        reference["model_sha256"] = hashlib.sha256(Path(model_file).read_bytes()).hexdigest()
    return reference


def write_reference(reference: dict, path: Path) -> None:
    """Compact JSON with rounded floats: a reviewable, stable file."""
    def rounded(v):
        if isinstance(v, float):
            return float(f"{v:.7g}")
        if isinstance(v, list):
            return [rounded(x) for x in v]
        if isinstance(v, dict):
            return {k: rounded(x) for k, x in v.items()}
        return v
    path.write_text(json.dumps(rounded(reference), separators=(",", ":")) + "\n", encoding="utf-8")
