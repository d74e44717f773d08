"""What the adaptive policy measures, each estimate with its uncertainty.

- `TextAcceptance`: expected tokens per pass at each fixed k, from fixed-k passes laid over the text the
  recent passes committed (acceptance belongs to text positions, whatever k ran).
- `Rates`: a probability per draft position (whether a draft goes on past a position) over the last
  `memory` passes that observed it, so that it follows a changing workload.
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
    once older than `horizon` passes, shrunk toward a prior that counts as `prior_weight` observations: the
    estimate at position i - 1 (`prior` at position 0)."""

    def __init__(self, positions: int, prior: float, prior_weight: float, memory: int, horizon: int):
        self.prior, self.prior_weight, self.memory, self.horizon = prior, prior_weight, memory, horizon
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
        out: list[float] = []
        for s, n in zip(self.sums, self.counts):
            before = out[-1] if out else self.prior
            out.append(min(max((s + before * self.prior_weight) / (max(n, 0.0) + self.prior_weight), 0.0), 1.0))
        return out

    def _drop(self) -> None:
        _, totals, counts = self._passes.popleft()
        self._shift(totals, counts, -1.0)

    def _shift(self, totals: list[float], counts: list[float], sign: float) -> None:
        for i, (s, n) in enumerate(zip(totals, counts)):
            self.sums[i] += sign * s
            self.counts[i] += sign * n


class _Text:
    """One row's text as the passes laid over it see it: acceptance by absolute position (None: not drafted) from
    `offset`, and per k the chance that a fixed-k pass starts at each position not yet passed."""

    def __init__(self, k_max: int):
        self.offset, self.text = 0, []
        self.starts: list[dict[int, float]] = [{0: 1.0} for _ in range(k_max + 1)]

    def trim(self) -> None:
        first = min((min(starts) for starts in self.starts[1:] if starts), default=self.offset + len(self.text))
        del self.text[: first - self.offset]
        self.offset = first


