"""`verispec check`: certify, on the user's own target, draft and settings, that decoding is lossless.

Owns `run_check` and its four parts, each a pass/fail with the numbers behind it:
(a) the rule at real contexts: for each context (a prompt and the target's greedy continuation
    of it) and each of the first k draft positions along the draft's most likely proposals,
    the models' actual p and q (processed with the user's settings; a model draft's q sharpened by
    its proposal temperature, proposal.py: fixed, or under auto the tau that accepts most on these
    contexts, as auto would choose on them), then N verifications of
    that position by the engine's own functions (`sample` on per-row streams, `verify`; in
    invariant mode `invariant.choose` and `verify_greedy`); the committed token must be
    distributed as p: Pearson chi-square, small cells pooled, at a 1e-9 false-failure rate,
    with the smallest total-variation error the test detects;
(b) invariant mode: speculative output equals plain output token for token, M seeds;
(c) greedy: speculative output equals plain output;
    where a row of (b) or (c) differs, the plain row's top two scores (log p + G, or logits) at
    the first difference are compared with the engine's measured pass-shape deviation δ (the
    largest logit gap between one-position and multi-position passes over these contexts,
    `llamacpp.deviation`): a gap the deviation can move (4δ/T for log p + G, 2δ for logits) is
    numerics and is reported, not failed; a larger gap is blamed on the rule and fails;
(d) the negative control: (a) again with a planted bug (the recovered token drawn from p instead of
    normalize(max(p - q, 0))) where it moves the output most (`_planted_tv`), must fail; where every
    proposal tested leaves the bug below what the test detects (q one-hot at a token of p near 0 or 1,
    or q = p), at that p with q = p restricted to its most likely tokens (`_visible_q`).
A deterministic drafter (prompt lookup) has q one-hot at its proposal; positions where it
proposes nothing are not tested. Each step and row says what it does on `progress`; a time limit
(`max_seconds`) or an interrupt ends the check between verifications, and the report then holds
every finished step and names the rest (`CheckReport.cut`). Knows nothing of the command line.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from .. import rejection
from ..config import SamplingParams
from ..engine import generate_all
from ..invariant import choose
from ..llamacpp.deviation import pass_shape_deviation
from ..proposal import acceptance_grid, sharpen
from ..sampling import RowSampling, row_seed, sample
from ..streams import RowStreams
from .chisquare import chi_square, detectable_tv, merge_cells, threshold

DRAWS_X_VOCAB = 200_000 * 8192  # the default draws per position: as many as fit this work (built-in vocabulary: 200k)
CHUNK = 256  # verifications per tensor pass: [CHUNK, V] work arrays small enough (16 MB at V = 8192) to reuse
COMPARED = 8  # prompts of the comparisons (b) and (c)
INVARIANT_BLOCK = 25  # (b)'s seeded rows per batch: progress, and the time limit, between blocks


class Cut(Exception):
    """The check's time limit passed."""


class _Clock:
    """A check's time limit: `tick()` raises Cut once `max_seconds` have passed (None: no limit)."""

    def __init__(self, max_seconds: float | None):
        self.started = time.perf_counter()
        self.deadline = None if max_seconds is None else self.started + max_seconds

    def tick(self) -> None:
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise Cut


@dataclass
class PositionTest:
    context: int  # which context (0-based)
    position: int  # draft position, 1-based
    proposal: int | None  # the deterministic drafter's proposal (None: drawn from q)
    beta: float  # sum min(p, q): the exact acceptance probability
    accepted: float  # the observed acceptance rate
    statistic: float
    df: int
    threshold: float
    detectable_tv: float  # the smallest TV error this test detects about half of the time
    passed: bool


