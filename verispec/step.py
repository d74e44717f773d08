"""One iteration of the engine on the Python path, and the interface both paths keep.

Owns `Iteration` (what one step did: each row's committed tokens, accepted count and beta, the
proposals verified, the seconds drafting and scoring, the log-probabilities asked for), `Step`
(what the engine drives: `run`, then `commit` after its bookkeeping; `keep_rows` and `add_rows` as rows
leave and join, `read_joined`; `retire` where rows cannot leave)
and `PythonStep`: the drafter proposes k tokens per row, the target scores [pending, proposals]
in one pass, `rejection.verify_batch` keeps a prefix of each row and adds a recovered or bonus
token, and `commit` rolls the target's cache and the drafter back to the committed tokens. The
compiled step (llamacpp/step.py: propose, score, rule and both rollbacks in one C call) keeps the
same interface; the engine picks one of the two when a batch starts. `token_logprobs` is both paths'
log-probability of each committed token. Knows nothing of requests,
budgets or text.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Protocol

import torch

from .drafters.base import Drafter
from .rejection import verify_batch
from .sampling import RowSampling

LogProbs = list[tuple[float, dict[int, float]]]  # per output position: (log p(token), {alternative: log p})


class Iteration(NamedTuple):
    """One step's outcome, per row of the batch (rows not running: anything, the engine skips them)."""

    tokens: list[list[int]]  # [B][n_b + 1]: n_b accepted proposals, then the recovered or bonus token
    accepted: list[int]  # [B] n_b, 0..k
    beta: list[list[float]]  # [B][>= min(n_b + 1, k)]: sum min(p, q) at each verified position
    k: int  # proposals made per row (the k asked for, or fewer where a drafter stopped early)
    draft_s: float  # seconds proposing
    target_s: float  # seconds scoring (and, on the compiled step, the rule and the rollbacks)
    logprobs: dict[int, LogProbs]  # row -> its tokens' log-probabilities, where they were asked for


