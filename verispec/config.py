"""Frozen, validated configuration dataclasses.

Owns: `SamplingParams` (how a token is drawn) and `SpecConfig` (how speculation runs).
Every bad value raises `ValueError` naming the parameter, at construction time, so a
config that exists is a config that is valid. Knows nothing of models or tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def _check(condition: bool, name: str, value: object, expected: str) -> None:
    if not condition:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


SAMPLING_MODES = ("rejection", "invariant")


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is processed and sampled.

    The processing order is temperature, top-k, top-p, min-p (as in vLLM and `transformers`).
    temperature == 0 means greedy (the processed distribution is one-hot at the argmax).
    top_k == 0, top_p == 1 and min_p == 0 each switch that filter off.
    A stop token is included in the output and ends its row. `sampling` is how speculation
    keeps the target's distribution: "rejection" (accept with probability min(1, p/q)), or
    "invariant" (the tokens of plain decoding with the same seed, whatever the drafter and k).
    One SamplingParams may serve a whole batch (row b then draws with `row_seed(seed, b)`) or
    each row may have its own (`sampling.RowSampling`).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    sampling: str = "rejection"  # or "invariant": position-keyed noise, the tokens of plain decoding (invariant.py)

    def __post_init__(self) -> None:
        _check(
            _is_number(self.temperature) and self.temperature >= 0,
            "temperature",
            self.temperature,
            "a finite number >= 0",
        )
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k, "an integer >= 0 (0 = off)")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(
            self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63),
            "seed",
            self.seed,
            "None or an integer in [0, 2**63)",
        )
        _check(
            _is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
            "max_new_tokens",
            self.max_new_tokens,
            "an integer >= 1",
        )
        stop = self.stop_token_ids
        _check(
            isinstance(stop, (tuple, list)) and all(_is_int(t) and t >= 0 for t in stop),
            "stop_token_ids",
            stop,
            "a sequence of integers >= 0",
        )
        object.__setattr__(self, "stop_token_ids", tuple(stop))
        _check(self.sampling in SAMPLING_MODES, "sampling", self.sampling, f"one of {', '.join(SAMPLING_MODES)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class SpecConfig:
    """How speculation runs: the draft length k (0 = plain autoregressive decoding)."""

    k: int = 4

    def __post_init__(self) -> None:
        _check(_is_int(self.k) and 0 <= self.k <= 64, "k", self.k, "an integer in [0, 64]")
