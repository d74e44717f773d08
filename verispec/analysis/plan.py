"""The advisor behind `verispec plan`: should you speculate, with which draft, and with which k?

Owns the teacher-forced acceptance estimate, the replay that predicts S(k), and the
recommendation. No decoding loop runs with a draft: the target continues each prompt once,
then the target and each draft score the whole sequence in one pass each. For a block of
proposals that starts at continuation position t this gives beta[t, j], the probability
that its j-th proposal is accepted once those before it were: sum_x min(p_{t+j}(x), q(x)).
A draft model's q is its distribution after the true prefix (drafts of accepted tokens
follow the committed text); prompt lookup's q is one-hot at the j-th token it proposes from
sequence[:t], and where no n-gram matches it proposes nothing (the engine's plain pass). Suffix
drafting replays itself along each sequence (`replay`) and may propose fewer than k tokens: beta
is 0 past its proposal, where the engine would not have drafted.

S(k) replays the engine's blocks over the continuation: from t, a block accepts exactly i proposals with
probability prod_{j<i} beta[t, j] * (1 - beta[t, i]) and the next starts at t + i + 1. The expected cost of
covering the continuation (k*c + r(k+1) per drafting pass, r(1) per plain one, from the profiler) is summed
backwards from its end, and S(k) = tokens / cost. Costs are in passes of verispec's plain decoding, the
baseline `bench` compares with: on llama.cpp that is the compiled step (`profile_passes`), which also times a
draft it runs, its k = 0 passes (plain passes) interleaved with the others in one calibration, so that the
machine's drift lands on the unit and the costs alike; a model-free drafter is timed on the step it runs (the
compiled one, its lookup before each call) with its lookup and the rule in r(n) (the same `profile_passes`,
proposing at every pass); a combined draft as its model (its lookup's own time not counted); other drafters
`profile_costs`' Python-path passes, over a compiled plain pass timed apart. Their r(1) is then above 1.
`profile_passes` samples as the plan's settings (at T > 0 a pass also processes the vocabulary and runs the
rule on it). Greedy (beta in {0, 1}) makes it the engine's own count of passes on that continuation. A
combined draft's gate depends on each row's history, so its passes are walked forward instead
(`combined_cost`: exact under greedy, a mean of seeded walks otherwise). Blocks start where the last one
stopped, after a rejection more often than at a random position, which a mean of beta over every position
misses (it overstates prompt lookup). The per-position alpha_i that `plan` reports are that mean (block
acceptance products over every start where the drafter proposes, and their ratios), for reading; the
prediction and the recommendation come from the replay."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..config import SamplingParams
from ..drafters.combined import CombinedDrafter, LookupGate
from ..drafters.ngram import PromptLookupDrafter
from ..engine import generate_all
from ..proposal import acceptance_grid
from ..sampling import RowSampling, process_logits
from .profile import context_bucket, profile_costs, profile_passes


def draft_model_of(candidate) -> torch.nn.Module | None:
    """The network a candidate runs (None for a model-free drafter such as prompt lookup)."""
    if isinstance(candidate, torch.nn.Module):
        return candidate
    return getattr(candidate, "model", None)


def _llamacpp_draft(drafter) -> bool:
    """Whether a drafter's model runs on llama.cpp, so on the compiled step (a torch draft beside a llama.cpp
    target, such as a vocabulary-subset draft of `train draft --target`, runs the Python path)."""
    return hasattr(drafter, "own_model") and not isinstance(getattr(drafter, "model", None), torch.nn.Module)


def _lookup(drafter: PromptLookupDrafter, sequence: list[int], start: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt lookup's proposal [T, k] from each prefix sequence[:t], t = start..end-1, and
    whether it came from a match [T] bool (else it is padding, and the engine would not draft)."""
    prefixes = [sequence[:t] for t in range(start, len(sequence))]
    drafter.start(prefixes, len(sequence))
    return drafter.lookup(k)


def _lookups(drafter, sequences: Sequence[Sequence[int]], starts: Sequence[int], k: int):
    """A model-free drafter's proposals along each sequence: per sequence, the padded proposal
    [T, k] from each prefix and its length [T] long (0: no match, the engine's plain pass). A
    drafter with `replay` (suffix drafting) runs it; prompt lookup proposes k or nothing."""
    if hasattr(drafter, "replay"):
        return drafter.replay(sequences, starts, k)
    results = []
    for sequence, start in zip(sequences, starts):
        proposals, found = _lookup(drafter, list(sequence), start, k)
        results.append((proposals, found.long() * k))
    return results