@dataclass
class CheckReport:
    settings: dict
    draws: int
    tests: list[PositionTest] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # what could not be tested, and why
    invariant: dict | None = None  # (b): rows compared, rows equal
    greedy: dict | None = None  # (c)
    control: dict | None = None  # (d)
    deviation: dict | None = None  # the engine's pass-shape deviation over the contexts (llamacpp.deviation)
    proposal_tau: float | None = None  # the draft's proposal temperature that (a) tested (proposal.py)
    seconds: float = 0.0
    steps: list[str] = field(default_factory=list)  # the steps planned, in order
    finished: list[str] = field(default_factory=list)  # the steps finished
    cut: str | None = None  # what ended the check before its last step (a time limit, an interrupt)

    @property
    def passed(self) -> bool:
        """Every finished step passed (after a cut: a verdict on what was checked, if anything was)."""
        parts = [all(t.passed for t in self.tests)]
        parts += [part["passed"] for part in (self.invariant, self.greedy, self.control) if part is not None]
        if self.cut is not None:
            return all(parts) and bool(self.finished or self.tests)
        return all(parts) and (bool(self.tests) or self.settings["temperature"] == 0)

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def _prefilled(model, context: list[int], room: int):
    """A one-row cache holding context[:-1] (context[-1] is the next input), with room for more."""
    cache = model.new_cache(1, len(context) + room + 2)
    if len(context) > 1:
        model.prefill([context[:-1]], cache)
    return cache


def _chain(target, drafter, context: list[int], k: int, sampling: RowSampling):
    """Along the draft's most likely proposals: (proposals [k'], p [k', V], q [k', V] or None)."""
    if hasattr(drafter, "chain"):  # a draft of another tokenizer: its restricted q, over the target's ids
        proposals, q = drafter.chain(context, k, sampling)
    elif hasattr(drafter, "model"):  # a draft model (early exit included): q along its most likely proposals
        model, proposals, q = drafter.model, [], []
        cache = _prefilled(model, context, k)
        logits = model(torch.tensor([[context[-1]]], device=model.device), cache)[0, -1:]  # [1, V]
        for i in range(k):
            q.append(sampling.process(logits.float()[None])[0, 0])  # [V]
            proposals.append(int(q[-1].argmax()))
            if i + 1 < k:
                logits = model(torch.tensor([[proposals[-1]]], device=model.device), cache)[0, -1:]
        q = torch.stack(q)
    else:  # deterministic: what it proposes after the context
        drafter.start([context], len(context) + k + 2)
        proposals, q = drafter.propose(k, sampling)[0][0].tolist(), None
    ids = torch.tensor([[context[-1], *proposals[:-1]]], device=target.device)  # p_i: after context + x_1..x_{i-1}
    p = sampling.process(target(ids, _prefilled(target, context, k)).float())[0][: len(proposals)]  # [k', V]
    return proposals, p, q


def verify_position(
    p: torch.Tensor,
    q: torch.Tensor | None,
    proposal: int,
    params: SamplingParams,
    n: int,
    seed: int,
    mode: str,
    tick: Callable[[], None] = lambda: None,
) -> tuple[np.ndarray, int]:
    """n verifications of one position with target distribution p [V] and draft distribution q
    [V] (None: q one-hot at `proposal`), in chunks, each row its own stream: (counts of the
    committed token [V], acceptances). `tick` runs before each chunk (a time limit)."""
    vocab = p.shape[-1]
    counts, accepted = np.zeros(vocab, dtype=np.int64), 0
    for start in range(0, n, CHUNK):
        tick()
        rows = min(CHUNK, n - start)
        seeds = [row_seed(seed, b) for b in range(start, start + rows)]
        target_probs = p.expand(rows, 2, vocab)  # position i and (unused) i + 1
        draft_probs = None if q is None else q.expand(rows, 1, vocab)
        if mode == "invariant":
            keys = torch.tensor(seeds)
            positions = torch.zeros(rows, 1, dtype=torch.long)
            x = torch.full((rows, 1), proposal) if q is None else choose(draft_probs, keys, positions)
            target_ids = choose(target_probs[:, :1], keys, positions)
            output, num_accepted = rejection.verify_greedy(x, torch.cat([target_ids, target_ids], dim=1))
        else:
            streams = RowStreams(seeds)
            x = torch.full((rows, 1), proposal) if q is None else sample(draft_probs, streams)
            output, num_accepted = rejection.verify(x, draft_probs, target_probs, streams)
        counts += np.bincount(output[:, 0].numpy(), minlength=vocab)
        accepted += int(num_accepted.sum())
    return counts, accepted


def _test(context: int, position: int, proposal: int | None, p, q, counts, accepted: int, n: int) -> PositionTest:
    beta = float(torch.minimum(p, q).sum()) if q is not None else float(p[proposal])
    statistic, df = chi_square(counts, p.double().numpy())
    limit = threshold(df)
    return PositionTest(
        context, position, proposal, beta, accepted / n, statistic, df, limit, detectable_tv(n, df), statistic <= limit
    )


