"""The placeholder's guess: plain decoding (no draft) on a target that pads every pass of one
position with a second one (a placeholder, so that llama.cpp's kernels see the same width in every
pass: llamacpp/context.py) fills that position with a guess instead of a copy of the pending token.

The pass costs what it cost; the guess is verified as any lookup proposal (one token, q one-hot:
the coupled rule, rejection.py), so the output is plain decoding's token for token, greedy or
sampled with a seed. When the guess is right the pass commits two tokens. The guess is suffix
drafting's (drafters/suffix.py) at one token, from a one-token match on: the row's own text and
the earlier requests of its batch. A row with company runs plain (its placeholder has no logits
then: policy.LoneRowGuess). `VERISPEC_PLACEHOLDER_GUESS=0` leaves the placeholder a copy.
"""

from __future__ import annotations

import os

from ..policy import DraftLengthPolicy, FixedLength, LoneRowGuess
from .suffix import SuffixDrafter


def placeholder_guess(target) -> tuple[SuffixDrafter | None, DraftLengthPolicy]:
    """(drafter, policy) for a batch given no draft: a one-token guesser where the target pads every
    pass of one position (`pads_lone_passes`), else (None, plain)."""
    if not getattr(target, "pads_lone_passes", False) or os.environ.get("VERISPEC_PLACEHOLDER_GUESS", "1") == "0":
        return None, FixedLength(0)
    guesser = SuffixDrafter(min_match=1, device=target.device)
    guesser.placeholder_guess = True
    return guesser, LoneRowGuess()