@torch.no_grad()
def teacher_forced_blocks(
    target: torch.nn.Module,
    draft,
    sequences: Sequence[Sequence[int]],
    starts: Sequence[int],
    params: SamplingParams,
    k_max: int,
    proposal_report: dict | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence, for the positions that predict sequence[starts[b]:]: beta [T, k_max] float64
    (beta[t, j] for the j-th proposal of a block that starts at t; 0 past the end) and
    proposes [T] bool. `draft` is a causal LM, a ModelDrafter, a PromptLookupDrafter or a
    SuffixDrafter (whose proposals past their own length are not proposed: beta 0 there).
    A draft model's beta is at its proposal temperature (`model_acceptance`), which it writes
    into `proposal_report` when one is given; a model-free drafter writes there its proposals'
    lengths per sequence ("lengths": [T] long, 0 where it proposes nothing), which set the
    positions of its passes (suffix drafting proposes fewer than k where its match is short)."""
    if isinstance(draft, CombinedDrafter):  # a combined draft
        return combined_blocks(combined_rows(target, draft, sequences, starts, params, k_max))
    model = draft_model_of(draft)
    if model is None and not isinstance(draft, PromptLookupDrafter) and not hasattr(draft, "replay"):
        raise ValueError(
            f"cannot score a {type(draft).__name__}: give a model, a ModelDrafter, a PromptLookupDrafter "
            "or a SuffixDrafter"
        )
    lookups = _lookups(draft, sequences, starts, k_max) if model is None else [None] * len(sequences)
    if model is None and proposal_report is not None:
        proposal_report["lengths"] = [lengths for _, lengths in lookups]
    accepted = [None] * len(sequences)
    if model is not None and not hasattr(draft, "chain"):
        accepted, tau, by_tau = model_acceptance(target, draft, sequences, starts, params)
        if proposal_report is not None:
            proposal_report.update(draft_temperature=tau, acceptance_by_tau=by_tau)
    blocks = []
    for sequence, start, lookup, per_position in zip(sequences, starts, lookups, accepted):
        length = len(sequence) - start
        at = torch.arange(length)[:, None] + torch.arange(k_max)  # [T, k_max]: position of proposal j from t
        if per_position is not None:  # a draft model
            blocks.append(
                (
                    torch.where(at < length, per_position[at.clamp(max=length - 1)], 0.0),
                    torch.ones(length, dtype=torch.bool),
                )
            )
            continue
        ids = torch.tensor([list(sequence)], device=target.device)
        p = process_logits(target(ids)[0, start - 1 : -1], params)  # [T, V]
        if hasattr(draft, "chain"):  # a draft of another tokenizer: its restricted q after each true prefix
            sampling = RowSampling(params, 1)
            q = torch.stack([draft.chain(list(sequence[:t]), 1, sampling)[1][0] for t in range(start, len(sequence))])
            per_position = torch.minimum(p, q.to(p.device, p.dtype)).sum(dim=-1).double().cpu()  # [T]
            beta = per_position[at.clamp(max=length - 1)]
            proposes = torch.ones(length, dtype=torch.bool)
        else:
            proposals, lengths = lookup  # [T, k_max], [T]
            beta = p[at.clamp(max=length - 1).to(p.device), proposals.to(p.device)].double().cpu()
            proposes = lengths > 0
            beta = torch.where(~proposes[:, None] | (torch.arange(k_max) < lengths[:, None]), beta, 0.0)
        blocks.append((torch.where(at < length, beta, 0.0), proposes.cpu()))
    return blocks


def model_acceptance(
    target: torch.nn.Module, draft, sequences: Sequence[Sequence[int]], starts: Sequence[int], params: SamplingParams
) -> tuple[list[torch.Tensor], float | None, dict[float, float]]:
    """A draft model's acceptance after each true prefix: per sequence sum min(p, q'_tau) [T] float64, at
    its proposal temperature (proposal.py): fixed, or under auto the tau of the grid that accepts most
    over every position (the choice auto converges to). Returns (acceptance per sequence, tau or None
    for a draft without one or at temperature 0, {tau: mean acceptance})."""
    model, proposal = draft_model_of(draft), getattr(draft, "proposal", None)
    taus = (1.0,) if proposal is None or params.greedy else proposal.taus
    grids = []
    for sequence, start in zip(sequences, starts):
        ids = torch.tensor([list(sequence)], device=target.device)
        p = process_logits(target(ids)[0, start - 1 : -1], params)  # [T, V]
        q = process_logits(model(ids)[0, start - 1 : -1], params).to(p.device, p.dtype)  # [T, V]
        grids.append(acceptance_grid(q[None], p[None], taus)[0].double().cpu())  # [T, G]
    means = torch.cat(grids).mean(dim=0)  # [G]
    best = int(means.argmax())
    tau = taus[best] if proposal is not None and not params.greedy else None
    return [grid[:, best] for grid in grids], tau, dict(zip(taus, means.tolist()))


@dataclass(frozen=True)
class CombinedRow:
    """A combined draft's teacher-forced view of one continuation: from each position t, the lookup's beta and the
    model's [T, k_max], where the lookup proposes [T] bool and its proposal's length [T] long."""

    lookup_beta: torch.Tensor
    model_beta: torch.Tensor
    confident: torch.Tensor
    lengths: torch.Tensor


def combined_rows(target, draft, sequences, starts, params, k_max, proposal_report: dict | None = None) -> list:
    """A combined draft (drafters/combined.py): a CombinedRow per sequence."""
    found: dict = {}
    lookup = teacher_forced_blocks(target, draft.lookup, sequences, starts, params, k_max, found)
    model = teacher_forced_blocks(target, draft.drafter, sequences, starts, params, k_max, proposal_report)
    return [
        CombinedRow(lookup_beta, model_beta, confident, lengths)
        for (lookup_beta, confident), (model_beta, _), lengths in zip(lookup, model, found["lengths"])
    ]


def combined_blocks(rows: Sequence[CombinedRow]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(beta, proposes) per sequence as the gate would choose at every position (`gated`): what the acceptance
    report shows; the cost replays the passes themselves (`combined_cost`)."""
    out = []
    for row in rows:
        took = gated(row.confident, row.lookup_beta[:, 0], row.model_beta[:, 0])
        out.append((torch.where(took[:, None], row.lookup_beta, row.model_beta), torch.ones_like(row.confident)))
    return out


