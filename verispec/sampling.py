"""Logits -> the processed distribution a token is actually drawn from; seeded draws.

Owns: `process_logits` (temperature, top-k, top-p, min-p, greedy as one-hot), `sample`
(an exact draw from a probability tensor, driven by an explicit `torch.Generator`, or by
per-row streams, streams.py) and `RowSampling` (a batch's settings and random streams, one per row: a
seeded row draws only from its own stream, so its numbers do not depend on the other rows).
The distribution returned here is the one the token is drawn from, in float32: the draft
declares exactly this tensor as q, and the target's p is computed by the same function with
the same parameters. Knows nothing of models, caches or speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from .config import SamplingParams
from .streams import RowStreams, fresh_seed

__all__ = ["SamplingParams", "RowSampling", "process_logits", "sample", "uniform", "make_generator", "row_seed"]

Generators = torch.Generator | RowStreams | None  # one stream for all rows, or one per row (streams.py)


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn raw logits [..., V] into the float32 distribution [..., V] a token is drawn from."""
    logits = logits.float()
    if params.greedy:
        argmax = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros_like(logits).scatter_(-1, argmax, 1.0)
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        top = logits.topk(params.top_k, dim=-1)  # [..., K], most likely first
        kth = top.values[..., -1:]  # [..., 1]
        if logits.device.type == "cpu" and not bool(((logits >= kth).sum(dim=-1) > params.top_k).any()):
            return _within_top_k(logits, top.values, top.indices, params)  # no tie at the k-th: the same, on K
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    if params.min_p > 0.0:
        keep = probs >= params.min_p * probs.amax(dim=-1, keepdim=True)
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _within_top_k(
    logits: torch.Tensor,  # [..., V] scaled by the temperature
    values: torch.Tensor,  # [..., K] the K largest, descending
    indices: torch.Tensor,  # [..., K] their ids
    params: SamplingParams,
) -> torch.Tensor:
    """process_logits after top-k when exactly K tokens are kept: softmax, top-p and min-p on the K
    (already in descending order: no sort over the vocabulary), scattered back to [..., V]."""
    probs = torch.softmax(values, dim=-1)  # [..., K]
    if params.top_p < 1.0:
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        probs = probs * (mass_before < params.top_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if params.min_p > 0.0:
        probs = probs * (probs >= params.min_p * probs[..., :1])
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(logits).scatter_(-1, indices, probs)


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (the top token always)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # ties: the lower id first (as the C step)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly more likely tokens
    keep_sorted = mass_before < top_p
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    probs = probs * keep
    return probs / probs.sum(dim=-1, keepdim=True)


def uniform(shape: tuple[int, ...], generator: Generators, device: torch.device | str) -> torch.Tensor:
    """u ~ U[0, 1) in float64 of the given shape. With per-row streams (`RowStreams` or a
    selection of one, shape[0] rows) row b's numbers come from its own stream alone."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(shape, dtype=torch.float64, generator=generator, device=device)
    return generator.uniform(shape)


def sample(probs: torch.Tensor, generator: Generators = None) -> torch.Tensor:
    """One exact draw per row from probs [..., V] -> LongTensor [...]. Rows need not sum to
    one: any nonnegative weights with a positive sum are drawn from in proportion.

    Inverse transform sampling in float64: u ~ U[0, 1) (53 random bits), and the first token
    whose cumulative mass exceeds u * total. float32 probabilities are exact in float64 and the
    running sum rounds at 1e-16, so each token is drawn with its probability to that precision.
    A token with p = 0 does not raise the cumulative mass and is never drawn. One random number
    per row (an exponential race needs V of them: 10x slower at V = 8192). No host sync.
    With per-row streams (probs [B, ..., V]), row b draws from its own stream alone.
    """
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # [..., V], summed in float64 (no float64 copy of probs)
    total = cdf[..., -1:]  # [..., 1]
    u = uniform(tuple(total.shape), generator, probs.device)
    point = torch.minimum(u * total, total.nextafter(torch.zeros_like(total)))  # < total, even after rounding
    return torch.searchsorted(cdf, point, right=True).squeeze(-1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded with `seed`, or from fresh entropy when seed is None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


_GOLDEN = 0x9E3779B97F4A7C15


def row_seed(seed: int, row: int) -> int:
    """Row `row`'s seed when one seed is given for a whole batch (row 0 keeps it)."""
    return (seed + row * _GOLDEN) % 2**63


def _settings(params: SamplingParams) -> tuple:
    """What process_logits and the rule read: rows that share it are processed together."""
    return (
        params.temperature,
        params.top_k,
        params.top_p,
        params.min_p,
        params.sampling if not params.greedy else "greedy",
    )


class RowSampling:
    """A batch's sampling settings and random streams, one per row.

    `RowSampling(params, batch, device)`: one `SamplingParams` for every row (a seed s gives row
    b the seed row_seed(s, b), so rows are independent draws), or a sequence of one per row
    (each row its own seed: equal seeds and prompts give equal rows, as vLLM's per-request
    seeds). Row b draws only from its own stream (`streams`, seeded by seeds[b]: fresh entropy
    where its seed is None), and its invariant-mode noise is keyed by seeds[b]: a seeded row's
    numbers never depend on the other rows."""

    def __init__(
        self, params: SamplingParams | Sequence[SamplingParams], batch: int, device: torch.device | str = "cpu"
    ):
        if isinstance(params, SamplingParams):
            rows = [
                params if params.seed is None else replace(params, seed=row_seed(params.seed, b)) for b in range(batch)
            ]
        else:
            rows = list(params)
            if len(rows) != batch or not all(isinstance(p, SamplingParams) for p in rows):
                raise ValueError(
                    f"params must be one SamplingParams or one per prompt ({batch}), got {len(rows)} items"
                )
        self.params: list[SamplingParams] = rows
        self.seeds = [p.seed if p.seed is not None else fresh_seed() for p in rows]
        self.streams = RowStreams(self.seeds, device)
        self._group()

    def _group(self) -> None:
        rows = self.params
        groups: dict[tuple, list[int]] = {}
        for b, p in enumerate(rows):
            groups.setdefault(_settings(p), []).append(b)
        self.groups = [(rows[members[0]], members) for members in groups.values()]  # (settings, rows)
        self._modes = {
            mode: sorted(b for settings, members in self.groups if _settings(settings)[-1] == mode for b in members)
            for mode in ("greedy", "invariant", "rejection")
        }  # in row order: all rows of a mode are then the batch itself
        self.greedy = len(self._modes["greedy"]) == len(rows)  # every row at temperature 0

    def keep_rows(self, rows: Sequence[int]) -> None:
        """The batch becomes the old rows `rows`, in that order (each with its settings and its
        stream where it stands): engine.Batch, when rows leave."""
        self.params = [self.params[b] for b in rows]
        self.seeds = [self.seeds[b] for b in rows]
        self.streams.keep_rows(rows)
        self._group()

    def add_rows(self, params: Sequence[SamplingParams]) -> None:
        """New requests after the other rows, each with its settings and a fresh stream from its
        seed (as if it had started alone)."""
        if not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("add_rows needs one SamplingParams per new row")
        seeds = [p.seed if p.seed is not None else fresh_seed() for p in params]
        self.params, self.seeds = self.params + list(params), self.seeds + seeds
        self.streams.add_rows(seeds)
        self._group()

    def __len__(self) -> int:
        return len(self.params)

    @property
    def shared(self) -> SamplingParams | None:
        """The settings of every row when they are all the same (seeds aside), else None."""
        return self.groups[0][0] if len(self.groups) == 1 else None

    def rows(self, mode: str) -> list[int]:
        """The rows whose rule is `mode`: "greedy" (temperature 0), "invariant" or "rejection"."""
        return self._modes[mode]

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """process_logits of each row with its own settings: logits [B, ..., V] -> probs [B, ..., V] float32."""
        if len(self.groups) == 1:
            return process_logits(logits, self.groups[0][0])
        probs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        for settings, members in self.groups:
            index = torch.tensor(members, device=logits.device)
            probs[index] = process_logits(logits[index], settings)
        return probs

    def draw(
        self, probs: torch.Tensor, positions: torch.Tensor, modes: tuple[str, ...] = ("invariant", "rejection")
    ) -> torch.Tensor:
        """Each row's tokens from its processed distributions probs [B, T, V] at absolute
        positions [B, T]: the argmax at temperature 0, the invariant choice (`invariant.choose`)
        in invariant mode, else draws from the row's own generator. [B, T] long. Rows of a mode
        not in `modes` get the argmax and use no random numbers."""
        from .invariant import choose

        tokens = probs.argmax(dim=-1)  # [B, T] (greedy rows: the one-hot's token)
        for mode in modes:
            rows = self.rows(mode)
            if not rows:
                continue
            index = torch.tensor(rows, device=probs.device)
            if mode == "invariant":
                seeds = torch.tensor([self.seeds[b] for b in rows], device=probs.device)
                chosen = choose(probs[index], seeds, positions[index])
            else:
                chosen = sample(probs[index], self.streams if len(rows) == len(self) else self.streams.select(rows))
            tokens = chosen if len(rows) == len(self) else tokens.index_copy(0, index, chosen)
        return tokens
