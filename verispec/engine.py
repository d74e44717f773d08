"""The draft -> verify -> commit loop over a batch of token-id prompts.

Owns: `generate` (a streaming generator of committed tokens) and `generate_all`.
One iteration: the drafter proposes k tokens per row; the target scores the pending token
and the k proposals in one pass ([B, k+1] positions); `verify` keeps a prefix of each row
and adds a recovered or bonus token; the caches roll back to the committed lengths; the
new tokens are cut at max_new_tokens and at a stop token, then yielded. k = 0 (or no
drafter) is plain autoregressive decoding through the same code: the baseline. Each row has
its own sampling settings, budget, stop tokens and random stream (`sampling.RowSampling`).

The target's cache holds every committed token but the last one, which is "pending" and is
the first input of the next pass. One host synchronisation per iteration (the output
tokens, acceptance counts and beta, in one transfer). A target may offer `compiled_step`
(llama.cpp with a llama.cpp draft: models/llamacpp_step.py), which runs propose, score, rule
and both rollbacks as one call; the bookkeeping here is the same for both. Knows nothing of
text.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from .config import SamplingParams
from .control import DraftLengthPolicy, FixedLength
from .drafters.base import Drafter
from .models.rows import prefill_rows
from .rejection import acceptance_probability, verify, verify_greedy
from .sampling import RowSampling
from .stats import RequestStats, SpecStats


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
        raise ValueError(f"the prompt ({length} tokens) plus max_new_tokens ({budget}) exceeds the model's context of {context} positions")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # timings only mean something once queued work is done
        torch.cuda.synchronize(device)


def _cut(tokens: list[int], budget: int, stop_token_ids: tuple[int, ...]) -> tuple[list[int], str | None]:
    """Committed tokens of one row, cut at the budget and after the first stop token."""
    tokens = tokens[:budget]
    for i, token in enumerate(tokens):
        if token in stop_token_ids:
            return tokens[: i + 1], "stop"
    return tokens, ("length" if len(tokens) == budget else None)


def _score(target, input_ids: torch.Tensor, cache, sampling: RowSampling) -> torch.Tensor:
    """The target's pass over input_ids [B, k+1], as the rule needs it: when every row is at
    temperature 0 the argmax ids [B, k+1] (`forward_argmax` where the model offers it: no
    logits tensor); else the raw logits [B, k+1, V]."""
    if sampling.greedy:
        forward_argmax = getattr(target, "forward_argmax", None)
        return forward_argmax(input_ids, cache) if forward_argmax is not None else target(input_ids, cache).argmax(dim=-1)
    return target(input_ids, cache)


def _rule(
    scores: torch.Tensor,  # [B, k+1] the target's argmax ids (every row greedy), else [B, k+1, V] its raw logits
    draft_token_ids: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V] or None
    sampling: RowSampling,
    start_lengths: list[int],  # row b's pass predicts positions start_lengths[b] + 1 ..
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The accept-reject rule on one pass, each row by its own settings: (output [B, k+1],
    num_accepted [B], beta [B, k]).

    At temperature 0 p is one-hot at the argmax (as process_logits makes it), so the rule is
    `verify_greedy` on token ids and beta = sum min(p, q) = q(argmax): the same result as the
    general path without its [B, k+1, V] work. Invariant rows take the same path on the
    target's invariant choices (beta is then whether each proposal was its token). The other
    rows run `verify`, each drawing from its own stream; with a deterministic drafter (q
    one-hot) a row then keeps only the numbers of the tokens it commits, one each, so it
    commits the tokens of plain sampling with its seed, whatever was proposed."""
    batch, k = draft_token_ids.shape
    if scores.dim() == 2:  # every row greedy: the argmax ids
        output, num_accepted = verify_greedy(draft_token_ids, scores)
        if draft_probs is None:  # q one-hot at the proposal
            return output, num_accepted, (draft_token_ids == scores[:, :k]).float()
        return output, num_accepted, draft_probs.gather(-1, scores[:, :k, None]).squeeze(-1)
    if draft_probs is not None and draft_probs.shape[-1] != scores.shape[-1]:
        raise ValueError(f"draft vocabulary ({draft_probs.shape[-1]}) differs from the target's ({scores.shape[-1]})")
    target_probs = sampling.process(scores)  # [B, k+1, V]
    rejection = sampling.rows("rejection")
    streams = sampling.streams
    drawn = streams.counters.clone() if draft_probs is None else None  # [B] numbers each row had drawn (coupled form only)
    if len(rejection) == batch:  # the common case: no row to pick out
        output, num_accepted = verify(draft_token_ids, draft_probs, target_probs, streams)
        if draft_probs is None:  # coupled form: one number per committed token, the rest unread
            streams.counters = drawn + num_accepted + 1
        return output, num_accepted, acceptance_probability(draft_token_ids, draft_probs, target_probs)
    positions = torch.tensor(start_lengths, device=scores.device)[:, None] + 1 + torch.arange(k + 1, device=scores.device)  # [B, k+1]
    target_ids = sampling.draw(target_probs, positions, modes=("invariant",))  # [B, k+1]: argmax or invariant choice
    output, num_accepted = verify_greedy(draft_token_ids, target_ids)
    beta = (draft_token_ids == target_ids[:, :k]).float()  # [B, k]
    if draft_probs is not None:  # greedy rows: beta = q(argmax)
        greedy = torch.tensor(sampling.rows("greedy"), dtype=torch.long, device=scores.device)
        beta[greedy] = draft_probs[greedy].gather(-1, target_ids[greedy, :k, None]).squeeze(-1)
    if rejection:
        index = torch.tensor(rejection, device=scores.device)
        q = None if draft_probs is None else draft_probs[index]
        p = target_probs[index]
        rows_output, rows_accepted = verify(draft_token_ids[index], q, p, streams.select(rejection))
        output[index], num_accepted[index] = rows_output, rows_accepted
        if q is None:
            streams.counters[index] = drawn[index] + rows_accepted + 1
        beta[index] = acceptance_probability(draft_token_ids[index], q, p)
    return output, num_accepted, beta


