"""Two drafters as one (`--draft A+B`): a lookup's proposal where it is confident and has been right, a model's
elsewhere.

Per pass and per row (`choose`): a row takes the lookup's tokens where the lookup is confident (`lookup.confident(k)`:
the tokens and, per row, how many of them the lookup stands behind) and its gate (`LookupGate`) says the lookup's first
tokens have been accepted at least as often as the model's. When every running row takes them the pass drafts by lookup
alone and the model does not run (its pending tokens pile up, as on a plain pass, and are read at its next proposal).
Otherwise the model proposes for every row (its confidence stop counting only the rows that take its tokens), and each
row that takes the lookup's tokens has them instead, cut or padded to the model's width.

Exactness: a lookup's tokens are deterministic, so their q is one-hot. A pass by lookup alone declares
`draft_probs = None`, as the lookup does; a mixed pass declares the model's q where a row took the model's
tokens and a one-hot q where it took the lookup's (or None where the model declared None: one-hot at every
proposal). Either way each proposal's declared q is exactly what it was drawn from, so the rule stays exact; the
choice depends on what was committed before the pass, never on the pass's own draws.

Commit: the lookup appends what each row committed. The model learns it as pending tokens: on a pass by
lookup alone all of it; on a mixed pass a row that took the lookup's tokens tells the model that none of its
own proposals were accepted and that the first committed token followed, then appends the rest. On llama.cpp's
compiled step (llamacpp/step.py), which keeps the model's state itself, `choose` and `commit_lookup` are all it asks.
Knows nothing of vocabularies or sampling settings beyond what the two drafters declare.
"""

from __future__ import annotations

import torch

from ..sampling import RowSampling


class LookupGate:
    """Per row: whether a confident lookup's proposal goes before the model's, from each drafter's measured acceptance
    of its first token. Every pass where the lookup had a first token x_L for a row counts a lookup trial, a hit when
    the row's first committed token is x_L: that token is distributed as the target's p whichever drafter proposed
    (the rule is exact), so the hit rate estimates p(x_L), the acceptance x_L would have had, without bias. Every
    pass where the model proposed for the row counts a model trial, a hit when its first proposal was accepted
    (probability sum min(p, q)). The lookup goes first while its rate is at least the model's (a tie: the lookup,
    which runs no model). Priors: the lookup 1 hit in 1 trial (trusted until it misses), the model 1 in 2. Per row
    and from its own history only, so that a seeded request's choices do not depend on the other requests."""

    LOOKUP_PRIOR = (1.0, 1.0)  # (hits, trials)
    MODEL_PRIOR = (1.0, 2.0)

    def __init__(self):
        self.lookup: list[list[float]] = []  # per row [hits, trials]
        self.model: list[list[float]] = []

    def add_rows(self, count: int) -> None:
        self.lookup += [list(self.LOOKUP_PRIOR) for _ in range(count)]
        self.model += [list(self.MODEL_PRIOR) for _ in range(count)]

    def keep_rows(self, rows: list[int]) -> None:
        self.lookup, self.model = [self.lookup[r] for r in rows], [self.model[r] for r in rows]

    def prefers_lookup(self, row: int) -> bool:
        (lookup_hits, lookup_trials), (model_hits, model_trials) = self.lookup[row], self.model[row]
        return lookup_hits * model_trials >= model_hits * lookup_trials  # lookup rate >= model rate

    def observe(self, row: int, lookup: float | None, model: float | None) -> None:
        """Row `row`'s pass: a trial of the lookup (None: it had no first token) and of the model (None: it did
        not propose for this row), each a hit (1), a miss (0) or, in plan's replay, the hit's probability."""
        for counts, hit in ((self.lookup[row], lookup), (self.model[row], model)):
            if hit is not None:
                counts[0] += hit
                counts[1] += 1


