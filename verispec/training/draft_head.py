"""A draft whose output covers a subset of the target's vocabulary (FR-Spec, EAGLE-3's idea).

Owns `SubsetHeadLlama` (verispec's Llama with the full input embedding and an output head of
N < V rows; `forward` gives float32 logits [B, T, V] that are -inf outside the subset, so q is
0 there and the accept-reject rule stays exact: a token q never proposes is still reachable
through the residual max(p - q, 0)), `choose_subset` (the most frequent tokens of the
teacher's distributions, as few as keep the acceptance they cost under a bound) and
`subset_distill_loss`. Knows nothing of files or decoding.

The acceptance a subset S costs is at most the target's mass outside it: sum over x not in S of
min(p(x), q(x)) is 0 when q(x) = 0, and at most sum p(x) outside S otherwise; the greedy
acceptance it costs is the share of positions whose argmax lies outside S.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.kernels import Linear
from ..models.llama import LlamaConfig, LlamaForCausalLM


class SubsetHeadLlama(LlamaForCausalLM):
    """verispec's Llama with an output head over `vocab_ids` (sorted, unique target ids) only."""

    def __init__(self, config: LlamaConfig, vocab_ids: torch.Tensor):
        super().__init__(config.replace(tie_word_embeddings=False))
        vocab_ids = torch.as_tensor(vocab_ids, dtype=torch.long)
        if vocab_ids.ndim != 1 or not len(vocab_ids) or (vocab_ids.diff() <= 0).any():
            raise ValueError("vocab_ids must be a non-empty, strictly increasing list of token ids")
        if vocab_ids[0] < 0 or vocab_ids[-1] >= config.vocab_size:
            raise ValueError(f"vocab_ids must lie in [0, {config.vocab_size}), got {vocab_ids[0]}..{vocab_ids[-1]}")
        self.lm_head = Linear(config.hidden_size, len(vocab_ids), bias=False)
        self.register_buffer("vocab_ids", vocab_ids, persistent=True)

    def subset_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, d] -> float32 logits over the subset [B, T, N]."""
        return self.lm_head(self.model.norm(hidden)).float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, d] -> float32 logits [B, T, V], -inf outside the subset."""
        small = self.subset_logits(hidden)
        full = small.new_full((*small.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.vocab_ids, small)


def token_mass(ids: torch.Tensor, logp: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The teacher's probability mass per token, summed over positions: ids, logp [..., K] -> [V]."""
    mass = torch.zeros(vocab_size, dtype=torch.float64)
    return mass.index_add_(0, ids.reshape(-1).long(), logp.reshape(-1).double().exp())


def choose_subset(
    mass: torch.Tensor, argmax_counts: torch.Tensor, max_cost: float = 0.01, always: tuple[int, ...] = ()
) -> tuple[torch.Tensor, dict]:
    """The smallest set of most-massive tokens whose outside mass and outside greedy share are both
    at most `max_cost` of the teacher's (measured on held-out positions), plus `always` (e.g. EOS).
    Returns (sorted ids, {"size", "mass_outside", "greedy_outside"})."""
    order = torch.argsort(mass, descending=True)
    cum_mass = mass[order].cumsum(0) / mass.sum().clamp_min(1e-30)
    cum_greedy = argmax_counts[order].double().cumsum(0) / argmax_counts.sum().clamp_min(1)
    enough = (cum_mass >= 1 - max_cost) & (cum_greedy >= 1 - max_cost)
    size = int(enough.nonzero()[0, 0]) + 1 if enough.any() else len(order)
    size = max(size, min(len(order), 64))
    chosen = set(order[:size].tolist()) | {t for t in always if 0 <= t < len(mass)}
    ids = torch.tensor(sorted(chosen), dtype=torch.long)
    inside = torch.zeros(len(mass), dtype=torch.bool)
    inside[ids] = True
    report = {
        "size": len(ids),
        "mass_outside": float(mass[~inside].sum() / mass.sum().clamp_min(1e-30)),
        "greedy_outside": float(argmax_counts[~inside].sum() / argmax_counts.sum().clamp_min(1)),
    }
    return ids, report


def subset_index(vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] long: each target id's place in the subset, -1 outside it."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[vocab_ids] = torch.arange(len(vocab_ids))
    return index


def subset_distill_loss(
    logits: torch.Tensor, ids: torch.Tensor, logp: torch.Tensor, rest_logp: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """Mean KL(p || q) per position between coarsened distributions, q over the subset only:
    logits [B, T, N] (the subset's), the teacher's top-k ids [B, T, K] (target ids), logp [B, T, K],
    rest_logp [B, T] (its mass beyond the top k), index = subset_index(...). The outcomes kept are
    the teacher's top-k tokens that lie in the subset; everything else is one outcome (for p: its
    rest and its top-k tokens outside the subset; for q: its mass on the subset's other tokens)."""
    logq = F.log_softmax(logits.float(), dim=-1)  # [B, T, N]
    place = index[ids]  # [B, T, K], -1 outside the subset
    kept = place >= 0
    logq_top = logq.gather(-1, place.clamp_min(0)).masked_fill(~kept, float("-inf"))  # [B, T, K]
    logq_rest = torch.log1p(-logq_top.exp().sum(-1).clamp(max=1 - 1e-6)).clamp_min(-80.0)  # [B, T]
    p_top = logp.exp().masked_fill(~kept, 0.0)
    p_rest = (rest_logp.exp() + logp.exp().masked_fill(kept, 0.0).sum(-1)).clamp(1e-30, 1.0)
    kl_top = (p_top * (logp - logq_top.masked_fill(~kept, 0.0))).sum(-1)
    return (kl_top + p_rest * (p_rest.log() - logq_rest)).mean()
