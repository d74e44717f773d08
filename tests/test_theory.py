"""The closed forms and the refined cost model (verispec.theory), against exact arithmetic.

Expected tokens are checked against the distribution of the number of accepted tokens
(P(N = n) = alpha^n (1 - alpha) for n < k, alpha^k for n = k), computed in exact rationals.
Property tests use hypothesis; no timing, no Monte Carlo.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from verispec.rejection import acceptance_probability
from verispec.theory import (
    MAX_SUM_TERMS,
    CostModel,
    acceptance_rate,
    capped_speedups,
    expected_tokens,
    expected_tokens_per_position,
    mixed_speedup,
    optimal_k,
    refined_optimal_k,
    refined_speedup,
    refined_speedups,
    speedup,
    verification_cost_curve,
)

PROPERTY = settings(max_examples=200, deadline=None)

probabilities = st.floats(0.0, 1.0)
cost_ratios = st.floats(0.0, 2.0)
draft_lengths = st.integers(0, 64)
alpha_lists = st.lists(probabilities, max_size=32)


@st.composite
def distribution_pairs(draw) -> tuple[np.ndarray, np.ndarray]:
    """Two float64 distributions over the same vocabulary, with zeros allowed."""
    vocab = draw(st.integers(1, 16))
    pair = []
    for _ in range(2):
        weights = np.array(draw(st.lists(st.floats(0.0, 1.0), min_size=vocab, max_size=vocab)))
        assume(weights.sum() > 1e-6)
        pair.append(weights / weights.sum())
    return pair[0], pair[1]


@st.composite
def cost_curves(draw, length: int) -> list[float]:
    """r with r[0] == 1 and any positive values after it."""
    return [1.0] + draw(st.lists(st.floats(0.1, 10.0), min_size=length - 1, max_size=length - 1))


def exact_expected_tokens(alphas: list[float]) -> Fraction:
    """E = sum_n (n + 1) P(N = n), N = accepted draft tokens, in exact rationals."""
    alphas = [Fraction(a) for a in alphas]
    expected, reach = Fraction(0), Fraction(1)  # reach = P(N >= n)
    for n, alpha in enumerate(alphas):
        expected += (n + 1) * reach * (1 - alpha)
        reach *= alpha
    return expected + (len(alphas) + 1) * reach


# --------------------------------------------------------------------------- acceptance_rate


@PROPERTY
@given(distribution_pairs())
def test_acceptance_rate_is_one_minus_total_variation(pair):
    p, q = pair
    alpha = acceptance_rate(p.tolist(), q.tolist())
    assert isinstance(alpha, float)
    assert 0.0 <= alpha <= 1.0
    assert alpha == pytest.approx(1.0 - 0.5 * np.abs(p - q).sum(), abs=1e-12)
    assert acceptance_rate(q.tolist(), p.tolist()) == alpha


@PROPERTY
@given(distribution_pairs())
def test_acceptance_rate_of_a_distribution_with_itself_is_one(pair):
    assert acceptance_rate(pair[0].tolist(), pair[0].tolist()) == pytest.approx(1.0, abs=1e-12)


def test_acceptance_rate_of_disjoint_supports_is_zero():
    assert acceptance_rate([0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.25, 0.75]) == 0.0
    assert acceptance_rate([1.0, 0.0], [0.0, 1.0]) == 0.0


def test_acceptance_rate_on_tensors_is_per_row_in_the_input_dtype():
    generator = torch.Generator().manual_seed(0)
    target_probs = torch.softmax(torch.randn(3, 5, 11, generator=generator), dim=-1)  # [B, k, V]
    draft_probs = torch.softmax(torch.randn(3, 5, 11, generator=generator), dim=-1)  # [B, k, V]
    alpha = acceptance_rate(target_probs, draft_probs)
    assert alpha.shape == (3, 5) and alpha.dtype == torch.float32
    for b in range(3):
        for i in range(5):
            row = acceptance_rate(target_probs[b, i].double().tolist(), draft_probs[b, i].double().tolist())
            assert float(alpha[b, i]) == pytest.approx(row, abs=1e-6)
    one_hot = torch.nn.functional.one_hot(torch.tensor([2, 7]), 11)  # [2, V] long: converted to float
    assert torch.allclose(acceptance_rate(target_probs[0, :2], one_hot), target_probs[0, [0, 1], [2, 7]])


def test_acceptance_rate_agrees_with_the_rejection_rule_beta():
    generator = torch.Generator().manual_seed(1)
    target_probs = torch.softmax(torch.randn(4, 4, 9, generator=generator), dim=-1)  # [B, k+1, V]
    draft_probs = torch.softmax(torch.randn(4, 3, 9, generator=generator), dim=-1)  # [B, k, V]
    draft_token_ids = torch.zeros(4, 3, dtype=torch.long)  # [B, k]; beta does not depend on them
    beta = acceptance_probability(draft_token_ids, draft_probs, target_probs)  # [B, k]
    assert torch.allclose(acceptance_rate(target_probs[:, :3], draft_probs), beta, atol=1e-6)


BAD_DISTRIBUTIONS = [
    ("p", [0.5, -0.1, 0.6], [0.5, 0.5, 0.0]),
    ("q", [0.5, 0.5], [0.7, 0.7]),
    ("p", [0.5, 0.4], [0.5, 0.5]),
    ("p", [float("nan"), 1.0], [0.5, 0.5]),
    ("q", [0.5, 0.5], [1.0, float("inf")]),
    ("p", [], []),
    ("p", [[0.5, 0.5]], [[0.5, 0.5]]),  # sequences must be 1-D (use a tensor for [..., V])
    ("p", "ab", [0.5, 0.5]),
    ("q", [0.5, 0.5], [1.0, 0.0, 0.0]),  # shape mismatch
    ("q", torch.tensor([0.5, 0.5]), torch.tensor([0.25, 0.5])),
]


@pytest.mark.parametrize(("name", "p", "q"), BAD_DISTRIBUTIONS)
def test_acceptance_rate_bad_input_names_the_argument(name, p, q):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        acceptance_rate(p, q)


# --------------------------------------------------------------------------- expected_tokens and speedup


@PROPERTY
@given(probabilities, draft_lengths)
def test_expected_tokens_boundary_values(alpha, k):
    assert expected_tokens(alpha, 0) == 1.0
    assert expected_tokens(0.0, k) == 1.0
    assert expected_tokens(1.0, k) == k + 1
    assert 1.0 <= expected_tokens(alpha, k) <= k + 1


@PROPERTY
@given(probabilities, probabilities, draft_lengths)
def test_expected_tokens_is_monotone_in_alpha_and_in_k(alpha1, alpha2, k):
    low, high = sorted((alpha1, alpha2))
    assert expected_tokens(low, k) <= expected_tokens(high, k)
    assert expected_tokens(alpha1, k) <= expected_tokens(alpha1, k + 1)


@PROPERTY
@given(probabilities, draft_lengths)
def test_expected_tokens_is_the_exact_expectation(alpha, k):
    exact = exact_expected_tokens([alpha] * k)
    assert expected_tokens(alpha, k) == pytest.approx(float(exact), rel=1e-13)
    if alpha < 1.0:  # and the closed form, in rationals
        a = Fraction(alpha)
        assert exact == (1 - a ** (k + 1)) / (1 - a)


@pytest.mark.parametrize("k", [1, 4, 64, MAX_SUM_TERMS, MAX_SUM_TERMS + 1, 100_000])
@pytest.mark.parametrize("epsilon", [1e-9, 1e-12, 1e-15])
def test_expected_tokens_is_continuous_at_alpha_one(k, epsilon):
    alpha = 1.0 - epsilon
    shortfall = (1.0 - alpha) * k * (k + 1) / 2  # E = (k+1) - eps k(k+1)/2 + O(eps^2 k^3)
    assert expected_tokens(alpha, k) < k + 1
    assert expected_tokens(alpha, k) == pytest.approx(k + 1 - shortfall, rel=1e-12, abs=shortfall * 1e-3)


@pytest.mark.parametrize("k", [MAX_SUM_TERMS, MAX_SUM_TERMS + 1, 20_000])
@pytest.mark.parametrize("alpha", [0.3, 0.9, 0.999, 0.99999, 1 - 1e-9])
def test_expected_tokens_closed_form_for_long_drafts(alpha, k):
    reference = math.fsum(alpha**i for i in range(k + 1))
    assert expected_tokens(alpha, k) == pytest.approx(reference, rel=1e-10)


@PROPERTY
@given(probabilities, draft_lengths, cost_ratios)
def test_speedup_is_expected_tokens_over_cost(alpha, k, c):
    assert speedup(alpha, k, c) == expected_tokens(alpha, k) / (1 + k * c)
    assert speedup(alpha, 0, c) == 1.0
    assert speedup(0.0, k, c) <= 1.0


# --------------------------------------------------------------------------- optimal_k


@PROPERTY
@given(probabilities, cost_ratios, draft_lengths)
def test_optimal_k_is_the_argmax_of_speedup(alpha, c, k_max):
    speedups = [speedup(alpha, k, c) for k in range(k_max + 1)]
    best = optimal_k(alpha, c, k_max)
    assert 0 <= best <= k_max
    assert speedups[best] >= max(speedups) * (1 - 1e-12)
    assert all(s <= speedups[best] * (1 + 1e-12) for s in speedups[:best])


def test_optimal_k_ties_go_to_the_smaller_k():
    assert optimal_k(0.0, 0.0, 10) == 0  # S = 1 for every k
    assert optimal_k(1.0, 1.0, 10) == 0  # S = (k + 1) / (1 + k) = 1
    assert optimal_k(0.5, 0.5, 10) == 0  # S(1) = 1.5 / 1.5 = S(0)
    assert optimal_k(1.0, 0.5, 10) == 10  # S = (k + 1) / (1 + k/2), strictly increasing
    assert optimal_k(0.7, 0.0, 10) == 10  # free drafts: E increases with k


@PROPERTY
@given(
    st.floats(0.5, 0.99, exclude_min=True, exclude_max=True),
    st.floats(0.001, 0.2, exclude_min=True, exclude_max=True),
)
def test_speedup_has_an_interior_maximum(alpha, c):
    assume(speedup(alpha, 1, c) > 1)
    # S(k) < E_inf / (1 + k c) = 1 / ((1 - alpha)(1 + k c)) < 1 beyond alpha / ((1 - alpha) c): large enough.
    k_max = max(64, math.ceil(alpha / ((1 - alpha) * c)) + 1)
    best = optimal_k(alpha, c, k_max)
    assert 1 <= best < k_max
    assert speedup(alpha, best, c) > 1.0
    assert speedup(alpha, best, c) >= speedup(alpha, best - 1, c)  # equal only by rounding at a near-tie
    assert speedup(alpha, best + 1, c) <= speedup(alpha, best, c)
    assert speedup(alpha, k_max, c) < speedup(alpha, best, c)


def test_a_cap_of_64_is_not_large_enough_near_the_corner():
    assert optimal_k(0.99, 0.001, 64) == 64
    assert optimal_k(0.99, 0.001, 10_000) == 259


@PROPERTY
@given(probabilities, probabilities, cost_ratios)
def test_optimal_k_grows_with_alpha(alpha1, alpha2, c):
    low, high = sorted((alpha1, alpha2))
    assert optimal_k(low, c, 1000) <= optimal_k(high, c, 1000)


@PROPERTY
@given(probabilities, cost_ratios, cost_ratios)
def test_optimal_k_shrinks_with_c(alpha, c1, c2):
    low, high = sorted((c1, c2))
    assert optimal_k(alpha, low, 1000) >= optimal_k(alpha, high, 1000)


@PROPERTY
@given(st.floats(0.0, 1.0), probabilities, draft_lengths)
def test_low_acceptance_means_do_not_speculate(c, fraction, k_max):
    alpha = c * fraction  # alpha <= c, so S(1) = (1 + alpha) / (1 + c) <= 1
    assert all(speedup(alpha, k, c) <= 1.0 for k in range(k_max + 1))
    assert optimal_k(alpha, c, k_max) == 0


def test_optimal_k_for_long_drafts_uses_the_closed_form():
    alpha, c = 0.999, 1e-5
    best = optimal_k(alpha, c, 10**6)
    assert MAX_SUM_TERMS < best < 10**6
    assert speedup(alpha, best - 1, c) < speedup(alpha, best, c) >= speedup(alpha, best + 1, c)


# --------------------------------------------------------------------------- the refined model


@PROPERTY
@given(probabilities, draft_lengths, cost_ratios)
def test_refined_model_reduces_to_the_closed_form(alpha, k, c):
    alphas = [alpha] * k
    assert expected_tokens_per_position(alphas) == expected_tokens(alpha, k)
    assert refined_speedup(alphas, c, [1.0] * (k + 1)) == speedup(alpha, k, c)
    assert refined_speedup(alphas, c, lambda n: 1.0) == speedup(alpha, k, c)
    best, s = refined_optimal_k(alphas, c, lambda n: 1.0)
    assert s == speedup(alpha, best, c)
    assert s == pytest.approx(speedup(alpha, optimal_k(alpha, c, k), c), rel=1e-12)


@PROPERTY
@given(alpha_lists, cost_ratios, st.data())
def test_mixed_speedup_with_every_pass_proposing_k_is_the_refined_model(alphas, c, data):
    r = data.draw(cost_curves(len(alphas) + 1))
    k = len(alphas)
    assert mixed_speedup(alphas, c, r, [0.0] * k + [1.0]) == refined_speedup(alphas, c, r)
    assert mixed_speedup(alphas, c, r, [1.0] + [0.0] * k) == 1.0  # never proposing: plain decoding


def test_mixed_speedup_is_expected_tokens_over_expected_cost_per_pass():
    # a quarter of passes propose nothing (1 token, cost 1); the rest propose 2 tokens:
    # E = 1 + 0.5 + 0.5 * 0.8 = 1.9 tokens at cost 2 * 0.1 + 1.2 = 1.4
    tokens, cost = (
        Fraction(1, 4) + Fraction(3, 4) * Fraction(19, 10),
        Fraction(1, 4) + Fraction(3, 4) * Fraction(14, 10),
    )
    assert mixed_speedup([0.5, 0.8], 0.1, [1.0, 1.1, 1.2], [0.25, 0.0, 0.75]) == pytest.approx(
        float(tokens / cost), rel=1e-14
    )
    assert float(tokens / cost) < refined_speedup(
        [0.5, 0.8], 0.1, [1.0, 1.1, 1.2]
    )  # ignoring plain passes overstates S


@PROPERTY
@given(alpha_lists, cost_ratios, st.data())
def test_a_capped_draft_is_the_mixed_model_over_where_it_stops(alphas, c, data):
    """capped_speedups(k) is mixed_speedup with the shares a draft that goes on past position i
    with probability continues[i] gives: P(proposes j) = D_j - D_{j+1} below the cap, D_k at it;
    a draft that always goes on is the refined model."""
    assume(alphas)
    k = len(alphas)
    r = data.draw(cost_curves(k + 1))
    goes_on = data.draw(st.lists(probabilities, min_size=k, max_size=k))
    speedups, costs = capped_speedups(alphas, goes_on, c, r, k)
    reach = [math.prod(goes_on[:j]) for j in range(k + 1)]  # D_j
    for cap in range(k + 1):
        shares = [reach[j] - reach[j + 1] for j in range(cap)] + [reach[cap]] + [0.0] * (k - cap)
        assume(abs(sum(shares) - 1.0) <= 1e-9)
        assert speedups[cap] == pytest.approx(mixed_speedup(alphas, c, r, shares), rel=1e-9)
        assert costs[cap] == pytest.approx(sum(w * (j * c + r[j]) for j, w in enumerate(shares)), rel=1e-9)
    assert capped_speedups(alphas, [1.0] * k, c, r, k)[0] == pytest.approx(refined_speedups(alphas, c, r, k), rel=1e-12)


def test_capped_speedups_names_what_is_wrong():
    with pytest.raises(ValueError, match="continues"):
        capped_speedups([0.5, 0.5], [1.0, 1.5], 0.1, [1.0, 1.0, 1.0], 2)
    with pytest.raises(ValueError, match="k_max"):
        capped_speedups([0.5, 0.5], [1.0], 0.1, [1.0, 1.0, 1.0], 2)


@PROPERTY
@given(alpha_lists)
def test_expected_tokens_per_position_is_the_exact_expectation(alphas):
    expected = expected_tokens_per_position(alphas)
    assert expected == pytest.approx(float(exact_expected_tokens(alphas)), rel=1e-13)
    assert 1.0 <= expected <= len(alphas) + 1


@PROPERTY
@given(alpha_lists, cost_ratios, st.data())
def test_refined_optimal_k_is_the_first_argmax(alphas, c, data):
    r = data.draw(cost_curves(len(alphas) + 1))
    best, s = refined_optimal_k(alphas, c, r)
    speedups = [refined_speedup(alphas[:k], c, r) for k in range(len(alphas) + 1)]
    assert refined_speedups(alphas, c, r) == speedups  # the policy's one-call form, bit for bit
    assert speedups[0] == 1.0
    assert s == speedups[best] == max(speedups)
    assert all(earlier < s for earlier in speedups[:best])


@PROPERTY
@given(st.lists(probabilities, min_size=1, max_size=32), st.floats(1e-6, 2.0))
def test_compute_bound_verification_means_do_not_speculate(alphas, c):
    # r(n) = n: verifying k+1 tokens costs k+1 passes, so S(k) <= (k + 1) / (k c + k + 1) < 1.
    assert refined_optimal_k(alphas, c, lambda n: float(n)) == (0, 1.0)
    assert refined_optimal_k(alphas, c, [float(n) for n in range(1, len(alphas) + 2)]) == (0, 1.0)


def test_refined_optimal_k_limits():
    alphas, r = [0.9] * 6, [1.0, 1.0, 1.0, 1.05]
    assert refined_optimal_k(alphas, 0.01, r)[0] == 3  # default k_max = min(len(alphas), len(r) - 1)
    assert refined_optimal_k(alphas, 0.01, lambda n: 1.0)[0] == 6
    assert refined_optimal_k(alphas, 0.01, r, k_max=2)[0] == 2
    assert refined_optimal_k([], 0.5, [1.0]) == (0, 1.0)
    with pytest.raises(ValueError, match=r"^k_max\b"):
        refined_optimal_k(alphas, 0.01, r, k_max=4)
    with pytest.raises(ValueError, match=r"^k_max\b"):
        refined_optimal_k(alphas, 0.01, lambda n: 1.0, k_max=7)
    with pytest.raises(ValueError, match=r"^r\b"):
        refined_speedup(alphas, 0.01, r)  # r covers n <= 4 only, k + 1 = 7
    assert len(refined_speedups(alphas, 0.01, r)) == 4 and len(refined_speedups(alphas, 0.01, r, k_max=2)) == 3
    with pytest.raises(ValueError, match=r"^k_max\b"):
        refined_speedups(alphas, 0.01, r, k_max=4)
    with pytest.raises(ValueError, match=r"^alphas\[1\]"):
        refined_speedups([0.5, 1.5], 0.01, lambda n: 1.0)


def test_refined_model_prefers_a_short_draft_when_late_positions_are_rarely_accepted():
    # Acceptance collapses at position 3: drafting past it costs c and adds ~0.09 tokens.
    alphas = [0.95, 0.9, 0.1, 0.1, 0.1, 0.1]
    best, s = refined_optimal_k(alphas, 0.05, lambda n: 1.0)
    assert best == 2 and s == pytest.approx((1 + 0.95 + 0.95 * 0.9) / (1 + 2 * 0.05))


def test_verification_cost_curve_normalises_times():
    assert verification_cost_curve([2.0, 2.0, 3.0]) == (1.0, 1.0, 1.5)
    with pytest.raises(ValueError, match=r"^target_times\b"):
        verification_cost_curve([])
    with pytest.raises(ValueError, match=r"^target_times\b"):
        verification_cost_curve([1.0, 0.0])


# --------------------------------------------------------------------------- CostModel


def test_cost_model_delegates_to_the_functions():
    model = CostModel([0.9, 0.8, 0.5], 0.1, [1.0, 1.0, 1.1, 1.3])
    assert model.alphas == (0.9, 0.8, 0.5) and model.r == (1.0, 1.0, 1.1, 1.3)
    for k in range(4):
        assert model.speedup(k) == refined_speedup([0.9, 0.8, 0.5][:k], 0.1, [1.0, 1.0, 1.1, 1.3])
    assert model.best_k() == refined_optimal_k([0.9, 0.8, 0.5], 0.1, [1.0, 1.0, 1.1, 1.3])
    assert model.best_k(1) == (1, model.speedup(1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.c = 0.2
    with pytest.raises(ValueError, match=r"^k\b"):
        model.speedup(4)


def test_cost_model_normalises_r_within_tolerance():
    model = CostModel([0.5], 0.0, (1.0 + 1e-10, 2.0))
    assert model.r[0] == 1.0 and model.speedup(0) == 1.0
    assert CostModel([0.5], 0.0, lambda n: 1.0 + 1e-10).speedup(0) == 1.0


BAD_MODELS = [
    ("alphas", ([1.5], 0.1, [1.0, 1.0])),
    ("alphas", ([-0.1], 0.1, [1.0, 1.0])),
    ("alphas", ([float("nan")], 0.1, [1.0, 1.0])),
    ("alphas", (0.5, 0.1, [1.0, 1.0])),
    ("c", ([0.5], -0.1, [1.0, 1.0])),
    ("c", ([0.5], float("inf"), [1.0, 1.0])),
    ("r", ([0.5], 0.1, [1.1, 1.2])),
    ("r", ([0.5], 0.1, [1.0, 0.0])),
    ("r", ([0.5], 0.1, [1.0, -1.0])),
    ("r", ([0.5], 0.1, [])),
    ("r", ([0.5], 0.1, lambda n: 2.0 * n)),
]


@pytest.mark.parametrize(("name", "args"), BAD_MODELS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_MODELS)])
def test_cost_model_bad_value_names_the_parameter(name, args):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        CostModel(*args)


# --------------------------------------------------------------------------- validation of the functions

BAD_CALLS = [
    ("alpha", lambda: expected_tokens(1.5, 2)),
    ("alpha", lambda: expected_tokens(-0.1, 2)),
    ("alpha", lambda: speedup(float("nan"), 2, 0.1)),
    ("alpha", lambda: optimal_k(2.0, 0.1, 8)),
    ("alpha", lambda: expected_tokens(True, 2)),
    ("k", lambda: expected_tokens(0.5, -1)),
    ("k", lambda: speedup(0.5, 1.5, 0.1)),
    ("k", lambda: speedup(0.5, True, 0.1)),
    ("c", lambda: speedup(0.5, 2, -0.1)),
    ("c", lambda: optimal_k(0.5, -1.0, 8)),
    ("c", lambda: refined_speedup([0.5], -0.1, [1.0, 1.0])),
    ("k_max", lambda: optimal_k(0.5, 0.1, -1)),
    ("k_max", lambda: refined_optimal_k([0.5], 0.1, [1.0, 1.0], k_max=-1)),
    ("alphas", lambda: refined_speedup([0.5, 1.2], 0.1, [1.0, 1.0, 1.0])),
    ("alphas", lambda: expected_tokens_per_position("0.5")),
    ("r", lambda: refined_speedup([0.5], 0.1, [2.0, 2.0])),
    ("r", lambda: refined_optimal_k([0.5], 0.1, lambda n: 0.5 * n)),
    ("r", lambda: refined_speedup([0.5], 0.1, lambda n: 1.0 if n == 1 else -1.0)),
    ("shares", lambda: mixed_speedup([0.5], 0.1, [1.0, 1.0], [1.0])),
    ("shares", lambda: mixed_speedup([0.5], 0.1, [1.0, 1.0], [0.6, 0.6])),
    ("shares", lambda: mixed_speedup([0.5], 0.1, [1.0, 1.0], [-0.5, 1.5])),
]


@pytest.mark.parametrize(("name", "call"), BAD_CALLS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_CALLS)])
def test_bad_value_raises_value_error_naming_the_parameter(name, call):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        call()


def test_numpy_and_tensor_numbers_are_accepted():
    assert expected_tokens(np.float32(0.5), np.int64(2)) == 1.75
    assert expected_tokens_per_position(torch.tensor([0.5, 0.5], dtype=torch.float64)) == 1.75
    assert expected_tokens_per_position(np.array([0.5, 0.5])) == 1.75
