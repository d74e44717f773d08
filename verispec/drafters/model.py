"""A separate small draft model with its own KV cache.

Owns the draft model's cache and its "pending" tokens: committed tokens the draft model
has not consumed yet, fed together at the next proposal. At the start the whole prompt is
pending (the prefill is deferred to the first proposal, and never happens if no proposal is
ever asked for). After a step with a rejection only
the recovered token is pending; after a step where all k proposals were accepted, the last
proposal x_k was never fed to the draft model, so x_k and the bonus token are both pending
(forgetting x_k is the bug that lowered acceptance in vLLM PR #9730). A step with k = 0
runs no draft pass at all: its committed token joins the pending ones, so a policy that
stops speculating pays nothing for the draft. Rows that join a running batch (`add_rows`) are
read the same way: their prompts wait, unread, until the first proposal with k >= 1
(`read_joined`), so a server whose policy decodes plain at a large batch never pays the
draft's prefill for its joins. At temperature 0 a model that offers
`greedy_continuation` (llama.cpp's) drafts the k tokens in one call: the same tokens, without
a logits tensor between its passes.
"""

from __future__ import annotations

import torch

from ..models.llama import KVCache
from ..models.rows import prefill_rows
from ..proposal import ProposalTemperature, acceptance_grid, sharpen, verified_positions
from ..sampling import RowSampling
from .base import OwnModel


