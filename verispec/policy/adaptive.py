"""`AdaptiveLength` (`--k auto`): the draft length from measured acceptance and measured costs.

Before each iteration of B rows it asks `decision.choose_k` for the k in 0..k_max with the highest
optimistic throughput, from:
- tokens[k]: expected tokens per row and pass at fixed k, laid over the text the recent passes committed
  (`estimates.TextAcceptance`, with the chance a draft goes on past each position, `estimates.Rates`),
  shrunk toward theory.capped_speedups at `prior_alpha`;
- seconds[k] and its uncertainty: the clipped mean of the recent passes at (B, k) where there are some
  (`estimates.Times`: uncertainty = spread / sqrt(n), at least `spread_floor` / sqrt(n)); else the cost
  model's prediction, fitted to the times measured lately at B (to older ones where there are none
  lately): a calibration's shape (corrected per k by recent passes at any batch size), else the profile's
  shape (theory's r(k+1) + k c), each the expectation over where a draft allowed k stops (`capped_seconds`),
  else a line over k held flat where it falls, uncertain by `prior_uncertainty`
  (`default_uncertainty` where only the default shape is known, or a calibration's error for that kind
  of pass, plain or drafting, has not been measured lately).
The draft's reading of rows that joined is a cost per request, the same for every k > 0 and none at
k = 0 (plain passes leave it for later): it is not in the pass's time, where it would land on whichever k
happened to run, but measured per committed token over the recent drafting passes and added to every
drafting arm's seconds as that many seconds per token (`join_cost`). Only the first pass of each shape is
not timed (llama.cpp sizes its buffers there).
"""

from __future__ import annotations

import functools
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from ..theory import capped_speedups
from .decision import choose_k
from .estimates import CostShape, Rates, TextAcceptance, Times, capped_seconds


@dataclass(frozen=True)
class PolicySettings:
    """What `AdaptiveLength` assumes and how long it remembers; validated on construction."""

    prior_alpha: float = 0.7  # acceptance at a text position before any evidence, and where old evidence fades to
    prior_passes: float = 2.0  # tokens per pass from that prior count as this many passes
    memory: int = 400  # acceptance is measured over the last `memory` passes
    window: int = 9  # an iteration's time is the clipped mean of the last `window` timed passes at (batch, k)
    horizon: int = 400  # passes after which evidence is dropped (so a k left alone is measured again)
    spread_floor: float = 0.05  # the least relative spread of one timed pass
    prior_uncertainty: float = 0.05  # relative uncertainty of a time predicted by a calibration or a profile
    default_uncertainty: float = 0.5  # ... by the default shape (no calibration, no profile)

    def __post_init__(self) -> None:
        checks = {
            "prior_alpha": 0 < self.prior_alpha <= 1,
            "prior_passes": self.prior_passes > 0,
            "memory": isinstance(self.memory, int) and self.memory >= 1,
            "window": isinstance(self.window, int) and self.window >= 1,
            "horizon": isinstance(self.horizon, int) and self.horizon >= 1,
            "spread_floor": 0 <= self.spread_floor < 1,
            "prior_uncertainty": 0 <= self.prior_uncertainty < 1,
            "default_uncertainty": 0 <= self.default_uncertainty < 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name} is out of range: {getattr(self, name)!r}")


