"""Two drafters as one (`--draft A+B`): a lookup's proposal where it is confident, a model's elsewhere.

Per pass: when every running row has a confident lookup proposal (`lookup.confident(k)`: the tokens and, per
row, how many of them the lookup stands behind), the pass drafts by lookup alone and the model does not run
(its pending tokens pile up, as on a plain pass, and are read at its next proposal). Otherwise the model
proposes for every row, and each row with a confident lookup proposal takes the lookup's tokens instead,
cut or padded to the model's width.

Exactness: a lookup's tokens are deterministic, so their q is one-hot. A pass by lookup alone declares
`draft_probs = None`, as the lookup does; a mixed pass declares the model's q where a row took the model's
tokens and a one-hot q where it took the lookup's (or None where the model declared None: one-hot at every
proposal). Either way each proposal's declared q is exactly what it was drawn from, so the rule stays exact.

Commit: the lookup appends what each row committed. The model learns it as pending tokens: on a pass by
lookup alone all of it; on a mixed pass a row that took the lookup's tokens tells the model that none of its
own proposals were accepted and that the first committed token followed, then appends the rest.
Knows nothing of vocabularies or sampling settings beyond what the two drafters declare.
"""

from __future__ import annotations

import torch

from ..sampling import RowSampling


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
        self._model_ran = False  # whether the model proposed on this pass
        self._live: list[bool] = []  # per row: still generating (rows that finished in a fixed batch are not)

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

    @property
    def can_change_rows(self) -> bool:
        return bool(self.lookup.can_change_rows and self.drafter.can_change_rows)

    def keep_rows(self, rows: list[int]) -> None:
        self.lookup.keep_rows(rows)
        self.drafter.keep_rows(rows)
        self._live = [self._live[r] for r in rows]

    def reserve_row(self):
        return self.drafter.reserve_row()

    def release_row(self, view) -> None:
        self.drafter.release_row(view)

    def add_rows(self, prompts: list[list[int]], views: list | None = None) -> None:
        self.lookup.add_rows(prompts)
        self.drafter.add_rows(prompts, views)
        self._live += [True] * len(prompts)

    @property
    def joined_unread(self) -> int:
        return self.drafter.joined_unread

    def read_joined(self) -> None:
        self.drafter.read_joined()

    def history(self, row: int) -> list[int]:
        return self.lookup.history(row)

    # ---- a pass

    @torch.no_grad()
    def propose(self, k: int, sampling: RowSampling) -> tuple[torch.Tensor, torch.Tensor | None]:
        """draft_token_ids [B, k'] and draft_probs [B, k', V] or None (drafters/base.py)."""
        batch, live = len(self._live), self._live
        tokens, lengths = self.lookup.confident(k) if k > 0 else (None, [0] * batch)  # [B, k], [B]
        self._model_ran = not (k > 0 and any(live) and all(n > 0 for n, on in zip(lengths, live) if on))
        if not self._model_ran:
            width = max(lengths)
            self._proposal, self._took_lookup = tokens[:, :width], [True] * batch
            self.lookup_passes += 1
            self.drafter.propose(0, sampling)  # no model pass: its pending tokens wait
            self.lookup.take(self._proposal)
            return self._proposal, None
        proposal, probs = self.drafter.propose(k, sampling)  # [B, k'], [B, k', V] or None
        width = proposal.shape[1]
        self._took_lookup = [n > 0 and width > 0 for n in lengths]
        if any(self._took_lookup):
            self.mixed_passes += 1
            took = torch.tensor(self._took_lookup, device=proposal.device)
            proposal = torch.where(took[:, None], tokens[:, :width].to(proposal.device), proposal)
            if probs is not None:  # one-hot q where the lookup's tokens were taken
                one_hot = torch.nn.functional.one_hot(proposal, probs.shape[-1]).to(probs.dtype)
                probs = torch.where(took[:, None, None], one_hot, probs)
        self._proposal = proposal
        self.lookup.take(proposal)
        return proposal, probs

    def commit(self, num_accepted: list[int], next_token_ids: torch.Tensor, active: list[bool]) -> None:
        """Both drafters learn what each row committed: its accepted proposals, then next_token_ids [B]."""
        self.lookup.commit(num_accepted, next_token_ids, active)
        self._live = list(active)
        proposal = self._proposal
        committed = [
            proposal[row, :n].tolist() + [int(next_token_ids[row])] if on else []
            for row, (n, on) in enumerate(zip(num_accepted, active))
        ]
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
