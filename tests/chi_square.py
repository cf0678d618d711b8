"""Chi-square checks the sampling tests share: a quantile, and two samples drawn from one distribution."""
from __future__ import annotations

import math


def chi_square_critical(df: int, z: float = 3.719) -> float:
    """The chi-square quantile at the normal quantile z (Wilson-Hilferty; z 3.719: p = 1e-4, a test that fails
    by chance once in 10,000 runs)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_same_distribution(plain: dict, other: dict, min_count: int = 10) -> None:
    """Two equal-sized samples (outcome -> count) drawn from one distribution: outcomes seen fewer than min_count
    times in both together are pooled into one cell, then the two-sample chi-square test."""
    keys = [k for k in set(plain) | set(other) if plain.get(k, 0) + other.get(k, 0) >= min_count]
    rest = (sum(v for k, v in plain.items() if k not in keys), sum(v for k, v in other.items() if k not in keys))
    a = [plain.get(k, 0) for k in keys] + [rest[0]]
    b = [other.get(k, 0) for k in keys] + [rest[1]]
    chi2 = sum((x - y) ** 2 / (x + y) for x, y in zip(a, b) if x + y > 0)  # equal sample sizes
    assert chi2 < chi_square_critical(max(1, len(a) - 1)), (chi2, a, b)