def _proposal_tau(drafter, chains: list, params: SamplingParams) -> float | None:
    """The proposal temperature (a) tests a model draft at: its fixed tau, or under auto the tau of the
    grid that accepts most on these contexts (what auto would choose on them); None where the drafter
    has none or the mode is invariant (whose rows propose from q)."""
    proposal = getattr(drafter, "proposal", None)
    pairs = [(p, q) for _, _, p, q in chains if q is not None]
    if proposal is None or params.sampling != "rejection" or not pairs:
        return None
    if not proposal.auto:
        return proposal.fixed
    grid = torch.cat([acceptance_grid(q[None], p[None], proposal.taus)[0] for p, q in pairs])  # [positions, G]
    return proposal.taus[int(grid.mean(dim=0).argmax())]


@contextmanager
def _residual_from_p():
    """The planted bug of the negative control: the recovered token drawn from p."""
    original = rejection._residual_probs
    rejection._residual_probs = lambda draft_probs, target_probs: target_probs
    try:
        yield
    finally:
        rejection._residual_probs = original


def default_draws(vocab_size: int) -> int:
    """Verifications per position by default: 200,000 at the built-in 8,192 tokens, fewer for a
    larger vocabulary (the work of one is a few passes over [V]), at least 20,000."""
    return max(20_000, min(200_000, DRAWS_X_VOCAB // vocab_size))


@torch.no_grad()
def run_check(
    target,
    drafter,
    prompts: list[list[int]],
    params: SamplingParams,
    contexts: int = 1,
    k: int = 4,
    n: int | None = None,
    seeds: int = 200,
    max_new_tokens: int = 16,
    progress: Callable[[str], None] | None = None,
    max_seconds: float | None = None,
) -> CheckReport:
    """All four parts on the prompts (token ids), each continued greedily by the target for 16
    tokens: (a) on the first `contexts` where the drafter proposes, (b) and (c) on the first
    COMPARED. `params` holds the user's settings (temperature, top-k, top-p, min-p, sampling
    mode, seed); `drafter` is a fresh drafter (it is reused across parts). Past `max_seconds`, or
    on an interrupt, the report holds the steps finished and says what cut it."""
    clock = _Clock(max_seconds)
    n = n or default_draws(target.vocab_size)
    report = CheckReport(settings=asdict(params), draws=n)
    report.steps = ["numerics"] + ([] if params.greedy else ["(a)", "(d)", "(b)"]) + ["(c)"]
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, len(os.sched_getaffinity(0))))  # (a) and (d) are torch's work alone
    try:
        _run_check(report, target, drafter, prompts, params, contexts, k, seeds, max_new_tokens, progress, clock)
    except Cut:
        report.cut = f"the time limit (--max-seconds {max_seconds:g})"
    except KeyboardInterrupt:
        report.cut = "an interrupt"
    finally:
        torch.set_num_threads(threads)
    report.seconds = time.perf_counter() - clock.started
    return report


