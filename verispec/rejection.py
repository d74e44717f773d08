"""The accept-reject rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

Vocabulary (as in vLLM's rejection sampler):
- accepted tokens: draft tokens x_i kept because u_i < p_i(x_i) / q_i(x_i), u_i ~ U[0, 1);
  acceptance stops at the first rejection;
- recovered token: at the first rejection i, a token drawn from normalize(max(p_i - q_i, 0));
- bonus token: when all k draft tokens are accepted, a token drawn from p_{k+1}.
Every step therefore outputs 1..k+1 tokens, each distributed exactly as the target's.

p is the target's processed distribution, q the draft's; a deterministic drafter
(`draft_probs=None`) has q one-hot at its proposal x, and the rule is then run in its coupled
form: t_i ~ p_i, accept while t_i == x_i, commit t_i at the first difference (accepted with
probability p_i(x_i) = min(1, p/q); the committed t_i is drawn from p_i without x_i, which is
normalize(max(p_i - q_i, 0))). It uses one random number per position, so a row that commits
n tokens needs only the first n of them: the engine's per-row streams then give a
deterministic drafter the tokens of plain sampling with the same seed, whatever it proposed.
Greedy (one-hot p) reduces to "accept while the draft equals the target's argmax, then emit
the argmax".

`verify` is the rule on a batch of rows that share their settings; `verify_batch` is the rule
as the engine runs it on one target pass, each row by its own settings and random stream (and
llamacpp/llama_step.c's `verispec_rule` its compiled mirror, tested against it).
Pure tensor functions: no loops over rows or positions, no host synchronisation.
"""

from __future__ import annotations

import torch

from .sampling import Generators, RowSampling, sample, uniform


