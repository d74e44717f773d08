"""`CacheLengths`: the valid length of every row of a cache, the bookkeeping all caches share.

Knows nothing of what a cache stores (keys and values, llama.cpp's cells, a drafter's state).
"""

from __future__ import annotations

import torch


class CacheLengths:
    """A valid length per batch row, on the device and mirrored on the host (no sync to read).

    The bookkeeping every cache shares: a forward advances all rows by its T positions;
    `rollback` lowers them to the committed lengths. Subclasses keep their per-position
    state indexed by these lengths, so rolling back never copies that state.
    """

    def __init__(self, batch_size: int, max_length: int, device: torch.device | str):
        self.max_length = max_length
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B]
        self._host_lengths = [0] * batch_size

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def host_lengths(self) -> list[int]:
        return list(self._host_lengths)

    def advance(self, num_tokens: int) -> None:
        self.lengths += num_tokens
        self._host_lengths = [n + num_tokens for n in self._host_lengths]

    def check_rollback(self, lengths: list[int]) -> None:
        """A rollback only lowers lengths, one per row."""
        if len(lengths) != len(self._host_lengths):
            raise ValueError(f"rollback needs {len(self._host_lengths)} lengths, got {len(lengths)}")
        if any(not 0 <= new <= old for new, old in zip(lengths, self._host_lengths)):
            raise ValueError(f"rollback lengths {lengths} must lie in [0, current lengths {self._host_lengths}]")

    # A cache whose rows can leave and join (engine.Batch) offers `keep_rows(rows)` (the batch
    # becomes the old rows `rows`, ascending, in that order) and `add_rows(count)` (empty rows
    # after the others), moving its own per-row state; these two do the lengths.
    def _keep_lengths(self, rows: list[int]) -> None:
        if any(b <= a for a, b in zip(rows, rows[1:])) or any(not 0 <= r < self.batch_size for r in rows):
            raise ValueError(f"keep_rows needs ascending rows of the batch ({self.batch_size}), got {rows}")
        self.set_lengths([self._host_lengths[r] for r in rows])

    def _add_lengths(self, count: int) -> None:
        self.set_lengths(self._host_lengths + [0] * count)

    def set_lengths(self, lengths: list[int]) -> None:
        """Declare each row's valid length (after its state was written by other means: a row
        started anew, a compiled step); rollback is the check-and-lower form of this."""
        self._host_lengths = list(lengths)
        self.lengths = torch.tensor(lengths, dtype=torch.long, device=self.lengths.device)

    def rollback(self, lengths: list[int]) -> None:
        """Keep the first lengths[b] positions of row b; never copies the per-position state."""
        self.check_rollback(lengths)
        self._host_lengths = list(lengths)
        self.lengths = torch.tensor(lengths, dtype=torch.long, device=self.lengths.device)
