"""`SplitLength`: `--k auto` for a combined draft (drafters/combined.py), one `AdaptiveLength` per kind of pass.

A combined draft makes two kinds of drafting pass: the model's (it proposes k for the rows that do not take the
lookup's tokens, which are cut to k), and the lookup's alone (every row took the lookup's tokens: no model runs,
and each row proposes as far as its lookup stands behind it). They differ in cost (no draft time) and in what
acceptance means (a one-hot q: p of the lookup's token), so one policy measuring both at once chose a length right
for neither. Here the model's arm chooses k from the model's passes, and the lookup's arm chooses how far a pass by
lookup alone may go (`CombinedDrafter.alone_k`; 0: such a pass is a plain one) from the lookup's passes; both see
the plain passes. Which kind a pass is stays the drafter's gate's choice, per row, from what was committed before
the pass: like every policy this one changes how many tokens are proposed, never which are committed.

The lookup's arm lives on the model's policy (`AdaptiveLength.lookup_arm`), so that a policy kept over several
batches (a process's, a benchmark's round) keeps what both arms measured.
"""

from __future__ import annotations

from .adaptive import AdaptiveLength


class SplitLength:
    """The policy of a batch whose drafter has `alone_k` and `kind` (CombinedDrafter) under `--k auto`."""

    def __init__(self, model: AdaptiveLength, drafter):
        self.model, self.lookup, self.drafter = model, model.lookup_arm(), drafter
        self.k_max = model.k_max  # both arms share it

    def choose(self, batch: int = 1) -> int:
        self.drafter.alone_k = self.lookup.choose(batch)
        return self.model.choose(batch)

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
        kind = self.drafter.kind
        if kind == "lookup":
            lookup_cap = self.drafter.alone_k if self.drafter.alone_k is not None else cap
            self.lookup.observe(k, beta_sums, verified, draft_s, target_s, batch, lookup_cap, 0.0, committed, texts)
        elif kind == "model":
            self.model.observe(k, beta_sums, verified, draft_s, target_s, batch, cap, joined_s, committed, texts)
        else:  # a plain pass: what k = 0 costs, for both
            for arm, joined in ((self.model, joined_s), (self.lookup, 0.0)):
                arm.observe(0, [], [], draft_s, target_s, batch, 0, joined, committed, texts)

    def seed_costs(self, target: dict[int, float], draft: dict[tuple[int, int], float]) -> None:
        """A calibration (profile.calibrate): the lookup's arm takes its target passes and no draft time."""
        self.model.seed_costs(target, draft)
        self.lookup.seed_costs(target, {})


def split_for(policy, drafter):
    """`policy` as a batch with `drafter` runs it: a SplitLength where an AdaptiveLength meets a combined draft."""
    if isinstance(policy, AdaptiveLength) and hasattr(drafter, "alone_k") and hasattr(drafter, "kind"):
        return SplitLength(policy, drafter)
    return policy
