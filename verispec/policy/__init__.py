"""Draft-length policies: how many tokens to propose before each target pass.

`FixedLength` always proposes k; `AdaptiveLength` (`--k auto`) measures and decides:
- `estimates.py` owns what is measured: acceptance per draft position, whether a draft goes on past
  each position, and an iteration's seconds by (batch size, k), each with its uncertainty;
- `theory.py` owns the cost model (tokens per pass from acceptance; the refined cost r(k+1) + k c as
  the prior shape of an iteration's time over k);
- `decision.py` owns the choice: the k with the highest optimistic throughput;
- `split.py` gives a combined draft's passes by lookup alone an `AdaptiveLength` of their own.

A policy only changes how many tokens are proposed, never which are committed: exactness does not
depend on it. It knows nothing of models or tokens.
"""

from .adaptive import AdaptiveLength, PolicySettings
from .base import DraftLengthPolicy, FixedLength, LoneRowGuess
from .decision import choose_k
from .split import SplitLength, split_for

__all__ = [
    "AdaptiveLength",
    "DraftLengthPolicy",
    "FixedLength",
    "LoneRowGuess",
    "PolicySettings",
    "SplitLength",
    "choose_k",
    "split_for",
]