class Batch:
    """Rows decoding together, one target pass per `step`; rows may join and leave between passes.

    Built over `prompts` (every row's prompt prefilled at once); `live[b]` False makes row b a
    free slot (its prompt a placeholder that never generates). `join(rows, prompts, params)`
    starts new requests in free slots (their prompts prefilled then, one call per model), and
    `cancel(rows)` ends requests; a row that reaches its budget or a stop token leaves by
    itself. Every row has its own settings, budget, stop tokens and random stream, so a seeded
    row's tokens do not depend on the rows beside it or on when it joined (at a fixed k: with
    a draft model in rejection mode the draws depend on the k of each pass; invariant mode
    and prompt lookup do not). `max_length` bounds every row's prompt + budget + k_max + 1.
    The compiled step (llama.cpp) is used only by batches that never take a row later
    (`compiled=True`, `generate`'s case): its state is its own.
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
        live: Sequence[bool] | None = None,
        compiled: bool = True,
    ):
        policy = k if isinstance(k, DraftLengthPolicy) else FixedLength(k)  # validates an int k
        if drafter is None:
            policy = FixedLength(0)
        prompts = _check_prompts(prompts, target.vocab_size)
        device, batch = target.device, len(prompts)
        self.target, self.drafter, self.policy, self.device = target, drafter, policy, device
        self.sampling = RowSampling(params, batch, device)
        self.active = [True] * batch if live is None else [bool(x) for x in live]
        if len(self.active) != batch:
            raise ValueError(f"live needs one flag per prompt ({batch}), got {len(self.active)}")
        budgets = [p.max_new_tokens for p in self.sampling.params]
        check_context(target, prompts, budgets)
        needed = max(len(p) + n for p, n in zip(prompts, budgets)) + policy.k_max + 1
        if max_length is not None and max_length < needed:
            raise ValueError(f"max_length ({max_length}) is below the longest prompt plus its budget and k_max + 1 ({needed})")
        self.max_length = max_length or needed
        self.stats = stats if stats is not None else SpecStats()
        self.requests = [RequestStats(prompt_tokens=len(p)) for p in prompts]
        self._uncounted = {row for row, live in enumerate(self.active) if live}  # requests not yet in stats
        self.started = time.perf_counter()
        self.cache = target.new_cache(batch, self.max_length)
        target.prefill([p[:-1] for p in prompts], self.cache)
        if getattr(drafter, "shares_target_cache", False):  # e.g. early exit: reads the target's own KV
            drafter.start(prompts, self.max_length, target_cache=self.cache)
        elif drafter is not None:
            drafter.start(prompts, self.max_length)
        if isinstance(policy, FixedLength) and policy.k > 0 and hasattr(drafter, "prefill"):
            drafter.prefill()  # it will draft at once: read the prompts now, timed as prefill
        _sync(device)
        self.stats.prefill_time_s += time.perf_counter() - self.started
        self.pending_ids = [p[-1] for p in prompts]
        self.pending = torch.tensor(self.pending_ids, device=device)  # [B]
        # A model may run the whole iteration itself (llama.cpp with a llama.cpp draft or none: one compiled call); None otherwise.
        self.compiled = (target.compiled_step(self.cache, drafter, self.sampling, prompts, policy.k_max)
                         if compiled and hasattr(target, "compiled_step") else None)
        self._closed = False

    def __len__(self) -> int:
        return len(self.active)

    @torch.no_grad()
    def join(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> None:
        """Start requests in free rows: prompts[i] with params[i] (its own seed) in rows[i]."""
        rows, prompts = list(rows), _check_prompts(prompts, self.target.vocab_size)
        params = list(params)
        if self.compiled is not None:
            raise RuntimeError("rows cannot join a batch that runs on the compiled step (build it with compiled=False)")
        if len(rows) != len(prompts) or len(params) != len(prompts) or len(set(rows)) != len(rows):
            raise ValueError(f"join needs distinct rows and one prompt and SamplingParams per row, got {len(rows)}, {len(prompts)}, {len(params)}")
        busy = [r for r in rows if not 0 <= r < len(self.active) or self.active[r]]
        if busy:
            raise ValueError(f"row {busy[0]} is not a free row of this batch")
        check_context(self.target, prompts, [p.max_new_tokens for p in params])
        longest = max(len(p) + q.max_new_tokens for p, q in zip(prompts, params)) + self.policy.k_max + 1
        if longest > self.max_length:
            raise ValueError(f"a prompt plus its max_new_tokens and k_max + 1 ({longest}) exceeds the batch's max_length ({self.max_length})")
        started = time.perf_counter()
        self._count(rows)  # the rows' earlier requests, if any
        prefill_rows(self.target, self.cache, rows, [p[:-1] for p in prompts])
        self.sampling.replace(rows, params)
        if self.drafter is not None:
            self.drafter.join(rows, prompts)
        for row, prompt in zip(rows, prompts):
            self.pending_ids[row] = prompt[-1]
            self.requests[row] = RequestStats(prompt_tokens=len(prompt))
            self.active[row] = True
        self._uncounted.update(rows)
        self.pending = torch.tensor(self.pending_ids, device=self.device)
        _sync(self.device)
        self.stats.prefill_time_s += time.perf_counter() - started

    def cancel(self, rows: Sequence[int], reason: str = "abort") -> None:
        """End the requests in these rows before their budget (a client went away, a stop
        string): they take no part in later passes and their rows are free."""
        for row in rows:
            if self.active[row]:
                self.active[row] = False
                self.requests[row].finish_reason = reason
        if self.compiled is not None:
            self.compiled.retire(list(rows))

    @torch.no_grad()
    def step(self) -> list[list[int]]:
        """One target pass over the active rows: the tokens newly committed to each row ([] for
        none, and for rows that are not active). A row that finishes here is no longer active."""
        policy, drafter, target, sampling, cache = self.policy, self.drafter, self.target, self.sampling, self.cache
        batch, device, stats = len(self.active), self.device, self.stats
        k = min(max(policy.choose(), 0), policy.k_max)
        _sync(device)
        t0 = time.perf_counter()
        if self.compiled is not None:  # propose, score, rule and both rollbacks (as if every active row goes on)
            committed, accepted, betas, k, draft_s = self.compiled.step(k)
            t1, t2 = t0 + draft_s, time.perf_counter()
            rows = list(zip(committed, accepted, betas))
        else:
            if drafter is not None:
                draft_token_ids, draft_probs = drafter.propose(k, sampling)  # [B, k], [B, k, V]
                k = draft_token_ids.shape[1]  # a drafter may propose fewer (prompt lookup with no match)
            else:
                draft_token_ids, draft_probs = self.pending.new_zeros(batch, 0), None
            _sync(device)
            t1 = time.perf_counter()
            start_lengths = cache.host_lengths
            scores = _score(target, torch.cat([self.pending[:, None], draft_token_ids], dim=1), cache, sampling)  # [B, k+1(, V)]
            _sync(device)
            t2 = time.perf_counter()
            output, num_accepted, beta = _rule(scores, draft_token_ids, draft_probs, sampling, start_lengths)  # [B, k+1], [B], [B, k]
            host = torch.cat([output, num_accepted[:, None], beta.double()], dim=1).tolist()  # the sync (float64: ids exact)
            accepted = [int(row[k + 1]) for row in host]
            rows = [([int(t) for t in values[: n + 1]], n, values[k + 2 :]) for values, n in zip(host, accepted)]
        stats.draft_time_s += t1 - t0
        stats.target_time_s += t2 - t1

        chunk: list[list[int]] = [[] for _ in range(batch)]
        finished = [False] * batch  # rows that stop at this step
        beta_sums, verified = [0.0] * k, [0] * k  # over active rows, for the policy
        for row, ((tokens, n, beta_row), request) in enumerate(zip(rows, self.requests)):
            if not self.active[row]:
                continue
            request.observe(k, n, beta_row)
            for i in range(min(n + 1, k)):
                beta_sums[i] += beta_row[i]
                verified[i] += 1
            params = sampling.params[row]
            tokens, reason = _cut(tokens, params.max_new_tokens - request.generated_tokens, params.stop_token_ids)
            request.generated_tokens += len(tokens)
            request.finish_reason = reason
            chunk[row] = tokens
            finished[row] = reason is not None
        still_active = [live and not done for live, done in zip(self.active, finished)]

        if self.compiled is not None:
            self.compiled.retire([row for row, done in enumerate(finished) if done])
        else:
            # Roll back to the committed tokens; a row that is not active keeps its old length (its
            # contents no longer matter, and its cache must not grow while others go on).
            cache.rollback([n + 1 + a if live else n for n, a, live in zip(start_lengths, accepted, still_active)])
            # The recovered or bonus token of each row is pending now (a finished row keeps its own).
            self.pending_ids = [int(values[a]) if live else old for values, a, live, old in zip(host, accepted, still_active, self.pending_ids)]
            self.pending = torch.tensor(self.pending_ids, device=device)  # [B]
            if drafter is not None:
                drafter.commit(accepted, self.pending, still_active)  # rows not active: ignored
        self.active = still_active
        self.last_k, self.last_accepted = k, accepted  # for a server's metrics: this pass's k and each row's accepted count
        policy.observe(k, beta_sums, verified, t1 - t0, time.perf_counter() - t1)
        return chunk

    def _count(self, rows: Sequence[int]) -> None:
        for row in rows:
            if row in self._uncounted:
                self._uncounted.discard(row)
                self.stats.add(self.requests[row])

    def close(self) -> None:
        """Add the requests not yet counted to stats, in row order (a row's request is counted
        when the row is reused, or here), and the batch's wall time; once."""
        if self._closed:
            return
        self._closed = True
        self._count(sorted(self._uncounted))
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
    (control.AdaptiveLength). Rows accept different counts per step; a row stops exactly at
    its max_new_tokens or at one of its stop tokens (which it includes). A fixed batch:
    `Batch` is the same loop with rows that join and leave.
    """
    batch = Batch(target, prompts, params, drafter, k, stats)
    try:
        while any(batch.active):
            yield batch.step()
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