class ModelDrafter:
    """Drafts k tokens autoregressively with a causal LM (`forward(input_ids, cache)` -> logits).

    `confidence_threshold` (0 = off): stop drafting after a position where the draft's most
    likely token has probability below it in every row, so that a step proposes fewer than k
    tokens where the draft is unsure (`transformers`' assistant_confidence_threshold, llama.cpp's
    --draft-p-min); rows that are done do not count. The decision uses only the draft's own
    distributions, so the rule stays exact.

    `draft_temperature` (None: auto): rows sampled by the rejection rule propose from q sharpened
    by a proposal temperature tau (proposal.py), fixed, or chosen per row by the acceptance every
    tau of the grid would have had at the verified positions (`observe_target`).
    """

    def __init__(
        self, model: torch.nn.Module, confidence_threshold: float = 0.0, draft_temperature: float | None = None
    ):
        if not 0.0 <= confidence_threshold < 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1), got {confidence_threshold}")
        self.model = model
        self.confidence_threshold = confidence_threshold
        self.proposal = ProposalTemperature(draft_temperature)
        self.cache: KVCache | None = None
        self._base_probs: torch.Tensor | None = None  # [B, k, V] q before sharpening (auto: for observe_target)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def start(self, prompts: list[list[int]], max_length: int) -> None:
        """The prompts become pending tokens: unless `prefill()` is called now, the draft model
        reads them in its first proposal, so a policy that never speculates never pays for the
        draft's prefill either."""
        device = self.model.device
        self.cache = self.model.new_cache(len(prompts), max_length)
        self._prompts = prompts
        longest = max(len(p) for p in prompts)
        self.pending = torch.tensor(
            [list(p) + [0] * (longest - len(p)) for p in prompts], dtype=torch.long, device=device
        )  # [B, P]
        self.pending_count = [len(p) for p in prompts]
        self.proposal.start(len(prompts))
        self._live = torch.ones(len(prompts), dtype=torch.bool, device=device)  # [B] rows still generating
        self._unread: list[list[int] | None] = [None] * len(
            prompts
        )  # per row: a joined prompt's body the cache has not read (add_rows)

    def own_model(self) -> OwnModel | None:
        """The draft model, its cache and pending tokens, for a target that runs whole iterations
        itself (drafters/base.py); None before `start` and for a subclass, whose proposals or
        commits may be its own (early exit reads the target's cache)."""
        if type(self) is not ModelDrafter or self.cache is None:
            return None
        return OwnModel(
            self.model,
            self.cache,
            self.pending,
            list(self.pending_count),
            self.confidence_threshold,
            self.proposal,
            list(self._unread),
        )

    @property
    def can_change_rows(self) -> bool:
        """Whether rows can leave and join between steps: the draft model's cache must move its rows."""
        return hasattr(self.cache, "keep_rows")

    def keep_rows(self, rows: list[int]) -> None:
        """Rows leave (engine.Batch): only `rows` remain, in that order, each as it stands."""
        assert self.cache is not None, "start() first"
        self.cache.keep_rows(rows)
        index = torch.tensor(rows, dtype=torch.long, device=self.pending.device)
        self.pending, self._live = self.pending.index_select(0, index), self._live.index_select(0, index)
        self.pending_count = [self.pending_count[r] for r in rows]
        self._prompts = [self._prompts[r] for r in rows]
        self._unread = [self._unread[r] for r in rows]
        self.proposal.keep_rows(rows)

    def reserve_row(self):
        """A one-row cache for a prompt read piece by piece before its request joins (the
        server's chunked prefill), or None where the draft's cache cannot (read at add_rows)."""
        return self.cache.reserve_row() if hasattr(self.cache, "reserve_row") else None

    def release_row(self, view) -> None:
        self.cache.release_row(view)

    def add_rows(self, prompts: list[list[int]], views: list | None = None) -> None:
        """New requests after the other rows (engine.Batch): each prompt's last token is pending
        and the rest is read at the first proposal with k >= 1 (`read_joined`), or was read into
        `views` (from reserve_row) already."""
        assert self.cache is not None, "start() first"
        if views is not None and all(v is not None for v in views):
            for view in views:
                self.cache.adopt_row(view)
            self._unread += [None] * len(prompts)
        else:
            self.cache.add_rows(len(prompts))
            self._unread += [list(p[:-1]) for p in prompts]
        new = self.pending.new_zeros(len(prompts), self.pending.shape[1])
        new[:, 0] = torch.tensor([p[-1] for p in prompts], dtype=torch.long, device=new.device)
        self.pending = torch.cat([self.pending, new])
        self.pending_count += [1] * len(prompts)
        self._live = torch.cat([self._live, self._live.new_ones(len(prompts))])
        self._prompts = self._prompts + [list(p) for p in prompts]
        self.proposal.add_rows(len(prompts))

    @property
    def joined_unread(self) -> int:
        """Prompt tokens of joined rows that the draft model has not read yet."""
        return sum(len(body) for body in self._unread if body is not None)

    def read_joined(self) -> None:
        """Read the prompts of rows that joined since the last proposal with k >= 1 (one call
        for all of them; the engine calls it before a drafting pass, timed as prefill)."""
        rows = [row for row, body in enumerate(self._unread) if body is not None]
        if rows:
            prefill_rows(
                self.model, self.cache, rows, [self._unread[row] for row in rows]
            )  # empties each row, then writes
            for row in rows:
                self._unread[row] = None

    def prefill(self) -> None:
        """Read the prompts now (all but their last tokens, which stay pending): the engine calls
        this when it will speculate anyway, so that the prefill is timed as prefill."""
        assert self.cache is not None, "start() first"
        if max(self.cache.host_lengths) == 0 and max(self.pending_count) > 1:
            self.model.prefill([p[:-1] for p in self._prompts], self.cache)
            self.pending = torch.tensor([[p[-1]] for p in self._prompts], dtype=torch.long, device=self.pending.device)
            self.pending_count = [1] * len(self._prompts)

    @torch.no_grad()
    def propose(
        self, k: int, sampling: RowSampling, counted: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """drafters/base.py's; counted [B] bool: the rows whose confidence decides the stop (default: every live
        row; a combined draft leaves out the rows that take the lookup's tokens, as the compiled step does)."""
        assert self.cache is not None, "start() first"
        batch = self.cache.batch_size
        self._k, self._base_probs = k, None
        if k == 0:  # no pass at all: the pending tokens wait for the next proposal
            return self.pending.new_zeros(batch, 0), torch.zeros(batch, 0, self.vocab_size, device=self.pending.device)
        self.read_joined()
        self._start_lengths = self.cache.host_lengths
        width = max(self.pending_count)
        if sampling.greedy and hasattr(
            self.model, "greedy_continuation"
        ):  # the same tokens as the loop below, in one call
            draft_token_ids = self.model.greedy_continuation(
                self.pending[:, :width],
                self.pending_count,
                k,
                self.cache,
                self.confidence_threshold,
                self._stop_rows(counted).numpy(),
            )  # [B, k]
            self._last_proposal, self._k = draft_token_ids[:, -1], draft_token_ids.shape[1]
            return draft_token_ids, None
        logits = self._last_logits(self.pending[:, :width])  # [B, 1, V]
        if width > 1:  # rows with fewer pending tokens fed pads: roll them back
            self.cache.rollback([n + c for n, c in zip(self._start_lengths, self.pending_count)])
        token_ids, probs, base = [], [], []
        keep_probs = bool(sampling.rows("rejection"))  # greedy and invariant rows: q one-hot at the proposal
        taus = self._taus(sampling) if keep_probs else None  # [B] each row's proposal temperature, or None: q
        # Proposal i of row b is at absolute position committed[b] + i, where the target's noise for it is
        # (invariant mode).
        committed = torch.tensor(
            [n + c for n, c in zip(self._start_lengths, self.pending_count)], device=self.pending.device
        )  # [B]
        for i in range(k):
            if i > 0:
                logits = self.model(token_ids[-1][:, None], self.cache)
            if sampling.greedy:  # q is one-hot at the argmax (as process_logits makes it): its token needs no draw
                token_ids.append(logits[:, -1].float().argmax(dim=-1))  # [B]
                top = torch.softmax(logits[:, -1].float(), dim=-1).amax(dim=-1) if self.confidence_threshold else None
            else:  # each row by its own settings: a draw from its own generator, or its invariant choice
                q = sampling.process(logits[:, -1:])  # [B, 1, V]
                proposal = q if taus is None else sharpen(q, taus[:, None])  # [B, 1, V], the distribution drawn from
                token_ids.append(sampling.draw(proposal, committed[:, None] + i)[:, 0])
                if keep_probs:
                    probs.append(proposal[:, 0])
                    base.append(q[:, 0])
                top = q[:, 0].amax(dim=-1) if self.confidence_threshold else None
            if top is not None and bool(
                (top[self._stop_rows(counted)] < self.confidence_threshold).all()
            ):  # rows that are done (or not counted) do not count
                break
        draft_token_ids = torch.stack(token_ids, dim=1)  # [B, k'], k' <= k
        self._last_proposal, self._k = draft_token_ids[:, -1], draft_token_ids.shape[1]
        self._base_probs = torch.stack(base, dim=1) if base and self.proposal.auto else None  # [B, k', V]
        # every row greedy or invariant: q is one-hot at each proposal, which is what draft_probs = None declares
        return draft_token_ids, (torch.stack(probs, dim=1) if probs else None)  # [B, k', V]

    def _stop_rows(self, counted: torch.Tensor | None) -> torch.Tensor:
        """[B] bool: the rows whose confidence decides the stop (the live ones, of those counted)."""
        return self._live if counted is None else self._live & counted.to(self._live.device)

    def _taus(self, sampling: RowSampling) -> torch.Tensor | None:
        """[B] the proposal temperature of each row: its chosen tau where the rejection rule samples it,
        1 (q itself) elsewhere; None where every row proposes from q."""
        chosen = self.proposal.chosen()  # [B]
        rejection = torch.zeros_like(chosen, dtype=torch.bool)
        rejection[sampling.rows("rejection")] = True
        taus = torch.where(rejection, chosen, 1.0)
        return None if bool((taus == 1).all()) else taus.to(self.pending.device)

    def observe_target(
        self,
        target_probs: torch.Tensor,  # [B, k+1, V] p of the pass that verified the last proposal
        num_accepted: torch.Tensor,  # [B]
        rows: list[int],  # the rows sampled by the rejection rule (the others propose from q: nothing to learn)
    ) -> None:
        """Auto proposal temperature: the acceptance each tau would have had at the verified positions."""
        if self._base_probs is None or not rows:
            return
        k = self._base_probs.shape[1]
        verified = verified_positions(num_accepted, k)  # [B, k]
        outside = torch.ones(len(verified), dtype=torch.bool)
        outside[rows] = False
        verified[outside] = False
        self.proposal.observe(acceptance_grid(self._base_probs, target_probs, self.proposal.taus), verified)

    def _last_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed ids [B, W] (row b's real tokens first, then pads); logits [B, 1, V] at each row's
        last real token. A model with `hidden_states`/`logits` (verispec's) computes the head
        for those positions only: the first pass reads a whole prompt."""
        batch, width = ids.shape
        if width == 1:
            return self.model(ids, self.cache)
        rows = torch.arange(batch, device=ids.device)
        last = torch.tensor(self.pending_count, device=ids.device) - 1  # [B]
        if hasattr(self.model, "hidden_states") and hasattr(self.model, "logits"):
            return self.model.logits(self.model.hidden_states(ids, self.cache)[rows, last][:, None])
        return self.model(ids, self.cache)[rows, last][:, None]

    def append_pending(self, tokens: list[list[int]]) -> None:
        """Committed tokens the model did not propose (drafters/combined.py), after each row's pending ones;
        [] leaves a row as it is. Read at the next proposal, as a plain pass's tokens are."""
        if not any(tokens):
            return
        width = max(count + len(new) for count, new in zip(self.pending_count, tokens))
        if width > self.pending.shape[1]:
            more = self.pending.new_zeros(len(tokens), width - self.pending.shape[1])
            self.pending = torch.cat([self.pending, more], dim=1)
        for row, (count, new) in enumerate(zip(self.pending_count, tokens)):
            if new:
                self.pending[row, count : count + len(new)] = torch.tensor(new, dtype=torch.long)
        self.pending_count = [count + len(new) for count, new in zip(self.pending_count, tokens)]

    def commit(self, num_accepted: list[int], next_token_ids: torch.Tensor, active: list[bool]) -> None:
        assert self.cache is not None
        k, batch = self._k, len(active)
        self._live = torch.tensor(active, dtype=torch.bool, device=self._live.device)
        if k == 0:  # nothing was fed: append the committed token to each row's pending tokens
            columns = torch.tensor(self.pending_count, device=self.pending.device)[:, None]
            self.pending = torch.cat([self.pending, self.pending.new_zeros(batch, 1)], dim=1).scatter(
                1, columns, next_token_ids[:, None]
            )
            self.pending_count = [c + 1 if live else c for c, live in zip(self.pending_count, active)]
            return
        # Fed: the pending tokens and x_1..x_{k-1}. Valid: the pending tokens and x_1..x_n.
        all_accepted = [live and n == k for n, live in zip(num_accepted, active)]
        self.cache.rollback(
            [
                start + count + min(n, k - 1) if live else start
                for start, count, n, live in zip(self._start_lengths, self.pending_count, num_accepted, active)
            ]
        )
        # Pending now: the recovered token, or x_k (never fed) and the bonus token.
        two = torch.tensor(all_accepted, device=self.pending.device)
        self.pending = torch.stack(
            [torch.where(two, self._last_proposal, next_token_ids), next_token_ids], dim=1
        )  # [B, 2]
        self.pending_count = [2 if both else 1 for both in all_accepted]