def verify(
    draft_token_ids: torch.Tensor,  # [B, k] long
    draft_probs: torch.Tensor | None,  # [B, k, V] float32, or None: q one-hot at the proposal
    target_probs: torch.Tensor,  # [B, k+1, V] float32, processed with the same SamplingParams
    generator: Generators = None,  # one for the batch, or one per row (row b then draws from generator[b] alone)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (output_token_ids [B, k+1], num_accepted [B]).

    output_token_ids holds the accepted draft tokens, then the recovered or bonus token,
    then -1. num_accepted counts accepted draft tokens only (0..k).
    """
    batch, k = draft_token_ids.shape
    if draft_probs is None:  # q one-hot: the target's own draws, accepted while they equal the proposals
        return verify_greedy(draft_token_ids, sample(target_probs, generator))  # one draw per position
    ids = draft_token_ids[..., None]  # [B, k, 1]
    p_draft = target_probs[:, :k].gather(-1, ids)  # p_i(x_i)   [B, k, 1]
    u = uniform(tuple(p_draft.shape), generator, p_draft.device)  # [B, k, 1] float64
    uq = u * draft_probs.gather(-1, ids)  # float64 (u is)
    accepted = uq < p_draft  # u < p/q without dividing by q, compared in float64   [B, k, 1]
    num_accepted = accepted.squeeze(-1).cumprod(dim=1).sum(dim=1)  # [B]

    # The token after the accepted prefix: from the residual at a rejection, from p_{k+1} when all
    # k were accepted. Only that one position per row is computed.
    vocab = target_probs.shape[-1]
    p_next = target_probs.gather(1, num_accepted[:, None, None].expand(batch, 1, vocab))  # [B, 1, V]
    extra_probs = p_next
    if k > 0:
        at = num_accepted.clamp_max(k - 1)[:, None]  # [B, 1] the rejected position (any, for rows that took the bonus)
        q_next = draft_probs.gather(1, at[..., None].expand(batch, 1, vocab))  # [B, 1, V]
        residual = _residual_probs(q_next, p_next)  # [B, 1, V]
        extra_probs = torch.where((num_accepted < k)[:, None, None], residual, p_next)
    extra_token = sample(extra_probs[:, 0], generator)  # [B]

    positions = torch.arange(k + 1, device=num_accepted.device)  # [k+1]
    padded = torch.nn.functional.pad(draft_token_ids, (0, 1), value=-1)  # [B, k+1]
    output = torch.where(positions < num_accepted[:, None], padded, -1)
    output = output.scatter(1, num_accepted[:, None], extra_token[:, None])
    return output, num_accepted


def verify_greedy(
    draft_token_ids: torch.Tensor,  # [B, k] long
    target_token_ids: torch.Tensor,  # [B, k+1] long: the target's argmax at each position
) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify` when p is one-hot at the target's argmax (temperature 0), whatever q is: a
    proposal is accepted iff it is the argmax (min(1, p/q) is 1 there and 0 elsewhere), and the
    recovered or bonus token is the argmax (the residual max(p - q, 0) is one-hot there too).
    No random numbers and no [.., V] tensors. Same outputs as `verify`."""
    k = draft_token_ids.shape[1]
    num_accepted = (draft_token_ids == target_token_ids[:, :k]).cumprod(dim=1).sum(dim=1)  # [B] (bool cumprod is long)
    positions = torch.arange(k + 1, device=num_accepted.device)  # [k+1]
    output = torch.where(positions <= num_accepted[:, None], target_token_ids, -1)  # accepted tokens equal the argmax
    return output, num_accepted


def verify_batch(
    scores: torch.Tensor,  # [B, k+1] the target's argmax ids (every row greedy), else [B, k+1, V] its raw logits
    draft_token_ids: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V] or None
    sampling: RowSampling,
    start_lengths: list[int],  # [B] row b's pass predicts positions start_lengths[b] + 1 ..
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The accept-reject rule on one pass, each row by its own settings: (output [B, k+1],
    num_accepted [B], beta [B, k], target_probs [B, k+1, V] or None where every row is greedy).

    At temperature 0 p is one-hot at the argmax (as process_logits makes it), so the rule is
    `verify_greedy` on token ids and beta = sum min(p, q) = q(argmax): the same result as the
    general path without its [B, k+1, V] work. Invariant rows take the same path on the
    target's invariant choices (beta is then whether each proposal was its token). The other
    rows run `verify`, each drawing from its own stream; with a deterministic drafter (q
    one-hot) a row then keeps only the numbers of the tokens it commits, one each, so it
    commits the tokens of plain sampling with its seed, whatever was proposed."""
    batch, k = draft_token_ids.shape
    if scores.dim() == 2:  # every row greedy: the argmax ids
        output, num_accepted = verify_greedy(draft_token_ids, scores)
        if draft_probs is None:  # q one-hot at the proposal
            return output, num_accepted, (draft_token_ids == scores[:, :k]).float(), None
        return output, num_accepted, draft_probs.gather(-1, scores[:, :k, None]).squeeze(-1), None
    if draft_probs is not None and draft_probs.shape[-1] != scores.shape[-1]:
        raise ValueError(f"draft vocabulary ({draft_probs.shape[-1]}) differs from the target's ({scores.shape[-1]})")
    target_probs = sampling.process(scores)  # [B, k+1, V]
    rejection = sampling.rows("rejection")
    streams = sampling.streams
    drawn = (
        streams.counters.clone() if draft_probs is None else None
    )  # [B] numbers each row had drawn (coupled form only)
    if len(rejection) == batch:  # the common case: no row to pick out
        output, num_accepted = verify(draft_token_ids, draft_probs, target_probs, streams)
        if draft_probs is None:  # coupled form: one number per committed token, the rest unread
            streams.counters = drawn + num_accepted + 1
        return output, num_accepted, acceptance_probability(draft_token_ids, draft_probs, target_probs), target_probs
    positions = (
        torch.tensor(start_lengths, device=scores.device)[:, None] + 1 + torch.arange(k + 1, device=scores.device)
    )  # [B, k+1]
    target_ids = sampling.draw(target_probs, positions, modes=("invariant",))  # [B, k+1]: argmax or invariant choice
    output, num_accepted = verify_greedy(draft_token_ids, target_ids)
    beta = (draft_token_ids == target_ids[:, :k]).float()  # [B, k]
    if draft_probs is not None:  # greedy rows: beta = q(argmax)
        greedy = torch.tensor(sampling.rows("greedy"), dtype=torch.long, device=scores.device)
        beta[greedy] = draft_probs[greedy].gather(-1, target_ids[greedy, :k, None]).squeeze(-1)
    if rejection:
        index = torch.tensor(rejection, device=scores.device)
        q = None if draft_probs is None else draft_probs[index]
        p = target_probs[index]
        rows_output, rows_accepted = verify(draft_token_ids[index], q, p, streams.select(rejection))
        output[index], num_accepted[index] = rows_output, rows_accepted
        if q is None:
            streams.counters[index] = drawn[index] + rows_accepted + 1
        beta[index] = acceptance_probability(draft_token_ids[index], q, p)
    return output, num_accepted, beta, target_probs


def _at(probs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """probs [B, k, V] at token_ids [B, k] -> [B, k]."""
    return probs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)


def _residual_probs(
    draft_probs: torch.Tensor,  # [B, k, V]
    target_probs: torch.Tensor,  # [B, k, V]
) -> torch.Tensor:
    """max(p - q, 0) per position [B, k, V], unnormalized: `sample` draws in proportion to
    its weights, so this is drawing from normalize(max(p - q, 0)).

    Where p - q has no positive mass, a rejection has probability zero; p is returned there
    so that every row can be drawn from.
    """
    residual = (target_probs - draft_probs).clamp_min(0.0)
    return torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, target_probs)


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
