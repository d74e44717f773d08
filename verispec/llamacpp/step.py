"""The speculative iteration on a llama.cpp target and a llama.cpp draft, in one compiled call.

Owns `CompiledStep` (the state of one batch, slot by slot: both models' pending tokens and
lengths, each row's settings and random stream, as arrays the compiled step reads and writes;
rows join and leave between steps, as a server's requests do). llama_step.c (built and loaded by
compiled.py) does what the engine's Python path (step.PythonStep) does with a `ModelDrafter`:
propose, score, the accept-reject rule, both rollbacks, in C against llama.cpp's C API: between
two target passes Python runs cold (the pass streams the weights through the caches), so the
dozen Python and torch steps of an iteration cost a sizeable share of a pass there. At temperature 0 it is
`greedy_continuation`, `forward_argmax` and `rejection.verify_greedy`; at T > 0 it is
`rejection.verify` on p and q processed as `sampling.process_logits` does (top-k, top-p, min-p
included, each row its own), the draft proposing from q sharpened by each row's proposal
temperature (proposal.py), with its own random stream. The Python path stays the reference:
tests compare the two token for token at T = 0, the rule alone on random inputs at T > 0, and
the exactness suite runs the compiled step at T > 0. Knows nothing of drafters but `is_lookup`, the
`DraftSource` protocol below and a combined draft's `choose` / `commit_lookup` (drafters/combined.py), nor of text.
"""

from __future__ import annotations

import ctypes
import sys
import time
from typing import Any, Protocol

import numpy as np
import torch

from ..drafters.base import is_lookup
from .compiled import Sampling, StepArgs, load, sampling_struct, step_status
from .context import LlamaCppCache
from .lib import library, log_tail

__all__ = ["CompiledStep", "DraftModel", "DraftSource", "refusal", "step_status"]

_TOO_MANY_TOKENS = -1
_HEAD_OUT_OF_ORDER = -2


class DraftModel(Protocol):
    """A drafter's own draft model between steps, as `DraftSource.own_model` gives it (drafters.base.OwnModel)."""

    model: Any  # the draft model: the compiled step runs it when its cache is a LlamaCppCache
    cache: Any  # its cache, row b the batch's row b
    pending: torch.Tensor  # [B, P] long: row b's first pending_count[b] tokens are committed, unread by the draft
    pending_count: list[int]
    confidence_threshold: float  # stop drafting once every row's top q is below it (0: off)
    proposal: Any  # proposal.ProposalTemperature: each row's proposal temperature (None: q itself)
    unread: Any  # per row: a joined prompt's body the draft has not read (None: nothing), or None for all


class DraftSource(Protocol):
    """What the compiled step asks of a drafter (drafters.model.ModelDrafter keeps it): its own
    model, or None where its proposals are not a model's own (the step then does not apply).
    Read once, at the start; from then on the step owns that state. A lookup (prompt lookup,
    suffix drafting: a drafter with `confident` and no `own_model`) is not one: it proposes
    before each call, as on the Python path (`propose`, then `commit`), and the call verifies
    its tokens (`given`: q one-hot, the coupled form). A combined draft (`choose`, `commit_lookup`; its model
    drafter kept as `drafter`) does both: per call, the rows it names take the lookup's tokens (`given_rows`)
    and the model drafts for the others."""

    def own_model(self) -> DraftModel | None: ...


def _is_combined(drafter) -> bool:
    """A combined draft (drafters/combined.py): a lookup and a model drafter, chosen per row."""
    return hasattr(drafter, "choose") and hasattr(drafter, "commit_lookup")


def _capacity(cache: LlamaCppCache, draft: DraftModel | None) -> int:
    """Tokens one llama_decode takes in both contexts (the C step fills both batches up to it)."""
    return min(cache.context.n_batch, draft.cache.context.n_batch) if draft is not None else cache.context.n_batch


def refusal(params) -> str | None:
    """Why a row with these SamplingParams cannot run on the compiled step, or None where it can."""
    if params.sampling == "invariant" and not params.greedy:
        return "sampling 'invariant' runs on the Python step only (its coupling is not compiled)"
    return None


