"""Draft-length policies: how many tokens to propose before each target pass.

Owns `FixedLength` (always k) and `AdaptiveLength` (`--k auto`), which keeps online
estimates of the refined model's inputs from the run itself and picks, before every
iteration, the shortest k in 0..k_max whose predicted speed-up
S(k) = E(alpha_1..alpha_k) / (k*c + r(k+1)) (theory.refined_speedup) is within `tolerance`
(1%) of the best (`shortest_near_best`):
- alpha_i: the running mean of beta at verified draft position i (the exact conditional
  acceptance probability; lower variance than counting accepts) over about 20 passes, or
  `memory` (160) betas where passes bring fewer (one row), past the first position
  pulled toward the first's estimate by `shrink` betas (deep positions are verified seldom);
  a position not proposed ages, during plain passes too, so that a long back-off ends with a
  fresh look; one proposed but not reached (an earlier rejection), or asked for but not
  proposed (the draft stopped on its own), neither counts nor ages;
- d_i: how often a draft asked for more than i tokens, having proposed i, proposes one more
  (`continues`, by batch size): k caps a draft with a confidence stop, and S(k) is
  theory.capped_speedups (a position past the draft's own stop costs only when it is reached;
  counted as if always proposed, auto capped one row at k = 3 and ran 2.44 tokens a pass
  against 2.63 at the cap of 4 it chooses with d_i);
- the cost of an iteration at batch size B and draft length k: t_target over the B(k+1)
  positions of its pass (measured at that count, else interpolated between the counts
  measured, past them the profile's shape; the first pass at each shape is not timed, nor, in service, a pass right after rows left or joined) plus t_draft(B, k) (measured, else a fixed cost per drafting pass plus a cost per
  token fitted over the lengths timed at B, else interpolated between batch sizes), both the
  median of the last `recent` iterations with that key (a mean let one stalled pass on a busy
  2-core machine flip the choice), where "target" time is everything in an iteration but the draft passes
  (verification, sampling and bookkeeping included: that is what a pass really costs). The
  draft's time is folded into r(k+1) = t_iteration / t_target(B), with c = 0.
A cost profile (profiler.py: `prior_c`, `prior_r`) lets it choose well from the first
iteration. A calibration (profiler.calibrate: medians of real passes at every batch size and
k, `seed_costs`, as the server runs before its first request) replaces both tables: its
iteration times, smoothed by a line over k = 1..k_max at each batch size, give the shape over
batch sizes and k, multiplied by the `stretch`, the median ratio of passes in service to the
calibration's, one for plain passes and one for drafting passes (pooled over k), at the batch
size once it has seen `recent` passes of the kind, else pooled over batch sizes (so that a batch
size or k seldom seen still learns from the others; a server's passes run at longer contexts
than the calibration's, beside HTTP work), and one over both, used for a kind seen fewer than
`recent` times; but where a (batch size, k) ran its last `recent` iterations lately (all within 4 * recent passes), their median
(`service_seconds`: the calibration's line over k misses the steps of real passes). Where
drafting is predicted to gain less than `explore`, the calibration's shape decides, so plain
passes are measured at that batch size (`_plain_due`).
Without either it starts with one plain pass and one k = 4 pass to measure.
k = 0 (plain decoding) is chosen when nothing beats 1, once the first position has been
verified `min_evidence` times over all rows (before that it drafts one token; a fresh server
at 32 rows had drafted for 16 passes, at two plain passes' cost each, when it counted passes); the policy then probes k = 1 after
`probe_every` plain iterations so that it notices when drafting pays again (and after twice as
many after each probe at that batch size that finds it still does not pay, up to 8 times: at 32
rows a probe costs two plain passes, since the draft first reads every token since its last
pass; drafting at another batch size measures acceptance meanwhile; a batch size not seen yet starts
from the gap of the nearest one seen, and a return to drafting that lasts fewer than `recent`
passes counts as a probe that found drafting does not pay), unless the costs alone
rule drafting out (no k pays even if every proposal were accepted: a draft as slow as the
target); then it does not probe at all (a probe would make the draft catch up on every token
since its last pass, for nothing). Backed off at a batch size, the policy drafts again only where
drafting is predicted to gain at least `switch` (5%): each return pays a catch-up, and at 16
rows, where plain and drafting passes were near a tie (drafting at 0.95-1.01 of plain), estimates
taken at different moments of a busy machine predicted 1.02-1.09, and the policy went back and
forth, catching up each time, at 0.95 of plain overall. That gain is judged against the
faster of plain's last `recent` and last 3 * recent passes at the batch size once drafting
passes have been timed (`_calm`): backed off, plain's time is fresh and drafting's old, and a
busy moment that slows plain passes made drafting look cheap beside them. The return's catch-up itself is
costed too: its seconds per token (what catch-up passes took beyond a drafting pass's time,
per row and plain pass since) times the tokens pending now, spread over the passes that
returns to drafting at this batch size lasted (the median of the last `recent`; `probe_every`
before any), is added to a drafting iteration's time (at 32 rows a server returned to drafting on
predicted gains of 1.01-1.09, catching up each time, and its drafting passes committed 0.34
tokens a ms against plain's 0.54). Drafting at a batch size where it is
predicted to gain `explore` or more, the policy measures no plain pass there, so a plain time
taken in a busy moment could stand for good (a server drafted at 16 rows for 200 passes and
more on a plain stretch of 1.72 left by one): once the newest plain pass at a batch size
is `refresh_every` passes old, one plain pass is due there. Any plain pass at a batch size
whose plain passes are sparse (spanning more than 4 * recent passes: drafting there, with a
plain pass due every `probe_every`) that runs 10% under their median drops them, and `recent`
new ones are measured (at 16 rows a server drafted on a plain median of 47.5 ms taken in a
busy moment, its k = 1 passes at 66-88 ms, while the plain passes due meanwhile ran 37 and
43 ms and moved a median of 27 by one place each). The draft's cost
is not taken from a drafting pass that follows plain passes, nor from the first one: there a
model draft first reads every token committed since its last pass (the whole prompt, the
first time), which says nothing about the cost per proposed token, and counting it made one
catch-up keep the policy backed off. A policy only changes
how many tokens are proposed, never which are committed, so exactness is untouched.
Knows nothing of models or tokens.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from .config import SpecConfig
from .theory import capped_speedups, refined_optimal_k


@runtime_checkable
class DraftLengthPolicy(Protocol):
    k_max: int

    def choose(self, batch: int = 1) -> int:
        """The draft length for the next iteration of `batch` rows, in 0..k_max."""

    def observe(self, k: int, beta_sums: list[float], verified: list[int], draft_s: float, target_s: float, batch: int = 1,
                cap: int | None = None) -> None:
        """After an iteration of `batch` rows that proposed k tokens: per draft position, the sum of
        beta over the rows' verified positions and their number; the seconds spent drafting and the
        rest; cap: the draft length chosen for it (None: k), of which a draft may propose fewer."""


@dataclass
class FixedLength:
    k: int

    def __post_init__(self) -> None:
        SpecConfig(k=self.k)  # validates k

    @property
    def k_max(self) -> int:
        return self.k

    def choose(self, batch: int = 1) -> int:
        return self.k

    def observe(self, k: int, beta_sums: list[float], verified: list[int], draft_s: float, target_s: float, batch: int = 1,
                cap: int | None = None) -> None:
        pass


class _Mean:
    """An exponentially weighted mean. `get(default, anchor)` counts the default as `prior_weight`
    observations, a weight halved by every observation (and dropped below 0.01), so it steadies
    the first few estimates and is then gone; the anchor (default: the default) as `shrink`
    observations that never go (a deep draft position's few greedy betas, each 0 or 1, are
    pulled toward the first position's well-measured estimate); and, once the evidence has
    faded below one observation (`fade`: iterations that observed nothing here), the default as
    the missing weight, so that an estimate nobody checks any more returns to it instead of freezing."""

    def __init__(self, decay: float, prior_weight: float = 0.0, shrink: float = 0.0):
        self.decay, self.total, self.weight, self.prior_weight, self.shrink = decay, 0.0, 0.0, prior_weight, shrink
        self.count = 0  # observations ever

    def add(self, value: float, weight: float = 1.0, decay: float | None = None) -> None:
        """One observation; `decay`, if given, replaces the mean's own from now on (fades too)."""
        self.decay = self.decay if decay is None else decay
        self.count += 1
        self.total = self.decay * self.total + value * weight
        self.weight = self.decay * self.weight + weight
        self.prior_weight = self.prior_weight / 2 if self.prior_weight > 0.01 else 0.0  # gone after ~8: a plain mean again

    def fade(self, power: int = 4) -> None:
        """An iteration without an observation: old evidence counts less (by default four times
        faster than evidence that keeps coming, so that an estimate left behind is soon questioned again)."""
        self.total *= self.decay**power
        self.weight *= self.decay**power

    def get(self, default: float, anchor: float | None = None) -> float:
        prior = max(self.prior_weight, 1.0 - self.weight)  # evidence faded below one observation: the default returns
        anchor = default if anchor is None else anchor
        return (self.total + default * prior + anchor * self.shrink) / (self.weight + prior + self.shrink)


class _Recent:
    """The median of the last `size` values: a pass that a busy machine stretched tenfold (another
    thread on the core, an allocation) moves it by one place instead of pulling a mean along."""

    def __init__(self, size: int):
        self.values: deque[float] = deque(maxlen=size)
        self._ats: deque[int] = deque(maxlen=size)  # when each value came (the caller's count)
        self.count = 0  # observations ever

    def add(self, value: float, at: int = 0) -> None:
        self.values.append(value)
        self._ats.append(at)
        self.count += 1
        self._median = statistics.median(self.values)  # once per observation: `get` runs for every key on every choice

    @property
    def oldest(self) -> int:
        """When the oldest value in the window came."""
        return self._ats[0]

    @property
    def newest(self) -> int:
        """When the newest value in the window came."""
        return self._ats[-1]

    def __len__(self) -> int:
        return len(self.values)

    def get(self, default: float = 0.0) -> float:
        return self._median if self.values else default


@dataclass
class AdaptiveLength:
    k_max: int = 8
    decay: float = 0.95  # per observation of acceptance; about the last 20 iterations count, or `memory` betas where they bring fewer
    memory: int = 160  # betas an acceptance estimate averages over at least: at one row, 20 passes (20 betas, each 0 or 1 in
    #                    greedy decoding) put alpha 0.7 at +-0.1, and auto chose k = 2 on 12% and k = 5-8 on 12% of its passes
    probe_every: int = 16
    prior_alpha: float = 0.7  # for positions not verified yet
    prior_weight: float = 2.0  # the prior at a position counts as this many betas, halved by each one seen there:
    #                            one greedy rejection (beta 0) at the start does not stop drafting
    shrink: float = 4.0  # positions past the first always count the first's estimate as this many betas
    min_evidence: int = 16  # betas at the first position, over all rows, before the policy stops drafting altogether (8 greedy
    #                         betas, each 0 or 1, could not tell 0.4 from 0.7: a fresh server backed off on a prompt k = 3 served at 2.1 tokens a pass)
    prior_c: float | None = None  # from a cost profile: used until a draft pass is timed
    prior_r: tuple[float, ...] | None = None  # r(1..): the shape of t_target(n) until it is measured
    prior_batch: int = 1  # the batch size prior_r was measured at
    _alpha: list[_Mean] = field(init=False, repr=False)
    recent: int = 9  # a time is the median of the last this many passes with its key
    tolerance: float = 0.01  # the shortest k whose predicted S is within this fraction of the best (shortest_near_best)
    explore: float = 0.2  # drafting predicted to gain less than this: plain passes at the batch size are measured (`_plain_due`)
    switch: float = 0.05  # backed off at a batch size, drafting resumes there only when predicted to gain at least this
    refresh_every: int = 256  # passes after the newest plain pass at a batch size, one plain pass is due there
    _target: dict[int, _Recent] = field(init=False, repr=False)  # seconds of a target pass, by positions in it: batch * (k + 1)
    _draft: dict[tuple[int, int], _Recent] = field(init=False, repr=False)  # seconds of a drafting pass, by (batch, k)
    _goes_on: dict[int, list[_Mean]] = field(init=False, repr=False)  # by batch size, per position: does the draft propose it (`continues`)
    _shapes: set[tuple[str, object]] = field(init=False, repr=False)  # ("target" or "draft", key) whose first pass was seen, untimed (`_timed`)
    _seeded_target: dict[int, float] = field(init=False, repr=False)  # a calibration's t_target, by positions
    _seeded_draft: dict[tuple[int, int], float] = field(init=False, repr=False)  # its t_draft, by (batch, k)
    _calibrated: dict[int, list[float]] = field(init=False, repr=False)  # calibrated_seconds by batch size, k = 0..k_max
    _stretch: dict[bool | None | tuple[int, bool], _Recent] = field(init=False, repr=False)  # by drafting or not (None: both), also
    #                                                             by (batch, drafting): a pass's seconds / the calibration's
    _drafted_at: dict[int, int] = field(init=False, repr=False)  # drafting passes at each batch size since its last plain one
    _iteration: dict[tuple[int, int], _Recent] = field(init=False, repr=False)  # an iteration's seconds in service, by (batch, k)
    _passes: int = field(init=False, default=0)
    _since_draft: int = field(init=False, default=0)
    _probe_gap: dict[int, int] = field(init=False, repr=False)  # by batch size, plain passes before the next probe there: probe_every,
    #                                                             doubled by each probe that finds drafting still does not pay (at most 8 times)
    _backed_off: set[int] = field(init=False, repr=False)  # batch sizes where the policy last chose plain for want of a gain
    _catch_up: _Recent = field(init=False, repr=False)  # seconds per row and plain pass that a drafting pass after plain ones spent catching up
    _returned_at: dict[int, int] = field(init=False, repr=False)  # by batch size, the pass at which drafting last resumed there
    _episodes: dict[int, _Recent] = field(init=False, repr=False)  # by batch size, how many passes returns to drafting lasted
    _stale: set[int] = field(init=False, repr=False)  # batch sizes whose old plain passes were dropped (`refresh_every`)
    _drafted: bool = field(init=False, default=False)
    _first_betas: int = field(init=False, default=0)  # betas seen at the first draft position, over all rows
    _last_batch: int = field(init=False, default=0)  # the previous pass's batch size: a pass right after rows left or joined is not
    #   timed in service (its seconds carry their bookkeeping: at 4 rows, drafting passes right after 28 rows left took
    #   119-361 ms against 35-45 ms, and stood as drafting's time there until the policy, backed off, predicted k = 1 at 0.5 of plain)

    def __post_init__(self) -> None:
        if not isinstance(self.k_max, int) or not 1 <= self.k_max <= 64:
            raise ValueError(f"k_max must be an integer in [1, 64], got {self.k_max!r}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay!r}")
        if not isinstance(self.memory, int) or self.memory < 1:
            raise ValueError(f"memory must be an integer >= 1, got {self.memory!r}")
        if not isinstance(self.recent, int) or self.recent < 1:
            raise ValueError(f"recent must be an integer >= 1, got {self.recent!r}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance!r}")
        if not (isinstance(self.explore, (int, float)) and self.explore >= 0):
            raise ValueError(f"explore must be a number >= 0, got {self.explore!r}")
        if not isinstance(self.probe_every, int) or self.probe_every < 1:
            raise ValueError(f"probe_every must be an integer >= 1, got {self.probe_every!r}")
        if self.prior_c is not None and not (isinstance(self.prior_c, (int, float)) and self.prior_c >= 0):
            raise ValueError(f"prior_c must be a number >= 0, got {self.prior_c!r}")
        if not isinstance(self.prior_batch, int) or self.prior_batch < 1:
            raise ValueError(f"prior_batch must be an integer >= 1, got {self.prior_batch!r}")
        if self.prior_r is not None:
            self.prior_r = tuple(float(x) for x in self.prior_r)
            if not self.prior_r or any(x <= 0 for x in self.prior_r):
                raise ValueError(f"prior_r must be positive ratios r(1), r(2), ..., got {self.prior_r!r}")
        if not isinstance(self.refresh_every, int) or self.refresh_every < 1:
            raise ValueError(f"refresh_every must be an integer >= 1, got {self.refresh_every!r}")
        if not (isinstance(self.switch, (int, float)) and self.switch >= 0):
            raise ValueError(f"switch must be a number >= 0, got {self.switch!r}")
        if not self.shrink >= 0:
            raise ValueError(f"shrink must be >= 0, got {self.shrink!r}")
        self._probe_gap, self._backed_off, self._stale, self._returned_at, self._episodes = {}, set(), set(), {}, {}
        self._catch_up = _Recent(self.recent)
        self._alpha = [_Mean(self.decay, self.prior_weight, self.shrink if i else 0.0) for i in range(self.k_max)]
        self._goes_on = {}
        self._target, self._draft, self._shapes = {}, {}, set()
        self._seeded_target, self._seeded_draft, self._calibrated, self._stretch, self._drafted_at, self._iteration = {}, {}, {}, {}, {}, {}

    # ---- estimates

    def alphas(self) -> list[float]:
        """Per-position conditional acceptance; a position's prior is the estimate of the one
        before it (prior_alpha for the first), so an unverified position borrows it, and past the
        first it is pulled toward the first's by `shrink` betas (a pull toward the one before
        compounded: two lucky betas at depth 4 lifted depths 5-8 to 0.95)."""
        out: list[float] = []
        for mean in self._alpha:  # clamped: a float32 beta of a certain token can read 1 + 1e-7
            out.append(min(max(mean.get(out[-1] if out else self.prior_alpha, out[0] if out else None), 0.0), 1.0))
        return out

    def continues(self, batch: int = 1) -> list[float]:
        """Per position i, the chance that a pass allowed past i tokens, having proposed i,
        proposes one more (theory.capped_speedups): 1 for a draft that always proposes what it
        is allowed. Measured at each batch size over the last `memory` passes (a draft stops only
        when every row is unsure, so it stops less often the more rows there are); at a batch
        size not seen yet, from the nearest one seen as if rows were unsure independently:
        1 - (1 - d)^(batch / seen). A position not observed yet borrows the one before's."""
        if batch in self._goes_on:
            seen, power = batch, 1.0
        elif self._goes_on:
            seen = _nearest(self._goes_on, batch)
            power = batch / seen
        else:
            return [1.0] * self.k_max
        out: list[float] = []
        for mean in self._goes_on[seen]:
            d = min(max(mean.get(out[-1] if out else 1.0), 0.0), 1.0)
            out.append(1.0 - (1.0 - d) ** power)
        return out

    def target_seconds(self, n: int) -> float | None:
        """t_target of a pass over n positions in all (batch * (k + 1)): measured, else linear in
        n through the two nearest measured points, past them the profile's shape (`_positions_time`);
        counts timed fewer than three times are used only while no count has been timed more."""
        steady = {m: mean.get() for m, mean in self._target.items() if mean.count >= 3}
        return _positions_time(steady or {m: mean.get() for m, mean in self._target.items()}, n, self._prior_ratio,
                               extrapolate=self.prior_r is not None)

    def _prior_ratio(self, n: float) -> float:
        """The shape of t_target over n positions in all: the profile's r at n / prior_batch
        positions per row (linear between and past its points), else 1 + 5% per position."""
        r = self.prior_r
        if not r:
            return 1 + 0.05 * (n - 1)
        x = max(n / self.prior_batch, 1.0)
        if x <= len(r):
            low = int(x)
            return r[low - 1] + (x - low) * ((r[low] if low < len(r) else r[-1]) - r[low - 1])
        slope = (r[-1] - r[0]) / max(len(r) - 1, 1)
        return r[-1] + slope * (x - len(r))

    def draft_seconds(self, batch: int, k: int) -> float | None:
        """t_draft of a drafting pass proposing k tokens for each of `batch` rows (`_draft_time`)."""
        return _draft_time({key: mean.get() for key, mean in self._draft.items()}, batch, k)

    def calibrated_seconds(self, batch: int, k: int) -> float:
        """An iteration's seconds at this batch size and k by the calibration alone (seed_costs):
        for k >= 1 the least-squares line over k = 1..k_max of its times at this batch size (three
        passes per point on a busy machine are 5-10% apart; a bump at one k made the choice jump)."""
        if batch not in self._calibrated:
            raw = [_positions_time(self._seeded_target, batch * (j + 1), self._prior_ratio) for j in range(self.k_max + 1)]
            raw[1:] = _fitted_line([t + _draft_time(self._seeded_draft, batch, j) for j, t in enumerate(raw) if j])
            self._calibrated[batch] = raw
        return self._calibrated[batch][k]

    def stretch(self, k: int, batch: int | None = None) -> float:
        """How much longer passes at draft length k take in service than the calibration said:
        the median of the last 3 * recent ratios of plain passes (k = 0) or of drafting passes
        (any k > 0, pooled: a k seldom run would otherwise rest on one pass), at this batch size
        once `recent` passes of the kind ran there (the calibration's shape over batch sizes
        was off: drafting passes took 0.85-0.93 of it at one row and 1.04 at 8), else at any
        batch size (a calibration runs at a short context without HTTP traffic); until a kind
        has run `recent` passes, the median over both kinds (the first plain passes of a
        server, after joins, took 1.5-1.9 times the calibration's at 16 rows while steady ones
        took 1.06, as drafting ones did: two such passes made plain look dear and the policy
        drafted at a loss); 1 before any."""
        for key in ((batch, k > 0), k > 0):
            seen = self._stretch.get(key)
            if seen is not None and seen.count >= self.recent:
                return seen.get()
        pooled = self._stretch.get(None)
        return pooled.get() if pooled is not None else 1.0

    def service_seconds(self, batch: int, k: int) -> float:
        """An iteration's seconds at this batch size and k in service: the median of its last
        `recent` iterations where all of them ran within the last 4 * recent passes (the
        calibration's line over k missed its steps: at 2 rows it rose 6.8 ms a token where
        service rose 5, so k = 2 looked no better than k = 1 and ran 16% more tokens a ms),
        else the calibration's times scaled by the `stretch`. All, not the latest: at 16 rows
        five slow plain passes in a row set the plain median at 64 ms, the policy drafted, and
        the one plain pass it measured every 16 drafting passes (45-57 ms) left that median
        standing for 70 passes while drafting ran 10% fewer tokens a second than plain."""
        seen = self._iteration.get((batch, k))
        if seen is not None and seen.count >= self.recent and self._passes - seen.oldest <= 4 * self.recent:
            return seen.get()
        return self.calibrated_seconds(batch, k) * self.stretch(k, batch)

    def _model_inputs(self, batch: int = 1) -> tuple[list[float], float, list[float]] | None:
        """(alphas, c, r(1..k_max+1)) for the refined model at this batch size, or None before
        anything is known: r(n) = t_target(batch * n) / t_target(batch), so that r grows like n
        once a pass over the batch's positions is compute-bound and drafting stops paying.
        The drafting pass's time is folded into r(k + 1) (in units of t_target(batch)) and c is 0:
        a draft's cost per row falls with the batch size, which a constant c cannot say."""
        if self._seeded_target:  # calibrated: its shape over batch sizes and k, scaled by what passes take in service
            t = [self.service_seconds(batch, k) for k in range(self.k_max + 1)]
            return self.alphas(), 0.0, [x / t[0] for x in t]
        t1 = self.target_seconds(batch)
        if t1 is None and self.prior_c is not None:  # nothing timed yet: the profile alone
            r = [self._prior_ratio(batch * n) / self._prior_ratio(batch) for n in range(1, self.k_max + 2)]
            return self.alphas(), self.prior_c, r
        if t1 is None or (not self._draft and self.prior_c is None):
            return None
        r = [1.0]
        for k in range(1, self.k_max + 1):
            t_draft = self.draft_seconds(batch, k) if self._draft else self.prior_c * t1 * k
            r.append((self.target_seconds(batch * (k + 1)) + t_draft) / t1)
        return self.alphas(), 0.0, r

    def predicted_speedups(self, batch: int = 1) -> list[float]:
        """S(k) for k = 0..k_max at this batch size from the current estimates (S(0) = 1); [] before any."""
        inputs = self._model_inputs(batch)
        if inputs is None:
            return []
        alphas, c, r = inputs
        return capped_speedups(alphas, self.continues(batch), c, r, self.k_max)[0]

    # ---- the policy

    def choose(self, batch: int = 1) -> int:
        inputs = self._model_inputs(batch)
        if inputs is None:  # nothing measured yet: one plain pass, then one drafted pass
            return 0 if self.target_seconds(batch) is None else min(4, self.k_max)
        alphas, c, r = inputs
        speedups, costs = capped_speedups(alphas, self.continues(batch), c, r, self.k_max)
        best = shortest_near_best(speedups, self.tolerance)
        if best > 0 and batch in self._backed_off:
            calm = self._calm(batch)  # judged against plain's calmer time: see `_calm`
            if self._return_speedup(batch, best, speedups[best] * calm, costs[best] / calm) < 1 + self.switch:
                best = 0  # too small a gain to pay for going back: see `switch`
        if best > 0:  # drafting pays at this batch size: once it stops, the first probe here comes after probe_every plain
            if batch in self._backed_off:  # passes, unless it stops within `recent` passes of a return (below)
                self._backed_off.discard(batch)
                self._returned_at[batch] = self._passes
            if self._passes - self._returned_at.get(batch, -self.recent) >= self.recent:
                self._probe_gap[batch] = self.probe_every
            if self._plain_stale(batch):
                return 0  # plain has not been measured here for long: see `refresh_every`
            plain = self._stretch.get((batch, False))
            refreshing = batch in self._stale and (plain is None or len(plain) < self.recent)
            if (speedups[best] < 1 + self.explore or refreshing) and self._plain_due(batch):
                return 0
            timed = [j for b, j in self._draft if b == batch]
            if best < self.k_max and timed == [best] and not self._seeded_target:
                return best + 1  # a second draft length, once: separates the draft's fixed cost from its cost per token
            return best
        if batch not in self._backed_off:
            self._backed_off.add(batch)
            if batch in self._returned_at:  # a return to drafting ends: how long it lasted
                lasted = self._passes - self._returned_at.pop(batch)
                self._episodes.setdefault(batch, _Recent(self.recent)).add(lasted)
                if lasted < self.recent:  # a return that did not last is a probe that found drafting still does not pay
                    self._probe_gap[batch] = min(2 * self._gap(batch), 8 * self.probe_every)
        gap = self._gap(batch)
        due = self._since_draft + 1 >= gap
        if self._first_betas < self.min_evidence or due:
            # too few betas to give up on drafting (greedy betas are 0 or 1: two early rejections
            # say little), or time to probe: has acceptance risen? Not when even a draft that is
            # always accepted could not pay at this c and r(n): acceptance is not the question then.
            if refined_optimal_k([1.0] * self.k_max, c, r, k_max=self.k_max)[0] > 0:
                if due:  # the next probe waits twice as long, unless this one finds drafting pays again
                    self._probe_gap[batch] = min(2 * gap, 8 * self.probe_every)
                return 1
        return 0

    def _gap(self, batch: int) -> int:
        """Plain passes before the next probe at this batch size; at a batch size not seen yet,
        the gap of the nearest one seen (by ratio), not a fresh `probe_every`: acceptance is the
        same at every batch size, and a server at 32 rows whose batch ran short while clients
        sent their next requests probed at 18 and at 30 rows, new each, catching up 64 plain
        passes each time (137-226 ms against a plain pass's 75-90), while 32 rows probed every 64."""
        if batch in self._probe_gap or not self._probe_gap:
            return self._probe_gap.get(batch, self.probe_every)
        return self._probe_gap[_nearest(self._probe_gap, batch)]

    def _calm(self, batch: int) -> float:
        """Backed off at a batch size, plain's time there is the median of its last `recent`
        passes, all fresh, while drafting's is older (the calibration's, scaled by the stretch
        of drafting passes run before): a busy moment that slows the plain passes makes drafting
        look cheap beside them (at 16 rows the median of plain's last 9 passes rose from 27.3 to
        31.8 ms, S(1) from 0.90 to 1.055 against a k = 1 time of 51.5 ms from earlier, and the
        policy drafted 10 passes at a median of 61.5 ms, 0.88 of plain). A return is judged
        against the faster of plain's last `recent` and last 3 * recent passes there: this
        returns that time over the one the prediction used, at most 1. It is 1 without a
        calibration, and where no drafting pass has been timed `recent` times: drafting's time
        is then plain's pooled stretch, which moves with plain's, and only the gap between a
        fresh plain median and that older stretch can show a lasting rise of plain as a gain."""
        plain = self._stretch.get((batch, False))
        drafting = self._stretch.get(True)
        if not self._seeded_target or plain is None or plain.count < self.recent or drafting is None or drafting.count < self.recent:
            return 1.0
        return min(1.0, self.calibrated_seconds(batch, 0) * plain.get() / self.service_seconds(batch, 0))

    def _plain_stale(self, batch: int) -> bool:
        """Whether the newest plain pass at this batch size is `refresh_every` passes old (none: not stale)."""
        plain = self._stretch.get((batch, False))
        return plain is not None and self._passes - plain.newest > self.refresh_every

    def _plain_sparse(self, batch: int) -> bool:
        """Whether the plain passes behind this batch size's plain stretch span more than 4 * recent
        passes (drafting there measures one plain pass now and then): such a median can hold a
        busy moment long after it passed."""
        plain = self._stretch.get((batch, False))
        return plain is not None and self._passes - plain.oldest > 4 * self.recent

    def _return_speedup(self, batch: int, k: int, speedup: float, r_k: float) -> float:
        """S(k) with the catch-up of returning to drafting now spread over the passes that returns
        here have lasted (the module docstring); r_k: an iteration's time in plain passes' units."""
        if not len(self._catch_up):
            return speedup
        t_plain = self.service_seconds(batch, 0) if self._seeded_target else self.target_seconds(batch)
        if not t_plain:
            return speedup
        episodes = self._episodes.get(batch)
        horizon = max(episodes.get(), 1) if episodes is not None else self.probe_every
        catch_up = self._catch_up.get() * batch * (self._since_draft + 1)
        return speedup * r_k / (r_k + catch_up / (horizon * t_plain))

    def _plain_due(self, batch: int) -> bool:
        """Where drafting is predicted to pay by less than `explore`, an error in the calibration's
        shape decides (at 8 rows it predicted 1.14 where drafting ran at 1.01 of plain): plain
        passes are measured at this batch size until `recent` of them give it its own stretch,
        then one after every `probe_every` drafting passes there (a plain pass costs at most
        `explore` of one, and the draft reads one token more the pass after)."""
        if not self._seeded_target:
            return False
        plain = self._stretch.get((batch, False))
        return plain is None or plain.count < self.recent or self._drafted_at.get(batch, 0) >= self.probe_every

    def observe(self, k: int, beta_sums: list[float], verified: list[int], draft_s: float, target_s: float, batch: int = 1,
                cap: int | None = None) -> None:
        cap = k if cap is None else min(max(cap, k), self.k_max)
        if cap > 0:  # whether the draft went on past each position it was allowed past: see `continues`
            means = self._goes_on.setdefault(batch, [_Mean(self.decay, self.prior_weight) for _ in range(self.k_max)])
            for i in range(min(k + 1, cap)):
                means[i].add(float(i < k), 1.0, decay=max(self.decay, 1 - 1 / self.memory))
        catch_up = k > 0 and not (self._since_draft == 0 and self._drafted)
        changed, self._last_batch = self._last_batch not in (0, batch), batch  # rows left or joined since the last pass: see `_last_batch`
        if self._seeded_target and not catch_up and not changed:
            ratio = (target_s + draft_s) / self.calibrated_seconds(batch, k)
            if k == 0 and self._plain_sparse(batch) and ratio < 0.9 * self._stretch[(batch, False)].get():
                del self._stretch[(batch, False)]  # the plain passes seen here long ago ran slower than plain runs now: stale
                self._stale.add(batch)
            for kind in (k > 0, None, (batch, k > 0)):  # None: both kinds
                self._stretch.setdefault(kind, _Recent(3 * self.recent)).add(ratio, self._passes)
            self._iteration.setdefault((batch, k), _Recent(self.recent)).add(target_s + draft_s, self._passes)
        self._passes += 1
        self._timed("target", batch * (k + 1), target_s)
        self._drafted_at[batch] = self._drafted_at.get(batch, 0) + 1 if k else 0
        if k == 0:  # acceptance unobserved: its estimates age as if observed (a long back-off ends in a fresh look)
            self._since_draft += 1
            for mean in self._alpha:
                mean.fade(power=1)
            return
        if self._since_draft == 0 and self._drafted:  # not a catch-up: see the module docstring
            self._timed("draft", (batch, k), draft_s)
        elif self._drafted:  # a catch-up: what it took beyond a drafting pass, per row and plain pass since
            steady = self.draft_seconds(batch, k)
            steady = _draft_time(self._seeded_draft, batch, k) if steady is None and self._seeded_draft else steady
            if steady is not None:
                self._catch_up.add(max(draft_s - steady, 0.0) / (batch * self._since_draft))
        self._since_draft, self._drafted = 0, True
        self._first_betas += verified[0] if verified else 0
        for i, mean in enumerate(self._alpha):
            count = verified[i] if i < len(verified) else 0
            if count:  # a pass with fewer than memory / 20 betas here decays slower: see `memory`
                mean.add(beta_sums[i] / count, 1.0, decay=max(self.decay, 1 - count / self.memory))
            elif i >= cap:  # not asked for: the estimate drifts back to the one before it
                mean.fade()  # (asked for but not proposed, the draft unsure: no news, as for one not reached)
            # proposed but not reached (an earlier rejection): no news, and not stale either. Fading
            # here held a deep position's weight near `shrink`'s (at one row, greedy: 0.74-0.77
            # at depths 3-5 where fixed k = 5 measured 0.81-0.95), and auto drafted short

    def _timed(self, kind: str, key, seconds: float) -> None:
        """Add a pass's seconds to `_target` or `_draft` (kind) under its shape, unless it is the
        first pass of that shape: llama.cpp sizes its buffers then (and torch's allocator grows),
        and that one slow pass, left as the only time at a draft length seldom run, made that
        length look dear for good."""
        if (kind, key) in self._shapes:
            (self._target if kind == "target" else self._draft).setdefault(key, _Recent(self.recent)).add(seconds)
        else:
            self._shapes.add((kind, key))

    def seed_costs(self, target: dict[int, float], draft: dict[tuple[int, int], float]) -> None:
        """Times measured before any request (profiler.calibrate): t_target by the positions of a
        pass, t_draft by (batch, k); each counts as one observation, acceptance is untouched."""
        self._seeded_target.update(target)
        self._seeded_draft.update(draft)
        self._calibrated.clear()


def _nearest(sizes, batch: int) -> int:
    """The batch size among `sizes` nearest to batch by ratio (the larger on a tie)."""
    return min(sizes, key=lambda seen: (abs(math.log(seen / batch)), -seen))


def shortest_near_best(speedups: list[float], tolerance: float) -> int:
    """The smallest k with S(k) >= (1 - tolerance) * max S, for S(0..k_max). Where the predicted
    S is flat, the shorter draft: it wastes fewer positions when the estimates behind S are
    optimistic (a deep position's acceptance from a few greedy betas that all came out 1), and
    its tokens arrive sooner. Measured in a server at 8-32 rows (BENCHMARKS.md), fixed k = 2-4
    were within 10% of plain while the plain argmax drafted longer and lost 15-40%. The default
    tolerance is 1%: at 3% a server at one row ran one token shorter than the argmax on 70% of
    its passes, and fixed k = 3 served 7% more than k = 2 there (the acceptance of a mix of
    prompts favours longer drafts more than its mean says: E(alpha, k) is convex in alpha)."""
    top = max(speedups)
    return next(k for k, s in enumerate(speedups) if s >= (1 - tolerance) * top)


def _least_squares(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through two or more (x, t) points."""
    mean_x = sum(x for x, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    slope = sum((x - mean_x) * (t - mean_t) for x, t in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return mean_t - slope * mean_x, slope


def _fitted_line(values: list[float]) -> list[float]:
    """The least-squares line through (1, values[0]), (2, values[1]), ... at those points; flat
    (the mean) if it falls: a pass proposing more tokens does not take less time."""
    points = list(enumerate(values, 1))
    fixed, slope = _least_squares(points) if len(points) > 1 else (values[0], 0.0)
    if slope < 0:
        return [sum(values) / len(values)] * len(values)
    return [fixed + slope * x for x, _ in points]


def _positions_time(table: dict[int, float], n: int, prior_ratio, extrapolate: bool = False) -> float | None:
    """t over n positions from {positions: seconds}: the value at n, else linear through the two
    nearest points (flat or rising), else one point scaled by prior_ratio's shape; None if empty.
    With `extrapolate`, past the points measured the nearest one scaled by prior_ratio's shape
    (a measured profile): a line through two close points, each a median of a few passes, ran
    ahead of the profile's (concave) curve, and deep drafts looked dear."""
    if n in table:
        return table[n]
    known = sorted(table.items())
    if not known:
        return None
    below = [point for point in known if point[0] < n]
    above = [point for point in known if point[0] > n]
    if len(known) == 1 or (extrapolate and not (below and above)):
        m, t = below[-1] if below else above[0]
        return t * prior_ratio(n) / prior_ratio(m)
    if below and above:
        (m0, t0), (m1, t1) = below[-1], above[0]
    else:
        (m0, t0), (m1, t1) = known[:2] if not below else known[-2:]
    slope = max((t1 - t0) / (m1 - m0), 0.0)
    return max(t0 + slope * (n - m0), 1e-9)


def _draft_time(table: dict[tuple[int, int], float], batch: int, k: int) -> float | None:
    """t_draft of a drafting pass proposing k tokens for each of `batch` rows from {(batch, k):
    seconds}: the value there; else from the lengths timed at this batch size (a least-squares
    line over k, a fixed cost per drafting pass plus a cost per token, when two or more were
    timed: a draft model whose weights the target's pass pushed out of the cache pays more for
    its first token; else proportional to k); else linear in the batch size between the nearest
    sizes timed (and proportional to it beyond them). None if empty."""
    if (batch, k) in table:
        return table[(batch, k)]
    sizes = sorted({b for b, _ in table})
    if not sizes:
        return None
    if batch in sizes:
        return _line([(j, t) for (b, j), t in sorted(table.items()) if b == batch], k)
    below, above = [b for b in sizes if b < batch], [b for b in sizes if b > batch]
    if below and above:
        b0, b1 = below[-1], above[0]
        t0, t1 = _draft_time(table, b0, k), _draft_time(table, b1, k)
        return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
    b = below[-1] if below else above[0]
    return _draft_time(table, b, k) * batch / b


def _line(points: list[tuple[int, float]], k: int) -> float:
    """t(k) from (k, seconds) points: a least-squares line (fixed + slope * k) through two or
    more when both parts come out non-negative, else proportional to k."""
    per_token = sum(t for _, t in points) / sum(j for j, _ in points)
    if len(points) < 2:
        return per_token * k
    fixed, slope = _least_squares(points)
    return fixed + slope * k if slope > 0 and fixed >= 0 else per_token * k