class TextAcceptance:
    """Expected tokens a row commits per pass at each fixed k = 0..k_max, from the acceptance at the text positions
    its recent passes committed.

    The acceptance of a draft token at text position t, beta_t = sum min(p_t, q_t), is fixed by the text before t
    whatever k is (the draft's context at t is that text), and the committed text is distributed as the target's
    whatever k is (the rule is exact). So fixed-k passes laid over each row's recent text predict what fixed k
    commits per pass, for every k, from passes run at any mix of k: a pass from s accepts position s + j with
    beta_{s+j} while the draft goes on past j (`continues`), up to k, commits one token more, and the next pass
    starts after them. Acceptance by draft depth pooled over the k that ran does not predict this: a long draft's
    passes start right after a rejection more often, where text is harder. A position where nothing was drafted
    (a bonus token, a plain pass) counts as the mean of the drafted ones lately (`prior` before any). A row's
    passes are laid as soon as the positions they need are known; their tokens and count are kept over the last
    `memory` passes and dropped past `horizon`. At most `follow` rows are followed at a time (each as long as it
    runs): the text's acceptance is a mean over positions, which a few rows sample well, and laying passes costs
    Python per row."""

    follow = 4

    def __init__(self, k_max: int, prior: float, memory: int, horizon: int):
        self.k_max, self.prior, self.memory, self.horizon = k_max, prior, memory, horizon
        self.rows: dict[object, _Text] = {}
        self.tokens, self.passes = [0.0] * (k_max + 1), [0.0] * (k_max + 1)  # over the kept passes, by k
        self.drafted = [0.0, 0.0]  # sum of beta and count of drafted positions over the kept passes
        self._kept: deque[tuple[int, list[float], list[float], list[float]]] = deque()

    def add(self, at: int, texts: dict, continues: list[float]) -> None:
        """One pass: per row id, the acceptance at each position it committed (None where nothing was drafted);
        rows absent have left."""
        for gone in set(self.rows) - set(texts):
            del self.rows[gone]
        for row_id in texts:
            if len(self.rows) < self.follow:
                self.rows.setdefault(row_id, _Text(self.k_max))
        texts = {row_id: text for row_id, text in texts.items() if row_id in self.rows}
        tokens, passes = [0.0] * (self.k_max + 1), [0.0] * (self.k_max + 1)
        known = [b for text in texts.values() for b in text if b is not None]
        drafted = [float(sum(min(max(b, 0.0), 1.0) for b in known)), float(len(known))]
        self.drafted = [a + b for a, b in zip(self.drafted, drafted)]  # the fill below sees this pass's too
        fill = self.mean(at)
        for row_id, text in texts.items():
            row = self.rows[row_id]
            row.text += [fill if b is None else min(max(b, 0.0), 1.0) for b in text]
            for k in range(1, self.k_max + 1):
                tokens[k], passes[k] = self._lay(row, k, continues, tokens[k], passes[k])
            row.trim()
        self.tokens = [t + n for t, n in zip(self.tokens, tokens)]
        self.passes = [p + n for p, n in zip(self.passes, passes)]
        self._kept.append((at, tokens, passes, drafted))
        while len(self._kept) > self.memory or (self._kept and at - self._kept[0][0] > self.horizon):
            self._drop()

    def expected(self, now: int, prior: list[float], prior_passes: float) -> list[float]:
        """Tokens per pass at k = 0..k_max, shrunk toward `prior` as if it were `prior_passes` passes."""
        self.forget(now)
        w = prior_passes
        return [1.0] + [(t + e * w) / (n + w) for t, n, e in zip(self.tokens[1:], self.passes[1:], prior[1:])]

    def mean(self, now: int) -> float:
        """The mean acceptance of the drafted positions kept (`prior` where there are none)."""
        self.forget(now)
        return self.drafted[0] / self.drafted[1] if self.drafted[1] > 0 else self.prior

    def forget(self, now: int) -> None:
        """Drop the passes older than `horizon`."""
        while self._kept and now - self._kept[0][0] > self.horizon:
            self._drop()

    def _lay(self, row: _Text, k: int, continues: list[float], tokens: float, passes: float) -> tuple[float, float]:
        starts, text, offset = row.starts[k], row.text, row.offset
        end, s = offset + len(text), min(starts, default=0)
        while starts and s + k <= end:  # s: the earliest start not yet laid (every start is at s or after)
            mass = starts.pop(s, 0.0)
            s += 1
            if not mass:
                continue
            run, committed, at = mass, 0.0, s - 1 - offset
            for j in range(k):
                go = continues[j] * text[at + j]
                stop = run * (1.0 - go)
                starts[s + j] = starts.get(s + j, 0.0) + stop
                committed += stop * (j + 1)
                run *= go
                if not run:  # a position nothing gets past (a rejection at T = 0): the rest adds nothing
                    break
            else:
                starts[s + k] = starts.get(s + k, 0.0) + run
            tokens, passes = tokens + committed + run * (k + 1), passes + mass
        return tokens, passes

    def _drop(self) -> None:
        _, tokens, passes, drafted = self._kept.popleft()
        self.tokens = [a - b for a, b in zip(self.tokens, tokens)]
        self.passes = [a - b for a, b in zip(self.passes, passes)]
        self.drafted = [a - b for a, b in zip(self.drafted, drafted)]


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
        cap = self.clip * middle
        mean = sum([min(v, cap) for v in values]) / len(values)
        spread = 1.4826 * statistics.median([abs(v - middle) for v in values]) / middle if middle > 0 else 0.0
        return mean, len(values), spread


def capped_seconds(seconds: list[float], continues: list[float]) -> list[float]:
    """Expected seconds of a pass allowed k = 0..k_max tokens, from the seconds of a pass that proposes j
    (`seconds[j]`) and the chance a draft allowed past j goes on (`continues[j]`): a position past the draft's
    own stop costs only when it is reached (theory.capped_speedups' cost, in seconds; here without its input
    checks, as the policy asks for it every pass)."""
    out, reached = [seconds[0]], 1.0
    for j in range(1, len(seconds)):
        reached *= continues[j - 1]
        out.append(out[-1] + reached * (seconds[j] - seconds[j - 1]))
    return out


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
