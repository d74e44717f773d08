"""The placeholder's guess: plain decoding (no draft) on a target that pads a lone row's pass of one
position with a second one (a placeholder, so that llama.cpp's kernels see the same width in every
pass: llamacpp/context.py) fills that position with a guess instead of a copy of the pending token.

Where the target pads: every such pass under sgemm's attention or flash attention over sgemm's
weights; under flash attention over dot-product weights (Q4_1, K-quants) only from the text's length
`lone_pad_from` on (SPLIT_KV_FROM + 1), where flash attention would split one query's cells. There the
placeholder sat in a spare sequence, attending to one cell; the guess sits in the row's own sequence
and attends to all of them, which costs that much more and pays when the guess is right.

The guess is verified as any lookup proposal (one token, q one-hot: the coupled rule, rejection.py),
so the output is plain decoding's token for token, greedy or sampled with a seed. When the guess is
right the pass commits two tokens. The guess is suffix drafting's (drafters/suffix.py) at one token,
from a one-token match on: the row's own text and the earlier requests of its batch; a row shorter
than `lone_pad_from` guesses nothing (its pass has no placeholder). A row with company runs plain (its
placeholder has no logits then: policy.LoneRowGuess). `VERISPEC_PLACEHOLDER_GUESS=0` leaves the
placeholder a copy.
"""

from __future__ import annotations

import os

from ..policy import DraftLengthPolicy, FixedLength, LoneRowGuess
from .suffix import SuffixDrafter


class PlaceholderGuesser(SuffixDrafter):
    """Suffix drafting's one-token guess, for the rows whose text is at least `guess_from` tokens long."""

    placeholder_guess = True

    def __init__(self, guess_from: int, **settings):
        super().__init__(min_match=1, **settings)
        self.guess_from = guess_from

    def _walks(self, k: int) -> tuple[list[list[int]], list[int]]:
        walks, lengths = super()._walks(k)
        return walks, [n if len(row.tokens) >= self.guess_from else 0 for row, n in zip(self.rows, lengths)]


def placeholder_guess(target) -> tuple[SuffixDrafter | None, DraftLengthPolicy]:
    """(drafter, policy) for a batch given no draft: a one-token guesser where the target pads a lone
    row's one-position passes (`lone_pad_from`: always, or past a length), else (None, plain)."""
    start = getattr(target, "lone_pad_from", None)
    if start is None or os.environ.get("VERISPEC_PLACEHOLDER_GUESS", "1") == "0":
        return None, FixedLength(0)
    return PlaceholderGuesser(start, device=target.device), LoneRowGuess()
