"""The cost profiler: t_target(n) for n = 1..k_max+1 positions and t_draft, measured.

Owns `CostProfile` and `profile_costs`. A target step is what one engine iteration costs
besides drafting: the forward pass over n positions, `process_logits` and `verify`. A draft
step is one single-position forward, `process_logits` and a draw. Every n is measured in
round-robin order after a warm-up, repeated, and the median kept, so drift on a shared
machine lands on every n alike. Results are cached per (model, dtype, batch, context
bucket), the target's times and the draft's apart (a draft model is known by its file where it
has one), so that candidates of one `plan` share the target's times and two candidates drafting
with one file share its cost: their ranking then rests on acceptance, not on timing noise.
Knows nothing of text; the refined model that consumes r and c is in theory.py.

Also owns `calibrate`: real passes of a server's `engine.Batch` (drafter, caches, rule and
bookkeeping included) at every batch size the server will see and every k in 0..k_max, timed
into an `AdaptiveLength` before the first request, so that `--k auto` starts from measured
t_target(B(k+1)) and t_draft(B, k) instead of exploring under load; and `profile_passes`, the
same passes at one row turned into a CostProfile (`plan`'s costs for a draft that llama.cpp's
compiled step runs, as `bench` and `generate` run it).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import SamplingParams
from ..drafters.base import is_lookup
from ..rejection import verify
from ..sampling import process_logits, sample

_TARGET_S: dict[tuple, tuple[float, ...]] = {}  # (target, dtype, batch, context, k_max) -> t_target(1..k_max+1)
_DRAFT_S: dict[tuple, float] = {}  # (draft, dtype, batch, context) -> t_draft


def _identity(model: torch.nn.Module) -> tuple:
    """What a cached time is keyed by: a model's file and threads where it has one, else the object."""
    path = getattr(model, "path", None)
    return ("file", str(path), getattr(model, "n_threads", None)) if path is not None else ("object", id(model))


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
        return {
            "target_s": list(self.target_s),
            "draft_s": self.draft_s,
            "r": list(self.r),
            "c": self.c,
            "batch_size": self.batch_size,
            "context_length": self.context_length,
        }


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
    target_key = (_identity(target), target.dtype, batch_size, context, k_max)
    draft_key = (
        (_identity(draft_model), getattr(draft_model, "dtype", None), batch_size, context) if draft_model else None
    )
    target_s = _TARGET_S.get(target_key) if use_cache else None
    draft_s = _DRAFT_S.get(draft_key) if use_cache and draft_key is not None else None
    params = SamplingParams(temperature=1.0)
    generator = torch.Generator(device=target.device).manual_seed(0)
    steps = {}
    if target_s is None:
        target_cache = _prefilled(target, batch_size, context, k_max + 1, generator)  # one cache: every step rolls back
        steps = {n: _target_step(target, target_cache, n, params, generator) for n in range(1, k_max + 2)}
    if draft_model is not None and draft_s is None:
        steps["draft"] = _draft_step(
            draft_model, _prefilled(draft_model, batch_size, context, 1, generator), params, generator
        )
    times: dict[object, list[float]] = {name: [] for name in steps}
    for round_ in range(warmup + repeats if steps else 0):
        for name, step in steps.items():
            started = time.perf_counter()
            step()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - started)
    if target_s is None:
        target_s = _TARGET_S[target_key] = tuple(statistics.median(times[n]) for n in range(1, k_max + 2))
    if draft_model is not None and draft_s is None:
        draft_s = _DRAFT_S[draft_key] = statistics.median(times["draft"])
    return CostProfile(target_s=target_s, draft_s=draft_s, batch_size=batch_size, context_length=context)


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


class _Scripted:
    """A draft-length policy that plays a script (`k`) and keeps each pass's (batch, k, draft_s, target_s)."""

    def __init__(self, k_max: int):
        self.k_max, self.k = k_max, 0
        self.times: list[tuple[int, int, float, float]] = []

    def choose(self, batch: int = 1) -> int:
        return self.k

    def observe(self, k: int, beta_sums, verified, draft_s: float, target_s: float, batch: int = 1, *_, **__) -> None:
        self.times.append((batch, k, draft_s, target_s))


def batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes a calibration times: the powers of two below max_batch, and max_batch."""
    return [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch] + [max_batch]


@torch.no_grad()
def calibrate(
    batch,
    policy,
    sizes: Sequence[int],
    max_model_len: int,
    repeats: int = 3,
    prompt_length: int = 64,
    sampling: SamplingParams | None = None,
) -> float:
    """Time passes of `batch` (an empty engine.Batch) and seed `policy` with their medians
    (`AdaptiveLength.seed_costs`); returns the seconds taken.

    For each repeat and each size B in `sizes` (interleaved, so that drift lands on every size
    alike): B rows of a synthetic prompt join (greedy, or sampled as `sampling`: temperature,
    top-k, top-p, min-p, whose processing a pass at T > 0 pays), then passes at k = 0, 1, 1, 2, ..., k_max
    (the draft's reading of the joined prompt is reported apart from the draft time, so it is
    not in these times), and the rows are cancelled. Medians, not means: the first pass at a new shape
    can cost ten times the others (llama.cpp sizes its buffers). t_target is keyed by the
    positions of a pass, B(k+1); t_draft by (B, k). The batch is left empty, as it was, and a
    drafter that keeps earlier requests (suffix drafting's corpus) forgets the synthetic ones."""
    if len(batch):
        raise ValueError("calibrate needs a batch with no rows")
    k_max, vocab = policy.k_max, batch.target.vocab_size
    prompt_length = max(1, min(prompt_length, max_model_len // 4))
    budget = min(3 + k_max * (k_max + 3) // 2, max_model_len - prompt_length)  # what the script can commit at most
    if budget < 1:
        return 0.0
    params = SamplingParams(temperature=0, max_new_tokens=budget)
    if sampling is not None:
        params = dataclasses.replace(sampling, max_new_tokens=budget, seed=0, stop_token_ids=())
    scripted, saved = _Scripted(k_max), batch.policy
    script = [0, 1, *range(1, k_max + 1)] if k_max else [0, 0, 0]
    started = time.perf_counter()
    batch.policy = scripted
    try:
        for _ in range(repeats):
            for size in sizes:
                ids = [("calibration", row) for row in range(size)]
                prompts = [
                    [(7919 * (i + 1) + 104729 * row) % vocab for i in range(prompt_length)] for row in range(size)
                ]
                batch.join(prompts, [params] * size, ids)
                for k in script:
                    if not len(batch):
                        break
                    scripted.k = k
                    batch.step()
                if len(batch):
                    batch.cancel(list(batch.ids), "abort")
    finally:
        batch.policy = saved
        if hasattr(batch.drafter, "clear_corpus"):
            batch.drafter.clear_corpus()
    target: dict[int, list[float]] = {}
    draft: dict[tuple[int, int], list[float]] = {}
    for rows, k, draft_s, target_s in scripted.times:
        target.setdefault(rows * (k + 1), []).append(target_s)
        if k > 0:
            draft.setdefault((rows, k), []).append(draft_s)
    policy.seed_costs(
        {n: statistics.median(t) for n, t in target.items()}, {key: statistics.median(t) for key, t in draft.items()}
    )
    return time.perf_counter() - started


class _Costs:
    """Receives a calibration's medians (`calibrate` calls seed_costs, as on AdaptiveLength)."""

    def __init__(self, k_max: int):
        self.k_max, self.target, self.draft = k_max, {}, {}

    def seed_costs(self, target: dict[int, float], draft: dict[tuple[int, int], float]) -> None:
        self.target, self.draft = target, draft


_PASSES: dict[tuple, CostProfile] = {}  # (target, draft, context, k_max) -> profile_passes


class _EveryPass:
    """A model-free drafter (prompt lookup, suffix drafting) that proposes k tokens at every pass, its own
    padded lookup (`confident(k)`, then `take`), so that `calibrate` times passes of every k on a synthetic
    prompt where the lookup finds nothing: its lookup, the target's pass and the rule as `generate` runs them."""

    def __init__(self, lookup):
        self.lookup = lookup

    def __getattr__(self, name: str):
        return getattr(self.lookup, name)

    def propose(self, k: int, sampling=None) -> tuple[torch.Tensor, None]:
        if k == 0:
            return self.lookup.propose(0, sampling)
        walks = self.lookup.confident(k)[0]  # [B, k]
        self.lookup.take(walks)
        return walks, None


@torch.no_grad()
def profile_passes(
    target,
    drafter,
    k_max: int = 8,
    context_length: int = 128,
    repeats: int = 5,
    sampling: SamplingParams | None = None,
) -> CostProfile:
    """t_target(1..k_max+1) and t_draft from passes of a real engine.Batch of one row (`calibrate`):
    the path `generate` and `bench` run, llama.cpp's compiled step where it applies, with its own
    sampling, rule and bookkeeping in the times (`profile_costs` times the Python path's). A pass
    of k proposals is t_target(k + 1); t_draft is the median over k of its drafting time / k. With no
    drafter (k_max 0): plain passes, the baseline `bench` compares with. A model-free drafter (one
    with `confident`) proposes k at every pass (`_EveryPass`); its lookup's time is in t_target.
    Rows sample as `sampling` (temperature, top-k, top-p, min-p; default greedy): at T > 0 a pass
    also processes the vocabulary at each position and runs the rule on it."""
    from ..engine import Batch  # the engine and the policies sit above this module
    from ..policy import FixedLength

    context = context_bucket(context_length)
    limit = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    budget = 3 + k_max * (k_max + 3) // 2  # what calibrate's script commits at most
    if isinstance(limit, int):
        context = max(1, min(context, limit - budget - k_max - 1))
    model = getattr(drafter, "model", None)
    lookup = is_lookup(drafter)
    kind = _identity(model) if model is not None else type(drafter).__name__ if lookup else None
    sampled = None if sampling is None or sampling.greedy else sampling  # None: greedy passes
    settings = None if sampled is None else (sampled.temperature, sampled.top_k, sampled.top_p, sampled.min_p)
    key = (_identity(target), kind, context, k_max, settings)
    if key in _PASSES:
        return _PASSES[key]
    costs = _Costs(k_max)
    params = SamplingParams(temperature=0, max_new_tokens=1)
    proposer = _EveryPass(drafter) if lookup else drafter
    batch = Batch(target, [], params, proposer, FixedLength(k_max), capacity=1, max_length=context + budget + k_max + 1)
    try:
        calibrate(batch, costs, [1], 4 * context + budget, repeats, prompt_length=context, sampling=sampled)
    finally:
        batch.close()
    target_s = tuple(
        costs.target[n] + (costs.draft[(1, n - 1)] if lookup and n > 1 else 0.0) for n in range(1, k_max + 2)
    )
    draft_s = statistics.median(costs.draft[(1, k)] / k for k in range(1, k_max + 1)) if model is not None else None
    _PASSES[key] = CostProfile(target_s=target_s, draft_s=draft_s, batch_size=1, context_length=context)
    return _PASSES[key]
