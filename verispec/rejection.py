"""The accept-reject rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

Vocabulary (as in vLLM's rejection sampler):
- accepted tokens: draft tokens x_i kept because u_i < p_i(x_i) / q_i(x_i), u_i ~ U[0, 1);
  acceptance stops at the first rejection;
- recovered token: at the first rejection i, a token drawn from normalize(max(p_i - q_i, 0));
- bonus token: when all k draft tokens are accepted, a token drawn from p_{k+1}.
Every step therefore outputs 1..k+1 tokens, each distributed exactly as the target's.

p is the target's processed distribution, q the draft's; a deterministic drafter
(`draft_probs=None`) has q one-hot at its proposal. Greedy (one-hot p) reduces to
"accept while the draft equals the target's argmax, then emit the argmax".
Pure tensor functions: no loops over rows or positions, no host synchronisation.
"""

from __future__ import annotations

import torch

from .sampling import sample


def verify(
    draft_token_ids: torch.Tensor,  # [B, k] long
    draft_probs: torch.Tensor | None,  # [B, k, V] float32, or None: q one-hot at the proposal
    target_probs: torch.Tensor,  # [B, k+1, V] float32, processed with the same SamplingParams
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (output_token_ids [B, k+1], num_accepted [B]).

    output_token_ids holds the accepted draft tokens, then the recovered or bonus token,
    then -1. num_accepted counts accepted draft tokens only (0..k).
    """
    batch, k = draft_token_ids.shape
    p_draft = _at(target_probs[:, :k], draft_token_ids)  # p_i(x_i)   [B, k]
    q_draft = torch.ones_like(p_draft) if draft_probs is None else _at(draft_probs, draft_token_ids)
    u = torch.rand(p_draft.shape, generator=generator, device=p_draft.device)
    accepted = u * q_draft < p_draft  # u < p/q without dividing by q   [B, k]
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B]

    # Distribution of the token after the accepted prefix: residual at a rejection, p_{k+1} otherwise.
    residual = _residual_probs(draft_token_ids, draft_probs, target_probs[:, :k])  # [B, k, V]
    extra_probs = torch.cat([residual, target_probs[:, k:]], dim=1)  # [B, k+1, V]
    rows = torch.arange(batch, device=num_accepted.device)
    extra_token = sample(extra_probs[rows, num_accepted], generator)  # [B]

    positions = torch.arange(k + 1, device=num_accepted.device)  # [k+1]
    padded = torch.cat([draft_token_ids, draft_token_ids.new_full((batch, 1), -1)], dim=1)
    output = torch.where(positions < num_accepted[:, None], padded, -1)
    output = output.scatter(1, num_accepted[:, None], extra_token[:, None])
    return output, num_accepted


def _at(probs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """probs [B, k, V] at token_ids [B, k] -> [B, k]."""
    return probs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)


def _residual_probs(
    draft_token_ids: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V] or None
    target_probs: torch.Tensor,  # [B, k, V]
) -> torch.Tensor:
    """normalize(max(p - q, 0)) per position [B, k, V].

    Where p - q has no positive mass, a rejection has probability zero; p is returned there
    so that the tensor is always a distribution.
    """
    if draft_probs is None:  # q one-hot: remove the proposal's mass from p
        residual = target_probs.scatter(-1, draft_token_ids.unsqueeze(-1), 0.0)
    else:
        residual = (target_probs - draft_probs).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), target_probs)


def acceptance_probability(
    draft_token_ids: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V] or None
    target_probs: torch.Tensor,  # [B, k+1, V] (or [B, k, V])
) -> torch.Tensor:
    """beta_i = sum_x min(p_i(x), q_i(x)) = 1 - TV(p_i, q_i), per verified position [B, k].

    The exact probability that position i is accepted given the prefix (for a deterministic
    drafter, p_i at its proposal). Costs no extra pass: both distributions are in memory.
    """
    k = draft_token_ids.shape[1]
    if draft_probs is None:
        return _at(target_probs[:, :k], draft_token_ids)
    return torch.minimum(target_probs[:, :k], draft_probs).sum(dim=-1)
