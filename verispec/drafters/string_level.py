"""A draft model with its own tokenizer, drafting text: string-level proposals (as `transformers`'
universal assisted generation).

Owns `StringLevelDrafter`. At temperature 0 the draft continues the committed text (re-encoded by
its own tokenizer, `DraftText`) with its most likely tokens over its whole vocabulary, k of them;
their bytes, after the bytes of the committed text the draft's ids do not spell yet (an
incomplete character), are encoded by the target's tokenizer, and the first k target ids are the
proposals. A draft token the target lacks (a merge only the draft has) is then still proposed, as
the target's tokens for its text, where token-level intersection (`cross_vocab`) can only propose
intersection tokens. Proposals are deterministic (q one-hot), so verification is exact as for
any drafter; a row whose text gives fewer ids proposes its last id again in the padding, which the
target then rejects or accepts like any proposal. A confidence stop (`--confidence-threshold`) applies to
the intersection's drafts only.

At temperature > 0 it drafts as `TokenIntersectionDrafter` (q restricted to the intersection), whose
acceptance there is sum min(p, q) rather than p(x) of a fixed proposal. Which of the two drafts a
greedy pair better is measured (`verispec plan` and `bench` take both), not assumed.
"""

from __future__ import annotations

import torch

from ..sampling import RowSampling
from .cross_vocab import TokenIntersectionDrafter
from .draft_text import _incomplete_tail


class StringLevelDrafter(TokenIntersectionDrafter):
    """Greedy rows: the draft's own most likely text, re-encoded by the target's tokenizer (module docstring)."""

    def mode_line(self, texts: list[str] | None = None) -> str:
        return "string-level drafting at temperature 0; otherwise " + super().mode_line(texts)

    @torch.no_grad()
    def chain(self, context: list[int], k: int, sampling: RowSampling) -> tuple[list[int], torch.Tensor]:
        """After `context` (target ids): (proposals [k], q [k, V_target]), as the parent's; at temperature 0 the
        string-level proposals, q one-hot at each (for `plan`'s and `check`'s per-position scoring)."""
        if not sampling.greedy:
            return super().chain(context, k, sampling)
        self.start([context], len(context) + k + 2)
        proposals = self.propose(k, sampling)[0][0].tolist()
        proposals += proposals[-1:] * (k - len(proposals))
        return proposals, torch.nn.functional.one_hot(torch.tensor(proposals), self.target_size).float()

    @torch.no_grad()
    def propose(self, k: int, sampling: RowSampling) -> tuple[torch.Tensor, torch.Tensor | None]:
        if k == 0 or not sampling.greedy:
            return super().propose(k, sampling)
        assert self.cache is not None, "start() first"
        self._k, self._k_max = k, max(k, self._k_max)
        self._start = [len(c) for c in self.cached]
        logits = self._read()  # [B, 1, V_draft]
        self._start = [len(c) for c in self.cached]
        drafted = []  # per step [B] draft ids
        for i in range(k):
            if i > 0:
                logits = self.model(drafted[-1][:, None], self.cache)
            drafted.append(logits[:, -1].argmax(dim=-1))
        drafted_ids = torch.stack(drafted, dim=1).tolist()  # [B, k]
        rows = [self._target_ids(b, ids)[:k] or [0] for b, ids in enumerate(drafted_ids)]
        width = max(map(len, rows))
        padded = [r + r[-1:] * (width - len(r)) for r in rows]
        self._proposals = torch.tensor(padded, dtype=torch.long, device=self.model.device)  # [B, k'] target ids
        self._k = width
        self.cached = [c + ids[: k - 1] for c, ids in zip(self.cached, drafted_ids)]
        return self._proposals, None

    def _target_ids(self, row: int, draft_ids: list[int]) -> list[int]:
        """The target's ids for the text the draft continued row `row` with (after the committed bytes
        its ids do not spell yet); an incomplete character at the end is left out."""
        text = b"".join(self.draft_text.pieces[d] or b"" for d in draft_ids if d not in self.draft_text.special)
        held = self.rows[row].held
        if held:
            tail = b"".join(self.target_text.pieces[t] or b"" for t in self.rows[row].history[-4:])[-held:]
            if not text.startswith(tail):
                return []
            text = text[held:]
        text = text[: len(text) - _incomplete_tail(text)]
        return self.target_text.encode(text.decode("utf-8", errors="replace")) if text else []