class Step(Protocol):
    """What the engine asks of an iteration, on either path."""

    can_change_rows: bool  # rows may leave and join between steps (the batch's keep_rows / add_rows)

    def run(self, k: int, pending: torch.Tensor, logprobs: dict[int, int]) -> Iteration | tuple:
        """Propose up to k tokens for every running row, verify them after pending [B] (the token
        each row's caches have not read yet); logprobs: row -> top alternatives wanted. A tuple
        holds Iteration's fields in its order."""

    def commit(self, accepted: list[int], pending: torch.Tensor, live: list[bool]) -> None:
        """After the engine cut each row at its budget and stop tokens: rows with live[b] go on
        with accepted[b] proposals committed and pending[b] as their next token; the others
        keep what their caches held before the step."""

    def retire(self, rows: list[int]) -> None:
        """Rows that finished and stay in place (`can_change_rows` false): no part in later steps."""

    def keep_rows(self, rows: list[int]) -> None:
        """Only `rows` stay: called before the caches, the drafter and the sampling drop the others."""

    def add_rows(self, rows: list[int], pending: list[int]) -> None:
        """Rows that joined, after the caches, the drafter and the sampling took them; pending[i] is
        row rows[i]'s next token."""

    @property
    def joined_unread(self) -> int:
        """Prompt tokens of joined rows that the draft has not read yet."""

    def read_joined(self) -> None:
        """The draft reads those prompts now (the engine times it: a cost per request)."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":  # timings only mean something once queued work is done
        torch.cuda.synchronize(device)


def score(target, input_ids: torch.Tensor, cache, sampling: RowSampling, logits: bool = False) -> torch.Tensor:
    """The target's pass over input_ids [B, k+1], as the rule needs it: when every row is at
    temperature 0 (and `logits` is not asked for) the argmax ids [B, k+1] (`forward_argmax`
    where the model offers it: no logits tensor); else the raw logits [B, k+1, V]."""
    if sampling.greedy and not logits:
        forward_argmax = getattr(target, "forward_argmax", None)
        if forward_argmax is not None:
            return forward_argmax(input_ids, cache)
        return target(input_ids, cache).argmax(dim=-1)
    return target(input_ids, cache)


class PythonStep:
    """The iteration in PyTorch over any target with the model protocol and any `Drafter`."""

    def __init__(self, target, cache, drafter: Drafter | None, sampling: RowSampling, device: torch.device):
        self.target, self.cache, self.drafter, self.sampling, self.device = target, cache, drafter, sampling, device
        self.can_change_rows = hasattr(cache, "keep_rows") and (
            drafter is None or getattr(drafter, "can_change_rows", False)
        )
        self._start_lengths: list[int] = []

    def run(self, k: int, pending: torch.Tensor, logprobs: dict[int, int]) -> Iteration:
        started = time.perf_counter()
        if self.drafter is not None:
            draft_token_ids, draft_probs = self.drafter.propose(k, self.sampling)  # [B, k], [B, k, V]
            k = draft_token_ids.shape[1]  # a drafter may propose fewer (prompt lookup with no match)
        else:
            draft_token_ids, draft_probs = pending.new_zeros(len(pending), 0), None
        sync(self.device)
        drafted = time.perf_counter()
        self._start_lengths = self.cache.host_lengths
        input_ids = torch.cat([pending[:, None], draft_token_ids], dim=1)  # [B, k+1]
        scores = score(self.target, input_ids, self.cache, self.sampling, bool(logprobs))  # [B, k+1(, V)]
        sync(self.device)
        scored = time.perf_counter()
        starts = self._start_lengths
        output, num_accepted, beta, target_probs = verify_batch(
            scores, draft_token_ids, draft_probs, self.sampling, starts
        )  # [B, k+1], [B], [B, k], [B, k+1, V] or None
        observe = getattr(self.drafter, "observe_target", None)  # a drafter that learns from p (proposal.py)
        if observe is not None and target_probs is not None and k > 0:
            observe(target_probs, num_accepted, self.sampling.rows("rejection"))
        # the sync (float64: ids exact)
        host = torch.cat([output, num_accepted[:, None], beta.double()], dim=1).tolist()
        accepted = [int(row[k + 1]) for row in host]
        tokens = [[int(t) for t in values[: n + 1]] for values, n in zip(host, accepted)]
        found = token_logprobs(scores, output, logprobs) if logprobs else {}
        betas = [values[k + 2 :] for values in host]
        return Iteration(tokens, accepted, betas, k, drafted - started, scored - drafted, found)

    def commit(self, accepted: list[int], pending: torch.Tensor, live: list[bool]) -> None:
        """Roll back to the committed tokens; a row that is not running keeps its old length (rows
        stay in place where they cannot leave: their contents no longer matter, and their caches
        must not grow while others go on)."""
        self.cache.rollback([n + 1 + a if on else n for n, a, on in zip(self._start_lengths, accepted, live)])
        if self.drafter is not None:
            self.drafter.commit(accepted, pending, live)  # rows not running: ignored

    def retire(self, rows: list[int]) -> None:
        """Nothing: a row that is not live is left as it was by `commit`."""

    def keep_rows(self, rows: list[int]) -> None:
        """Nothing: the caches and the drafter hold every per-row state of this path."""

    def add_rows(self, rows: list[int], pending: list[int]) -> None:
        """Nothing: as keep_rows."""

    @property
    def joined_unread(self) -> int:
        return getattr(self.drafter, "joined_unread", 0)

    def read_joined(self) -> None:
        self.drafter.read_joined()


def token_logprobs(scores: torch.Tensor, output: torch.Tensor, wanted: dict[int, int]) -> dict[int, LogProbs]:
    """For each row in wanted (row -> top alternatives): (log p(token), {alternative: log p}) at
    every position of output [B, k+1] (-1 past the committed tokens), from the raw logits scores [B, k+1, V]."""
    rows = list(wanted)
    index = torch.tensor(rows, device=scores.device)
    logp = torch.log_softmax(scores[index].float(), dim=-1)  # [R, k+1, V]
    chosen = logp.gather(-1, output[index].clamp_min(0)[..., None]).squeeze(-1).tolist()  # [R][k+1]
    top_n = max(wanted.values())
    top = logp.topk(top_n, dim=-1) if top_n else None
    values, ids = (top.values.tolist(), top.indices.tolist()) if top is not None else (None, None)
    out = {}
    for i, row in enumerate(rows):
        n = wanted[row]
        out[row] = [
            (chosen[i][j], dict(zip(ids[i][j][:n], values[i][j][:n])) if n else {}) for j in range(output.shape[1])
        ]
    return out
