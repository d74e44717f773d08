"""The draft's proposal distribution: q sharpened by a proposal temperature tau, chosen by measured acceptance.

The rule (rejection.py) is exact for any proposal distribution q' as long as each proposal is
drawn from q' and q' is what the rule is told. A draft model proposes from

    q'_tau = normalize(q ** (1 / tau)) on q's support,

q the draft's processed distribution (sampling.process_logits, the target's settings): tau = 1
is q itself (acceptance sum min(p, q), the best for a draft that samples from q), tau = 0 the
argmax of q, one-hot (acceptance p(argmax q): llama.cpp's greedy draft with sample-and-match),
and tau in between q sharpened. A small draft is less confident than a target whose distribution
is truncated (top-k, top-p, min-p), so a sharper proposal often accepts more.

At every verified position p and q are both in memory, so the acceptance sum min(p, q'_tau) of
every tau in the grid is known there, counterfactually, at the cost of a few [V] vector
operations: `acceptance_grid`. `ProposalTemperature` keeps a running mean of it per row
(request) and tau, and proposes each row from its best tau: a full-information choice, so it
needs no exploration; a row leaves q only once another tau's gain clears its noise (a lower
confidence bound on the paired difference). The estimate pools the draft positions (a row sees k
of them per pass). Rows are independent: a row's
choice reads only its own positions. Greedy rows (p and q one-hot) and invariant rows (whose
coupling is invariant.py's Gumbel choice, not this rule) always propose at tau = 1.
Knows nothing of models, drafters or the engine.
"""

from __future__ import annotations

import numpy as np
import torch

TAUS = (1.0, 0.7, 0.5, 0.35, 0.2, 0.0)  # the grid of `--draft-temperature auto`: q first, the argmax last
MEMORY = 256  # verified positions of a row after which an old one weighs 1/e
Z = 3.0  # standard errors a tau's gain over q must clear before a row proposes with it (5 taus compared)


