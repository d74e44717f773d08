"""SamplingParams validation, process_logits against hand-computed distributions, and the
exactness of `sample` (chi-square against the exact distribution, false-failure rate 1e-9)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from scipy import stats
from stats_helpers import (
    assert_distributed_as,
    chi_square,
    counts_of,
    is_distributed_as,
    threshold,
)

from verispec.config import SamplingParams
from verispec.sampling import make_generator, process_logits, sample

N = 200_000


# --------------------------------------------------------------------------- SamplingParams

BAD_VALUES = [
    ("temperature", -1.0),
    ("temperature", float("nan")),
    ("temperature", True),
    ("temperature", float("inf")),
    ("top_k", -1),
    ("top_k", 1.5),
    ("top_k", True),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", float("nan")),
    ("min_p", -0.1),
    ("min_p", 2.0),
    ("seed", -1),
    ("seed", 1.0),
    ("max_new_tokens", 0),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1, 2.0]),
]


@pytest.mark.parametrize(("name", "value"), BAD_VALUES, ids=[f"{n}={v!r}" for n, v in BAD_VALUES])
def test_bad_value_raises_value_error_naming_the_parameter(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0},
        {"temperature": 0.0},
        {"temperature": 2},
        {"top_k": 0},
        {"top_k": 50},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"seed": 0},
        {"seed": None},
        {"seed": 2**63 - 1},
        {"max_new_tokens": 1},
        {"stop_token_ids": ()},
    ],
)
def test_good_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(params, key) == value


def test_stop_token_ids_list_becomes_tuple():
    params = SamplingParams(stop_token_ids=[2, 0, 7])
    assert params.stop_token_ids == (2, 0, 7)
    assert isinstance(params.stop_token_ids, tuple)
    hash(params)  # frozen and hashable once the list is a tuple


def test_sampling_params_is_frozen_and_greedy_flag():
    params = SamplingParams(temperature=0)
    assert params.greedy
    assert not SamplingParams(temperature=0.5).greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 1.0  # type: ignore[misc]


# --------------------------------------------------------------------------- process_logits


def _np_softmax(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _close(actual: torch.Tensor, expected) -> None:
    expected = torch.as_tensor(np.asarray(expected, dtype=np.float64), dtype=torch.float64)
    assert actual.dtype == torch.float32
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual.double(), expected, atol=1e-6, rtol=1e-5)


def test_greedy_is_one_hot_at_argmax():
    logits = torch.tensor([[0.1, 2.0, -3.0, 1.9], [5.0, 4.0, 4.5, -1.0], [-2.0, -1.0, -3.0, -0.5]])
    probs = process_logits(logits, SamplingParams(temperature=0))
    expected = torch.zeros(3, 4)
    expected[0, 1] = expected[1, 0] = expected[2, 3] = 1.0
    assert probs.dtype == torch.float32
    assert torch.equal(probs, expected)


def test_greedy_ignores_filters_and_keeps_leading_dims():
    logits = torch.randn(2, 3, 11, generator=make_generator(0))
    probs = process_logits(logits, SamplingParams(temperature=0, top_k=2, top_p=0.5, min_p=0.3))
    assert probs.shape == (2, 3, 11)
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(2, 3))
    assert torch.equal((probs > 0).sum(-1), torch.ones(2, 3, dtype=torch.long))


@pytest.mark.parametrize("temperature", [0.25, 0.5, 1.0, 2.0, 7.0])
def test_temperature_scaling_is_softmax_of_logits_over_t(temperature):
    raw = [2.0, -1.0, 0.5, 3.0, 0.0, -2.5]
    probs = process_logits(torch.tensor(raw), SamplingParams(temperature=temperature))
    _close(probs, _np_softmax(np.array(raw) / temperature))


def test_top_k_keeps_exactly_the_k_largest():
    raw = [0.5, 2.0, -1.0, 1.5, 0.0, 3.0]  # order of size: 5, 1, 3, 0, 4, 2
    probs = process_logits(torch.tensor(raw), SamplingParams(top_k=3))
    e = np.exp([3.0, 2.0, 1.5])
    expected = np.zeros(6)
    expected[[5, 1, 3]] = e / e.sum()
    _close(probs, expected)
    assert probs[[0, 2, 4]].eq(0).all()  # exactly zero, not tiny
    ranking = [5, 1, 3, 0, 4, 2]
    for k in range(1, 6):
        kept = process_logits(torch.tensor(raw), SamplingParams(top_k=k)) > 0
        assert kept.sum().item() == k
        assert set(torch.nonzero(kept).ravel().tolist()) == set(ranking[:k])


def test_top_k_with_temperature():
    raw = np.array([0.5, 2.0, -1.0, 1.5, 0.0, 3.0])
    probs = process_logits(torch.tensor(raw, dtype=torch.float32), SamplingParams(temperature=0.5, top_k=2))
    expected = np.zeros(6)
    expected[[5, 1]] = _np_softmax(raw[[5, 1]] / 0.5)
    _close(probs, expected)


@pytest.mark.parametrize("top_k", [0, 6, 100])
def test_top_k_off_or_at_least_vocab_is_plain_softmax(top_k):
    raw = [0.5, 2.0, -1.0, 1.5, 0.0, 3.0]
    probs = process_logits(torch.tensor(raw), SamplingParams(top_k=top_k))
    _close(probs, _np_softmax(raw))


# probabilities in a shuffled order; sorted: 0.4 (token 1), 0.3 (token 3), 0.2 (token 2), 0.1 (token 0)
TOP_P_PROBS = [0.1, 0.4, 0.2, 0.3]


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.01, [0, 1, 0, 0]),  # the top token always survives
        (0.35, [0, 1, 0, 0]),  # 0.4 alone reaches 0.35
        (0.65, [0, 4 / 7, 0, 3 / 7]),  # 0.4 < 0.65, 0.4 + 0.3 reaches it
        (0.75, [0, 4 / 9, 2 / 9, 3 / 9]),  # 0.7 < 0.75, + 0.2 reaches it
        (0.95, TOP_P_PROBS),  # 0.9 < 0.95: all four needed
        (1.0, TOP_P_PROBS),  # off
    ],
)
def test_top_p_keeps_smallest_prefix_reaching_top_p(top_p, expected):
    logits = torch.tensor(np.log(TOP_P_PROBS), dtype=torch.float32)
    probs = process_logits(logits, SamplingParams(top_p=top_p))
    _close(probs, expected)
    assert torch.equal(probs == 0, torch.tensor(expected) == 0)


def test_top_p_on_batched_rows_is_per_row():
    logits = torch.tensor(np.log([TOP_P_PROBS, TOP_P_PROBS[::-1]]), dtype=torch.float32)
    probs = process_logits(logits, SamplingParams(top_p=0.65))
    _close(probs, [[0, 4 / 7, 0, 3 / 7], [3 / 7, 0, 4 / 7, 0]])


# shuffled: max 0.5 (token 1)
MIN_P_PROBS = [0.15, 0.5, 0.1, 0.25]


@pytest.mark.parametrize(
    ("min_p", "expected"),
    [
        (0.0, MIN_P_PROBS),  # off
        (0.1, MIN_P_PROBS),  # cut-off 0.05: nothing below
        (0.25, [0.15 / 0.9, 0.5 / 0.9, 0, 0.25 / 0.9]),  # cut-off 0.125 drops 0.1
        (0.45, [0, 2 / 3, 0, 1 / 3]),  # cut-off 0.225 drops 0.15 and 0.1
        (1.0, [0, 1, 0, 0]),  # only the maximum itself
    ],
)
def test_min_p_drops_tokens_below_min_p_times_max(min_p, expected):
    logits = torch.tensor(np.log(MIN_P_PROBS), dtype=torch.float32)
    probs = process_logits(logits, SamplingParams(min_p=min_p))
    _close(probs, expected)
    assert torch.equal(probs == 0, torch.tensor(expected) == 0)


def test_filters_apply_in_order_temperature_top_k_top_p_min_p():
    # logits chosen so each stage removes something and no boundary is near a tie.
    raw = np.array([1.0, 3.0, 0.0, 2.2, 2.0, -1.0, 1.5, 0.4])
    t = 2.0
    # temperature 2, top_k 5: keep 1 (3.0), 3 (2.2), 4 (2.0), 6 (1.5), 0 (1.0)
    keep_k = [1, 3, 4, 6, 0]
    p = np.zeros(8)
    p[keep_k] = _np_softmax(raw[keep_k] / t)
    # p ~ 0.321 (1), 0.215 (3), 0.195 (4), 0.152 (6), 0.118 (0)
    # top_p 0.8: mass before token 6 = 0.730 < 0.8, before token 0 = 0.882 -> keep 1, 3, 4, 6; drop 0
    order = np.argsort(-p)
    mass_before = np.cumsum(p[order]) - p[order]
    assert list(order[:5]) == [1, 3, 4, 6, 0] and mass_before[3] < 0.78 and mass_before[4] > 0.82
    p[0] = 0.0
    p /= p.sum()
    # min_p 0.55: cut-off 0.55 * 0.364 = 0.200; after renormalisation only token 6 (0.172) is below it
    cut = 0.55 * p.max()
    assert p[6] < cut - 0.01 and p[4] > cut + 0.01
    p[p < cut] = 0.0
    p /= p.sum()
    probs = process_logits(
        torch.tensor(raw, dtype=torch.float32), SamplingParams(temperature=t, top_k=5, top_p=0.8, min_p=0.55)
    )
    _close(probs, p)
    assert set(torch.nonzero(probs).ravel().tolist()) == {1, 3, 4}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.3, top_k=7),
        SamplingParams(temperature=1.5, top_p=0.6),
        SamplingParams(min_p=0.2),
        SamplingParams(temperature=0.7, top_k=10, top_p=0.9, min_p=0.05),
    ],
    ids=["default", "greedy", "t0.3-k7", "t1.5-p0.6", "minp0.2", "all"],
)
def test_rows_are_float32_distributions(dtype, params):
    logits = (3 * torch.randn(4, 5, 32, generator=make_generator(1))).to(dtype)
    probs = process_logits(logits, params)
    assert probs.dtype == torch.float32
    assert probs.shape == logits.shape
    assert torch.isfinite(probs).all()
    assert (probs >= 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(4, 5), atol=1e-5, rtol=0)
    assert (probs.amax(-1) > 0).all()


def test_process_logits_does_not_modify_its_input():
    logits = torch.randn(3, 9, generator=make_generator(2))
    before = logits.clone()
    process_logits(logits, SamplingParams(temperature=0.5, top_k=4, top_p=0.8, min_p=0.1))
    assert torch.equal(logits, before)


# --------------------------------------------------------------------------- sample

# V = 12 with three zero-probability tokens and one rare one (expected 200 of 200,000)
P12 = np.array([0.2, 0.0, 0.05, 0.15, 0.001, 0.0, 0.1, 0.3, 0.049, 0.0, 0.1, 0.05])


def test_sample_is_exact_chi_square():
    probs = torch.tensor(P12, dtype=torch.float32)
    draws = sample(probs.expand(N, -1), make_generator(1234))
    assert draws.shape == (N,)
    assert draws.dtype == torch.long
    counts = counts_of(draws, 12)
    assert counts[P12 == 0].sum() == 0, f"zero-probability tokens drawn: {counts}"
    assert_distributed_as(counts, P12, are_counts=True, label="sample(P12)")


def test_sample_normalises_unnormalised_weights():
    weights = torch.tensor(P12 * 7.3, dtype=torch.float32)
    draws = sample(weights.expand(N, -1), make_generator(99))
    assert_distributed_as(draws, P12, label="sample(7.3 * P12)")


def test_sample_rows_are_independent_distributions():
    other = np.array([0.0, 0.3, 0.0, 0.0, 0.2, 0.1, 0.0, 0.0, 0.0, 0.25, 0.0, 0.15])
    probs = torch.tensor(np.stack([P12, other]), dtype=torch.float32)  # [2, V]
    draws = sample(probs.expand(N // 2, 2, 12), make_generator(7))  # [N/2, 2]
    assert draws.shape == (N // 2, 2)
    assert_distributed_as(draws[:, 0], P12, label="row 0")
    assert_distributed_as(draws[:, 1], other, label="row 1")


def test_sample_one_hot_and_same_seed_same_draws():
    one_hot = torch.zeros(1000, 12)
    one_hot[:, 5] = 1.0
    assert (sample(one_hot, make_generator(0)) == 5).all()

    probs = torch.tensor(P12, dtype=torch.float32).expand(5000, -1)
    a = sample(probs, make_generator(42))
    b = sample(probs, make_generator(42))
    c = sample(probs, make_generator(43))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_make_generator_seeded_and_unseeded():
    g1, g2 = make_generator(5), make_generator(5)
    assert torch.equal(torch.rand(10, generator=g1), torch.rand(10, generator=g2))
    u1, u2 = make_generator(None), make_generator(None)
    assert not torch.equal(torch.rand(100, generator=u1), torch.rand(100, generator=u2))


def test_sample_is_rejected_when_off_by_small_tv():
    """The chi-square test has the power the issue asks for: a TV error of 0.01 is caught at N."""
    probs = torch.tensor(P12, dtype=torch.float32)
    draws = sample(probs.expand(N, -1), make_generator(1234))
    shifted = P12.copy()
    shifted[0] -= 0.01
    shifted[7] += 0.01
    assert not is_distributed_as(draws, shifted)


# --------------------------------------------------------------------------- the helpers themselves


def test_chi_square_helper_merges_small_cells_and_flags_zero_cells():
    probs = np.array([0.5, 0.3, 0.1, 0.05, 0.03, 0.02, 0.0])
    counts = np.array([50, 30, 10, 5, 3, 2, 0])  # N = 100: expected 3 and 2 must merge, pooled 5
    stat, df = chi_square(counts, probs)
    assert stat == pytest.approx(0.0, abs=1e-12)
    assert df == 4  # cells {3+2}, 5, 10, 30, 50
    # a pooled cell below min_expected absorbs the next smallest: expected 2 < 5, + 48 -> 50
    stat, df = chi_square(np.array([2, 50, 48]), np.array([0.02, 0.5, 0.48]))
    assert (stat, df) == (pytest.approx(0.0, abs=1e-12), 1)  # cells {2, 48}, 50
    stat, df = chi_square(np.array([60, 30, 5, 3, 2]), np.array([0.6, 0.3, 0.05, 0.03, 0.02]), min_expected=4)
    assert df == 3  # {3, 2} reaches 4 on its own: cells {3, 2}, 5, 30, 60
    stat, df = chi_square(np.array([50, 30, 10, 5, 3, 1, 1]), probs)
    assert stat == math.inf
    assert not is_distributed_as(np.array([50, 30, 10, 5, 3, 1, 1]), probs, are_counts=True)
    # a single cell: nothing to test except the zero cells
    assert chi_square(np.array([0, 10, 0]), np.array([0.0, 1.0, 0.0])) == (0.0, 0)
    assert threshold(0) == 0.0
    assert stats.chi2.sf(threshold(10), 10) == pytest.approx(1e-9, rel=1e-6)
    assert threshold(10) == pytest.approx(62.95, abs=0.01)
    with pytest.raises(ValueError):
        counts_of(torch.tensor([0, 3, -1]), 4)
