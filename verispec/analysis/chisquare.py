"""Pearson's chi-square test of observed counts against a known distribution, without scipy.

Owns `chi_square` (the statistic and degrees of freedom, cells with an expected count below
5 pooled, smallest first), `threshold` (the quantile exceeded with a given false-failure
probability under the null: the regularised upper incomplete gamma function of torch,
inverted by bisection in float64) and `detectable_tv` (the smallest total-variation error
that the test detects about half of the time). Used by `verispec check`; the test suite's
helpers (tests/stats_helpers.py) use the same statistic and check the threshold against
scipy's. Knows nothing of models.
"""

from __future__ import annotations

import math

import numpy as np
import torch

FALSE_FAILURE = 1e-9
MIN_EXPECTED = 5.0


def merge_cells(
    observed: np.ndarray, expected: np.ndarray, min_expected: float = MIN_EXPECTED
) -> tuple[np.ndarray, np.ndarray]:
    """Pool cells with expected < min_expected into one cell (smallest first), so that every
    cell, the pooled one included, has expected >= min_expected (when the total allows)."""
    order = np.argsort(expected, kind="stable")
    exp_sorted, obs_sorted = expected[order], observed[order]
    i, pool_e, pool_o = 0, 0.0, 0.0
    while i < exp_sorted.size and exp_sorted[i] < min_expected:  # all the small cells
        pool_e, pool_o, i = pool_e + exp_sorted[i], pool_o + obs_sorted[i], i + 1
    while 0 < pool_e < min_expected and i < exp_sorted.size:  # the pool itself is too small: absorb the next smallest
        pool_e, pool_o, i = pool_e + exp_sorted[i], pool_o + obs_sorted[i], i + 1
    cells_e, cells_o = list(exp_sorted[i:]), list(obs_sorted[i:])
    if pool_e > 0:
        cells_e.insert(0, pool_e)
        cells_o.insert(0, pool_o)
    return np.asarray(cells_o, dtype=np.float64), np.asarray(cells_e, dtype=np.float64)


def chi_square(counts, probs, min_expected: float = MIN_EXPECTED) -> tuple[float, int]:
    """Pearson chi-square statistic and degrees of freedom of `counts` against the exact `probs`.

    `probs` is normalised here (it need only be non-negative with a positive sum). Cells where
    probs == 0 must be empty: a single draw there gives statistic = inf. Cells with expected
    count < min_expected are merged (`merge_cells`); df = number of cells - 1. With a single
    cell (df = 0) there is nothing left to test and the statistic is 0.
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    if counts.shape != probs.shape:
        raise ValueError(f"counts {counts.shape} and probs {probs.shape} differ in length")
    if not np.all(np.isfinite(probs)) or np.any(probs < 0) or probs.sum() <= 0:
        raise ValueError("probs must be finite, >= 0, with a positive sum")
    if np.any(counts < 0):
        raise ValueError("counts must be >= 0")
    n = counts.sum()
    if n <= 0:
        raise ValueError("no observations")
    probs = probs / probs.sum()
    support = probs > 0
    observed, expected = merge_cells(counts[support], n * probs[support], min_expected)
    df = observed.size - 1
    if counts[~support].sum() > 0:
        return math.inf, df
    if df <= 0:
        return 0.0, 0
    return float(np.sum((observed - expected) ** 2 / expected)), df


def _survival(x: float, df: int) -> float:
    """P(chi-square with df degrees of freedom > x)."""
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64))
    )


def threshold(df: int, false_failure: float = FALSE_FAILURE) -> float:
    """The chi-square quantile exceeded with probability `false_failure` under the null."""
    if df <= 0:
        return 0.0
    low, high = float(df), float(df) + 10.0
    while _survival(high, df) > false_failure:
        low, high = high, 2 * high
    for _ in range(200):  # bisection to float64 resolution
        middle = (low + high) / 2
        if middle in (low, high):
            break
        low, high = (middle, high) if _survival(middle, df) > false_failure else (low, middle)
    return high


def detectable_tv(n: int, df: int, false_failure: float = FALSE_FAILURE) -> float:
    """The smallest total-variation error the test detects with probability about 1/2 at n draws:
    the hardest case, mass delta moved between two cells, gives a noncentrality of at least
    4 n delta^2, and the statistic's mean (df + noncentrality) then reaches the threshold."""
    if df <= 0 or n <= 0:
        return math.inf
    return math.sqrt(max(threshold(df, false_failure) - df, 0.0) / (4 * n))
