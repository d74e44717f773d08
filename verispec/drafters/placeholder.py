"""The placeholder's guess: plain decoding (no draft) on a target that pads a lone row's pass of one
position with a second one (a placeholder, so that llama.cpp's kernels see the same width in every
pass: llamacpp/context.py) fills that position with a guess instead of a copy of the pending token.

Where the target pads: every such pass under sgemm's attention or flash attention over sgemm's
weights; under flash attention over dot-product weights (Q4_1, K-quants) only from the text's length
`lone_pad_from` on (SPLIT_KV_FROM + 1), where flash attention would split one query's cells. There the
placeholder sat in a spare sequence, attending to one cell; the guess sits in the row's own sequence
and attends to all n of them, which adds at most n * `query_cost_per_cell` of a pass (the target's
shapes: one query's attention over one position's products). A row guesses there only while its
guesses would pay that: the share of its last `window` would-be guesses that were right (Laplace's
rule) above that cost. A would-be guess is scored on every pass, made or not: the coupled rule draws
one number per committed token, so the committed token is the same either way, and the guess would
have been taken exactly when it equals it.

The guess is verified as any lookup proposal (one token, q one-hot: the coupled rule, rejection.py),
so the output is plain decoding's token for token, greedy or sampled with a seed. When the guess is
right the pass commits two tokens. The guess is suffix drafting's (drafters/suffix.py) at one token,
from a one-token match on: the row's own text and the earlier requests of its batch; a row shorter
than `lone_pad_from` guesses nothing (its pass has no placeholder), and one more than `window` tokens
shorter looks nothing up (engine.Batch runs without the guesser where no row can get that long). A row
with company runs plain (its placeholder has no logits then: policy.LoneRowGuess).
`VERISPEC_PLACEHOLDER_GUESS=0` leaves the placeholder a copy.
"""

from __future__ import annotations

import os
from collections import deque

import torch

from ..policy import DraftLengthPolicy, FixedLength, LoneRowGuess
from .suffix import SuffixDrafter, _Row


class PlaceholderGuesser(SuffixDrafter):
    """Suffix drafting's one-token guess for the rows whose text is at least `guess_from` tokens long, where
    the row's recent would-be guesses were right more often than `cell_cost` times that length (0: free)."""

    placeholder_guess = True

    def __init__(self, guess_from: int, cell_cost: float = 0.0, window: int = 32, **settings):
        super().__init__(min_match=1, **settings)
        self.guess_from, self.cell_cost, self.window = guess_from, cell_cost, window
        self._would: list[int | None] = []  # per row, the token it would have guessed at the last pass (None: none)
        self._scores: dict[int, deque[bool]] = {}  # id of a row -> whether its last would-be guesses were right

    def accuracy(self, row: _Row) -> float:
        """(right + 1) / (scored + 2) over the row's last `window` would-be guesses."""
        scored = self._scores.get(id(row), ())
        return (sum(scored) + 1) / (len(scored) + 2)

    def _walks(self, k: int) -> tuple[list[list[int]], list[int]]:
        """Rows more than `window` tokens short of `guess_from` do not look anything up: their would-be guesses
        could not count by the time they may guess (a lookup and its scoring cost 3% of a plain pass on a small
        file; below the split no pass of such a file has a placeholder)."""
        if k <= 0:
            return [], []
        near = self.guess_from - self.window
        walks = [self.walk(row, k) if len(row.tokens) >= near else ([row.tokens[-1]] * k, 0) for row in self.rows]
        lengths = [n for _, n in walks]
        self._would = [tokens[0] if n else None for (tokens, _), n in zip(walks, lengths)]
        return [tokens for tokens, _ in walks], [n if self._pays(row) else 0 for row, n in zip(self.rows, lengths)]

    def _pays(self, row: _Row) -> bool:
        length = len(row.tokens)
        return length >= self.guess_from and (not self.cell_cost or self.accuracy(row) > self.cell_cost * length)

    def commit(self, num_accepted: list[int], next_token_ids: torch.Tensor, active: list[bool]) -> None:
        following = next_token_ids.tolist()
        for row, would, made, accepted, token, live in zip(
            self.rows, self._would, self._proposal, num_accepted, following, active
        ):
            if live and would is not None:  # made: taken or not; else: would the pass have committed it
                scored = self._scores.setdefault(id(row), deque(maxlen=self.window))
                scored.append(accepted > 0 if made else token == would)
        if len(self._scores) > 2 * len(self.rows) + 8:  # rows that left
            self._scores = {id(row): self._scores[id(row)] for row in self.rows if id(row) in self._scores}
        self._would = []
        super().commit(num_accepted, next_token_ids, active)


def placeholder_guess(target) -> tuple[SuffixDrafter | None, DraftLengthPolicy]:
    """(drafter, policy) for a batch given no draft: a one-token guesser where the target pads a lone
    row's one-position passes (`lone_pad_from`: always, or past a length), else (None, plain)."""
    start = getattr(target, "lone_pad_from", None)
    if start is None or os.environ.get("VERISPEC_PLACEHOLDER_GUESS", "1") == "0":
        return None, FixedLength(0)
    cell_cost = target.query_cost_per_cell if start > 0 else 0.0
    return PlaceholderGuesser(start, cell_cost, device=target.device), LoneRowGuess()
