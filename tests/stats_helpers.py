"""Exact-distribution checks: Pearson chi-square of observed counts against a KNOWN distribution.

The threshold is the chi-square quantile for a false-failure rate of 1e-9 per assertion, so a
correct implementation fails essentially never, whatever the seed; power comes from the number
of draws (a total-variation error delta gives a noncentrality of about 4 * N * delta**2).

    from stats_helpers import assert_distributed_as, is_distributed_as
    assert_distributed_as(samples, p)            # samples: token ids, p: exact probabilities
    assert not is_distributed_as(samples, p)     # negative controls
"""

from __future__ import annotations

import numpy as np
from scipy import stats

from verispec.analysis.chisquare import chi_square as _chi_square

FALSE_FAILURE = 1e-9
MIN_EXPECTED = 5.0

__all__ = [
    "FALSE_FAILURE",
    "MIN_EXPECTED",
    "to_numpy",
    "counts_of",
    "chi_square",
    "threshold",
    "assert_distributed_as",
    "is_distributed_as",
]


def to_numpy(x) -> np.ndarray:
    """A torch tensor (any device, any dtype) or array-like -> numpy array."""
    if hasattr(x, "detach"):  # torch.Tensor without importing torch here
        x = x.detach().cpu()
        if x.dtype.is_floating_point:
            x = x.double()
        return x.numpy()
    return np.asarray(x)


def counts_of(samples, vocab: int) -> np.ndarray:
    """Token ids (any shape) -> counts per token [vocab]. Ids outside [0, vocab) are an error."""
    ids = to_numpy(samples).ravel()
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"samples must be integer token ids, got dtype {ids.dtype}")
    ids = ids.astype(np.int64)
    bad = ids[(ids < 0) | (ids >= vocab)]
    if bad.size:
        raise ValueError(f"{bad.size} sample(s) outside [0, {vocab}), e.g. {np.unique(bad)[:10].tolist()}")
    return np.bincount(ids, minlength=vocab)


def chi_square(counts, probs, min_expected: float = MIN_EXPECTED) -> tuple[float, int]:
    """Pearson chi-square statistic and degrees of freedom of `counts` against the exact `probs`
    (tensors or arrays): verispec.analysis.chisquare.chi_square (cells with expected < min_expected
    pooled; a draw where probs == 0 gives inf)."""
    return _chi_square(to_numpy(counts), to_numpy(probs), min_expected)


def threshold(df: int, false_failure: float = FALSE_FAILURE) -> float:
    """The chi-square quantile exceeded with probability `false_failure` under the null (scipy's:
    an independent check of verispec.analysis.chisquare.threshold, tests/test_check.py)."""
    if df <= 0:
        return 0.0
    return float(stats.chi2.isf(false_failure, df))


def _counts_and_probs(samples_or_counts, probs, are_counts: bool):
    probs = to_numpy(probs).astype(np.float64).ravel()
    if are_counts:
        counts = to_numpy(samples_or_counts).astype(np.float64).ravel()
    else:
        counts = counts_of(samples_or_counts, probs.size)
    return counts, probs


def _report(
    counts: np.ndarray, probs: np.ndarray, stat: float, df: int, thr: float, false_failure: float, label: str
) -> str:
    n = counts.sum()
    p = probs / probs.sum()
    expected = n * p
    zero_hits = np.nonzero((p == 0) & (counts > 0))[0]
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(expected > 0, (counts - expected) / np.sqrt(expected), np.inf * (counts > 0))
    worst = np.argsort(-np.abs(np.nan_to_num(z, posinf=1e300)), kind="stable")[:8]
    lines = [
        f"{label + ': ' if label else ''}chi-square {stat:.2f} > threshold {thr:.2f} "
        f"(df={df}, N={int(n)}, false-failure rate {false_failure:g}); "
        f"empirical TV distance {0.5 * np.abs(counts / n - p).sum():.4g}",
    ]
    if zero_hits.size:
        lines.append(f"  tokens with probability 0 drawn: { {int(t): int(counts[t]) for t in zero_hits} }")
    lines.append("  token: observed / expected (largest deviations)")
    for t in worst:
        lines.append(f"  {int(t):5d}: {int(counts[t]):8d} / {expected[t]:10.1f}")
    return "\n".join(lines)


def is_distributed_as(
    samples_or_counts,
    probs,
    *,
    are_counts: bool = False,
    false_failure: float = FALSE_FAILURE,
    min_expected: float = MIN_EXPECTED,
) -> bool:
    """True when the chi-square test against the exact `probs` does not reject."""
    counts, p = _counts_and_probs(samples_or_counts, probs, are_counts)
    stat, df = chi_square(counts, p, min_expected)
    return stat <= threshold(df, false_failure)


def assert_distributed_as(
    samples_or_counts,
    probs,
    *,
    are_counts: bool = False,
    false_failure: float = FALSE_FAILURE,
    min_expected: float = MIN_EXPECTED,
    label: str = "",
) -> None:
    """Assert that samples (token ids, any shape) or counts (with are_counts=True) are
    consistent with the exact distribution `probs` [V] at the given false-failure rate."""
    counts, p = _counts_and_probs(samples_or_counts, probs, are_counts)
    stat, df = chi_square(counts, p, min_expected)
    thr = threshold(df, false_failure)
    assert stat <= thr, _report(counts, p, stat, df, thr, false_failure, label)
