"""The advisor behind `verispec plan`: should you speculate, with which draft, and with which k?

Owns the teacher-forced acceptance estimate and the recommendation. No decoding loop runs
with a draft: the target continues each prompt once, then the target and each draft score
the whole sequence in one pass each. At every continuation position t this gives
beta_t = sum_x min(p_t(x), q_t(x)). A block that starts at t accepts its first i proposals
with probability prod_{j<i} beta_{t+j} (drafts of accepted tokens follow the committed text),
so the mean of that product over t estimates alpha_1 * ... * alpha_i, and the ratios of
successive products the per-position alpha_i of the refined model. With the profiler's c
and r(n) it predicts S(k) for every k and recommends the best, or k = 0: do not speculate.

A candidate is a draft model or a drafter: a ModelDrafter (early exit included) is scored
through its model; prompt lookup through its first proposal after every true prefix (q
one-hot), whose cost is counted as zero (c = 0: a lookup runs no model). Where no n-gram
matches, prompt lookup proposes nothing and the engine runs a plain pass: its alphas come
from the blocks that start at a match, and S(k) weighs plain passes by the share of
positions without one (theory.mixed_speedup).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .config import SamplingParams
from .drafters.ngram import PromptLookupDrafter
from .engine import generate_all
from .profiler import profile_costs
from .sampling import process_logits
from .theory import mixed_speedup, refined_speedup


def draft_model_of(candidate) -> torch.nn.Module | None:
    """The network a candidate runs (None for a model-free drafter such as prompt lookup)."""
    if isinstance(candidate, torch.nn.Module):
        return candidate
    return getattr(candidate, "model", None)


def _lookup(drafter: PromptLookupDrafter, sequence: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt lookup's first proposal [T] after each prefix sequence[:t], t = start..end-1, and
    whether it came from a match [T] bool (else it is padding, and the engine would not draft)."""
    prefixes = [sequence[:t] for t in range(start, len(sequence))]
    drafter.start(prefixes, len(sequence))
    proposals, found = drafter.lookup(1)  # [T, 1], [T]
    return proposals[:, 0], found


def lookup_matched(drafter: PromptLookupDrafter, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[torch.Tensor]:
    """Per sequence, [T_b] bool: whether prompt lookup finds a match at each continuation position."""
    return [_lookup(drafter, list(sequence), start)[1].cpu() for sequence, start in zip(sequences, starts)]


@torch.no_grad()
def teacher_forced_beta(
    target: torch.nn.Module, draft, sequences: Sequence[Sequence[int]], starts: Sequence[int], params: SamplingParams
) -> list[torch.Tensor]:
    """beta_t for the positions that predict sequence[starts[b]:], one [T_b] tensor per sequence.
    `draft` is a causal LM, a ModelDrafter or a PromptLookupDrafter."""
    model = draft_model_of(draft)
    if model is None and not isinstance(draft, PromptLookupDrafter):
        raise ValueError(f"cannot score a {type(draft).__name__}: give a model, a ModelDrafter or a PromptLookupDrafter")
    betas = []
    for sequence, start in zip(sequences, starts):
        ids = torch.tensor([list(sequence)], device=target.device)
        p = process_logits(target(ids)[0, start - 1 : -1], params)  # [T, V]
        if model is not None:
            q = process_logits(model(ids)[0, start - 1 : -1], params)
        else:
            q = torch.nn.functional.one_hot(_lookup(draft, list(sequence), start)[0].to(p.device), p.shape[-1]).float()
        betas.append(torch.minimum(p, q).sum(dim=-1).double().cpu())
    return betas


def position_alphas(betas: Sequence[torch.Tensor], k_max: int, block_starts: Sequence[torch.Tensor] | None = None) -> list[float]:
    """alpha_1..alpha_k_max from per-position beta: ratios of mean block-acceptance products,
    over every block start t, or over those where block_starts[b][t] is True."""
    products = []  # products[i] = mean over t of prod_{j<=i} beta_{t+j}
    for i in range(k_max):
        values = [
            torch.stack([b[j : len(b) - i + j] for j in range(i + 1)]).prod(dim=0)[block_starts[n][: len(b) - i] if block_starts else slice(None)]
            for n, b in enumerate(betas) if len(b) > i
        ]
        values = torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)
        products.append(float(values.mean()) if len(values) else float("nan"))
    alphas, before = [], 1.0
    for product in products:
        if math.isnan(product) or before <= 0:  # too few positions this deep: borrow the last
            alphas.append(alphas[-1] if alphas else 0.0)
            continue
        alphas.append(min(max(product / before, 0.0), 1.0))
        before = product
    return alphas


def plan(
    target: torch.nn.Module,
    drafts: dict[str, object],
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    k_max: int = 8,
) -> dict:
    """Per draft (a model or a drafter): alpha per position, c, predicted S(k) for k = 0..k_max,
    the recommended k."""
    continuations = generate_all(target, prompts, params)
    sequences = [list(p) + c for p, c in zip(prompts, continuations)]
    context = round(sum(map(len, sequences)) / len(sequences))
    report = {"k_max": k_max, "temperature": params.temperature, "prompts": len(prompts), "candidates": []}
    for name, draft in drafts.items():
        starts = [len(p) for p in prompts]
        betas = teacher_forced_beta(target, draft, sequences, starts, params)
        matched = lookup_matched(draft, sequences, starts) if isinstance(draft, PromptLookupDrafter) else None
        alphas = position_alphas(betas, k_max, matched)
        profile = profile_costs(target, draft_model_of(draft), k_max=k_max, context_length=context)
        c = profile.c or 0.0  # None: no draft model (prompt lookup)
        if matched is None:
            share = 1.0
            predicted = [refined_speedup(alphas[:k], c, profile.r) for k in range(k_max + 1)]
        else:  # a position without a match is a plain pass
            share = float(torch.cat(matched).double().mean())
            predicted = [1.0] + [mixed_speedup(alphas[:k], c, profile.r, [1.0 - share] + [0.0] * (k - 1) + [share]) for k in range(1, k_max + 1)]
        best = max(range(k_max + 1), key=lambda k: (predicted[k], -k))
        report["candidates"].append({
            "draft": name, "alpha_by_position": alphas, "beta": float(torch.cat(betas).mean()), "c": c,
            "r": list(profile.r), "proposal_share": share, "predicted_speedup": predicted, "recommended_k": best,
            "advice": "do not speculate" if best == 0 else f"speculate with k = {best}",
        })
    return report