class CompiledStep:
    """Both models' state for the compiled step, slot by slot: slot s is llama.cpp sequence s of both
    contexts, and the batch's row r runs in slot cache.seqs[r].

    `maybe(target, cache, drafter, sampling, prompts, k_max)` returns one when it applies (a
    `LlamaCppModel` target; a drafter whose `own_model()` is a llama.cpp model of the same
    vocabulary, or a lookup (`is_lookup`), or no drafter: plain decoding; every row greedy or in
    rejection mode, each with its own temperature, top-k, top-p and min-p (a batch that starts with
    top-p without top-k runs the Python path, whose torch sort of the vocabulary is faster; rows
    that join later may have it); the compiled step loaded; slots*(k_max+1) positions in one
    llama.cpp batch of both contexts). It keeps the engine's step interface (step.PythonStep's):
    `run(k, pending, logprobs)` runs one iteration for the batch's rows, `commit` tells a lookup
    what was committed (a draft model's state is the step's own); rows leave (`keep_rows`, called
    before the caches drop them) and join (`add_rows`, after the caches, the drafter and the
    sampling took them) between steps, as a server's requests do.
    At T > 0 row r draws from its own splitmix64 stream, started where `RowStreams` starts it (so
    a seed gives the same tokens each run, whatever the other rows and whenever it joined; not the
    Python path's tokens, which draw in another order). Row r proposes from q sharpened by the
    draft's `proposal.chosen()[r]`, read before each call; with `--draft-temperature auto` each call
    also hands the proposal the acceptance every tau of its grid would have had at the verified
    positions of its sampled rows (`proposal.observe`), as ModelDrafter.observe_target does on the
    Python path. Log-probabilities are read from the target's logits that the call leaves behind."""

    can_change_rows = True
    refusal = staticmethod(refusal)

    def __init__(self, loaded, target, cache: LlamaCppCache, draft: DraftModel | None, drafter, sampling, k_max: int):
        lib = library()
        slots = cache.context.n_seq
        self._function, self._lib = loaded.verispec_step, lib
        self.target, self.cache, self.drafter, self.sampling, self.k_max = target, cache, drafter, sampling, k_max
        self.draft, self.draft_cache = (draft.model, draft.cache) if draft is not None else (None, None)
        self.capacity = _capacity(cache, draft)
        self._batches = [lib.llama_batch_init(self.capacity, 0, 1) for _ in range(2)]
        width = cache.max_length + 2  # a slot's pending tokens: a whole prompt, then k = 0 steps
        self.draft_pending = np.zeros((slots, width), np.int32)
        self.draft_count = np.ones(slots, np.int32)
        self.draft_length = np.zeros(slots, np.int32)
        self.target_pending = np.zeros(slots, np.int32)
        self.target_length = np.zeros(slots, np.int32)
        self.active = np.zeros(slots, np.uint8)
        self.settings = (Sampling * slots)()  # each slot's struct verispec_sampling
        self.sampled = np.zeros(slots, bool)  # each slot's temperature > 0 (its settings, read from Python)
        self.proposals = np.zeros(slots * max(k_max, 1), np.int32)
        self.lookup = draft is None and is_lookup(drafter)  # the drafter proposes before each call
        self.combined = draft is not None and _is_combined(drafter)  # per call, per row: the lookup's or the model's
        self.given = np.zeros(slots * max(k_max, 1), np.int32)  # [S, k] a lookup's proposals, slot by slot
        self.given_rows = np.zeros(slots, np.uint8)  # a combined draft's: the slots that take them this call
        self._took: list[bool] = []  # a combined draft's: the rows that took the lookup's tokens at the last call
        self._proposed: torch.Tensor | None = None  # [B, k'] the last call's proposals (a combined draft)
        self.output = np.zeros(slots * (k_max + 1), np.int32)
        self.num_accepted = np.zeros(slots, np.int32)
        self.first_at = np.full(slots, -1, np.int32)
        self.seconds = np.zeros(2)
        vocab = target.vocab_size
        self.rng = np.zeros(slots, np.uint64)  # slot s's splitmix64 state: its row's stream key, then as drawn
        self.draft_probs = np.zeros(slots * k_max * vocab, np.float32)  # q of every proposal (sampled rows)
        self.scratch, self.index = np.zeros(4 * vocab, np.float32), np.zeros(3 * vocab + 2, np.int32)
        self.beta = np.zeros(slots * max(k_max, 1), np.float64)
        self.proposal = draft.proposal if draft is not None else None  # ProposalTemperature or None
        self.taus = np.ones(slots, np.float32)  # each slot's proposal temperature, set before each call
        grid = self.proposal.taus if self.proposal is not None and self.proposal.auto else ()
        self.grid_taus = np.asarray(grid, np.float32)
        self.grid = np.zeros(slots * k_max * len(grid), np.float64)  # [S, k, G] the counterfactual acceptance
        self.draft_top = np.zeros(slots * k_max, np.int32)
        self.draft_norms = np.zeros(slots * k_max * (1 + len(grid)), np.float32)
        self._joined: set[int] = set()  # slots whose prompts the draft has not read yet
        context = cache.context
        self._args = StepArgs(
            draft=self.draft_cache.context.ptr if draft is not None else None,
            draft_batch=ctypes.addressof(self._batches[0]),
            target=context.ptr,
            target_batch=ctypes.addressof(self._batches[1]),
            capacity=self.capacity,
            rows=slots,
            active=self.active.ctypes.data,
            k=0,
            p_min=draft.confidence_threshold if draft is not None else 0.0,
            sampling=ctypes.addressof(self.settings),
            rng=self.rng.ctypes.data,
            draft_probs=self.draft_probs.ctypes.data,
            scratch=self.scratch.ctypes.data,
            beta=self.beta.ctypes.data,
            draft_pending=self.draft_pending.ctypes.data,
            width=width,
            draft_count=self.draft_count.ctypes.data,
            draft_length=self.draft_length.ctypes.data,
            target_pending=self.target_pending.ctypes.data,
            target_length=self.target_length.ctypes.data,
            proposals=self.proposals.ctypes.data,
            output=self.output.ctypes.data,
            num_accepted=self.num_accepted.ctypes.data,
            seconds=self.seconds.ctypes.data,
            invariant=_invariant(context),
            taus=self.taus.ctypes.data if self.proposal is not None else None,
            grid_taus=self.grid_taus.ctypes.data if len(grid) else None,
            grid_size=len(grid),
            grid=self.grid.ctypes.data if len(grid) else None,
            draft_top=self.draft_top.ctypes.data,
            draft_norms=self.draft_norms.ctypes.data,
            index=self.index.ctypes.data,
            tell_q=0,
            first_at=self.first_at.ctypes.data,
            given=self.given.ctypes.data if self.lookup or self.combined else None,
            given_rows=self.given_rows.ctypes.data if self.combined else None,
            head=ctypes.addressof(context.head.struct) if context.head is not None else None,
        )

    @classmethod
    def maybe(
        cls, target, cache, drafter: DraftSource | None, sampling, prompts: list[list[int]], k_max: int
    ) -> CompiledStep | None:
        if not isinstance(cache, LlamaCppCache) or any(refusal(p) for p in sampling.params):
            return None
        vocab = target.vocab_size
        if any(p.top_p < 1.0 and not 0 < p.top_k < vocab for p in sampling.params if not p.greedy):
            return None  # top-p alone sorts the vocabulary at every position: torch's sort is faster
        draft = None
        if drafter is not None and not is_lookup(drafter):
            source = drafter.drafter if _is_combined(drafter) else drafter
            draft = source.own_model() if hasattr(source, "own_model") else None
            if draft is None or not isinstance(draft.cache, LlamaCppCache) or draft.model.vocab_size != vocab:
                return None
            if draft.cache.seqs != cache.seqs or draft.cache.context.n_seq != cache.context.n_seq:
                return None  # the C step takes slot s to be sequence s in both contexts
        loaded = load()
        if loaded is None or cache.context.n_seq * (k_max + 1) > _capacity(cache, draft):
            return None
        step = cls(loaded, target, cache, draft, drafter, sampling, k_max)
        step.add_rows(list(range(len(prompts))), [p[-1] for p in prompts])
        return step

    # ---- rows

    def keep_rows(self, rows: list[int]) -> None:
        """Only `rows` stay (called before the caches drop the others): the other slots take no part."""
        kept = {self.cache.seqs[r] for r in rows}
        for seq in self.cache.seqs:
            if seq not in kept:
                self.active[seq] = 0
                self._joined.discard(seq)

    def add_rows(self, rows: list[int], pending: list[int]) -> None:
        """Rows that joined (the caches, the drafter and the sampling hold them already): each slot
        takes its row's target length and pending token, its settings and stream, and the draft's
        unread tokens (a joined prompt's body is read at the next drafting step: `read_joined`)."""
        if self.draft is not None and self.draft_cache.seqs != self.cache.seqs:
            raise RuntimeError("the draft's and the target's caches hold different sequences")
        own = (self.drafter.drafter if self.combined else self.drafter).own_model() if self.draft is not None else None
        lengths, keys = self.cache.host_lengths, self.sampling.streams.keys
        for row, token in zip(rows, pending):
            seq, params = self.cache.seqs[row], self.sampling.params[row]
            if refusal(params):
                raise ValueError(refusal(params))
            self.settings[seq], self.sampled[seq] = sampling_struct(params), not params.greedy
            self.rng[seq] = np.int64(keys[row].item()).view(np.uint64)
            self.target_length[seq], self.target_pending[seq] = lengths[row], token
            self.active[seq] = 1
            if own is not None:
                unread = own.unread[row] if own.unread is not None and own.unread[row] is not None else []
                tokens = list(unread) + own.pending[row, : own.pending_count[row]].tolist()
                self.draft_pending[seq, : len(tokens)] = tokens
                self.draft_count[seq], self.draft_length[seq] = len(tokens), self.draft_cache.host_lengths[row]
                if len(tokens) > 1:
                    self._joined.add(seq)

    @property
    def joined_unread(self) -> int:
        """Prompt tokens of joined rows that the draft has not read yet."""
        return sum(int(self.draft_count[s]) - 1 for s in self._joined)

    def read_joined(self) -> None:
        """The draft reads the joined rows' prompts now (the engine times it as a cost per request)."""
        self._read_pending(sorted(self._joined))
        self._joined.clear()

    # ---- the step

    def run(self, k: int, pending: torch.Tensor | None = None, logprobs: dict[int, int] | None = None) -> tuple:
        """One iteration of the batch's rows: the fields of step.Iteration, in its order (this
        package sits below the engine, so a plain tuple). `pending` is the Python path's: this step
        keeps its own pending tokens."""
        started, before = time.perf_counter(), self.seconds.tolist()
        seqs = np.asarray(self.cache.seqs, np.int64)
        if self.proposal is not None and len(seqs):
            self.taus[seqs] = self.proposal.chosen().numpy()
        looked_up = 0.0
        if self.lookup:  # the lookup's tokens [B, k'] (k' <= k: fewer where nothing matched), at k = 0 too
            tokens = self.drafter.propose(k, self.sampling)[0]
            k = tokens.shape[1]
            if k:
                self.given[: len(self.active) * k].reshape(-1, k)[seqs] = tokens.numpy()
            looked_up = time.perf_counter() - started
        elif self.combined:  # per row, the lookup's tokens or the model's proposals (at k = 0: neither)
            tokens, self._took, alone = self.drafter.choose(k)  # [B, k] ([B, k'] alone), [B], bool
            self.given_rows[seqs] = self._took
            k = tokens.shape[1] if tokens is not None else 0
            if k:
                self.given[: len(self.active) * k].reshape(-1, k)[seqs] = tokens.numpy()
            looked_up = time.perf_counter() - started
        made = self._call(k)
        if made == _TOO_MANY_TOKENS and self.draft is not None:  # the draft's pending tokens do not fit in one batch
            self._read_pending([int(s) for s in seqs])
            made = self._call(k)
        if made == _TOO_MANY_TOKENS:
            raise RuntimeError(f"a step of {k} proposals does not fit in one llama.cpp batch of {self.capacity} tokens")
        if made < 0:
            raise RuntimeError(f"llama_decode failed (status {-1000 - made}): {log_tail()}")
        if k > 0:
            self._joined.clear()  # a drafting step read every pending token
        drafted, verified = float(self.seconds[0]) - before[0], float(self.seconds[1]) - before[1]  # Python floats
        drafted += looked_up
        self.target.forward_compute_s += verified
        self.cache.set_lengths(self.target_length[seqs].tolist())
        if self.draft is not None:
            self.draft.forward_compute_s += drafted
            self.draft_cache.set_lengths(self.draft_length[seqs].tolist())
        accepted = self.num_accepted[seqs].tolist()
        rows = self.output[: len(self.active) * (k + 1)].reshape(-1, k + 1)[seqs].tolist()
        tokens = [row[: n + 1] for row, n in zip(rows, accepted)]
        betas = self.beta[: len(self.active) * k].reshape(-1, k)[seqs].tolist() if k else [[] for _ in accepted]
        beta = [row[: min(n + 1, made)] for row, n in zip(betas, accepted)]  # the verified positions
        if self.combined:  # [B, made]
            proposed = self.proposals[: len(self.active) * k].reshape(-1, k)[seqs, :made] if k else seqs[:, None][:, :0]
            self._proposed = torch.from_numpy(proposed.astype(np.int64))
        if len(self.grid_taus) and made > 0:
            self._observe(seqs, k, made)
        found = self._logprobs(seqs, tokens, logprobs) if logprobs else {}
        return tokens, accepted, beta, made, drafted, time.perf_counter() - started - drafted, found

    def _observe(self, seqs: np.ndarray, k: int, made: int) -> None:
        """The proposal's estimates take the grid at this call's verified positions of the sampled rows."""
        size = len(self.grid_taus)
        sampled = self.sampled[seqs] & (self.given_rows[seqs] == 0)  # a given row verified one-hot q's
        if not sampled.any():
            return
        grid = self.grid[: len(self.active) * k * size].reshape(-1, k, size)[seqs, :made]  # [B, made, G], a copy
        # proposal.verified_positions, of the sampled rows: positions 0..n_b
        verified = (np.arange(made)[None, :] <= self.num_accepted[seqs][:, None]) & sampled[:, None]
        self.proposal.observe(grid, verified)  # [B, made, G], [B, made]

    def _logprobs(self, seqs: np.ndarray, tokens: list[list[int]], wanted: dict[int, int]) -> dict:
        """Row -> (log p(token), {alternative: log p}) per committed token, from the target's raw logits
        that this call left in its context (as step.PythonStep's, from its scores)."""
        from ..step import token_logprobs

        vocab, found = self.target.vocab_size, {}
        for row, n in wanted.items():
            first, count = int(self.first_at[seqs[row]]), len(tokens[row])
            head = self.cache.context.head
            if head is not None:  # first_at indexes the own head's rows
                logits = head.logits_buffer(0)[first : first + count].copy()  # [count, V]
            else:
                logits = np.stack(
                    [
                        np.ctypeslib.as_array(
                            self._lib.llama_get_logits_ith(self.cache.context.ptr, first + i), (vocab,)
                        )
                        for i in range(count)
                    ]
                )  # [count, V]
            scores, output = torch.from_numpy(logits)[None], torch.tensor([tokens[row]])
            found[row] = token_logprobs(scores, output, {0: n})[0]
        return found

    def commit(self, accepted: list[int], pending: torch.Tensor, live: list[bool]) -> None:
        """`run` rolled both caches back and keeps the pending tokens itself; a lookup learns what
        each row committed (as on the Python path), and a combined draft what the last call proposed."""
        if self.lookup:
            self.drafter.commit(accepted, pending, live)
        elif self.combined:
            self.drafter.commit_lookup(self._proposed, self._took, accepted, pending, live)

    def tell_q(self) -> None:
        """From now on the rule is told q whatever tau drew the proposals: inexact where tau < 1 (the
        negative control of the tests that show the exactness suite would see it)."""
        self._args.tell_q = 1

    def _call(self, k: int) -> int:
        self._args.k = k
        head = self.cache.context.head
        if head is not None:  # the target's logits: at most every slot's k + 1 positions and a placeholder
            self._args.head_logits = head.logits_buffer(len(self.active) * (k + 1) + 1).ctypes.data
        made = self._function(ctypes.byref(self._args))
        if made == _HEAD_OUT_OF_ORDER:
            raise RuntimeError("the output head's rows were not the target pass's outputs in order")
        return made

    def _read_pending(self, slots: list[int]) -> None:
        """The draft reads these active slots' pending tokens but the last (in batches of any size)."""
        slots = [s for s in slots if self.active[s] and self.draft_count[s] > 1]
        if not slots:
            return
        tokens = np.concatenate([self.draft_pending[s, : self.draft_count[s] - 1] for s in slots])
        positions = np.concatenate([self.draft_length[s] + np.arange(self.draft_count[s] - 1) for s in slots])
        seqs = np.concatenate([np.full(self.draft_count[s] - 1, s) for s in slots])
        self.draft_cache.context.decode(tokens, positions, seqs, False)
        for s in slots:
            self.draft_length[s] += self.draft_count[s] - 1
            self.draft_pending[s, 0] = self.draft_pending[s, self.draft_count[s] - 1]
            self.draft_count[s] = 1

    def __del__(self) -> None:
        if not sys.is_finalizing():
            for batch in self._batches:
                self._lib.llama_batch_free(batch)


def _invariant(context) -> int:
    """llama_step.c's `invariant`: 0 ordinary passes; 1 flash attention's placeholders (4: with the spare
    sequence for a lone row's, context.py's `spare_seq`); 2 sgemm's attention; 3 flash over sgemm's weights."""
    if not context.invariant:
        return 0
    if not context.flash:
        return 2
    if context.lone_pad:
        return 3
    return 4 if context.spare_seq is not None else 1
