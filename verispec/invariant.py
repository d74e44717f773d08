"""Drafter-invariant sampling (Daliri, Musco and Suresh 2024): public randomness keyed by position.

Owns `gumbel_noise` (Gumbel noise G(x) for every token x at (a row's seed, absolute position),
counter-based: the same numbers whoever asks, in whatever order or batch) and `choose`
(argmax_x log p(x) + G(x), an exact draw from p). With `SamplingParams(sampling="invariant")`
the target's token at position j is t_j = choose(p_j, G_j) and the draft proposes
choose(q_j, G_j) with the same noise; a proposal is accepted while it equals t_j, and the
token after the accepted ones is t_j itself (recovered or bonus). The committed tokens are
then those of plain decoding with the same seed, token for token, whatever the drafter and
whatever k: the rule is `rejection.verify_greedy` on the ids t_j. A proposal is accepted with
probability at least (1 - TV)/(1 + TV) against 1 - TV for rejection sampling. Top-k, top-p
and min-p act on p and q before the noise (`process_logits`), as in plain sampling.

The noise of token x at (seed, position) is splitmix64 of a mix of the three, turned into
u in (0, 1) with 53 bits and G = -log(-log u). Each row has its own seed (`RowSampling`: one
seed for a batch gives row b the seed `row_seed(seed, b)`), so a row's noise depends on its
seed and positions alone, never on the other rows. Knows nothing of models or caches.
"""

from __future__ import annotations

import torch

from .streams import signed, splitmix64, to_unit

_POSITION, _TOKEN = signed(0xA0761D6478BD642F), signed(0xE7037ED1A0B428DB)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """G [B, T, V] float64 for rows with seeds [B] (each row's own, long) at positions [B, T]
    (absolute, long)."""
    device = positions.device
    key = splitmix64(seeds.to(device).long()[:, None])  # [B, 1]
    key = splitmix64(key ^ (positions.long() * _POSITION))  # [B, T]
    bits = splitmix64(key[..., None] ^ (torch.arange(vocab, device=device) * _TOKEN))  # [B, T, V]
    u = to_unit(bits) + 2.0**-54  # (0, 1)
    return -torch.log(-torch.log(u))


def choose(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The token at each of positions [B, T]: argmax_x log p(x) + G(x) for the processed
    distributions probs [B, T, V] (`process_logits`; a token of p = 0 is never chosen), the
    noise of each row keyed by its seed (seeds [B]). [B, T] long."""
    noise = gumbel_noise(seeds, positions, probs.shape[-1])
    return (probs.double().log() + noise).argmax(dim=-1)
