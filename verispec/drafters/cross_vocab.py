"""A draft model with its own tokenizer: token-level intersection (Timor et al., ICML 2025).

Owns `TokenIntersection` (the draft ids whose exact bytes are also a target token, each mapped
to that target id), `intersect` (build it from two `TokenText`s), `TokenIntersectionDrafter`
and `intersection_mass` (the share of the draft's probability the intersection holds on some
prompts: how much of the draft is usable).

The rule that matches tokens: a normal draft token maps to the normal target token of the same
bytes (the lowest such id where the target has several); a special token maps to the target's
special token of the same text. Nothing else is in the intersection.

The drafter proposes intersection tokens only. Its q at a position is the draft's processed
distribution (the row's own temperature, top-k, top-p, min-p: `RowSampling.process`) restricted
to the intersection and renormalised, as a dense float32 distribution over the target's ids, and
each proposal is drawn from exactly that q with the row's own stream (`RowSampling.draw`), so
the accept-reject rule (both modes) stays exact unchanged. At temperature 0 the proposal is the
draft's most likely intersection token. Where a row's restricted mass is zero (the processed
draft puts no mass on the intersection) the row proposes its most likely intersection token
with q one-hot there: a proposal the rule verifies exactly, like any other.

The draft reads the committed text re-encoded by its own tokenizer (`DraftText`), incrementally:
only a tail after a stable anchor is re-encoded after each commit; the draft cache is rolled back
to the longest common prefix with what it holds and the rest is fed. The context changes what
the draft proposes, never exactness. Knows nothing of requests or the target's model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.rows import prefill_rows
from ..models.token_text import TokenText
from ..sampling import RowSampling
from .base import OwnModel
from .draft_text import DraftText


@dataclass(frozen=True)
class TokenIntersection:
    """draft_ids [N] -> target_ids [N] (long; a target id may appear more than once where two
    draft tokens share its bytes); `to_draft` [V_target] long: a draft id of each target id in
    the intersection, -1 elsewhere; `draft_size` the draft tokens with any text."""

    draft_ids: torch.Tensor
    target_ids: torch.Tensor
    to_draft: torch.Tensor
    draft_size: int

    def __len__(self) -> int:
        return int(self.draft_ids.numel())

    def to(self, device: torch.device | str) -> TokenIntersection:
        return TokenIntersection(
            self.draft_ids.to(device), self.target_ids.to(device), self.to_draft.to(device), self.draft_size
        )


def intersect(target: TokenText, draft: TokenText, target_size: int | None = None) -> TokenIntersection:
    """The token-level intersection of two tokenizers (module docstring: the rule). ValueError
    when they share no token."""
    target_size = len(target) if target_size is None else target_size
    lookup: dict[tuple[bool, bytes], int] = {}
    for i, piece in enumerate(target.pieces[:target_size]):
        if piece:  # a token with no text (None or b"") never matches
            lookup.setdefault((i in target.special, piece), i)
    pairs = [
        (d, lookup[(d in draft.special, piece)])
        for d, piece in enumerate(draft.pieces)
        if piece and (d in draft.special, piece) in lookup
    ]
    if not pairs:
        raise ValueError("the draft's tokenizer shares no token with the target's: no token-level intersection")
    draft_ids = torch.tensor([d for d, _ in pairs], dtype=torch.long)
    target_ids = torch.tensor([t for _, t in pairs], dtype=torch.long)
    to_draft = torch.full((target_size,), -1, dtype=torch.long)
    to_draft[target_ids.flip(0)] = draft_ids.flip(0)  # the lowest draft id of each target id
    return TokenIntersection(draft_ids, target_ids, to_draft, sum(1 for p in draft.pieces if p))


def restricted_q(
    logits: torch.Tensor, sampling: RowSampling, inter: TokenIntersection, target_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [B, V_target] float32, best [B] target ids) from the draft's logits [B, V_draft]: each
    row's processed draft distribution restricted to the intersection and renormalised; one-hot
    at `best` (the most likely intersection token) for rows at temperature 0 and rows whose
    restricted mass is zero."""
    logits = logits.float()
    best = inter.target_ids[logits[:, inter.draft_ids].argmax(dim=-1)]  # [B]
    onehot = torch.zeros(logits.shape[0], target_size, device=logits.device).scatter_(1, best[:, None], 1.0)
    if sampling.greedy:
        return onehot, best
    probs = sampling.process(logits[:, None])[:, 0]  # [B, V_draft]
    restricted = torch.zeros_like(onehot).index_add_(1, inter.target_ids, probs[:, inter.draft_ids])  # [B, V_target]
    mass = restricted.sum(dim=-1, keepdim=True)  # [B, 1]
    fixed = mass == 0
    greedy = sampling.rows("greedy")
    if greedy:
        fixed[torch.tensor(greedy, device=logits.device)] = True
    return torch.where(fixed, onehot, restricted / mass.clamp_min(torch.finfo(torch.float32).tiny)), best