def gated(confident: torch.Tensor, lookup_first: torch.Tensor, model_first: torch.Tensor) -> torch.Tensor:
    """Where a combined draft's gate (drafters/combined.LookupGate) takes the lookup at each position t [T] bool of
    one row, replayed at every position: a trial of the lookup where it is confident, of the model where the lookup
    is not taken, each hit with its first proposal's acceptance at t (lookup_first, model_first [T])."""
    gate, took = LookupGate(), []
    gate.add_rows(1)
    for sure, lookup_hit, model_hit in zip(confident.tolist(), lookup_first.tolist(), model_first.tolist()):
        took.append(bool(sure) and gate.prefers_lookup(0))
        gate.observe(0, lookup_hit if sure else None, None if took[-1] else model_hit)
    return torch.tensor(took, dtype=torch.bool)


def combined_cost(row: CombinedRow, k: int, c: float, r: Sequence[float], draws: int = 64, seed: int = 0) -> float:
    """Expected cost, in plain passes, of a combined draft at one row over one continuation with draft length k:
    its passes walked forward as the engine runs them, the gate (LookupGate) choosing at each, a pass by lookup
    alone costing r(min(k, its length) + 1), one by the model k*c + r(k + 1). Proposal i of a pass is accepted
    with its beta; the gate's lookup trial is a hit with the lookup's first beta (the pass's own outcome where the
    lookup drafted). Under greedy every beta is 0 or 1: one walk, the engine's passes exactly; else the mean of
    `draws` walks from a fixed seed."""
    length = row.lookup_beta.shape[0]
    lookup, model = row.lookup_beta[:, :k].tolist(), row.model_beta[:, :k].tolist()
    sure, sizes = row.confident.tolist(), [min(k, int(n)) for n in row.lengths.tolist()]
    exact = all(b in (0.0, 1.0) for beta in (row.lookup_beta, row.model_beta) for b in beta.unique().tolist())
    draws = 1 if exact or k == 0 else draws
    generator, total = torch.Generator().manual_seed(seed), 0.0
    for _ in range(draws):
        if k == 0:
            total += length * r[0]
            continue
        numbers = torch.rand(length, k + 1, generator=generator).tolist()  # [T, k + 1]: the tests, then the trial
        gate, t = LookupGate(), 0
        gate.add_rows(1)
        while t < length:
            took = bool(sure[t]) and gate.prefers_lookup(0)
            beta, u = (lookup if took else model)[t], numbers[t]
            n = next((i for i in range(k) if u[i] >= beta[i]), k)
            total += r[sizes[t]] if took else k * c + r[k]
            lookup_hit = float(n > 0) if took else float(u[k] < lookup[t][0]) if sure[t] else None
            gate.observe(0, lookup_hit, None if took else float(n > 0))
            t += n + 1
    return total / draws


