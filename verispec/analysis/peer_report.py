"""The report of `verispec bench --peer llamacpp`, from the runs of every system on every (prompt, seed) pair.

Owns `report`: per system and pair the median decode tokens/s over rounds; per system the median of
those over pairs, and each ratio (to llama.cpp plain, to llama.cpp's fastest speculative row, to its
fastest n-gram row) as the median of per-pair ratios with their [min, max]; acceptance per proposal
(accepted / drafted, pooled over every run, and its range over pairs) for every system that drafts;
verispec's own time per target pass; the proposal temperature each verispec run ended on, where its
drafter has one; and, greedy, whether each system's output is llama.cpp plain's. Knows nothing of how
the systems ran: a run is a dict with "decoded" and "seconds", and "tokens" or "text", "stats" (verispec)
or "drafted"/"accepted" (llama.cpp's program).
"""

from __future__ import annotations

import statistics
from collections import Counter

from ..stats import SpecStats
from .llamacpp_program import DRAFT_SIMPLE, keep_best_lengths

PLAIN = "llama.cpp plain (llama-cpp-python)"


def report(
    results: dict[str, list[list[dict]]],
    pairs: list[tuple[int, int]],
    tokenizer,
    header: dict,
    sweeps: dict[str, tuple[str, int]] | None = None,
) -> dict:
    """The report's rows from results[system][pair] (that pair's runs, one per round), `pairs` the
    (prompt index, seed) of each pair; each n-gram drafter of `sweeps` (system name -> (drafter,
    length)) kept at its fastest length. `tokenizer` decodes token ids to compare with the program's text."""
    rows = []
    for system, per_pair in results.items():
        speeds = [statistics.median(r["decoded"] / r["seconds"] for r in runs) for runs in per_pair]
        row = {"system": system, "tokens_per_s": statistics.median(speeds), "pair_tokens_per_s": speeds}
        row.update(acceptance(per_pair))
        if "stats" in per_pair[0][0]:
            row.update(_own_time(per_pair), **_proposals(per_pair))
        if header["temperature"] == 0:
            row.update(_identity(system, results, tokenizer))
        rows.append(row)
    rows = keep_best_lengths(rows, sweeps or {})
    # llama.cpp's drafts with a model (alone, or chained after an n-gram drafter), and its model-free n-gram drafters
    chained = [row for row in rows if DRAFT_SIMPLE in row["system"]]
    own = [row for row in rows if row["system"].startswith("llama.cpp speculative")] + chained
    ngram = [row for row in rows if "draft_length_sweep" in row and row not in chained]
    best_own = max(own, key=lambda row: row["tokens_per_s"]) if own else None
    best_ngram = max(ngram, key=lambda row: row["tokens_per_s"]) if ngram else None
    for row in rows:
        for name, reference in (
            ("vs_llamacpp_plain", rows[0]),
            ("vs_llamacpp_speculative_best", best_own),
            ("vs_llamacpp_ngram_best", best_ngram),
        ):
            row[name], row[f"{name}_range"] = versus(row, reference)
    return {
        **header,
        "pair_order": [list(pair) for pair in pairs],
        "llamacpp_speculative_best": None if best_own is None else best_own["system"],
        "runs": rows,
    }


def versus(row: dict, reference: dict | None) -> tuple[float | None, list[float] | None]:
    """The median over pairs of row's tokens/s over reference's, and [min, max] of those ratios."""
    if reference is None:
        return None, None
    ratios = [a / b for a, b in zip(row["pair_tokens_per_s"], reference["pair_tokens_per_s"])]
    return statistics.median(ratios), [min(ratios), max(ratios)]


def _counts(run: dict) -> tuple[int, int] | None:
    """(drafted, accepted) of one run; None for a system that does not report them."""
    if "stats" in run:
        return run["stats"].proposed, run["stats"].accepted
    if "drafted" in run:
        return run["drafted"], run["accepted"]
    return None


def acceptance(per_pair: list[list[dict]]) -> dict:
    """alpha_hat = accepted / drafted over every run, and alpha_hat_range = [min, max] over pairs
    (pairs that drafted nothing left out); {} for a system without counts."""
    counts = [[_counts(run) for run in runs] for runs in per_pair]
    if counts[0][0] is None:
        return {}
    by_pair = [(sum(d for d, _ in pair), sum(a for _, a in pair)) for pair in counts]
    drafted, accepted = sum(d for d, _ in by_pair), sum(a for _, a in by_pair)
    alphas = [a / d for d, a in by_pair if d]
    return {
        "alpha_hat": accepted / drafted if drafted else None,
        "alpha_hat_range": [min(alphas), max(alphas)] if alphas else None,
        "drafted": drafted,
        "accepted": accepted,
    }


def _own_time(per_pair: list[list[dict]]) -> dict:
    """verispec's pooled stats and its time outside llama.cpp's passes, per target pass."""
    runs = [run for pair in per_pair for run in pair]
    stats = SpecStats()
    for run in runs:
        stats.add(run["stats"].requests[0])
    decode_s, inside_s, target_s = (sum(run[key] for run in runs) for key in ("seconds", "inside", "target"))
    return {
        "beta": stats.beta if stats.proposed else None,
        "mean_tokens_per_pass": stats.mean_tokens_per_pass,
        "own_ms_per_pass": 1e3 * (decode_s - inside_s) / stats.target_passes,
        "own_share_of_target_pass": (decode_s - inside_s) / target_s,
    }


def _proposals(per_pair: list[list[dict]]) -> dict:
    """The proposal temperature each run ended on, counted, and the mean of each tau's measured acceptance;
    {} when the drafter reports none."""
    summaries = [run["proposal"] for pair in per_pair for run in pair if run.get("proposal")]
    if not summaries:
        return {}
    taus = Counter(float(summary["tau"]) for summary in summaries)
    measured: dict[float, list[float]] = {}
    for summary in summaries:
        for tau, value in summary.get("acceptance", {}).items():
            measured.setdefault(float(tau), []).append(float(value))
    return {
        "proposal_tau": {f"{tau:g}": n for tau, n in taus.most_common()},
        "proposal_acceptance": {f"{tau:g}": statistics.mean(values) for tau, values in sorted(measured.items())},
    }


def _identity(system: str, results: dict[str, list[list[dict]]], tokenizer) -> dict:
    """Greedy: whether the last round's output of each pair is llama.cpp plain's (and, for verispec's
    token ids, verispec plain's: speculative = plain)."""
    last = [runs[-1] for runs in results[system]]
    reference = [runs[-1]["tokens"] for runs in results[PLAIN]]
    if "tokens" in last[0]:
        same = [run["tokens"] == tokens for run, tokens in zip(last, reference)]
    else:  # text, over what both produced (the program may decode a few tokens more)
        texts = (tokenizer.decode(tokens) for tokens in reference)
        same = [a.startswith(b) or b.startswith(a) for a, b in zip((run["text"] for run in last), texts)]
    row = {"identical_to_llamacpp_plain": all(same), "identical_prompts": sum(same)}
    if system.startswith("verispec") and "tokens" in last[0] and "verispec plain" in results:
        own = [runs[-1]["tokens"] for runs in results["verispec plain"]]
        row["identical_to_verispec_plain"] = all(run["tokens"] == tokens for run, tokens in zip(last, own))
    return row
