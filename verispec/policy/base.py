"""The draft-length policy protocol and the fixed policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..config import SpecConfig


@runtime_checkable
class DraftLengthPolicy(Protocol):
    k_max: int

    def choose(self, batch: int = 1) -> int:
        """The draft length for the next iteration of `batch` rows, in 0..k_max."""

    def observe(
        self,
        k: int,
        beta_sums: list[float],
        verified: list[int],
        draft_s: float,
        target_s: float,
        batch: int = 1,
        cap: int | None = None,
        joined_s: float = 0.0,
        committed: int = 0,
        texts: dict | None = None,
    ) -> None:
        """After an iteration of `batch` rows that proposed k tokens: per draft position, the sum of beta over
        the rows' verified positions and their number; the seconds spent drafting and the rest; cap: the draft
        length chosen for it (None: k), of which a draft may propose fewer; joined_s: the seconds the draft
        spent reading rows that joined since it last drafted (not in draft_s: a cost per request, not per
        pass); committed: the tokens the iteration committed over its rows; texts: per row id, the acceptance
        (sum min(p, q)) at each text position the row committed, None where nothing was drafted."""


@dataclass
class FixedLength:
    """Always k (0: plain decoding)."""

    k: int

    def __post_init__(self) -> None:
        SpecConfig(k=self.k)  # validates k

    @property
    def k_max(self) -> int:
        return self.k

    def choose(self, batch: int = 1) -> int:
        return self.k

    def observe(
        self,
        k: int,
        beta_sums: list[float],
        verified: list[int],
        draft_s: float,
        target_s: float,
        batch: int = 1,
        cap: int | None = None,
        joined_s: float = 0.0,
        committed: int = 0,
        texts: dict | None = None,
    ) -> None:
        pass


@dataclass
class LoneRowGuess(FixedLength):
    """k = 1 for a pass of one row, else 0 (plain): a target that pads every one-position pass verifies a
    guess at the placeholder's position for nothing when the row is alone (drafters/placeholder.py)."""

    k: int = 1

    def choose(self, batch: int = 1) -> int:
        return 1 if batch == 1 else 0