def replay_cost(
    beta: torch.Tensor,
    proposes: torch.Tensor,
    k: int,
    c: float,
    r: Sequence[float],
    lengths: torch.Tensor | None = None,
) -> float:
    """Expected cost of producing the T tokens of one continuation with draft length k, in units
    of a plain pass: k*c + r(k+1) per drafting pass, r(1) where the drafter proposes nothing,
    blocks replayed as the engine runs them. beta [T, >= k], proposes [T]; r[n-1] = r(n). lengths [T]
    (a model-free drafter's, at one row): a pass from t proposes min(k, lengths[t]) tokens and costs
    r(that + 1) (beta is 0 past the proposal)."""
    length = beta.shape[0]
    rows, flags = beta[:, :k].tolist(), proposes.tolist()
    sizes = [k] * length if lengths is None else [min(k, int(n)) for n in lengths.tolist()]
    cost = [0.0] * (length + 1)  # cost[t]: expected cost from continuation position t to the end
    for t in range(length - 1, -1, -1):
        if k == 0 or not flags[t]:
            cost[t] = r[0] + cost[t + 1]
            continue
        total, reach = k * c + r[sizes[t]], 1.0  # reach = P(the first i proposals are accepted)
        for i in range(k):  # exactly i accepted: the next block starts at t + i + 1
            total += reach * (1.0 - rows[t][i]) * cost[min(t + i + 1, length)]
            reach *= rows[t][i]
        cost[t] = total + reach * cost[min(t + k + 1, length)]  # all k accepted
    return cost[0]


def position_alphas(
    betas: Sequence[torch.Tensor], k_max: int, block_starts: Sequence[torch.Tensor] | None = None
) -> list[float]:
    """alpha_1..alpha_k_max from per-position beta: ratios of mean block-acceptance products,
    over every block start t, or over those where block_starts[b][t] is True."""
    products = []  # products[i] = mean over t of prod_{j<=i} beta_{t+j}
    for i in range(k_max):
        values = [
            torch.stack([b[j : len(b) - i + j] for j in range(i + 1)]).prod(dim=0)[
                block_starts[n][: len(b) - i] if block_starts else slice(None)
            ]
            for n, b in enumerate(betas)
            if len(b) > i
        ]
        values = torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)
        products.append(float(values.mean()) if len(values) else float("nan"))
    alphas, before = [], 1.0
    for product in products:
        if math.isnan(product) or before <= 0:  # too few positions this deep: borrow the last
            alphas.append(alphas[-1] if alphas else 0.0)
            continue
        alphas.append(min(max(product / before, 0.0), 1.0))
        before = product
    return alphas


def position_counts(
    betas: Sequence[torch.Tensor], k_max: int, block_starts: Sequence[torch.Tensor] | None = None
) -> list[int]:
    """How many block starts reach depth 1..k_max (the samples behind each alpha_i)."""
    return [
        sum(
            int(block_starts[n][: len(b) - i].sum()) if block_starts else len(b) - i
            for n, b in enumerate(betas)
            if len(b) > i
        )
        for i in range(k_max)
    ]


