"""The cost profiler: t_target(n) for n = 1..k_max+1 positions and t_draft, measured.

Owns `CostProfile` and `profile_costs`. A target step is what one engine iteration costs
besides drafting: the forward pass over n positions, `process_logits` and `verify`. A draft
step is one single-position forward, `process_logits` and a draw. Every n is measured in
round-robin order after a warm-up, repeated, and the median kept, so drift on a shared
machine lands on every n alike. Results are cached per (model, dtype, batch, context
bucket). Knows nothing of text; the refined model that consumes r and c is in theory.py.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from .config import SamplingParams
from .rejection import verify
from .sampling import process_logits, sample

_CACHE: dict[tuple, "CostProfile"] = {}


@dataclass(frozen=True)
class CostProfile:
    target_s: tuple[float, ...]  # t_target(n) for n = 1..k_max+1, seconds (medians)
    draft_s: float | None  # seconds per draft token, or None without a draft model
    batch_size: int
    context_length: int

    @property
    def r(self) -> tuple[float, ...]:
        """r(n) = t_target(n) / t_target(1), as a sequence with r[n - 1] = r(n)."""
        return tuple(t / self.target_s[0] for t in self.target_s)

    @property
    def c(self) -> float | None:
        return None if self.draft_s is None else self.draft_s / self.target_s[0]

    def to_dict(self) -> dict:
        return {"target_s": list(self.target_s), "draft_s": self.draft_s, "r": list(self.r), "c": self.c,
                "batch_size": self.batch_size, "context_length": self.context_length}


def context_bucket(length: int) -> int:
    """The power of two at or above `length` (costs change slowly with context)."""
    return 1 << max(0, (length - 1).bit_length())


@torch.no_grad()
def profile_costs(
    target: torch.nn.Module,
    draft_model: torch.nn.Module | None = None,
    k_max: int = 8,
    batch_size: int = 1,
    context_length: int = 128,
    repeats: int = 7,
    warmup: int = 2,
    use_cache: bool = True,
) -> CostProfile:
    """Measure t_target(1..k_max+1) and t_draft at this batch size and context bucket."""
    if not isinstance(k_max, int) or k_max < 0:
        raise ValueError(f"k_max must be an integer >= 0, got {k_max!r}")
    if batch_size < 1 or context_length < 1 or repeats < 1:
        raise ValueError("batch_size, context_length and repeats must be >= 1")
    context = context_bucket(context_length)
    limit = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int):  # measure within the model's context (the bucket rounds up)
        if limit < k_max + 2:
            raise ValueError(f"k_max ({k_max}) does not fit in the model's context of {limit} positions")
        context = min(context, limit - k_max - 1)
    key = (id(target), id(draft_model), target.dtype, batch_size, context, k_max)
    if use_cache and key in _CACHE:
        return _CACHE[key]
    params = SamplingParams(temperature=1.0)
    generator = torch.Generator(device=target.device).manual_seed(0)
    target_cache = _prefilled(target, batch_size, context, k_max + 1, generator)  # one cache: every step rolls back
    steps = {n: _target_step(target, target_cache, n, params, generator) for n in range(1, k_max + 2)}
    if draft_model is not None:
        steps["draft"] = _draft_step(draft_model, _prefilled(draft_model, batch_size, context, 1, generator), params, generator)
    times: dict[object, list[float]] = {name: [] for name in steps}
    for round_ in range(warmup + repeats):
        for name, step in steps.items():
            started = time.perf_counter()
            step()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - started)
    profile = CostProfile(
        target_s=tuple(statistics.median(times[n]) for n in range(1, k_max + 2)),
        draft_s=statistics.median(times["draft"]) if draft_model is not None else None,
        batch_size=batch_size,
        context_length=context,
    )
    _CACHE[key] = profile
    return profile


def _prefilled(model: torch.nn.Module, batch_size: int, context: int, extra: int, generator: torch.Generator):
    cache = model.new_cache(batch_size, context + extra)
    prompt = torch.randint(0, model.vocab_size, (context,), generator=generator, device=model.device).tolist()
    model.prefill([prompt] * batch_size, cache)
    return cache


def _target_step(target, cache, n: int, params: SamplingParams, generator):
    lengths = cache.host_lengths
    ids = torch.randint(0, target.vocab_size, (cache.batch_size, n), generator=generator, device=target.device)

    def step() -> None:
        target_probs = process_logits(target(ids, cache), params)  # [B, n, V]
        output, num_accepted = verify(ids[:, 1:], None, target_probs, generator)
        torch.cat([output, num_accepted[:, None]], dim=1).tolist()  # the iteration's host sync
        cache.rollback(lengths)

    return step


def _draft_step(draft, cache, params: SamplingParams, generator):
    lengths = cache.host_lengths
    ids = torch.randint(0, draft.vocab_size, (cache.batch_size, 1), generator=generator, device=draft.device)

    def step() -> None:
        sample(process_logits(draft(ids, cache)[:, -1], params), generator)
        cache.rollback(lengths)

    return step