class CombinedDrafter:
    """lookup: a model-free drafter with `confident(k)` (drafters/ngram.py, drafters/suffix.py); model: a
    ModelDrafter (kept as `drafter`). Rows join and leave both."""

    def __init__(self, lookup, model):
        if not hasattr(lookup, "confident"):
            raise ValueError(f"{type(lookup).__name__} cannot lead a combined draft: it has no confident(k)")
        self.lookup, self.drafter = lookup, model  # drafter: the ModelDrafter
        self.lookup_passes = self.mixed_passes = 0  # for reports: how the passes drafted
        self._proposal: torch.Tensor | None = None  # [B, k'] what this pass proposed
        self._took_lookup: list[bool] = []  # per row: this pass proposed the lookup's tokens
        self._live: list[bool] = []  # per row: still generating (rows that finished in a fixed batch are not)
        self._candidates: list[int | None] = []  # per row: the lookup's first token this pass (None: none)
        self.gate = LookupGate()
        self.alone_k: int | None = None  # how far a pass by lookup alone may go (None: the pass's k; policy/split.py)
        self.kind = "plain"  # the last pass: "plain", "lookup" (by lookup alone) or "model" (the model proposed)

    @property
    def _model_ran(self) -> bool:
        """Whether the model ran on the last pass (every pass but one by lookup alone; `choose` set `kind`)."""
        return self.kind != "lookup"

    def clear_corpus(self) -> None:
        """Forget earlier requests: the lookup's corpus, where it keeps one (suffix drafting)."""
        if hasattr(self.lookup, "clear_corpus"):
            self.lookup.clear_corpus()

    @property
    def model(self):
        """The draft network (as ModelDrafter.model): what a cost profile or a kernel calibration times."""
        return self.drafter.model

    # ---- rows (engine.Batch), forwarded to both

    def start(self, prompts: list[list[int]], max_length: int) -> None:
        self.lookup.start(prompts, max_length)
        self.drafter.start(prompts, max_length)
        self._live = [True] * len(prompts)
        self.gate = LookupGate()
        self.gate.add_rows(len(prompts))
        self.alone_k, self.kind = None, "plain"  # a new batch: its policy sets alone_k, if it is a SplitLength

    @property
    def can_change_rows(self) -> bool:
        return bool(self.lookup.can_change_rows and self.drafter.can_change_rows)

    def keep_rows(self, rows: list[int]) -> None:
        self.lookup.keep_rows(rows)
        self.drafter.keep_rows(rows)
        self._live = [self._live[r] for r in rows]
        self.gate.keep_rows(rows)

    def reserve_row(self):
        return self.drafter.reserve_row()

    def release_row(self, view) -> None:
        self.drafter.release_row(view)

    def add_rows(self, prompts: list[list[int]], views: list | None = None) -> None:
        self.lookup.add_rows(prompts)
        self.drafter.add_rows(prompts, views)
        self._live += [True] * len(prompts)
        self.gate.add_rows(len(prompts))

    @property
    def joined_unread(self) -> int:
        return self.drafter.joined_unread

    def read_joined(self) -> None:
        self.drafter.read_joined()

    def history(self, row: int) -> list[int]:
        return self.lookup.history(row)

    # ---- a pass

    def choose(self, k: int) -> tuple[torch.Tensor | None, list[bool], bool]:
        """This pass's lookup: its tokens [B, k'] (None: a plain pass), per row whether the pass takes them, and
        whether every running row does (the pass drafts by lookup alone, as far as its longest proposal and
        `alone_k` go, whatever k is; `alone_k` 0: a plain pass instead). Otherwise the model proposes k (0: a
        plain pass) and the rows that take the lookup's tokens have them cut to k. Sets `kind`."""
        batch, live = len(self._live), self._live
        alone_k = k if self.alone_k is None else self.alone_k
        reach = max(k, alone_k)
        self._candidates, self.kind = [None] * batch, "plain"
        if reach == 0:
            return None, [False] * batch, False
        tokens, lengths = self.lookup.confident(reach)  # [B, reach], [B]
        firsts = tokens[:, 0].tolist()
        self._candidates = [first if n > 0 and on else None for first, n, on in zip(firsts, lengths, live)]
        took = [c is not None and self.gate.prefers_lookup(row) for row, c in enumerate(self._candidates)]
        if any(live) and all(t for t, on in zip(took, live) if on):  # by lookup alone
            width = min(max(lengths), alone_k)
            if width == 0:
                return None, [False] * batch, False
            self.kind = "lookup"
            return tokens[:, :width], [True] * batch, True
        if k == 0:
            return None, [False] * batch, False
        self.kind = "model"
        return tokens[:, :k], took, False

    @torch.no_grad()
    def propose(self, k: int, sampling: RowSampling) -> tuple[torch.Tensor, torch.Tensor | None]:
        """draft_token_ids [B, k'] and draft_probs [B, k', V] or None (drafters/base.py)."""
        tokens, took, alone = self.choose(k)  # [B, k] or [B, k'] or None, [B]
        if tokens is None:  # a plain pass: the model reads nothing new
            k = 0
        if alone:
            self._proposal, self._took_lookup = tokens, took
            self.lookup_passes += 1
            self.drafter.propose(0, sampling)  # no model pass: its pending tokens wait
            self.lookup.take(self._proposal)
            return self._proposal, None
        counted = torch.tensor([not t for t in took], dtype=torch.bool)  # the confidence stop: the model's rows
        proposal, probs = self.drafter.propose(k, sampling, counted)  # [B, k'], [B, k', V] or None
        width = proposal.shape[1]
        self._took_lookup = [t and width > 0 for t in took]
        if any(self._took_lookup):
            self.mixed_passes += 1
            taken = torch.tensor(self._took_lookup, device=proposal.device)
            proposal = torch.where(taken[:, None], tokens[:, :width].to(proposal.device), proposal)
            if probs is not None:  # one-hot q where the lookup's tokens were taken
                one_hot = torch.nn.functional.one_hot(proposal, probs.shape[-1]).to(probs.dtype)
                probs = torch.where(taken[:, None, None], one_hot, probs)
        self._proposal = proposal
        self.lookup.take(proposal)
        return proposal, probs

    def commit(self, num_accepted: list[int], next_token_ids: torch.Tensor, active: list[bool]) -> None:
        """Both drafters learn what each row committed: its accepted proposals, then next_token_ids [B]."""
        committed = self._learn(num_accepted, next_token_ids, active)
        if not self._model_ran:
            self.drafter.append_pending([tokens[:-1] for tokens in committed])
            self.drafter.commit(num_accepted, next_token_ids, active)
            return
        took = [t and on for t, on in zip(self._took_lookup, active)]
        own_accepted = [0 if t else n for t, n in zip(took, num_accepted)]
        first = torch.tensor(
            [tokens[0] if t else int(next_token_ids[row]) for row, (t, tokens) in enumerate(zip(took, committed))],
            dtype=torch.long,
            device=next_token_ids.device,
        )  # [B]: a row that took the lookup's tokens: none of the model's were accepted, the first committed followed
        self.drafter.commit(own_accepted, first, active)
        self.drafter.append_pending([tokens[1:] if t else [] for t, tokens in zip(took, committed)])

    def commit_lookup(
        self,
        proposal: torch.Tensor,
        took: list[bool],
        num_accepted: list[int],
        next_token_ids: torch.Tensor,
        active: list[bool],
    ) -> None:
        """On a compiled step, which keeps the model's state itself: the pass proposed `proposal` [B, k'] (the
        lookup's tokens where `took`, as `choose` said), and row b committed num_accepted[b] of them, then
        next_token_ids[b] [B]. The lookup and the gate learn it."""
        self._proposal, self._took_lookup = proposal, took
        if not self._model_ran:
            self.lookup_passes += 1
        elif any(t and on for t, on in zip(took, self._live)):
            self.mixed_passes += 1
        self.lookup.take(proposal)
        self._learn(num_accepted, next_token_ids, active)

    def _learn(self, num_accepted: list[int], next_token_ids: torch.Tensor, active: list[bool]) -> list[list[int]]:
        """The lookup appends what each running row committed, and the gate sees the pass (its first committed
        token against the lookup's first, and the model's first proposal's fate where the model proposed for the
        row). Returns the committed tokens per row ([] where a row did not run)."""
        self.lookup.commit(num_accepted, next_token_ids, active)
        width = self._proposal.shape[1]
        committed = [
            self._proposal[row, :n].tolist() + [int(next_token_ids[row])] if on else []
            for row, (n, on) in enumerate(zip(num_accepted, active))
        ]
        for row, (candidate, tokens, n) in enumerate(zip(self._candidates, committed, num_accepted)):
            if tokens:
                own = self._model_ran and width > 0 and not self._took_lookup[row]
                hit = None if candidate is None else float(candidate == tokens[0])
                self.gate.observe(row, hit, float(n > 0) if own else None)
        self._live = list(active)
        return committed