def plan(
    target: torch.nn.Module,
    drafts: dict[str, object],
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    k_max: int = 8,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Per draft (a model or a drafter): alpha per position, c, the share of positions where it
    proposes, predicted S(k) for k = 0..k_max (the replay), the recommended k. `progress` is
    told each phase as it starts."""
    say = progress or (lambda message: None)
    say(f"the target's continuations of {len(prompts)} prompts")
    continuations = generate_all(target, prompts, params)
    sequences = [list(p) + c for p, c in zip(prompts, continuations)]
    context = round(sum(map(len, sequences)) / len(sequences))
    # the Python path's passes and their unit, at the mean context decoding sees (prompt to end): on llama.cpp
    # their cost curve changes shape with the context (a torch draft beside a llama.cpp target)
    decoding = context_bucket(round(sum(len(p) + len(s) for p, s in zip(prompts, sequences)) / (2 * len(prompts))))
    report = {"k_max": k_max, "temperature": params.temperature, "prompts": len(prompts), "candidates": []}
    # S(k) is over verispec's plain decoding, as bench's: on llama.cpp a plain pass runs the compiled step
    compiled = getattr(target, "compiled_step", None) is not None
    plain: list[float] = []  # the compiled plain pass, timed once where a candidate runs the Python path
    for number, (name, draft) in enumerate(drafts.items(), 1):
        say(f"draft {number}/{len(drafts)} ({name}): acceptance along the continuations, then its costs")
        starts = [len(p) for p in prompts]
        proposal = {}
        rows = None  # a combined draft's: its passes are replayed forward (combined_cost)
        if isinstance(draft, CombinedDrafter):
            rows = combined_rows(target, draft, sequences, starts, params, k_max, proposal)
            blocks = combined_blocks(rows)
        else:
            blocks = teacher_forced_blocks(target, draft, sequences, starts, params, k_max, proposal)
        lengths = proposal.pop("lengths", [None] * len(blocks))  # a model-free drafter's proposal lengths
        betas, proposes = [beta[:, 0] for beta, _ in blocks], [flags for _, flags in blocks]
        alphas = position_alphas(betas, k_max, proposes)
        timed = draft.drafter if isinstance(draft, CombinedDrafter) else draft  # a combined draft: its model's
        on_step = compiled and (hasattr(timed, "confident") or _llamacpp_draft(timed))
        if on_step:  # timed as generate runs it; its k = 0 passes are plain passes, interleaved with the others
            profile = profile_passes(target, timed, k_max, context, sampling=params)
        else:
            profile = profile_costs(target, draft_model_of(draft), k_max=k_max, context_length=decoding)
            if compiled and not plain:  # the Python path's passes, over the compiled step's plain pass
                plain.append(profile_passes(target, None, 0, decoding, repeats=7, sampling=params).target_s[0])
        unit = plain[0] if compiled and not on_step else profile.target_s[0]  # costs in plain passes
        c = (profile.draft_s or 0.0) / unit  # no draft model (prompt lookup): 0
        # a pass over more positions is never cheaper (timing noise)
        r = list(itertools.accumulate((t / unit for t in profile.target_s), max))
        tokens = sum(len(flags) for flags in proposes)
        predicted = [
            tokens
            / (
                sum(combined_cost(row, k, c, r) for row in rows)
                if rows is not None
                else sum(replay_cost(beta, flags, k, c, r, size) for (beta, flags), size in zip(blocks, lengths))
            )
            for k in range(1, k_max + 1)
        ]
        predicted = [1.0, *predicted]  # k = 0: plain decoding, the baseline
        share = float(torch.cat(proposes).double().mean())
        best = max(range(k_max + 1), key=lambda k: (predicted[k], -k))
        report["candidates"].append(
            {
                "draft": name,
                "alpha_by_position": alphas,
                "alpha_samples": position_counts(betas, k_max, proposes),
                "beta": float(torch.cat(betas).mean()),
                "c": c,
                "r": r,
                "proposal_share": share,
                "predicted_speedup": predicted,
                "recommended_k": best,
                "advice": "do not speculate" if best == 0 else f"speculate with k = {best}",
                "draft_temperature": proposal.get("draft_temperature"),
                "acceptance_by_tau": proposal.get("acceptance_by_tau", {}),
            }
        )
    return report
