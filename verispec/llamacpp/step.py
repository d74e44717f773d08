"""The speculative iteration on a llama.cpp target and a llama.cpp draft, in one compiled call.

Owns `CompiledStep` (the state of one `generate` call: both models' pending tokens and
lengths as arrays the compiled step reads and writes). llama_step.c (built and loaded by
compiled.py) does what the engine's Python path (step.PythonStep) does with a `ModelDrafter`:
propose, score, the accept-reject rule, both rollbacks, in C against llama.cpp's C API: between
two target passes Python runs cold (the pass streams the weights through the caches), so the
dozen Python and torch steps of an iteration cost a sizeable share of a pass there. At temperature 0 it is
`greedy_continuation`, `forward_argmax` and `rejection.verify_greedy`; at T > 0 it is
`rejection.verify` on p and q processed as `sampling.process_logits` does (top-k, top-p, min-p
included), the draft proposing from q sharpened by each row's proposal temperature (proposal.py),
with its own random stream. The Python path stays the reference: tests compare the two token for
token at T = 0, the rule alone on random inputs at T > 0, and the exactness suite runs the
compiled step at T > 0. Knows nothing of drafters but the `DraftSource` protocol below, nor of text.
"""

from __future__ import annotations

import ctypes
import sys
import time
from typing import Any, Protocol

import numpy as np
import torch

from .compiled import StepArgs, load, step_status
from .context import LlamaCppCache
from .lib import library, log_tail

__all__ = ["CompiledStep", "DraftModel", "DraftSource", "step_status"]

_TOO_MANY_TOKENS = -1


class DraftModel(Protocol):
    """A drafter's own draft model between steps, as `DraftSource.own_model` gives it (drafters.base.OwnModel)."""

    model: Any  # the draft model: the compiled step runs it when its cache is a LlamaCppCache
    cache: Any  # its cache, row b the batch's row b
    pending: torch.Tensor  # [B, P] long: row b's first pending_count[b] tokens are committed, unread by the draft
    pending_count: list[int]
    confidence_threshold: float  # stop drafting once every row's top q is below it (0: off)
    proposal: Any  # proposal.ProposalTemperature: each row's proposal temperature (None: q itself)


class DraftSource(Protocol):
    """What the compiled step asks of a drafter (drafters.model.ModelDrafter keeps it): its own
    model, or None where its proposals are not a model's own (the step then does not apply).
    Read once, at the start; from then on the step owns that state."""

    def own_model(self) -> DraftModel | None: ...


def _capacity(cache: LlamaCppCache, draft: DraftModel | None) -> int:
    """Tokens one llama_decode takes in both contexts (the C step fills both batches up to it)."""
    return min(cache.context.n_batch, draft.cache.context.n_batch) if draft is not None else cache.context.n_batch