def _run_check(report, target, drafter, prompts, params, contexts, k, seeds, max_new_tokens, progress, clock) -> None:
    say = progress or (lambda message: None)
    n, tick = report.draws, clock.tick
    seed = params.seed if params.seed is not None else 0
    greedy = SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
    say(f"contexts: {len(prompts)} prompts, each continued by 16 greedy tokens of the target")
    prompts = [c + t for c, t in zip(prompts, generate_all(target, prompts, replace(greedy, max_new_tokens=16)))]
    tick()
    say(
        f"pass-shape deviation: {min(COMPARED, len(prompts))} contexts, one-position passes against 4-position, 2-row "
        "and large-cache passes"
    )
    deviation = pass_shape_deviation(target, prompts[:COMPARED])
    report.deviation = {**asdict(deviation), "largest": deviation.largest}
    tick()
    if getattr(target, "shape_invariant", False):  # llama.cpp with exact kernels: what its default settings would give
        from ..llamacpp.deviation import default_settings_deviation

        say("pass-shape deviation under llama.cpp's default kernels (--exact-kernels off), in a fresh process")
        report.deviation["llama_cpp_defaults"] = default_settings_deviation(target, prompts[:COMPARED])
    report.finished.append("numerics")
    single = RowSampling(replace(params, seed=seed), 1)
    tested = []  # ((context, position, p, q, proposal), its test) of every position (a) tested
    if params.greedy:
        report.skipped.append("(a), (d): at temperature 0 p is one-hot; (c) is the test")
    else:
        chains = []  # (context, proposals, p, q)
        for c, context in enumerate(prompts):
            if len(chains) == contexts:
                break
            tick()
            proposals, p, q = _chain(target, drafter, context, k, single)
            if len(proposals) < k:
                report.skipped.append(
                    f"context {c + 1}: the drafter proposed {len(proposals)} of {k} tokens; "
                    + (f"positions {len(proposals) + 1}..{k} not tested" if proposals else "another prompt is used")
                )
            if proposals:
                chains.append((c, proposals, p, q))
        if not chains:  # one line, not one per context: (a) and (d) have nothing to test, and the verdict fails
            report.skipped = [
                f"(a), (d): the drafter proposed nothing after any of the {len(prompts)} contexts; give --prompts "
                "whose continuations repeat text it can draft from"
            ]
        tau = report.proposal_tau = _proposal_tau(drafter, chains, params)
        for c, proposals, p, q in chains:
            q = q if q is None or tau in (None, 1) else sharpen(q, tau)  # the distribution the draft proposes from
            for i, proposal in enumerate(proposals):
                qi = None if q is None else q[i]
                say(f"(a) context {c + 1}, position {i + 1} of {len(proposals)}: {n:,} verifications")
                counts, accepted = verify_position(
                    p[i], qi, proposal, params, n, row_seed(seed, 1000 * c + i), params.sampling, tick
                )
                test = _test(c, i + 1, None if qi is not None else proposal, p[i], qi, counts, accepted, n)
                report.tests.append(test)
                tested.append(((c, i + 1, p[i], qi, proposal), test))
        report.finished.append("(a)")
    if tested:  # (d): the same test with the planted bug, where it shows most
        _control(report, tested, params, n, seed, say, tick)
    if not params.greedy:
        _invariant(report, target, drafter, prompts, params, k, seeds, max_new_tokens, deviation, say, tick)
    tick()
    say(f"(c) greedy: {min(COMPARED, len(prompts))} prompts, speculative against plain, {max_new_tokens} tokens")
    plain = generate_all(target, prompts[:COMPARED], greedy)
    spec = generate_all(target, prompts[:COMPARED], greedy, drafter, k=k)
    gaps = [_logit_gap(target, context, a, b) for context, a, b in zip(prompts, plain, spec) if a != b]
    report.greedy = {
        "rows": len(plain),
        "equal": len(plain) - len(gaps),
        "near_ties": sum(g <= 2 * deviation.largest for g in gaps),
        "gaps": gaps,
        "passed": all(g <= 2 * deviation.largest for g in gaps),
    }
    report.finished.append("(c)")


def _planted_tv(p: torch.Tensor, q: torch.Tensor) -> float:
    """TV from p of what the rule commits with the planted bug: min(p, q) + (1 - beta) p against p."""
    return 0.5 * float((torch.minimum(p, q) - torch.minimum(p, q).sum() * p).abs().sum())


def _visible_q(p: torch.Tensor, n: int) -> torch.Tensor:
    """A draft q under which the planted bug shows most in (a)'s test of n draws at p: p restricted to its j most
    likely tokens S, renormalised (the bug then commits p on S plus (1 - p(S)) p), j chosen over powers of two by
    the chi-square statistic the bug adds in expectation, after the test's pooling of small cells."""
    order, expected = p.argsort(descending=True), n * p.double().numpy()

    def shift(j: int) -> float:
        buggy = (1 - float(p[order[:j]].sum())) * expected
        buggy[order[:j].numpy()] += expected[order[:j].numpy()]
        observed, pooled = merge_cells(buggy, expected)
        return float(((observed - pooled) ** 2 / pooled).sum())

    j = max((2**i for i in range(int(math.log2(len(p))) + 1)), key=shift)
    return torch.zeros_like(p).index_put_((order[:j],), p[order[:j]] / p[order[:j]].sum())