@dataclass
class AdaptiveLength:
    """The adaptive draft-length policy; prior_c / prior_r / prior_batch: a cost profile (profile.py), if any."""

    k_max: int = 8
    prior_c: float | None = None
    prior_r: tuple[float, ...] | None = None
    prior_batch: int = 1
    settings: PolicySettings = field(default_factory=PolicySettings)

    def __post_init__(self) -> None:
        if not isinstance(self.k_max, int) or not 1 <= self.k_max <= 64:
            raise ValueError(f"k_max must be an integer in [1, 64], got {self.k_max!r}")
        if self.prior_c is not None and not (isinstance(self.prior_c, (int, float)) and self.prior_c >= 0):
            raise ValueError(f"prior_c must be a number >= 0, got {self.prior_c!r}")
        if self.prior_r is not None:
            self.prior_r = tuple(float(x) for x in self.prior_r)
            if not self.prior_r or any(x <= 0 for x in self.prior_r):
                raise ValueError(f"prior_r must be positive ratios r(1), r(2), ..., got {self.prior_r!r}")
        if not isinstance(self.prior_batch, int) or self.prior_batch < 1:
            raise ValueError(f"prior_batch must be an integer >= 1, got {self.prior_batch!r}")
        s = self.settings
        self.text = TextAcceptance(self.k_max, s.prior_alpha, s.memory, s.horizon)
        self.goes_on: dict[int, Rates] = {}  # by batch size: does a draft allowed past position i propose it
        self.times = Times(s.window, s.horizon)
        self._drift = Times(3 * s.window, s.horizon)  # (0, k): a pass proposing k, seconds over the calibration's
        self.shape = CostShape(self.k_max, self.prior_c, self.prior_r, self.prior_batch)
        self._joins: deque[tuple[float, int]] = deque()  # (joined_s, committed) per drafting pass, the last `memory`
        self._joined = [0.0, 0]  # their sums
        self.passes = 0
        self._shapes: set[tuple[int, int]] = set()  # (batch, k) whose first pass went by
        self._lookup: AdaptiveLength | None = None  # a combined draft's passes by lookup alone (`lookup_arm`)

    # ---- estimates

    def acceptance(self) -> float:
        """The mean acceptance of the drafted text positions lately (the prior where there are none)."""
        return self.text.mean(self.passes)

    def continues(self, batch: int = 1) -> list[float]:
        """Per position i, the chance that a draft allowed past i tokens, having proposed i, proposes one more.
        At a batch size not seen, from the nearest one seen as if rows stopped independently."""
        if not self.goes_on:
            return [1.0] * self.k_max
        seen = min(self.goes_on, key=lambda b: (abs(math.log(b / batch)), -b))
        return [1.0 - (1.0 - d) ** (batch / seen) for d in self.goes_on[seen].get(self.passes)]

    def join_cost(self) -> float:
        """Seconds per committed token the draft spends reading rows that joined, over the recent drafting passes."""
        joined_s, tokens = self._joined
        return max(joined_s, 0.0) / tokens if tokens else 0.0

    def estimates(self, batch: int = 1) -> tuple[list[float], list[float], list[float]]:
        """(tokens, seconds, uncertainty) for k = 0..k_max at this batch size: the decision's inputs."""
        s = self.settings
        goes_on = self.continues(batch)
        prior_tokens = _prior_tokens(s.prior_alpha, tuple(round(d, 2) for d in goes_on))  # a prior: 0.01 will do
        tokens = self.text.expected(self.passes, prior_tokens, s.prior_passes)
        seen = [self.times.get(batch, k, self.passes) for k in range(self.k_max + 1)]
        fresh = [(k, m[0]) for k, m in enumerate(seen) if m is not None and m[1] > 0]
        known = fresh or [(k, m[0]) for k, m in enumerate(seen) if m]
        predicted, prior_u = self._predicted_seconds(batch, known, goes_on)
        seconds, uncertainty = list(predicted), list(prior_u)
        for k, m in enumerate(seen):
            if m is not None and m[1] > 0:  # measured lately
                seconds[k], uncertainty[k] = m[0], max(m[2], s.spread_floor) / math.sqrt(m[1])
        per_token = self.join_cost()
        seconds = [t + (per_token * batch * e if k > 0 else 0.0) for k, (t, e) in enumerate(zip(seconds, tokens))]
        return tokens, seconds, uncertainty

    def _predicted_seconds(
        self, batch: int, known: list[tuple[int, float]], goes_on: list[float]
    ) -> tuple[list[float], list[float]]:
        """Seconds at k = 0..k_max by the cost model, fitted to the (k, seconds) known at this batch size, and
        their uncertainty: a calibration's times, corrected per k by how recent passes at any batch size ran
        against them (`drift`), then scaled to the known ones; else a profile's shape scaled to them; else (the
        default shape only) the least-squares line over k through them (two or more), held flat where it falls:
        a longer draft never costs less, and two noisy times at neighbouring k must not make plain look dear;
        else the default shape scaled to them."""
        s = self.settings
        if self.shape.source == "default" and len({k for k, _ in known}) >= 2:
            mean_k = sum(k for k, _ in known) / len(known)
            mean_t = sum(t for _, t in known) / len(known)
            slope = sum((k - mean_k) * (t - mean_t) for k, t in known) / sum((k - mean_k) ** 2 for k, _ in known)
            line = [max(mean_t + max(slope, 0.0) * (k - mean_k), 1e-9) for k in range(self.k_max + 1)]
            return line, [s.prior_uncertainty] * len(line)
        shape = self.shape.seconds(batch)  # [k_max + 1]: a pass that proposes j tokens
        prior_u = [s.default_uncertainty if self.shape.source == "default" else s.prior_uncertainty] * len(shape)
        if self.shape.source == "calibration":
            drift, measured = self.drift()
            shape = [x * d for x, d in zip(shape, drift)]
            prior_u = [s.prior_uncertainty if m else s.default_uncertainty for m in measured]
        shape = capped_seconds(shape, goes_on)  # a pass allowed k: its draft may stop sooner (goes_on: `continues`)
        ratios = [t / shape[k] for k, t in known if shape[k] > 0]
        scale = statistics.median(ratios) if ratios else 1.0
        return [x * scale for x in shape], prior_u

    def drift(self) -> tuple[list[float], list[bool]]:
        """Per k, the median ratio of recent passes' seconds at any batch size to the calibration's, and whether
        it is known: a calibration runs short rows without a server's other work, and its error differs between
        plain and drafting passes. A k that did not run lately takes the median over the others of its kind
        (plain, or drafting) and counts as known when there are some; else the median over all (1 if none)."""
        seen = [self._drift.get(0, k, self.passes) for k in range(self.k_max + 1)]
        ran = {k: m[0] for k, m in enumerate(seen) if m is not None and m[1] > 0}
        drafting = [d for k, d in ran.items() if k > 0]
        anywhere = statistics.median(ran.values()) if ran else 1.0
        drift, known = [], []
        for k in range(self.k_max + 1):
            kind = drafting if k > 0 else []
            drift.append(ran[k] if k in ran else statistics.median(kind) if kind else anywhere)
            known.append(k in ran or bool(kind))
        return drift, known

    # ---- the policy

    def choose(self, batch: int = 1) -> int:
        return choose_k(*self.estimates(batch))

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
        cap = k if cap is None else min(max(cap, k), self.k_max)
        if (batch, cap) in self._shapes:  # the first pass of a shape sizes buffers: not timed
            self.times.add(batch, cap, draft_s + target_s, self.passes)
            if self.shape.source == "calibration":
                self._drift.add(0, k, (draft_s + target_s) / self.shape.seconds(batch)[k], self.passes)
        self._shapes.add((batch, cap))
        self.passes += 1
        if cap > 0:  # did the draft go on past each position it was allowed past
            goes_on = self.goes_on.setdefault(
                batch, Rates(self.k_max, 1.0, self.settings.prior_passes, self.settings.memory, self.settings.horizon)
            )
            went = min(k + 1, cap)
            goes_on.add(self.passes, [float(i < k) for i in range(went)], [1.0] * went)
        if cap > 0:
            self._joins.append((joined_s, committed))
            self._joined = [self._joined[0] + joined_s, self._joined[1] + committed]
            if len(self._joins) > self.settings.memory:
                old_s, old_tokens = self._joins.popleft()
                self._joined = [self._joined[0] - old_s, self._joined[1] - old_tokens]
        if texts is None and batch == 1 and committed:  # one row: its text follows from the sums
            betas = [b / n for b, n in zip(beta_sums[:k], verified[:k]) if n]
            texts = {0: betas[:committed] + [None] * (committed - len(betas[:committed]))}
        if texts is not None:
            self.text.add(self.passes, texts, self.continues(batch))

    def lookup_arm(self) -> AdaptiveLength:
        """The policy of a combined draft's passes by lookup alone (policy/split.py), made once: this policy's
        k_max, settings, profile of the target and calibration of its passes, and no draft time."""
        if self._lookup is None:
            self._lookup = AdaptiveLength(self.k_max, 0.0, self.prior_r, self.prior_batch, self.settings)
            if self.shape.target:
                self._lookup.seed_costs(dict(self.shape.target), {})
        return self._lookup

    def seed_costs(self, target: dict[int, float], draft: dict[tuple[int, int], float]) -> None:
        """A calibration (profile.calibrate): t_target by the positions of a pass, t_draft by (batch, k).
        It becomes the prior shape of an iteration's time; acceptance is untouched."""
        self.shape.seed(target, draft)


@functools.lru_cache(maxsize=256)
def _prior_tokens(alpha: float, goes_on: tuple[float, ...]) -> tuple[float, ...]:
    """Tokens per pass at k = 0..k_max before any text: theory's at acceptance `alpha` at every position."""
    k_max = len(goes_on)
    return tuple(capped_speedups([alpha] * k_max, list(goes_on), 0.0, [1.0] * (k_max + 1), k_max)[0])
