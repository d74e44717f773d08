"""The draft-length decision: the k whose throughput is highest at the optimistic end of its uncertainty.

This is an upper-confidence-bound (UCB) rule over the arms k = 0..k_max. The throughput of k is the
expected tokens a row commits per pass, E(k), over an iteration's seconds, t(k). A time measured often
and recently is known to within a few percent; a time predicted from the cost model, or measured long
ago and dropped, is known to within much less. Optimism makes the policy measure a k whose time is
uncertain exactly when that uncertainty could hide a better choice, and not otherwise: the exploration
a noisy, changing machine needs follows from the estimates' uncertainty, not from special cases.
"""

from __future__ import annotations

from collections.abc import Sequence


def choose_k(tokens: Sequence[float], seconds: Sequence[float], uncertainty: Sequence[float]) -> int:
    """argmax over k of tokens[k] / (seconds[k] * (1 - uncertainty[k])); ties go to the shorter draft.

    tokens[k]: expected tokens committed per row and pass at draft length k (tokens[0] = 1);
    seconds[k]: the estimated seconds of an iteration at k; uncertainty[k]: its relative uncertainty
    in [0, 1). Plain decoding (k = 0) is an arm like the others."""
    if not len(tokens) == len(seconds) == len(uncertainty) or not tokens:
        raise ValueError("tokens, seconds and uncertainty must be non-empty and of one length")
    optimistic = [e / (t * (1.0 - min(u, 0.9))) for e, t, u in zip(tokens, seconds, uncertainty)]
    return max(range(len(optimistic)), key=lambda k: (optimistic[k], -k))