def _control(report, tested, params, n, seed, say, tick) -> None:
    """(d): (a)'s test with the recovered token drawn from p, where that error is largest: it must fail."""
    one_hot = lambda token, p: torch.nn.functional.one_hot(torch.tensor(token), p.shape[-1]).float()  # noqa: E731
    found = [(c, i, p, q if q is not None else one_hot(x, p), x, t) for (c, i, p, q, x), t in tested]
    c, position, p, q, proposal, test = max(found, key=lambda t: _planted_tv(t[2], t[3]))
    if _planted_tv(p, q) < test.detectable_tv:  # the drafter's proposals cannot show the bug: a q of its own
        q, proposal = _visible_q(p, n), None
    beta = float(torch.minimum(p, q).sum())
    say(f"(d) negative control at context {c + 1}, position {position}: {n:,} verifications, recovered tokens from p")
    with _residual_from_p():
        counts, accepted = verify_position(p, q, proposal, params, n, row_seed(seed, 999_999), "rejection", tick)
    test = _test(c, position, None, p, q, counts, accepted, n)
    report.control = {
        "context": c,
        "position": position,
        "proposal": proposal,
        "beta": beta,
        "planted_tv": _planted_tv(p, q),
        "statistic": test.statistic,
        "df": test.df,
        "threshold": test.threshold,
        "detectable_tv": test.detectable_tv,
        "passed": not test.passed,
    }
    report.finished.append("(d)")


def _invariant(report, target, drafter, prompts, params, k, seeds, max_new_tokens, deviation, say, tick) -> None:
    """(b): seeded rows in invariant mode, speculative against plain, in blocks (each row's text depends on its seed
    alone), `report.invariant` kept up to date after each block."""
    seed = params.seed if params.seed is not None else 0
    rows = [prompts[b % min(COMPARED, len(prompts))] for b in range(seeds)]
    invariant = [
        replace(params, sampling="invariant", seed=seed + b, max_new_tokens=max_new_tokens) for b in range(seeds)
    ]
    movable = 4 * deviation.largest / params.temperature  # log p + G moves by at most 4 delta / T (each logit delta)
    gaps, started = [], time.perf_counter()
    for start in range(0, seeds, INVARIANT_BLOCK):
        tick()
        block = slice(start, min(start + INVARIANT_BLOCK, seeds))
        left = "" if start == 0 else f", about {(time.perf_counter() - started) * (seeds - start) / start:.0f} s left"
        say(f"(b) invariant mode: seeded rows {block.start + 1}-{block.stop} of {seeds}, {max_new_tokens} tokens{left}")
        plain = generate_all(target, rows[block], invariant[block])
        spec = generate_all(target, rows[block], invariant[block], drafter, k=k)
        gaps += [
            _gap(target, rows[start + b], a, b_tokens, invariant[start + b])
            for b, (a, b_tokens) in enumerate(zip(plain, spec))
            if a != b_tokens
        ]
        report.invariant = {
            "rows": block.stop,
            "equal": block.stop - len(gaps),
            "near_ties": sum(g <= movable for g in gaps),
            "gaps": gaps,
            "passed": all(g <= movable for g in gaps),
        }
    report.finished.append("(b)")


def _gap(target, prompt: list[int], plain: list[int], spec: list[int], params: SamplingParams) -> float:
    """At the first token where plain and speculative rows differ, the gap between the two largest
    scores log p(x) + G(x) of plain decoding (nats): tiny for a floating-point near-tie."""
    from ..invariant import gumbel_noise

    i = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    context = prompt + plain[:i]
    logits = target(torch.tensor([[context[-1]]], device=target.device), _prefilled(target, context, 0))[
        :, -1:
    ].float()  # [1, 1, V]
    probs = RowSampling(params, 1).process(logits)
    scores = probs.double().log() + gumbel_noise(
        torch.tensor([params.seed]), torch.tensor([[len(context)]]), probs.shape[-1]
    )
    top = scores.reshape(-1).topk(2).values
    return float(top[0] - top[1])


def _logit_gap(target, prompt: list[int], plain: list[int], spec: list[int]) -> float:
    """At the first token where greedy plain and speculative rows differ, the gap between the plain
    row's two largest logits (a one-position pass, as plain decoding scores it)."""
    i = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    context = prompt + plain[:i]
    logits = target(torch.tensor([[context[-1]]], device=target.device), _prefilled(target, context, 0))[
        0, -1
    ].float()  # [V]
    top = logits.topk(2).values
    return float(top[0] - top[1])
