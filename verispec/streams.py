"""Counter-based random numbers on int64 tensors: one independent stream per row, vectorised.

Owns `splitmix64` (the mixing function of Steele, Lea and Flood 2014, on int64 tensors, which
wrap around as uint64 does), `to_unit` (53 random bits -> a float64 in [0, 1)) and
`RowStreams`: row b's i-th number is splitmix64 of key_b + i * gamma, that is the i-th output
of a splitmix64 generator started at key_b (= splitmix64 of the row's seed), so drawing n
numbers for every row of a batch is one tensor expression, and a row's numbers depend on its
seed and on how many it drew before, never on the other rows. The same generator runs per
row in the compiled step (llamacpp/llama_step.c) and keys the invariant noise (invariant.py).
Knows nothing of models or speculation.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1


def signed(value: int) -> int:
    """A 64-bit constant as torch's int64 holds it (two's complement)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


GAMMA, _MIX1, _MIX2 = signed(0x9E3779B97F4A7C15), signed(0xBF58476D1CE4E5B9), signed(0x94D049BB133111EB)


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output for state x (its state advanced by gamma, then mixed), elementwise."""
    x = x + GAMMA  # int64 arithmetic wraps around, as uint64 would
    x = (x ^ _shift(x, 30)) * _MIX1
    x = (x ^ _shift(x, 27)) * _MIX2
    return x ^ _shift(x, 31)


def to_unit(bits: torch.Tensor) -> torch.Tensor:
    """int64 random bits -> float64 in [0, 1) from their top 53 bits (as the C code's uniform)."""
    return _shift(bits, 11).double() * 2.0**-53


def fresh_seed() -> int:
    """A seed in [0, 2**63) from the operating system's entropy."""
    return secrets.randbits(63)


class RowStreams:
    """One splitmix64 stream per row (seeds [B], each in [0, 2**63)), with a counter per row."""

    def __init__(self, seeds: Sequence[int], device: torch.device | str = "cpu"):
        self.keys = splitmix64(torch.tensor([signed(s) for s in seeds], dtype=torch.long, device=device))  # [B]
        self.counters = torch.zeros(len(seeds), dtype=torch.long, device=device)  # [B] numbers drawn so far

    def __len__(self) -> int:
        return len(self.keys)

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Only the streams of `rows` remain, in that order, each where it stands."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.keys.device)
        self.keys, self.counters = self.keys.index_select(0, index), self.counters.index_select(0, index)

    def add_rows(self, seeds: Sequence[int]) -> None:
        """New streams of `seeds` (counter 0) after the others."""
        new = RowStreams(seeds, self.keys.device)
        self.keys, self.counters = torch.cat([self.keys, new.keys]), torch.cat([self.counters, new.counters])

    def uniform(self, shape: tuple[int, ...], rows: torch.Tensor | None = None) -> torch.Tensor:
        """The next n = prod(shape[1:]) numbers of each row (all rows, or rows [shape[0]]), float64
        in [0, 1) of the given shape; those rows' counters advance by n."""
        keys, counters = (self.keys, self.counters) if rows is None else (self.keys[rows], self.counters[rows])
        if len(keys) != shape[0]:
            raise ValueError(f"{len(keys)} streams for {shape[0]} rows")
        n = 1
        for size in shape[1:]:
            n *= size
        steps = counters[:, None] + 1 + torch.arange(n, device=keys.device)  # [R, n]
        u = to_unit(splitmix64(keys[:, None] + steps * GAMMA - GAMMA))  # the state before the i-th advance
        if rows is None:
            self.counters += n
        else:
            self.counters[rows] += n
        return u.reshape(shape)

    def select(self, rows: Sequence[int]) -> _Selected:
        """The streams of some rows, as one argument for `sample` or `verify`."""
        return _Selected(self, torch.tensor(list(rows), dtype=torch.long, device=self.keys.device))


class _Selected:
    def __init__(self, streams: RowStreams, rows: torch.Tensor):
        self.streams, self.rows = streams, rows

    def __len__(self) -> int:
        return len(self.rows)

    def uniform(self, shape: tuple[int, ...]) -> torch.Tensor:
        return self.streams.uniform(shape, self.rows)