def sharpen(
    probs: torch.Tensor,  # [..., V] float32, a distribution (q)
    tau: torch.Tensor | float,  # a number, or one per distribution: shape probs.shape[:-1]
) -> torch.Tensor:
    """q'_tau [..., V] float32: normalize(q ** (1 / tau)) on q's support; tau = 1 returns q unchanged,
    tau = 0 the one-hot at q's argmax (the lowest id on ties, as argmax). Computed as
    exp((log q - log max q) / tau), so that no power underflows to an all-zero row."""
    tau = torch.as_tensor(tau, dtype=torch.float32, device=probs.device).expand(probs.shape[:-1])[..., None]  # [..., 1]
    top = probs.amax(dim=-1, keepdim=True)  # [..., 1]
    scaled = torch.where(probs > 0, torch.log(probs / top), float("-inf")) / tau.clamp_min(1e-6)
    sharp = torch.softmax(scaled, dim=-1)
    argmax = torch.zeros_like(probs).scatter_(-1, probs.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(tau == 1, probs, torch.where(tau == 0, argmax, sharp))


def acceptance_grid(
    draft_probs: torch.Tensor,  # [B, k, V] q (unsharpened)
    target_probs: torch.Tensor,  # [B, >= k, V] p
    taus: tuple[float, ...] = TAUS,
) -> torch.Tensor:
    """sum_x min(p_i(x), q'_tau,i(x)) for every tau of the grid: [B, k, G], G = len(taus)."""
    k = draft_probs.shape[1]
    p = target_probs[:, :k]
    return torch.stack([torch.minimum(p, sharpen(draft_probs, tau)).sum(dim=-1) for tau in taus], dim=-1)


class ProposalTemperature:
    """The proposal temperature of each row of a batch: fixed, or chosen from `taus` by the row's
    acceptance of each at its verified positions (`observe`). The choice is a lower confidence
    bound on the paired gain over the grid's first tau (q): mean(a_tau - a_q) - Z * its standard
    error, so that a few positions' noise never moves a row off q, and a real gain does within
    tens of positions. `fixed=None` is `--draft-temperature auto`."""

    def __init__(self, fixed: float | None = None, taus: tuple[float, ...] = TAUS, memory: int = MEMORY):
        if fixed is not None and not (isinstance(fixed, (int, float)) and 0.0 <= fixed <= 1.0):
            raise ValueError(f"draft temperature must be 'auto' or a number in [0, 1], got {fixed!r}")
        if memory < 1 or not taus:
            raise ValueError("ProposalTemperature needs a grid of taus and a memory >= 1")
        self.fixed, self.taus, self.decay = fixed, tuple(taus) if fixed is None else (float(fixed),), 1.0 - 1.0 / memory
        self.start(0)

    @property
    def auto(self) -> bool:
        return self.fixed is None

    def start(self, batch: int) -> None:
        # numpy, not torch: a few [B, G] operations per pass, where torch's per-call cost would dominate
        self.sums = np.zeros((batch, len(self.taus)))  # [B, G] decayed sums of acceptance
        self.squares = np.zeros((batch, len(self.taus)))  # [B, G] ... of (a_tau - a_q)^2
        self.counts = np.zeros(batch)  # [B] decayed count of verified positions
        self.left = np.zeros(1 + len(self.taus))  # rows that left: [count, sums...] (reports)
        self._chosen: torch.Tensor | None = None  # chosen(), until the estimates or the rows change

    def keep_rows(self, rows: list[int]) -> None:
        gone = np.ones(len(self.counts), dtype=bool)
        gone[rows] = False
        self.left += np.concatenate([[self.counts[gone].sum()], self.sums[gone].sum(axis=0)])
        self.sums, self.squares, self.counts = self.sums[rows], self.squares[rows], self.counts[rows]
        self._chosen = None

    def add_rows(self, count: int) -> None:
        """New rows start with no observation (their choice reads only their own positions)."""
        self.sums = np.concatenate([self.sums, np.zeros((count, len(self.taus)))])
        self.squares = np.concatenate([self.squares, np.zeros((count, len(self.taus)))])
        self.counts = np.concatenate([self.counts, np.zeros(count)])
        self._chosen = None

    def chosen(self) -> torch.Tensor:
        """Each row's tau now: [B] float32 (q, the first of the grid, until another's bound is above it).
        The same tensor until the estimates or the rows change: read it, do not write it."""
        if self._chosen is None:
            if not self.auto:
                best = np.zeros(len(self.counts), dtype=np.int64)
            else:
                n = np.maximum(self.counts, 1.0)[:, None]  # [B, 1]
                gain = (self.sums - self.sums[:, :1]) / n  # [B, G] mean of a_tau - a_q
                spread = np.maximum(self.squares / n - gain**2, 0.0)  # [B, G] its variance per position
                bound = gain - Z * np.sqrt(spread / n)
                best = np.where(bound > 0, bound, 0.0).argmax(axis=-1)  # the first of the grid on ties: q
            self._chosen = torch.from_numpy(np.asarray(self.taus, dtype=np.float32)[best])
        return self._chosen

    def estimates(self) -> torch.Tensor:
        """Each row's mean acceptance per tau [B, G] (nan before any observation)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return torch.from_numpy(self.sums / self.counts[:, None])

    def observe(
        self,
        grid: torch.Tensor | np.ndarray,  # [B, k, G] acceptance_grid at the pass's positions
        verified: torch.Tensor | np.ndarray,  # [B, k] bool: positions the rule reached (accepted, first rejection)
    ) -> None:
        weight = np.asarray(verified, dtype=np.float64)  # [B, k]
        count = weight.sum(axis=1)  # [B]
        decay = self.decay**count  # [B]: each verified position ages the older ones by one
        grid = np.asarray(grid, dtype=np.float64)
        self.sums = self.sums * decay[:, None] + (grid * weight[..., None]).sum(axis=1)
        self.squares = self.squares * decay[:, None] + ((grid - grid[..., :1]) ** 2 * weight[..., None]).sum(axis=1)
        self.counts = self.counts * decay + count
        self._chosen = None

    def summary(self) -> dict:
        """The batch's choice and estimates since `start`, pooled over its rows, those that left included
        (for reports): {"tau": ..., "acceptance": {tau: mean}}."""
        counts = self.counts.sum() + self.left[0]
        if self.fixed is not None or counts == 0:
            return {"tau": self.taus[0] if self.fixed is None else self.fixed, "acceptance": {}}
        means = ((self.sums.sum(axis=0) + self.left[1:]) / counts).tolist()
        return {
            "tau": self.taus[max(range(len(means)), key=means.__getitem__)],
            "acceptance": dict(zip(self.taus, means)),
        }


def verified_positions(num_accepted: torch.Tensor, k: int) -> torch.Tensor:
    """[B, k] bool: positions 0..min(n_b, k - 1) of row b, where the rule compared p and q."""
    return torch.arange(k, device=num_accepted.device)[None, :] <= num_accepted[:, None]
