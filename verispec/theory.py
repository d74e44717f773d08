"""Closed forms and the refined cost model of speculative decoding (Leviathan et al. 2023, sec. 3).

Owns the arithmetic that predicts how fast speculation is, and which draft length k to use:
- alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q), the probability that one draft token is
  accepted (`acceptance_rate`);
- with a constant alpha: E = (1 - alpha^(k+1)) / (1 - alpha) tokens per target pass
  (`expected_tokens`), the speed-up S = E / (1 + k*c) with c = t_draft / t_target (`speedup`)
  and the k that maximises it (`optimal_k`);
- the refined model, as measured: per-position conditional acceptance alpha_1..alpha_k and a
  verification-cost curve r(n) = t_target(n) / t_target(1) (`verification_cost_curve`):
  S(k) = (1 + sum_{i<=k} prod_{j<=i} alpha_j) / (k*c + r(k+1))
  (`expected_tokens_per_position`, `refined_speedup`, `refined_speedups`, `refined_optimal_k`, `CostModel`);
  `mixed_speedup` when some passes propose fewer than k tokens; `capped_speedups` when k caps a
  draft that stops on its own, with the chance it goes on past each position.
E counts the recovered or bonus token, so it lies in 1..k+1. k = 0 is plain decoding, S = 1.
S < 1 is the model's way of saying "back off": alpha low, c large, or r(n) growing like n
(compute-bound verification, large batches).

It does not know models, drafters, batches or clocks: alpha, c and r are numbers handed in
(measured by stats.py and bench.py). Pure functions on Python floats; only `acceptance_rate`
takes tensors. A bad value raises `ValueError` naming the parameter.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np
import torch

CostCurve = Sequence[float] | Callable[[int], float]
"""r(n) = t_target(n) / t_target(1): a sequence with r[n - 1] = r(n), or a callable n -> r(n)."""

R1_TOLERANCE = 1e-9  # |r(1) - 1| accepted (and normalised away)
SUM_TOLERANCE = 1e-4  # |sum(p) - 1| accepted: float32 rounding over a large vocabulary
MAX_SUM_TERMS = 4096  # up to this k, sums and scans run term by term; beyond, closed forms


# --------------------------------------------------------------------------- acceptance


def acceptance_rate(p: torch.Tensor | Sequence[float], q: torch.Tensor | Sequence[float]) -> torch.Tensor | float:
    """alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q) = 1 - 0.5 * sum_x |p(x) - q(x)|, over the last dim.

    p is the target's distribution, q the draft's (the literature's names). Tensors [..., V]
    give a tensor [...] in their promoted floating dtype; 1-D sequences of floats give a float.
    Both must be finite, >= 0 and sum to 1 within 1e-4 (2 eps for narrower dtypes), else
    ValueError naming p or q. The result is clamped to [0, 1]. Validation reads values back to
    the host; inside the decoding loop use `rejection.acceptance_probability` instead.
    """
    as_tensor = isinstance(p, torch.Tensor) or isinstance(q, torch.Tensor)
    target, draft = _distribution("p", p), _distribution("q", q)
    if draft.shape != target.shape:
        raise ValueError(f"q must have the same shape as p, got {tuple(draft.shape)} and {tuple(target.shape)}")
    dtype = torch.promote_types(target.dtype, draft.dtype)
    alpha = torch.minimum(target.to(dtype), draft.to(dtype)).sum(dim=-1, dtype=torch.float64).clamp(0.0, 1.0)
    return alpha.to(dtype) if as_tensor else float(alpha)


# --------------------------------------------------------------------------- closed forms (constant alpha)


def expected_tokens(alpha: float, k: int) -> float:
    """E = sum_{i=0..k} alpha^i = (1 - alpha^(k+1)) / (1 - alpha): mean tokens per target pass.

    Includes the recovered or bonus token, so 1 <= E <= k+1: k = 0 or alpha = 0 give 1, and
    alpha = 1 gives k + 1, the limit, reached continuously. Summed term by term up to
    k = 4096 (exact at alpha = 1, and monotone in alpha and in k even in floating point);
    beyond, the closed form through log and expm1, which stays accurate near alpha = 1.
    """
    alpha, k = _probability("alpha", alpha), _count("k", k)
    if k <= MAX_SUM_TERMS:
        return _tokens_per_pass(repeat(alpha, k))
    if alpha in (0.0, 1.0):
        return 1.0 if alpha == 0.0 else float(k + 1)
    return -math.expm1((k + 1) * math.log(alpha)) / (1.0 - alpha)


def speedup(alpha: float, k: int, c: float) -> float:
    """S = E(alpha, k) / (1 + k*c), c = t_draft / t_target >= 0: predicted time ratio versus plain decoding.

    S(0) = 1. With alpha = 0 it falls to 1 / (1 + k*c) <= 1; S(1) = (1 + alpha) / (1 + c).
    """
    alpha, k, c = _probability("alpha", alpha), _count("k", k), _cost_ratio(c)
    return expected_tokens(alpha, k) / (1.0 + k * c)


def optimal_k(alpha: float, c: float, k_max: int) -> int:
    """argmax over k in 0..k_max of S(k) = E(alpha, k) / (1 + k*c); ties go to the smaller k.

    0 (S = 1) means "do not speculate", the answer whenever alpha <= c. S is unimodal in k
    (E is concave in k, the cost affine), so the scan stops at the first k where one more
    draft token does not pay:
        S(k+1) > S(k)  <=>  alpha^(k+1) / E(alpha, k) > c / (1 + k*c)
                       <=>  sum_{j=1..k+1} alpha^(-j) < 1/c + k.
    Each side of the last form is monotone in floating point, so k* never decreases as alpha
    grows nor increases as c grows (exactly, while k* <= 4096; beyond, a bisection on the
    closed form). For 0 < alpha < 1 and c > 0, k* < alpha / ((1 - alpha) * c).
    """
    alpha, c, k_max = _probability("alpha", alpha), _cost_ratio(c), _count("k_max", k_max)
    if alpha == 0.0:  # S(k) = 1 / (1 + k*c)
        return 0
    if c == 0.0:  # S = E, strictly increasing in k
        return k_max
    if alpha == 1.0:  # S(k) = (k + 1) / (1 + k*c)
        return k_max if c < 1.0 else 0
    beta, budget = 1.0 / alpha, 1.0 / c
    tail = 0.0  # sum_{j=1..k+1} beta^j, built as beta * (1 + previous)
    for k in range(min(k_max, MAX_SUM_TERMS)):
        tail = beta * (1.0 + tail)
        if not tail < budget + k:
            return k
    if k_max <= MAX_SUM_TERMS:
        return k_max
    low, high = MAX_SUM_TERMS, k_max  # S increases up to low; the answer lies in [low, high]
    while low < high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if _improves(alpha, c, middle) else (low, middle)
    return low


# --------------------------------------------------------------------------- the refined model


def verification_cost_curve(target_times: Sequence[float]) -> tuple[float, ...]:
    """r(n) = t_target(n) / t_target(1) from measured times of one target pass over n = 1, 2, ... tokens.

    target_times[n - 1] is the time for n tokens; the result has r[0] == 1 and feeds the
    refined model. A memory-bound target gives r(n) close to 1; a compute-bound one r(n) ~ n.
    """
    times = _reals("target_times", target_times)
    positive = len(times) >= 1 and all(t > 0 for t in times)
    _check(positive, "target_times", target_times, "a non-empty sequence of times > 0")
    return tuple(t / times[0] for t in times)


def expected_tokens_per_position(alphas: Sequence[float]) -> float:
    """E = 1 + sum_{i=1..k} prod_{j<=i} alpha_j, k = len(alphas): mean tokens per target pass.

    alpha_j is the probability that draft position j is accepted given that 1..j-1 were, so
    P(at least i accepted) = prod_{j<=i} alpha_j. Includes the recovered or bonus token
    (1 <= E <= k+1). With every alpha_j = alpha it returns expected_tokens(alpha, k), bit for bit.
    """
    return _tokens_per_pass(_alphas(alphas))


def refined_speedup(alphas: Sequence[float], c: float, r: CostCurve) -> float:
    """S = (1 + sum_{i<=k} prod_{j<=i} alpha_j) / (k*c + r(k+1)), k = len(alphas).

    c = t_draft / t_target(1); r(n) = t_target(n) / t_target(1) with r(1) == 1 (within 1e-9),
    a sequence holding at least k+1 values or a callable. With r = 1 and a constant alpha it
    equals speedup(alpha, k, c), since k*c + r(k+1) = 1 + k*c.
    """
    alphas, c, curve = _alphas(alphas), _cost_ratio(c), _cost_curve(r)
    k = len(alphas)
    return _tokens_per_pass(alphas) / (k * c + _cost(curve, k + 1))


def mixed_speedup(alphas: Sequence[float], c: float, r: CostCurve, shares: Sequence[float]) -> float:
    """S = sum_j w_j E_j / sum_j w_j (j*c + r(j+1)), j = 0..k, k = len(alphas), w = shares.

    For a drafter that proposes fewer than k tokens on some passes (prompt lookup proposes
    nothing when no n-gram matches): w_j is the share of passes that propose j tokens, and
    E_j = 1 + sum_{i<=j} prod_{l<=i} alpha_l. The ratio of expected tokens to expected cost
    per pass is the long-run rate (renewal-reward). shares must hold k+1 values in [0, 1]
    summing to 1 (within 1e-6); all on j = k gives refined_speedup, bit for bit.
    """
    alphas, c, curve = _alphas(alphas), _cost_ratio(c), _cost_curve(r)
    weights = _reals("shares", shares)
    _check(len(weights) == len(alphas) + 1, "shares", shares, f"k+1 = {len(alphas) + 1} values (j = 0..k)")
    _check(
        all(0.0 <= w <= 1.0 for w in weights) and abs(sum(weights) - 1.0) <= 1e-6,
        "shares",
        shares,
        "values in [0, 1] summing to 1",
    )
    tokens = cost = 0.0
    for j, weight in enumerate(weights):
        if weight:
            tokens += weight * _tokens_per_pass(alphas[:j])
            cost += weight * (j * c + _cost(curve, j + 1))
    return tokens / cost


def refined_speedups(alphas: Sequence[float], c: float, r: CostCurve, k_max: int | None = None) -> list[float]:
    """[S(0), S(1), ..., S(k_max)], S(k) = (1 + sum_{i<=k} prod_{j<=i} alpha_j) / (k*c + r(k+1)),
    validated once (a policy asks before every pass). Each S(k) equals refined_speedup(alphas[:k],
    c, r), bit for bit. k_max defaults to the largest k that both alphas and a sequence r cover,
    min(len(alphas), len(r) - 1), and may not exceed either."""
    alphas, c, curve = _alphas(alphas), _cost_ratio(c), _cost_curve(r)
    longest = len(alphas) if callable(curve) else min(len(alphas), len(curve) - 1)
    if k_max is None:
        k_max = longest
    else:
        k_max = _count("k_max", k_max)
        _check(k_max <= len(alphas), "k_max", k_max, f"<= len(alphas) = {len(alphas)}")
        _check(k_max <= longest, "k_max", k_max, f"<= len(r) - 1 = {longest}")
    speedups = [1.0 / _cost(curve, 1)]
    tokens, accepted = 1.0, 1.0  # the same operations, in the same order, as _tokens_per_pass
    for k in range(1, k_max + 1):
        accepted *= alphas[k - 1]
        tokens += accepted
        speedups.append(tokens / (k * c + _cost(curve, k + 1)))
    return speedups


def capped_speedups(
    alphas: Sequence[float], continues: Sequence[float], c: float, r: CostCurve, k_max: int
) -> tuple[list[float], list[float]]:
    """([S(0), ..., S(k_max)], [cost(0), ..., cost(k_max)]) where k caps a draft that may stop
    sooner on its own (a confidence stop, prompt lookup without a match).

    continues[i]: the probability that a draft allowed more than i tokens, having proposed i,
    proposes the (i+1)-th; D_j = prod_{i<j} continues[i] is the chance a pass proposes at least j.
    Tokens E(k) = 1 + sum_{j<=k} D_j prod_{l<=j} alpha_l (alpha_l conditional on position l being
    proposed); cost(k) = sum_j P(proposes j) (j*c + r(j+1)) = C_0 + sum_{j<=k} D_j (C_j - C_{j-1})
    with C_j = j*c + r(j+1): a position past the draft's own stop costs only when it is reached.
    S(k) = E(k) / cost(k) (renewal-reward, as mixed_speedup); with every continues[i] = 1 it is
    refined_speedups."""
    alphas, c, curve = _alphas(alphas), _cost_ratio(c), _cost_curve(r)
    goes_on = _reals("continues", continues)
    _check(all(0.0 <= d <= 1.0 for d in goes_on), "continues", continues, "probabilities in [0, 1]")
    k_max = _count("k_max", k_max)
    _check(k_max <= min(len(alphas), len(goes_on)), "k_max", k_max, "<= len(alphas) and len(continues)")
    step = [j * c + _cost(curve, j + 1) for j in range(k_max + 1)]  # C_j
    tokens, cost, reached, accepted = 1.0, step[0], 1.0, 1.0
    speedups, costs = [tokens / cost], [cost]
    for j in range(1, k_max + 1):
        reached *= goes_on[j - 1]
        accepted *= alphas[j - 1]
        tokens += reached * accepted
        cost += reached * (step[j] - step[j - 1])
        speedups.append(tokens / cost)
        costs.append(cost)
    return speedups, costs


def refined_optimal_k(alphas: Sequence[float], c: float, r: CostCurve, k_max: int | None = None) -> tuple[int, float]:
    """(k*, S(k*)): argmax over k in 0..k_max of S(k) = (1 + sum_{i<=k} prod_{j<=i} alpha_j) / (k*c + r(k+1)).

    k = 0 is plain decoding, S = 1 / r(1) = 1. Ties go to the smaller k; S is not assumed
    unimodal (measured alphas and r need not be smooth), so every k is evaluated. k_max
    defaults to the largest k that both alphas and a sequence r cover, min(len(alphas),
    len(r) - 1), and may not exceed either. S(k*) equals refined_speedup(alphas[:k*], c, r).
    """
    speedups = refined_speedups(alphas, c, r, k_max)
    best_k = max(range(len(speedups)), key=lambda k: (speedups[k], -k))
    return best_k, speedups[best_k]


@dataclass(frozen=True)
class CostModel:
    """The refined model with its measurements: per-position alphas, cost ratio c, cost curve r.

    speedup(k) = (1 + sum_{i<=k} prod_{j<=i} alpha_j) / (k*c + r(k+1)) for k in 0..len(alphas);
    best_k() is refined_optimal_k. Validated at construction: alphas in [0, 1], c >= 0 finite,
    r positive and finite with r(1) == 1 within 1e-9. A sequence r is stored as a tuple divided
    by r[0] (so r[0] == 1 exactly); a callable r is stored as given.
    """

    alphas: tuple[float, ...]
    c: float
    r: tuple[float, ...] | Callable[[int], float]

    def __post_init__(self) -> None:
        object.__setattr__(self, "alphas", _alphas(self.alphas))
        object.__setattr__(self, "c", _cost_ratio(self.c))
        curve = _cost_curve(self.r)
        object.__setattr__(self, "r", self.r if callable(self.r) else curve)

    def speedup(self, k: int) -> float:
        """Predicted S at draft length k (0 = plain decoding, S = 1)."""
        k = _count("k", k)
        _check(k <= len(self.alphas), "k", k, f"<= len(alphas) = {len(self.alphas)}")
        return refined_speedup(self.alphas[:k], self.c, self.r)

    def best_k(self, k_max: int | None = None) -> tuple[int, float]:
        """(k*, S(k*)) over k in 0..k_max; see refined_optimal_k."""
        return refined_optimal_k(self.alphas, self.c, self.r, k_max)


# --------------------------------------------------------------------------- helpers


def _tokens_per_pass(alphas: Iterable[float]) -> float:
    """1 + sum_i prod_{j<=i} alpha_j, accumulated left to right (monotone in every alpha_j)."""
    tokens, accepted = 1.0, 1.0
    for alpha in alphas:
        accepted *= alpha
        tokens += accepted
    return tokens


def _improves(alpha: float, c: float, k: int) -> bool:
    """S(k+1) > S(k) for 0 < alpha < 1, c > 0: alpha^(k+1) (1 + k*c)(1 - alpha) > c (1 - alpha^(k+1))."""
    x = (k + 1) * math.log(alpha)
    return math.exp(x) * (1.0 + k * c) * (1.0 - alpha) > -c * math.expm1(x)


def _cost_curve(r: object) -> tuple[float, ...] | Callable[[int], float]:
    """A validated r: a tuple divided by r[0], or a callable whose values are checked when read."""
    if callable(r):
        first = _real("r(1)", r(1))
        _check(abs(first - 1.0) <= R1_TOLERANCE, "r(1)", first, "1 (r(n) = t_target(n) / t_target(1))")
        return lambda n: _positive(f"r({n})", r(n)) / first
    values = _reals("r", r)
    _check(len(values) >= 1 and all(v > 0 for v in values), "r", r, "a non-empty sequence of numbers > 0")
    _check(abs(values[0] - 1.0) <= R1_TOLERANCE, "r[0]", values[0], "1 (r[n-1] = t_target(n) / t_target(1))")
    return tuple(v / values[0] for v in values)


def _cost(curve: tuple[float, ...] | Callable[[int], float], n: int) -> float:
    """r(n) from a validated curve."""
    if callable(curve):
        return curve(n)
    if n > len(curve):
        raise ValueError(f"r must hold at least {n} values (r[n-1] = r(n), n up to k+1), got {len(curve)}")
    return curve[n - 1]


def _distribution(name: str, value: object) -> torch.Tensor:
    """value as a tensor [..., V] of probabilities, or ValueError naming `name`."""
    if isinstance(value, torch.Tensor):
        tensor = value
    else:
        try:
            tensor = torch.as_tensor(value, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"{name} must be a tensor [..., V] or a sequence of floats, got {value!r}") from None
        _check(tensor.dim() == 1, name, value, "a 1-D sequence of floats (or a tensor [..., V])")
    _check(tensor.dim() >= 1 and tensor.shape[-1] >= 1, name, value, "non-empty in its last dim")
    if not tensor.is_floating_point():
        tensor = tensor.to(torch.get_default_dtype())
    if not bool(torch.isfinite(tensor).all()) or bool((tensor < 0).any()):
        raise ValueError(f"{name} must be finite and >= 0 (a probability distribution)")
    tolerance = max(SUM_TOLERANCE, 2 * torch.finfo(tensor.dtype).eps)
    error = float((tensor.sum(dim=-1, dtype=torch.float64) - 1.0).abs().max())
    if error > tolerance:
        raise ValueError(f"{name} must sum to 1 over its last dim (within {tolerance:g}), off by {error:.3g}")
    return tensor


def _alphas(alphas: object) -> tuple[float, ...]:
    values = _reals("alphas", alphas)
    for j, alpha in enumerate(values):
        _check(0.0 <= alpha <= 1.0, f"alphas[{j}]", alpha, "in [0, 1]")
    return values


def _reals(name: str, values: object) -> tuple[float, ...]:
    """A 1-D sequence (or tensor) of finite numbers as a tuple of floats."""
    if isinstance(values, (torch.Tensor, np.ndarray)):
        _check(values.ndim == 1, name, values, "1-D")
        values = values.tolist()
    _check(isinstance(values, Sequence) and not isinstance(values, str), name, values, "a sequence of numbers")
    return tuple(_real(f"{name}[{i}]", v) for i, v in enumerate(values))


def _probability(name: str, value: object) -> float:
    value = _real(name, value)
    _check(0.0 <= value <= 1.0, name, value, "in [0, 1]")
    return value


def _cost_ratio(c: object) -> float:
    c = _real("c", c)
    _check(c >= 0.0, "c", c, ">= 0 (c = t_draft / t_target)")
    return c


def _positive(name: str, value: object) -> float:
    value = _real(name, value)
    _check(value > 0.0, name, value, "> 0")
    return value


def _real(name: str, value: object) -> float:
    """A finite real number (Python, numpy or a one-element tensor) as a float; bools are refused."""
    is_real = isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.numel() == 1)
    _check(is_real and not isinstance(value, bool), name, value, "a finite number")
    result = float(value)
    _check(math.isfinite(result), name, value, "a finite number")
    return result


def _count(name: str, value: object) -> int:
    """An integer >= 0 (Python or numpy); bools and floats are refused."""
    _check(not isinstance(value, bool), name, value, "an integer >= 0")
    try:
        result = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}") from None
    _check(result >= 0, name, value, "an integer >= 0")
    return result


def _check(condition: bool, name: str, value: object, expected: str) -> None:
    if not condition:
        raise ValueError(f"{name} must be {expected}, got {value!r}")