class TokenIntersectionDrafter:
    """Drafts target tokens with a causal LM over another vocabulary (module docstring).

    `model`: the draft (`forward(input_ids, cache)` -> logits over its own ids, `new_cache`);
    `draft_text` / `target_text`: the two tokenizers as bytes; `confidence_threshold` as in
    ModelDrafter (stop after a position where every running row's top q is below it)."""

    def __init__(
        self,
        model,
        draft_text: TokenText,
        target_text: TokenText,
        target_size: int,
        confidence_threshold: float = 0.0,
    ):
        if not 0.0 <= confidence_threshold < 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1), got {confidence_threshold}")
        self.model, self.target_size = model, target_size
        self.draft_text, self.target_text = draft_text, target_text
        self.intersection = intersect(target_text, draft_text, target_size).to(model.device)
        self.confidence_threshold = confidence_threshold
        self.cache = None

    @property
    def vocab_size(self) -> int:
        return self.target_size

    def mode_line(self, texts: list[str] | None = None) -> str:
        """Which mode the pair runs in, in words; with `texts`, the intersection's share of the
        draft's probability on them (`intersection_mass`)."""
        inter = self.intersection
        line = f"token-level intersection: {len(inter)} of {inter.draft_size} draft tokens"
        if texts:
            share = intersection_mass(self.model, self.draft_text, inter, texts)
            line += f", share of the draft's probability mass {share:.3f} on the prompts"
        return line

    def proposable(self, prompts: list[list[int]]) -> float:
        """The share of the prompts' tokens (target ids) that this draft can propose (in the intersection): where the
        target writes text as it tokenized the prompts, about the most the draft's acceptance can reach."""
        ids = torch.tensor([token for prompt in prompts for token in prompt], dtype=torch.long)
        return float((self.intersection.to_draft.cpu()[ids] >= 0).float().mean()) if len(ids) else 1.0

    @torch.no_grad()
    def chain(self, context: list[int], k: int, sampling: RowSampling) -> tuple[list[int], torch.Tensor]:
        """Along the most likely proposals after `context` (target ids): (proposals [k] target
        ids, q [k, V_target] each restricted q), for `check`'s per-position verification."""
        self.start([context], len(context) + k + 2)
        logits, proposals, q = self._read(), [], []
        for i in range(k):
            if i > 0:
                fed = self.intersection.to_draft[proposals[-1]].view(1, 1)
                logits = self.model(fed.to(self.model.device), self.cache)
            q.append(restricted_q(logits[:, -1], sampling, self.intersection, self.target_size)[0][0])
            proposals.append(int(q[-1].argmax()))
        return proposals, torch.stack(q)

    def own_model(self) -> OwnModel | None:
        """None: the proposals are not the draft model's own ids (drafters/base.py)."""
        return None

    @property
    def can_change_rows(self) -> bool:
        return hasattr(self.cache, "keep_rows")

    def start(self, prompts: list[list[int]], max_length: int) -> None:
        """Each prompt is re-encoded by the draft's tokenizer; the draft reads it at the first proposal."""
        self._capacity = 2 * max_length + 64  # draft tokens per row; a longer context keeps its last part
        self.cache = self.model.new_cache(len(prompts), self._capacity)
        self.rows = [self._text(p) for p in prompts]
        self.cached: list[list[int]] = [[] for _ in prompts]  # per row: the draft ids the cache holds
        self._live = [True] * len(prompts)
        self._k, self._k_max = 0, 16  # _k_max: room kept in the cache for a draft

    def _text(self, prompt: list[int]) -> DraftText:
        return DraftText(self.target_text, self.draft_text, self.intersection.to_draft.tolist(), prompt)

    def keep_rows(self, rows: list[int]) -> None:
        self.cache.keep_rows(rows)
        self.rows = [self.rows[r] for r in rows]
        self.cached = [self.cached[r] for r in rows]
        self._live = [self._live[r] for r in rows]

    def add_rows(self, prompts: list[list[int]], views: list | None = None) -> None:
        """New requests after the other rows: read at the next proposal (views are never given:
        reserve_row offers none, since a staged prompt's target ids mean nothing to this draft)."""
        self.cache.add_rows(len(prompts))
        self.rows += [self._text(p) for p in prompts]
        self.cached += [[] for _ in prompts]
        self._live += [True] * len(prompts)

    def reserve_row(self):
        return None

    def prefill(self) -> None:
        """Read the prompts now (all but their last draft tokens)."""
        self._feed_long_rows()

    def _context(self, row: int) -> list[int]:
        """The draft ids row `row` should condition on: its re-encoded text (at least one id),
        its last part where it would not fit the cache with room for a draft."""
        ids = self.rows[row].ids or [0]  # no text yet: a placeholder token to read
        return ids[-(self._capacity // 2) :] if len(ids) + 2 * self._k_max > self._capacity else ids

    def _feed_long_rows(self) -> None:
        """Rows whose cache holds nothing of their context (new or moved): prefill all but the last id."""
        rows = [b for b in range(len(self.rows)) if not _common(self.cached[b], self._context(b))]
        if rows:
            bodies = [self._context(b)[:-1] for b in rows]
            prefill_rows(self.model, self.cache, rows, bodies)
            for b, body in zip(rows, bodies):
                self.cached[b] = list(body)

    def _read(self) -> torch.Tensor:
        """Bring every row's cache to its context but the last id, then feed the rest; logits
        [B, 1, V_draft] after each row's whole context."""
        self._feed_long_rows()
        keep, rest = [], []
        for b in range(len(self.rows)):
            context = self._context(b)
            common = min(_common(self.cached[b], context), len(context) - 1)
            keep.append(common)
            rest.append(context[common:])
        self.cache.rollback(keep)
        width = max(len(r) for r in rest)
        ids = torch.zeros(len(rest), width, dtype=torch.long, device=self.model.device)  # [B, W]
        for b, r in enumerate(rest):
            ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        last = torch.tensor([len(r) - 1 for r in rest], device=ids.device)  # [B]
        logits = self.model(ids, self.cache)[torch.arange(len(rest), device=ids.device), last][:, None]
        self.cache.rollback([c + len(r) for c, r in zip(keep, rest)])
        self.cached = [self.cached[b][: keep[b]] + rest[b] for b in range(len(rest))]
        return logits

    @torch.no_grad()
    def propose(self, k: int, sampling: RowSampling) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.cache is not None, "start() first"
        batch, device = len(self.rows), self.model.device
        self._k, self._k_max = k, max(k, self._k_max)
        if k == 0:
            return torch.zeros(batch, 0, dtype=torch.long, device=device), torch.zeros(batch, 0, self.target_size)
        self._start = [len(c) for c in self.cached]
        logits = self._read()  # [B, 1, V_draft]
        self._start = [len(c) for c in self.cached]
        positions = torch.tensor([len(r.history) for r in self.rows], device=device)  # [B] next target position
        live = torch.tensor(self._live, device=device)
        token_ids, probs, fed = [], [], []
        keep_probs = bool(sampling.rows("rejection"))
        for i in range(k):
            if i > 0:
                fed.append(self.intersection.to_draft[token_ids[-1]])  # [B] draft ids of the last proposals
                logits = self.model(fed[-1][:, None], self.cache)
            q, best = restricted_q(logits[:, -1], sampling, self.intersection, self.target_size)  # [B, V_t], [B]
            token_ids.append(best if sampling.greedy else sampling.draw(q[:, None], positions[:, None] + i)[:, 0])
            if keep_probs:
                probs.append(q)
            if self.confidence_threshold and bool((q.amax(dim=-1)[live] < self.confidence_threshold).all()):
                break
        self._proposals = torch.stack(token_ids, dim=1)  # [B, k'] target ids
        self._k = self._proposals.shape[1]
        fed_ids = torch.stack(fed, dim=1).tolist() if fed[: self._k - 1] else [[] for _ in range(batch)]
        self.cached = [c + f[: self._k - 1] for c, f in zip(self.cached, fed_ids)]
        return self._proposals, (torch.stack(probs, dim=1) if probs else None)  # [B, k'], [B, k', V_t]

    def commit(self, num_accepted: list[int], next_token_ids: torch.Tensor, active: list[bool]) -> None:
        assert self.cache is not None
        self._live = list(active)
        nexts = next_token_ids.tolist()
        proposals = self._proposals.tolist() if self._k else [[] for _ in active]
        lengths = self.cache.host_lengths
        for b, (n, live) in enumerate(zip(num_accepted, active)):
            if live:
                self.rows[b].extend(proposals[b][:n] + [nexts[b]])
            elif self._k:  # as before the proposal: what it fed is taken back
                lengths[b] = min(lengths[b], self._start[b])
                self.cached[b] = self.cached[b][: lengths[b]]
        self.cache.rollback(lengths)


def _common(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@torch.no_grad()
def intersection_mass(model, draft_text: TokenText, inter: TokenIntersection, texts: list[str]) -> float:
    """Mean share of the draft's probability (temperature 1) on intersection tokens, over every
    position of `texts` encoded by the draft's tokenizer: how much of the draft can be used."""
    shares = []
    for text in texts:
        ids = draft_text.encode(text)[:512]
        if not ids:
            continue
        cache = model.new_cache(1, len(ids) + 1)
        probs = torch.softmax(model(torch.tensor([ids], device=model.device), cache)[0].float(), dim=-1)  # [T, V]
        shares.append(probs[:, inter.draft_ids.to(probs.device)].sum(dim=-1))
    if not shares:
        raise ValueError("no prompt text to measure the intersection's share of the draft's probability on")
    return float(torch.cat(shares).mean())


PROPOSABLE_FLOOR = 0.5  # a draft of another tokenizer that can propose less of the prompts' tokens is said not to pay


def cannot_pay(drafter, prompts: list[list[int]], spec: str) -> str | None:
    """A line, before decoding, where a token-level intersection draft can propose less than PROPOSABLE_FLOOR of the
    prompts' tokens as the target tokenizes them (its acceptance is at most about that share)."""
    share = drafter.proposable(prompts) if type(drafter) is TokenIntersectionDrafter else 1.0  # not string-level
    if share >= PROPOSABLE_FLOOR:
        return None
    return (
        f"--draft {spec}: it can propose only {share:.0%} of the prompt's tokens as the target tokenizes them, so it "
        "accepts at most about that: likely slower than plain decoding (`verispec plan` measures it; "
        "--draft suffix needs no model)"
    )
