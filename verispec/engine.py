"""The draft -> verify -> commit loop over a batch of token-id prompts.

Owns: `Batch` (requests decoding together, joining and leaving between passes), `generate` (a
streaming generator of committed tokens) and `generate_all`.
One iteration: the drafter proposes k tokens per row; the target scores the pending token
and the k proposals in one pass ([B, k+1] positions); `verify_batch` keeps a prefix of each row
and adds a recovered or bonus token; the new tokens are cut at max_new_tokens and at a stop
token; the caches roll back to the committed lengths; the tokens are yielded. k = 0 (or no
drafter) is plain autoregressive decoding through the same code: the baseline. Each row has
its own sampling settings, budget, stop tokens and random stream (`sampling.RowSampling`).

The target's cache holds every committed token but the last one, which is "pending" and is
the first input of the next pass. One host synchronisation per iteration (the output
tokens, acceptance counts and beta, in one transfer). The iteration itself is a `step.Step`,
chosen once when a batch starts: the target's `compiled_step` where it offers one that applies
(llama.cpp with a llama.cpp draft or none: llamacpp/step.py, one compiled call), else
`step.PythonStep`; the bookkeeping here is the same for both. Knows nothing of text.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .config import SamplingParams
from .drafters.base import Drafter, check_rollback
from .drafters.placeholder import placeholder_guess
from .models.rows import extend_rows, prefill_rows
from .policy import DraftLengthPolicy, FixedLength, split_for
from .sampling import RowSampling
from .stats import RequestStats, SpecStats
from .step import Iteration, PythonStep, Step, sync


def _check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    if not isinstance(prompts, Sequence) or isinstance(prompts, (str, bytes)) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    checked = []
    for row, prompt in enumerate(prompts):
        prompt = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        if not prompt:
            raise ValueError(f"prompts[{row}] is empty: a prompt needs at least one token")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompts[{row}] has token id {bad[0]!r} outside [0, {vocab_size})")
        checked.append(prompt)
    return checked


def check_context(target, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]) -> None:
    """ValueError (one line) when a prompt plus its max_new_tokens (one for all rows or one per
    row) does not fit in the target's context (`config.max_position_embeddings`, a GGUF's
    training context): past it a model produces garbage. Models that declare no context are
    not checked."""
    context = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if not isinstance(context, int) or not prompts:
        return
    length, budget = max(((len(p), n) for p, n in zip(prompts, budgets)), key=sum)
    if length + budget > context:
        raise ValueError(
            f"the prompt ({length} tokens) plus max_new_tokens ({budget}) exceeds the model's context of {context} "
            "positions"
        )


def _cut(tokens: list[int], budget: int, stop_token_ids: tuple[int, ...]) -> tuple[list[int], str | None]:
    """Committed tokens of one row, cut at the budget and after the first stop token."""
    tokens = tokens[:budget]
    for i, token in enumerate(tokens):
        if token in stop_token_ids:
            return tokens[: i + 1], "stop"
    return tokens, ("length" if len(tokens) == budget else None)


@dataclass
class Staged:
    """A row outside the batch whose prompt is being read piece by piece (`Batch.reserve`)."""

    view: object  # a one-row cache over the target cache's free storage
    draft_view: object | None  # the same in the draft model's cache (None: nothing to read ahead)
    fed: int = 0  # prompt tokens written


class Batch:
    """Requests decoding together, one target pass per `step`; they join and leave between passes.

    The batch's rows are its running requests, each with an id (`ids`): `join(prompts, params,
    ids)` adds rows after the others (their prompts prefilled then by the target; a model draft
    reads them before its next drafting pass, all in one call), a row
    that reaches its budget or a stop token leaves after its last pass, and `cancel(ids)` ends
    requests early. Rows that leave are dropped from every per-row state (`keep_rows` on the
    caches, the drafter and the sampling), so a pass costs what the running requests cost.
    Every row has its own settings, budget, stop tokens and random stream, so a seeded row's
    tokens do not depend on the rows beside it or on when it joined (at a fixed k: with a
    draft model in rejection mode the draws depend on the k of each pass; invariant mode and
    prompt lookup do not). `max_length` bounds every row's prompt + budget + k_max + 1;
    `capacity` the rows at once (default: the first prompts).

    The compiled step (llama.cpp with a llama.cpp draft or none: `compiled=True`, the default)
    keeps its own per-row state in slots; rows leave and join it as on the Python path, but for
    settings it cannot run (`CompiledStep.refusal`: invariant mode), which `join` refuses.
    """

    @torch.no_grad()
    def __init__(
        self,
        target: torch.nn.Module,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        drafter: Drafter | None = None,
        k: int | DraftLengthPolicy = 4,
        stats: SpecStats | None = None,
        *,
        max_length: int | None = None,
        capacity: int | None = None,
        compiled: bool = True,
        count_requests: bool = True,
    ):
        policy = k if isinstance(k, DraftLengthPolicy) else FixedLength(k)  # validates an int k
        if drafter is None:  # plain; on a target that pads one-position passes, a guess in the placeholder
            drafter, policy = placeholder_guess(target)
        check_rollback(target, drafter)  # a recurrent target or draft cannot verify: refused, never a wrong token
        policy = split_for(policy, drafter)  # a combined draft under auto: an arm per kind of pass
        empty = (
            capacity is not None
            and isinstance(prompts, Sequence)
            and not isinstance(prompts, (str, bytes))
            and len(prompts) == 0
        )
        if empty:  # no request yet: the caches are made for `capacity` rows, then emptied
            if not isinstance(capacity, int) or capacity < 1 or max_length is None:
                raise ValueError("a batch without prompts needs capacity >= 1 and max_length")
            prompts, params = [[0]] * capacity, SamplingParams(temperature=0, max_new_tokens=1)
        prompts = _check_prompts(prompts, target.vocab_size)
        device, batch = target.device, len(prompts)
        self.target, self.drafter, self.policy, self.device = target, drafter, policy, device
        self.capacity = capacity or batch
        if self.capacity < batch:
            raise ValueError(f"capacity ({self.capacity}) is below the number of prompts ({batch})")
        self.sampling = RowSampling(params, batch, device)
        budgets = [p.max_new_tokens for p in self.sampling.params]
        check_context(target, prompts, budgets)
        needed = max(len(p) + n for p, n in zip(prompts, budgets)) + policy.k_max + 1
        if max_length is not None and max_length < needed:
            raise ValueError(
                f"max_length ({max_length}) is below the longest prompt plus its budget and k_max + 1 ({needed})"
            )
        self.max_length = max_length or needed
        if getattr(drafter, "guess_from", 0) >= self.max_length:  # no row grows long enough to guess: plain passes
            drafter, policy = self.drafter, self.policy = None, FixedLength(0)
        self.stats = stats if stats is not None else SpecStats()
        guess = getattr(drafter, "placeholder_guess", False)
        self.stats.placeholder_guess |= guess
        self.stats.draft_given |= drafter is not None and not guess
        self.count_requests = count_requests
        self.ids: list = list(range(batch))
        # per row: None, or how many top alternatives it wants with each token's log-probability
        self.logprobs: list[int | None] = [None] * batch
        self.last_logprobs: dict = {}  # id -> [(log p(token), {alternative: log p})] for the tokens of the last step
        self.requests = [RequestStats(prompt_tokens=len(p)) for p in prompts]
        self.active = [True] * batch
        self.finished: list[
            tuple[object, RequestStats]
        ] = []  # (id, stats) of the rows that left at the last step or cancel
        self._done: dict = {}  # id -> stats of requests that left (count_requests)
        self._staged = 0  # rows reserved for prompts being read piece by piece
        self.started = time.perf_counter()
        self.cache = target.new_cache(self.capacity, self.max_length)
        if self.capacity > batch:
            self.cache.keep_rows(list(range(batch)))
        target.prefill([p[:-1] for p in prompts], self.cache)
        if getattr(drafter, "shares_target_cache", False):  # e.g. early exit: reads the target's own KV
            drafter.start(prompts, self.max_length, target_cache=self.cache)
        elif drafter is not None:
            drafter.start(prompts, self.max_length)
        if isinstance(policy, FixedLength) and policy.k > 0 and hasattr(drafter, "prefill"):
            drafter.prefill()  # it will draft at once: read the prompts now, timed as prefill
        sync(device)
        self.stats.prefill_time_s += time.perf_counter() - self.started
        self.pending_ids = [p[-1] for p in prompts]
        self.pending = torch.tensor(self.pending_ids, device=device)  # [B]
        # The iteration, chosen once: the target's own (one compiled call) where it offers one that applies.
        offer = getattr(target, "compiled_step", None) if compiled else None
        chosen = offer(self.cache, drafter, self.sampling, prompts, policy.k_max) if offer is not None else None
        self.stepper: Step = (
            chosen if chosen is not None else PythonStep(target, self.cache, drafter, self.sampling, device)
        )
        # Rows can leave and join when every per-row state can move them; else finished rows stay in place.
        self.can_change_rows = self.stepper.can_change_rows
        if empty:
            if not self.can_change_rows:
                raise ValueError(
                    "this target's cache or this drafter cannot take requests during a batch (keep_rows, add_rows)"
                )
            self.ids, self.requests = [], []
            self._keep([])
        self._closed = False

    def __len__(self) -> int:
        return len(self.ids)

    def _keep(self, rows: list[int]) -> None:
        """Only `rows` (ascending) remain, in every per-row state: the step first (the compiled
        step's slots), then the target cache (a drafter may share it), the drafter, the sampling
        and the lists."""
        self.stepper.keep_rows(rows)
        self.cache.keep_rows(rows)
        if self.drafter is not None:
            self.drafter.keep_rows(rows)
        self.sampling.keep_rows(rows)
        self.pending_ids = [self.pending_ids[r] for r in rows]
        self.pending = torch.tensor(self.pending_ids, dtype=torch.long, device=self.device)
        self.ids = [self.ids[r] for r in rows]
        self.logprobs = [self.logprobs[r] for r in rows]
        self.requests = [self.requests[r] for r in rows]
        self.active = [self.active[r] for r in rows]

    def _leave(self, rows: list[int]) -> None:
        """Rows whose requests ended: recorded in `finished`, then dropped (or, on the compiled
        step, left in place and skipped)."""
        for row in rows:
            self.finished.append((self.ids[row], self.requests[row]))
            if self.count_requests:
                self._done[self.ids[row]] = self.requests[row]
            self.active[row] = False
        if not rows:
            return
        if self.can_change_rows:
            gone = set(rows)
            self._keep([row for row in range(len(self.ids)) if row not in gone])
        else:
            self.stepper.retire(rows)

    @torch.no_grad()
    def join(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        ids: Sequence,
        logprobs: Sequence[int | None] | None = None,
    ) -> None:
        """Start requests: prompts[i] with params[i] (its own seed), known as ids[i], in rows
        after the running ones. logprobs[i] (None: not wanted) asks for each committed token's
        log-probability under the target's raw distribution (its logits before temperature and
        filters, as vLLM's default) and that many top alternatives: `last_logprobs` after a step."""
        logprobs = [None] * len(prompts) if logprobs is None else list(logprobs)
        if len(logprobs) != len(prompts) or any(n is not None and (not isinstance(n, int) or n < 0) for n in logprobs):
            raise ValueError("logprobs needs one entry per prompt: None or an integer >= 0")
        prompts, params, ids = _check_prompts(prompts, self.target.vocab_size), list(params), list(ids)
        if not self.can_change_rows:
            raise RuntimeError("requests cannot join this batch: its target's cache or drafter cannot add rows")
        self._check_runnable(params)
        if len(params) != len(prompts) or len(ids) != len(prompts):
            raise ValueError(
                f"join needs one SamplingParams and one id per prompt, got {len(prompts)}, {len(params)}, {len(ids)}"
            )
        if len(self.ids) + self._staged + len(prompts) > self.capacity:
            raise ValueError(
                f"the batch holds {self.capacity} rows; {len(self.ids)} run, {self._staged} are staged "
                f"and {len(prompts)} asked to join"
            )
        if len(set(ids)) != len(ids) or set(ids) & set(self.ids):
            raise ValueError("ids must be distinct from each other and from the running requests'")
        check_context(self.target, prompts, [p.max_new_tokens for p in params])
        longest = max(len(p) + q.max_new_tokens for p, q in zip(prompts, params)) + self.policy.k_max + 1
        if longest > self.max_length:
            raise ValueError(
                f"a prompt plus its max_new_tokens and k_max + 1 ({longest}) exceeds the batch's max_length "
                f"({self.max_length})"
            )
        started = time.perf_counter()
        first = len(self.ids)
        self.cache.add_rows(len(prompts))
        prefill_rows(self.target, self.cache, range(first, first + len(prompts)), [p[:-1] for p in prompts])
        if self.drafter is not None:
            self.drafter.add_rows(prompts)
        self._append(prompts, params, ids, logprobs)
        sync(self.device)
        self.stats.prefill_time_s += time.perf_counter() - started

    # A long prompt read piece by piece before its request joins (the server's chunked prefill,
    # so that the running rows wait at most one piece): `reserve` a row outside the batch, `feed`
    # it the prompt but its last token in pieces, then `join_staged` (or `release`).
    def reserve(self) -> Staged | None:
        """A staged row, or None where this batch cannot stage (a cache or drafter without
        reserve_row: such a prompt is read whole at join)."""
        if not self.can_change_rows or not hasattr(self.cache, "reserve_row"):
            return None
        if self.drafter is not None and not hasattr(self.drafter, "reserve_row"):
            return None
        if len(self.ids) + self._staged + 1 > self.capacity:
            raise ValueError(f"the batch holds {self.capacity} rows; {len(self.ids)} run and {self._staged} are staged")
        view = self.cache.reserve_row()
        draft_view = self.drafter.reserve_row() if self.drafter is not None else None
        self._staged += 1
        return Staged(view, draft_view)

    @torch.no_grad()
    def feed(self, staged: Staged, tokens: Sequence[int]) -> None:
        """Write the next piece of a staged prompt (never its last token)."""
        started = time.perf_counter()
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # [1, T]
        if staged.view.host_lengths[0] + ids.shape[1] > self.max_length:
            raise ValueError(f"a staged prompt longer than the batch's max_length ({self.max_length})")
        extend_rows(self.target, staged.view, ids)
        if staged.draft_view is not None:
            extend_rows(self.drafter.model, staged.draft_view, ids)
        staged.fed += ids.shape[1]
        sync(self.device)
        self.stats.prefill_time_s += time.perf_counter() - started

    def release(self, staged: Staged) -> None:
        """Give a staged row up (its request was cancelled before it joined)."""
        self.cache.release_row(staged.view)
        if staged.draft_view is not None:
            self.drafter.release_row(staged.draft_view)
        self._staged -= 1

    @torch.no_grad()
    def join_staged(
        self, staged: Staged, prompt: Sequence[int], params: SamplingParams, id, logprobs: int | None = None
    ) -> None:
        """Start the request whose prompt but its last token was fed to `staged`: it becomes the
        batch's last row, as `join` would make it."""
        prompt = _check_prompts([prompt], self.target.vocab_size)[0]
        if staged.fed != len(prompt) - 1:
            raise ValueError(
                f"the staged row holds {staged.fed} tokens; the prompt but its last token is {len(prompt) - 1}"
            )
        if id in self.ids:
            raise ValueError("ids must be distinct from the running requests'")
        self._check_runnable([params])
        check_context(self.target, [prompt], [params.max_new_tokens])
        if len(prompt) + params.max_new_tokens + self.policy.k_max + 1 > self.max_length:
            raise ValueError(
                f"a prompt plus its max_new_tokens and k_max + 1 exceeds the batch's max_length ({self.max_length})"
            )
        self.cache.adopt_row(staged.view)
        if self.drafter is not None:
            self.drafter.add_rows([prompt], [staged.draft_view])
        self._staged -= 1
        self._append([prompt], [params], [id], [logprobs])

    def refusal(self, params: SamplingParams) -> str | None:
        """Why a request with these settings cannot join this batch's step (None: it can): the
        compiled step does not run invariant mode (VERISPEC_LLAMA_STEP=0 runs the Python step)."""
        refusal = getattr(self.stepper, "refusal", None)
        why = refusal(params) if refusal is not None else None
        return None if why is None else f"{why}; this batch runs the compiled step (VERISPEC_LLAMA_STEP=0: Python)"

    def _check_runnable(self, params: list[SamplingParams]) -> None:
        for why in filter(None, map(self.refusal, params)):
            raise ValueError(why)

    def _append(self, prompts: list[list[int]], params: list[SamplingParams], ids: list, logprobs: list) -> None:
        first = len(self.ids)
        self.sampling.add_rows(params)
        self.pending_ids += [p[-1] for p in prompts]
        self.pending = torch.tensor(self.pending_ids, dtype=torch.long, device=self.device)
        self.ids += ids
        self.logprobs += logprobs
        self.requests += [RequestStats(prompt_tokens=len(p)) for p in prompts]
        self.active += [True] * len(prompts)
        self.stepper.add_rows(list(range(first, len(self.ids))), [p[-1] for p in prompts])

    def cancel(self, ids: Sequence, reason: str = "abort") -> None:
        """End these requests before their budget (a client went away, a stop string): their
        rows leave now. Ids not running are ignored."""
        self.finished = []
        wanted = set(ids)
        rows = [row for row, (i, live) in enumerate(zip(self.ids, self.active)) if i in wanted and live]
        for row in rows:
            self.requests[row].finish_reason = reason
        self._leave(rows)

    @torch.no_grad()
    def step(self) -> dict:
        """One target pass over the running rows: {id: tokens newly committed} for each of
        them ([] for none). Rows that finish here are in `finished` and leave the batch."""
        policy, drafter, sampling = self.policy, self.drafter, self.sampling
        device, stats = self.device, self.stats
        self.finished, self.last_logprobs = [], {}
        rows_now = sum(self.active)
        k = cap = min(max(policy.choose(batch=rows_now), 0), policy.k_max)  # cap: a draft may propose fewer
        joined_s = 0.0  # rows joined since the last drafting pass: the draft reads them now (a cost per request)
        if k > 0 and drafter is not None and self.stepper.joined_unread:
            started = time.perf_counter()
            self.stepper.read_joined()
            sync(device)
            joined_s = time.perf_counter() - started
            stats.prefill_time_s += joined_s
        sync(device)
        t0 = time.perf_counter()
        wanted = {row: n for row, (n, on) in enumerate(zip(self.logprobs, self.active)) if n is not None and on}
        done = Iteration(*self.stepper.run(k, self.pending, wanted))
        k, accepted = done.k, done.accepted
        stats.passes_k0 += cap == 0
        stats.passes_empty += cap > 0 and k == 0
        stats.draft_time_s += done.draft_s
        stats.target_time_s += done.target_s
        t1 = t0 + done.draft_s
        chunk: dict = {}
        finished: list[int] = []  # rows that stop at this step
        beta_sums, verified, committed = [0.0] * k, [0] * k, 0  # over active rows, for the policy
        texts: dict = {}  # per row id, the acceptance at each position it commits (None: not drafted)
        for row, (tokens, n, beta_row, request) in enumerate(zip(done.tokens, accepted, done.beta, self.requests)):
            if not self.active[row]:
                continue
            request.observe(k, n, beta_row)
            for i in range(min(n + 1, k)):
                beta_sums[i] += beta_row[i]
                verified[i] += 1
            params = sampling.params[row]
            committed += len(tokens)
            texts[self.ids[row]] = [float(b) for b in beta_row[: min(n + 1, k)]] + [None] * (n == k)
            tokens, reason = _cut(tokens, params.max_new_tokens - request.generated_tokens, params.stop_token_ids)
            request.generated_tokens += len(tokens)
            request.finish_reason = reason
            chunk[self.ids[row]] = tokens
            if row in done.logprobs:
                self.last_logprobs[self.ids[row]] = done.logprobs[row][: len(tokens)]
            if reason is not None:
                finished.append(row)
        self.last_k = k  # for a server's metrics: this pass's k and each request's accepted count
        self.last_accepted = {self.ids[row]: n for row, n in enumerate(accepted) if self.active[row]}
        # The recovered or bonus token of each row that goes on is pending now; the caches and the
        # drafter roll back to the committed tokens (the compiled step did so itself).
        gone = set(finished)
        live = [on and row not in gone for row, on in enumerate(self.active)]
        self.pending_ids = [tokens[-1] if on else old for tokens, on, old in zip(done.tokens, live, self.pending_ids)]
        self.pending = torch.tensor(self.pending_ids, device=device)  # [B]
        self.stepper.commit(accepted, self.pending, live)
        self._leave(finished)
        target_s = time.perf_counter() - t1
        policy.observe(k, beta_sums, verified, t1 - t0, target_s, rows_now, cap, joined_s, committed, texts)
        return chunk

    def close(self) -> None:
        """Add every request to stats in id order (integer ids; else in the order they ended; those
        still running stopped early) and the batch's wall time; once."""
        if self._closed:
            return
        self._closed = True
        if self.count_requests:
            for row, live in enumerate(self.active):
                if live:
                    self._done[self.ids[row]] = self.requests[row]
            keys = sorted(self._done) if all(isinstance(i, int) for i in self._done) else list(self._done)
            for key in keys:
                self.stats.add(self._done[key])
        self.stats.total_time_s += time.perf_counter() - self.started


@torch.no_grad()
def generate(
    target: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    drafter: Drafter | None = None,
    k: int | DraftLengthPolicy = 4,
    stats: SpecStats | None = None,
) -> Iterator[list[list[int]]]:
    """Yield, after each target pass, the tokens newly committed to each row ([] for none).

    `target` is a causal LM with `new_cache`, `prefill` and `forward(input_ids, cache)`;
    `drafter` follows the `Drafter` protocol. `params` is one `SamplingParams` for every row
    or one per prompt (each row its own settings, budget, stop tokens and seed: `RowSampling`).
    `k` is a draft length or a policy that picks one before every iteration
    (policy.AdaptiveLength). Rows accept different counts per step; a row stops exactly at
    its max_new_tokens or at one of its stop tokens (which it includes) and then leaves the
    batch. A `Batch` whose requests all start at once.
    """
    batch = Batch(target, prompts, params, drafter, k, stats)
    rows = len(batch)
    try:
        while any(batch.active):
            chunk = batch.step()
            yield [chunk.get(row, []) for row in range(rows)]
    finally:
        batch.close()


def generate_all(
    target: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    drafter: Drafter | None = None,
    k: int | DraftLengthPolicy = 4,
    stats: SpecStats | None = None,
) -> list[list[int]]:
    """Run `generate` to the end; return the generated tokens of each row."""
    outputs: list[list[int]] = [[] for _ in prompts]
    for chunk in generate(target, prompts, params, drafter, k, stats):
        for row, tokens in enumerate(chunk):
            outputs[row].extend(tokens)
    return outputs