class CompiledStep:
    """Both models' state for the compiled step, over the caches of one `generate` call.

    `maybe(target, cache, drafter, sampling, prompts, k_max)` returns one when it applies (a
    `LlamaCppModel` target; a drafter whose `own_model()` is a llama.cpp model of the same
    vocabulary, or no drafter: plain decoding; every row with the same settings: temperature 0, or
    rejection sampling at a temperature, with any top-k and min-p, and top-p where top-k is on
    (top-p alone would sort the whole vocabulary at every position: the Python path, whose torch sort
    is faster, runs it); the compiled step loaded; B*(k+1) positions in one llama.cpp batch of
    both contexts). It keeps the engine's step
    interface (step.PythonStep's): `run(k, pending, logprobs)` runs one iteration for the active
    rows, `commit` has nothing left to do, and rows that finish are `retire`d: they take no part
    in later steps and their caches stop growing; rows never join (`can_change_rows` is false).
    At T > 0 row b draws from its own splitmix64 stream, started where `RowStreams` starts it (so
    a seed gives the same tokens each run, whatever the other rows; not the Python path's tokens,
    which draw in another order). Row b proposes from q sharpened by the draft's
    `proposal.chosen()[b]`, read before each call; with `--draft-temperature auto` each call also
    hands the proposal the acceptance every tau of its grid would have had at the verified positions
    (`proposal.observe`), as ModelDrafter.observe_target does on the Python path."""

    can_change_rows = False

    def __init__(
        self,
        loaded,
        target,
        cache: LlamaCppCache,
        draft: DraftModel | None,
        prompts: list[list[int]],
        sampling,
        k_max: int,
    ):
        lib, batch = library(), len(prompts)
        self._function, self._lib = loaded.verispec_step, lib
        self.target, self.cache = target, cache
        self.draft, self.draft_cache = (draft.model, draft.cache) if draft is not None else (None, None)
        self.capacity = _capacity(cache, draft)
        self._batches = [lib.llama_batch_init(self.capacity, 0, 1) for _ in range(2)]
        params = sampling.shared
        # pending tokens: a whole prompt, then k = 0 steps
        width = max(len(p) + r.max_new_tokens for p, r in zip(prompts, sampling.params)) + 2
        self.draft_pending = np.zeros((batch, width), np.int32)
        self.draft_count = np.ones(batch, np.int32)
        self.draft_length = np.zeros(batch, np.int32)
        if draft is not None:
            pending = draft.pending.numpy()
            self.draft_pending[:, : pending.shape[1]] = pending
            self.draft_count[:] = draft.pending_count
            self.draft_length[:] = self.draft_cache.host_lengths
        self.target_pending = np.asarray([p[-1] for p in prompts], np.int32)
        self.target_length = np.asarray(cache.host_lengths, np.int32)
        self.active = np.ones(batch, np.uint8)
        self.proposals = np.zeros(batch * max(k_max, 1), np.int32)
        self.output = np.zeros(batch * (k_max + 1), np.int32)
        self.num_accepted = np.zeros(batch, np.int32)
        self.seconds = np.zeros(2)
        sampled = not params.greedy
        vocab = target.vocab_size if sampled else 0
        self.rng = sampling.streams.keys.numpy().view(np.uint64).copy()  # row b's splitmix64 state: its stream's key
        self.draft_probs = np.zeros(batch * k_max * vocab, np.float32)  # q of every proposal (T > 0)
        self.scratch, self.index = np.zeros(4 * vocab, np.float32), np.zeros(3 * vocab + 2 if vocab else 0, np.int32)
        self.beta = np.zeros(batch * max(k_max, 1), np.float64)
        self.proposal = draft.proposal if draft is not None and sampled else None  # ProposalTemperature or None
        self.taus = np.ones(batch, np.float32)  # each row's proposal temperature, set before each call
        grid = self.proposal.taus if self.proposal is not None and self.proposal.auto else ()
        self.grid_taus = np.asarray(grid, np.float32)
        self.grid = np.zeros(batch * k_max * len(grid), np.float64)  # [B, k, G] the counterfactual acceptance
        self.draft_top = np.zeros(batch * k_max if sampled else 0, np.int32)
        self.draft_norms = np.zeros(batch * k_max * (1 + len(grid)) if sampled else 0, np.float32)
        context = cache.context
        self._args = StepArgs(
            draft=self.draft_cache.context.ptr if draft is not None else None,
            draft_batch=ctypes.addressof(self._batches[0]),
            target=context.ptr,
            target_batch=ctypes.addressof(self._batches[1]),
            capacity=self.capacity,
            rows=batch,
            active=self.active.ctypes.data,
            k=0,
            p_min=draft.confidence_threshold if draft is not None else 0.0,
            temperature=params.temperature if sampled else 0.0,
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
            invariant=0 if not context.invariant else 2 if context.pad_always else 1,
            top_k=params.top_k if sampled else 0,
            top_p=params.top_p if sampled else 1.0,
            min_p=params.min_p if sampled else 0.0,
            taus=self.taus.ctypes.data if self.proposal is not None else None,
            grid_taus=self.grid_taus.ctypes.data if len(grid) else None,
            grid_size=len(grid),
            grid=self.grid.ctypes.data if len(grid) else None,
            draft_top=self.draft_top.ctypes.data,
            draft_norms=self.draft_norms.ctypes.data,
            index=self.index.ctypes.data,
            tell_q=0,
        )

    @classmethod
    def maybe(
        cls, target, cache, drafter: DraftSource | None, sampling, prompts: list[list[int]], k_max: int
    ) -> CompiledStep | None:
        params = sampling.shared  # one setting for every row (seeds aside), or None
        if params is None or not isinstance(cache, LlamaCppCache):
            return None
        draft = None
        if drafter is not None:
            draft = drafter.own_model() if hasattr(drafter, "own_model") else None
            if draft is None or not isinstance(draft.cache, LlamaCppCache):
                return None
            if not params.greedy and draft.model.vocab_size != target.vocab_size:
                return None
        top_p_alone = params.top_p < 1.0 and not 0 < params.top_k < target.vocab_size  # a sort of the vocabulary
        if not (params.greedy or (params.sampling == "rejection" and not top_p_alone)):
            return None
        loaded = load()
        if loaded is None or len(prompts) * (k_max + 1) > _capacity(cache, draft):
            return None
        if cache.seqs != list(range(len(prompts))) or (draft is not None and draft.cache.seqs != cache.seqs):
            return None  # the C step takes row b to be sequence b in both contexts
        return cls(loaded, target, cache, draft, prompts, sampling, k_max)

    def run(self, k: int, pending: torch.Tensor | None = None, logprobs: dict[int, int] | None = None) -> tuple:
        """One iteration of the active rows: the fields of step.Iteration, in its order (this
        package sits below the engine, so a plain tuple). `pending` and `logprobs` are the Python
        path's: this step keeps its own pending tokens and offers no log-probabilities."""
        started, before = time.perf_counter(), self.seconds.tolist()
        if self.proposal is not None:
            self.taus[:] = self.proposal.chosen().numpy()
        made = self._call(k)
        if made == _TOO_MANY_TOKENS and self.draft is not None:  # the draft's pending tokens do not fit in one batch
            self._read_pending()
            made = self._call(k)
        if made == _TOO_MANY_TOKENS:
            raise RuntimeError(f"a step of {k} proposals does not fit in one llama.cpp batch of {self.capacity} tokens")
        if made < 0:
            raise RuntimeError(f"llama_decode failed (status {-1000 - made}): {log_tail()}")
        drafted, verified = self.seconds[0] - before[0], self.seconds[1] - before[1]
        self.target.forward_compute_s += verified
        self.cache.set_lengths(self.target_length.tolist())
        if self.draft is not None:
            self.draft.forward_compute_s += drafted
            self.draft_cache.set_lengths(self.draft_length.tolist())
        accepted = self.num_accepted.tolist()
        rows = self.output[: len(accepted) * (k + 1)].reshape(-1, k + 1).tolist()  # row b at b * (k + 1)
        tokens = [row[: n + 1] if live else [] for row, n, live in zip(rows, accepted, self.active)]
        betas = self.beta[: len(accepted) * k].reshape(-1, k).tolist() if k else [[] for _ in accepted]
        beta = [row[: min(n + 1, made)] for row, n in zip(betas, accepted)]  # the verified positions
        if len(self.grid_taus) and made > 0:
            self._observe(k, made)
        return tokens, accepted, beta, made, drafted, time.perf_counter() - started - drafted, {}

    def _observe(self, k: int, made: int) -> None:
        """The proposal's estimates take the grid at this call's verified positions of the active rows."""
        rows, size = len(self.active), len(self.grid_taus)
        grid = self.grid[: rows * k * size].reshape(rows, k, size)[:, :made].copy()  # [B, made, G], the next call's own
        # proposal.verified_positions, of the active rows: positions 0..n_b
        verified = (np.arange(made)[None, :] <= self.num_accepted[:, None]) & self.active[:, None].astype(bool)
        self.proposal.observe(torch.from_numpy(grid), torch.from_numpy(verified))  # [B, made, G], [B, made]

    def tell_q(self) -> None:
        """From now on the rule is told q whatever tau drew the proposals: inexact where tau < 1 (the
        negative control of the tests that show the exactness suite would see it)."""
        self._args.tell_q = 1

    def commit(self, accepted: list[int], pending: torch.Tensor, live: list[bool]) -> None:
        """Nothing: `run` rolled both caches back and keeps the pending tokens itself."""

    def _call(self, k: int) -> int:
        self._args.k = k
        return self._function(ctypes.byref(self._args))

    def _read_pending(self) -> None:
        """The draft reads every active row's pending tokens but the last (in batches of any size)."""
        rows = [b for b in np.flatnonzero(self.active) if self.draft_count[b] > 1]
        if not rows:
            return
        tokens = np.concatenate([self.draft_pending[b, : self.draft_count[b] - 1] for b in rows])
        positions = np.concatenate([self.draft_length[b] + np.arange(self.draft_count[b] - 1) for b in rows])
        seqs = np.concatenate([np.full(self.draft_count[b] - 1, b) for b in rows])
        self.draft_cache.context.decode(tokens, positions, seqs, False)
        for b in rows:
            self.draft_length[b] += self.draft_count[b] - 1
            self.draft_pending[b, 0] = self.draft_pending[b, self.draft_count[b] - 1]
            self.draft_count[b] = 1

    def retire(self, rows: list[int]) -> None:
        """Rows that are done: no part in later steps (their caches keep what they hold)."""
        self.active[rows] = 0

    def __del__(self) -> None:
        if not sys.is_finalizing():
            for batch in self._batches:
                self._lib.llama_batch_free(batch)
