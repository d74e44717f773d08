"""Drafter-invariant sampling (Daliri, Musco and Suresh 2024): public randomness keyed by position.

Owns `gumbel_noise` (Gumbel noise G(x) for every token x at (seed, row, absolute position),
counter-based: the same numbers whoever asks, in whatever order or batch) and `choose`
(argmax_x log p(x) + G(x), an exact draw from p). With `SamplingParams(sampling="invariant")`
the target's token at position j is t_j = choose(p_j, G_j) and the draft proposes
choose(q_j, G_j) with the same noise; a proposal is accepted while it equals t_j, and the
token after the accepted ones is t_j itself (recovered or bonus). The committed tokens are
then those of plain decoding with the same seed, token for token, whatever the drafter and
whatever k: the rule is `rejection.verify_greedy` on the ids t_j. A proposal is accepted with
probability at least (1 - TV)/(1 + TV) against 1 - TV for rejection sampling. Top-k, top-p
and min-p act on p and q before the noise (`process_logits`), as in plain sampling.

The noise of token x at (seed, row, position) is splitmix64 of a mix of the four, turned into
u in (0, 1) with 53 bits and G = -log(-log u). Rows are keyed by their index in the batch.
Knows nothing of models or caches.
"""

from __future__ import annotations

import torch

from .config import SamplingParams
from .sampling import process_logits

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit constant as torch's int64 holds it (two's complement)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
_ROW, _POSITION, _TOKEN = _signed(0xD6E8FEB86659FD93), _signed(0xA0761D6478BD642F), _signed(0xE7037ED1A0B428DB)


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLDEN  # int64 arithmetic wraps around, as uint64 would
    x = (x ^ _shift(x, 30)) * _MIX1
    x = (x ^ _shift(x, 27)) * _MIX2
    return x ^ _shift(x, 31)


def gumbel_noise(seed: int, rows: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """G [B, T, V] float64 for rows [B] (long keys) at positions [B, T] (absolute, long)."""
    device = positions.device
    key = _splitmix64(torch.tensor(_signed(seed), dtype=torch.long, device=device))
    key = _splitmix64(key ^ (rows.to(device).long()[:, None] * _ROW))  # [B, 1]
    key = _splitmix64(key ^ (positions.long() * _POSITION))  # [B, T]
    bits = _splitmix64(key[..., None] ^ (torch.arange(vocab, device=device) * _TOKEN))  # [B, T, V]
    u = (_shift(bits, 11).double() + 0.5) * 2.0**-53  # (0, 1)
    return -torch.log(-torch.log(u))


def choose(probs: torch.Tensor, seed: int, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The token at each of positions [B, T]: argmax_x log p(x) + G(x) for the processed
    distributions probs [B, T, V] (`process_logits`; a token of p = 0 is never chosen). [B, T] long."""
    noise = gumbel_noise(seed, rows, positions, probs.shape[-1])
    return (probs.double().log() + noise).argmax(dim=-1)


def choose_from_logits(logits: torch.Tensor, params: SamplingParams, seed: int, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`choose` on process_logits(logits [B, T, V], params)."""
    return choose(process_logits(logits, params), seed, rows, positions)
