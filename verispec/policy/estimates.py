"""What the adaptive policy measures, each estimate with its uncertainty.

- `Rates`: a probability per draft position (acceptance, or whether a draft goes on past a
  position) over the last `memory` passes that observed it, so that it follows a changing workload;
  acceptance at a position is shrunk toward the acceptance pooled over all positions.
- `Times`: an iteration's seconds by (batch size, k), the mean of the last `window` passes (each clipped
  at twice their median), with a robust relative spread.
Evidence older than `horizon` passes is dropped: a k whose time is that old is predicted by the cost model
from the times measured lately, acceptance returns to its prior, and either is measured again if that
could pay. Between those moments the estimates stand still, so the choice does not dither.
- `CostShape`: the prior shape of an iteration's time over k at a batch size, from a calibration
  (times measured before the first request), else from a cost profile through the refined cost model
  (theory: an iteration costs r(k + 1) + k c target passes), else from a default c.
Knows nothing of models, tokens or of how the decision is made.
"""

from __future__ import annotations

import statistics
from collections import deque


class Rates:
    """Per position i: observed total / count over the last `memory` passes that observed anything, dropped
    once older than `horizon` passes, shrunk toward a prior that counts as `prior_weight` observations.

    The prior of position i is the estimate at position i - 1 (`prior` at position 0), or, with `pooled_weight`,
    the rate pooled over every position (itself shrunk toward `prior`), counting as that many observations.
    Pooling suits acceptance: a deep position
    is observed only when long drafts ran, which the policy chooses when acceptance was high lately, so its few
    observations describe a better moment than the shallow positions' many; shrunk toward the pooled rate it
    carries only as much of that as its evidence supports."""

    def __init__(
        self,
        positions: int,
        prior: float,
        prior_weight: float,
        memory: int,
        horizon: int,
        pooled_weight: float | None = None,
    ):
        self.prior, self.prior_weight, self.memory, self.horizon = prior, prior_weight, memory, horizon
        self.pooled_weight = pooled_weight
        self.sums, self.counts = [0.0] * positions, [0.0] * positions
        self._passes: deque[tuple[int, list[float], list[float]]] = deque()  # (at, totals, counts) per pass

    def add(self, at: int, totals: list[float], counts: list[float]) -> None:
        """One pass's observations, per position."""
        self._passes.append((at, totals, counts))
        self._shift(totals, counts, 1.0)
        if len(self._passes) > self.memory:
            self._drop()

    def get(self, now: int) -> list[float]:
        while self._passes and now - self._passes[0][0] > self.horizon:
            self._drop()
        pooled = (sum(self.sums) + self.prior * self.prior_weight) / (max(sum(self.counts), 0.0) + self.prior_weight)
        weight = self.prior_weight if self.pooled_weight is None else self.pooled_weight
        out: list[float] = []
        for s, n in zip(self.sums, self.counts):
            before = out[-1] if out else self.prior
            before = before if self.pooled_weight is None else pooled
            out.append(min(max((s + before * weight) / (max(n, 0.0) + weight), 0.0), 1.0))
        return out

    def _drop(self) -> None:
        _, totals, counts = self._passes.popleft()
        self._shift(totals, counts, -1.0)

    def _shift(self, totals: list[float], counts: list[float], sign: float) -> None:
        for i, (s, n) in enumerate(zip(totals, counts)):
            self.sums[i] += sign * s
            self.counts[i] += sign * n


class Times:
    """Seconds of an iteration by (batch size, k): median, count and relative spread of the recent ones."""

    def __init__(self, window: int, horizon: int, clip: float = 2.0):
        self.window, self.horizon, self.clip = window, horizon, clip
        self._seen: dict[tuple[int, int], deque[tuple[float, int]]] = {}

    def add(self, batch: int, k: int, seconds: float, at: int) -> None:
        self._seen.setdefault((batch, k), deque(maxlen=self.window)).append((seconds, at))

    def get(self, batch: int, k: int, now: int) -> tuple[float, int, float] | None:
        """(mean, n, relative spread) of the times at (batch, k) within the horizon, each time clipped at `clip`
        times their median; n = 0 and the median of the last ones seen where all are older; None where there
        are none. A mean, since a cost that comes every few passes (a draft reading a joined prompt) is part
        of what k costs; clipped, so that a stall does not decide. The spread is the median absolute
        deviation scaled to a normal sigma, over the median."""
        seen = self._seen.get((batch, k))
        if not seen:
            return None
        values = [s for s, at in seen if now - at <= self.horizon]
        if not values:
            return statistics.median(s for s, _ in seen), 0, 0.0
        middle = statistics.median(values)
        mean = statistics.fmean(min(v, self.clip * middle) for v in values)
        spread = 1.4826 * statistics.median(abs(v - middle) for v in values) / middle if middle > 0 else 0.0
        return mean, len(values), spread


class CostShape:
    """The prior shape of an iteration's seconds over k = 0..k_max at a batch size (any scale)."""

    def __init__(
        self,
        k_max: int,
        c: float | None = None,
        r: tuple[float, ...] | None = None,
        r_batch: int = 1,
        default_c: float = 0.25,
    ):
        self.k_max, self.c, self.r, self.r_batch, self.default_c = k_max, c, r, r_batch, default_c
        self.target: dict[int, float] = {}  # a calibration's seconds of a target pass, by positions in it
        self.draft: dict[tuple[int, int], float] = {}  # its seconds of a drafting pass, by (batch, k)
        self._by_batch: dict[int, list[float]] = {}  # seconds(batch), computed once per batch size

    def seed(self, target: dict[int, float], draft: dict[tuple[int, int], float]) -> None:
        """A calibration's times (profile.calibrate)."""
        self.target.update(target)
        self.draft.update(draft)
        self._by_batch.clear()

    @property
    def source(self) -> str:
        return "calibration" if self.target else "profile" if self.c is not None else "default"

    def seconds(self, batch: int) -> list[float]:
        if batch not in self._by_batch:
            self._by_batch[batch] = self._seconds(batch)
        return self._by_batch[batch]

    def _seconds(self, batch: int) -> list[float]:
        if self.target:
            return [
                _interpolate(self.target, batch * (k + 1)) + (self._draft(batch, k) if k else 0.0)
                for k in range(self.k_max + 1)
            ]
        c = self.default_c if self.c is None else self.c
        base = self._r(batch)
        return [self._r(batch * (k + 1)) / base + k * c for k in range(self.k_max + 1)]

    def _r(self, positions: int) -> float:
        """The profile's verification cost r at `positions` in all (linear between and past its points)."""
        if not self.r:
            return 1.0 + 0.05 * (positions - 1)
        x = max(positions / self.r_batch, 1.0)
        points = {n + 1: value for n, value in enumerate(self.r)}
        return _interpolate(points, x)

    def _draft(self, batch: int, k: int) -> float:
        """A calibration's drafting seconds at (batch, k), interpolated over k, then over batch sizes."""
        sizes = sorted({b for b, _ in self.draft})
        if not sizes:
            return 0.0
        by_size = {b: _interpolate({j: t for (s, j), t in self.draft.items() if s == b}, k) for b in sizes}
        return _interpolate(by_size, batch)


def _interpolate(points: dict, x: float) -> float:
    """Piecewise-linear through the points (x -> y), extended past the ends along the nearest segment."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]] * x / xs[0] if xs[0] > 0 else points[xs[0]]
    low = next((i for i in range(len(xs) - 1) if x <= xs[i + 1]), len(xs) - 2)
    x0, x1 = xs[low], xs[low + 1]
    y0, y1 = points[x0], points[x1]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)
