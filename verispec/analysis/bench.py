"""Side-by-side measurement: plain vs speculative decoding of the same prompts, in one run.

Owns `run_bench` and its reports (JSON, CSV, PNG plots). For every temperature and repeat,
each draft length k is measured as a pair, plain then speculative, over the whole prompt
set (batch 1 per prompt, as a user runs it), so that machine drift lands on both sides of a
ratio. A run's speed-up is the median of its per-pair ratios, with the min and max as its
spread; the predicted speed-up comes from the refined model (theory.py) with the run's own
per-position beta, its share of passes that proposed fewer than k tokens (prompt lookup with
no match: a plain pass), and the profiler's c and r(n). Greedy runs also check that the speculative
tokens equal the plain ones. Knows nothing of text.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..config import SamplingParams
from ..drafters.base import Drafter
from ..engine import generate_all
from ..models.quantize import weight_bytes
from ..policy import AdaptiveLength
from ..stats import SpecStats
from ..theory import mixed_speedup
from .profile import profile_costs

RUN_FIELDS = (
    "k",
    "temperature",
    "tokens_per_s_baseline",
    "tokens_per_s_speculative",
    "speedup",
    "speedup_min",
    "speedup_max",
    "decode_speedup",
    "alpha_hat",
    "beta",
    "mean_tokens_per_pass",
    "predicted_speedup",
    "greedy_identical",
    "baseline_spread",
    "noisy",
    "sampling",
    "invariant_identical",
    "invariant_bound",
)


def _timed(target, prompts, params, drafter, k) -> tuple[list[list[int]], float, SpecStats, list[float]]:
    """Run the prompts one by one; return outputs, tokens/s (prefill included), the stats and a model
    draft's proposal temperature at the end of each prompt. A drafter's corpus of earlier requests
    (suffix drafting) spans the prompts of this round only: no round sees another's outputs."""
    if hasattr(drafter, "clear_corpus"):
        drafter.clear_corpus()
    stats = SpecStats()
    outputs, started, taus = [], time.perf_counter(), []
    for prompt in prompts:
        outputs.extend(generate_all(target, [prompt], params, drafter, k=k, stats=stats))
        if getattr(drafter, "proposal", None) is not None and not params.greedy:
            taus.append(drafter.proposal.summary()["tau"])
    elapsed = time.perf_counter() - started
    return outputs, sum(map(len, outputs)) / elapsed, stats, taus


def _decode_s_per_token(outputs: list[list[int]], tokens_per_s: float, stats: SpecStats) -> float:
    """Seconds per generated token with the prefill taken out (_timed's tokens/s includes it)."""
    tokens = sum(map(len, outputs))
    return (tokens / tokens_per_s - stats.prefill_time_s) / tokens


def proposal_tau(taus: list[float]) -> float | None:
    """The proposal temperature most prompts ended at (the larger on ties), or None without a model draft."""
    return max(set(taus), key=lambda tau: (taus.count(tau), tau)) if taus else None


def _alphas(stats: SpecStats, k: int) -> list[float]:
    """Per-position beta, an unverified position borrowing the one before."""
    out: list[float] = []
    for i in range(k):
        value = stats.beta_by_position[i] if i < len(stats.beta_by_position) else float("nan")
        out.append(
            min(max(value, 0.0), 1.0) if not math.isnan(value) else (out[-1] if out else 0.0)
        )  # float32 beta: 1 + ulp
    return out


def _predicted_with_prefill(
    decode_speedup: float, plain_decode_s: float, prefill_plain_s: float, prefill_spec_s: float
) -> float:
    """The refined model predicts decoding; prompts are prefilled all the same (the draft's
    too), measured. Whole-run speed-up = (prefill + decode) plain / (prefill + decode) spec."""
    return (prefill_plain_s + plain_decode_s) / (prefill_spec_s + plain_decode_s / decode_speedup)


NOISY_SPREAD = 1.25  # a plain baseline whose repeats range wider than this (max / min) marks its run noisy


def run_bench(
    target: torch.nn.Module,
    make_drafter: Callable[[], Drafter],
    prompts: Sequence[Sequence[int]],
    ks: Sequence[int | str],
    temperatures: Sequence[float] = (0.0,),
    max_new_tokens: int = 64,
    repeats: int = 3,
    seed: int = 0,
    draft_model: torch.nn.Module | None = None,
    progress: bool = True,
    samplings: Sequence[str] = ("rejection",),
    truncation: dict | None = None,
) -> dict:
    """Measure every (temperature, sampling mode, k); return {"runs": [...], "profile": ..., ...}.
    `truncation` (top_k, top_p, min_p, as SamplingParams takes them) applies at every temperature.

    Invariant mode (not run at T = 0, where it is greedy) also checks that the speculative
    tokens equal the plain ones, and its run carries the bound on its acceptance, beta/(2 - beta)
    = (1 - TV)/(1 + TV), from the rejection run's beta at the same T and k when there is one
    (the bound is convex in beta, so at the mean beta it bounds the mean acceptance too)."""
    from tqdm import tqdm

    if not prompts:
        raise ValueError("prompts must not be empty")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    numeric = [k for k in ks if k != "auto"]
    if any(not isinstance(k, int) or k < 1 for k in numeric) or len(numeric) + ks.count("auto") != len(ks):
        raise ValueError(f"ks must be integers >= 1 or 'auto', got {list(ks)}")
    k_max = max(numeric or [8])
    context = round(statistics.mean(len(p) for p in prompts) + max_new_tokens / 2)
    profile = profile_costs(target, draft_model, k_max=k_max, context_length=context)  # no draft model: c = 0
    runs = []
    settings = [(t, mode) for t in temperatures for mode in samplings if not (t == 0 and mode == "invariant")]
    bar = tqdm(total=len(settings) * len(ks) * repeats, disable=not progress, desc="bench", dynamic_ncols=True)
    for temperature, sampling in settings:
        params = SamplingParams(
            temperature=temperature, seed=seed, max_new_tokens=max_new_tokens, sampling=sampling, **(truncation or {})
        )
        for k in ks:
            base_tps, spec_tps, ratios, identical, stats_all = [], [], [], True, SpecStats()
            decode_ratios = []  # prefill excluded: what plan predicts
            prefill_plain, prefill_spec, taus = [], [], []
            for _ in range(repeats):
                plain, tps_a, plain_stats, _ = _timed(target, prompts, params, None, 0)
                policy = AdaptiveLength(k_max=k_max, prior_c=profile.c or 0.0, prior_r=profile.r) if k == "auto" else k
                spec, tps_b, stats, spec_taus = _timed(target, prompts, params, make_drafter(), policy)
                base_tps.append(tps_a)
                spec_tps.append(tps_b)
                ratios.append(tps_b / tps_a)
                decode_ratios.append(
                    _decode_s_per_token(plain, tps_a, plain_stats) / _decode_s_per_token(spec, tps_b, stats)
                )
                identical = identical and spec == plain
                prefill_plain.append(plain_stats.prefill_time_s)
                prefill_spec.append(stats.prefill_time_s)
                taus += spec_taus
                for request in stats.requests:
                    stats_all.add(request)
                bar.update(1)
            run = {
                "k": k,
                "temperature": temperature,
                "tokens_per_s_baseline": statistics.median(base_tps),
                "tokens_per_s_speculative": statistics.median(spec_tps),
                "speedup": statistics.median(ratios),
                "speedup_min": min(ratios),
                "speedup_max": max(ratios),
                "decode_speedup": statistics.median(decode_ratios),
                "alpha_hat": stats_all.alpha_hat,
                "beta": stats_all.beta,
                "mean_tokens_per_pass": stats_all.mean_tokens_per_pass,
                "acceptance_by_position": stats_all.acceptance_by_position,
                "beta_by_position": stats_all.beta_by_position,
                "draft_temperature": proposal_tau(taus),
                "predicted_speedup": None,
                "greedy_identical": identical if temperature == 0 else None,
                "baseline_spread": max(base_tps) / min(base_tps),
                "sampling": sampling,
                "invariant_identical": identical if sampling == "invariant" and temperature > 0 else None,
                "invariant_bound": None,
            }
            run["noisy"] = run["baseline_spread"] > NOISY_SPREAD
            if k != "auto":
                tokens = stats_all.generated_tokens / repeats
                shares = (stats_all.proposal_length_shares + [0.0] * (k + 1))[: k + 1]  # passes proposing 0..k tokens
                run["predicted_speedup"] = _predicted_with_prefill(
                    mixed_speedup(_alphas(stats_all, k), profile.c or 0.0, profile.r, shares),
                    tokens * profile.target_s[0],
                    statistics.median(prefill_plain),
                    statistics.median(prefill_spec),
                )
            runs.append(run)
    bar.close()
    for run in runs:
        if run["sampling"] == "invariant":
            rejection = [
                r
                for r in runs
                if r["sampling"] == "rejection" and (r["temperature"], r["k"]) == (run["temperature"], run["k"])
            ]
            if rejection:
                run["invariant_bound"] = rejection[0]["beta"] / (2 - rejection[0]["beta"])
    best = {}
    for temperature, sampling in settings:
        fixed = [
            r
            for r in runs
            if (r["temperature"], r["sampling"]) == (temperature, sampling) and r["k"] != "auto" and not r["noisy"]
        ]
        if fixed:
            top = max(fixed, key=lambda r: r["speedup"])
            best[str(temperature) + ("" if sampling == "rejection" else f" {sampling}")] = {
                "k": top["k"],
                "speedup": top["speedup"],
            }
    return {
        "runs": runs,
        "profile": profile.to_dict(),
        "prompts": len(prompts),
        "best_k": best,
        "draft_bytes_per_token": weight_bytes(draft_model) if draft_model is not None else 0,
        "target_bytes_per_pass": weight_bytes(target),
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "truncation": dict(truncation or {}),
        "noisy_runs": sum(r["noisy"] for r in runs),
        "note": "mean_tokens_per_pass includes the recovered/bonus token (1..k+1); speedup = median of per-pair "
        "ratios (prefill included; decode_speedup: prefill excluded, what plan predicts); "
        f"noisy = the plain baseline's repeats ranged more than {NOISY_SPREAD}x (such runs are not picked as the best "
        "k)",
    }


def write_reports(
    result: dict,
    json_path: str | Path | None = None,
    csv_path: str | Path | None = None,
    plot_dir: str | Path | None = None,
) -> list[Path]:
    """Write the JSON, the CSV (one row per run) and the PNG plots that were asked for."""
    written = []
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
        written.append(Path(json_path))
    if csv_path:
        with open(csv_path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=RUN_FIELDS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(result["runs"])
        written.append(Path(csv_path))
    if plot_dir:
        written.extend(plot(result, plot_dir))
    return written


def plot(result: dict, directory: str | Path) -> list[Path]:
    """speedup_vs_k.png (measured with spread, and predicted) and acceptance_by_position.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    runs = [r for r in result["runs"] if r["k"] != "auto"]
    repeats = result.get("repeats", 1)
    fig, ax = plt.subplots(figsize=(6, 4))
    for temperature in sorted({r["temperature"] for r in result["runs"]}):
        rs = sorted((r for r in runs if r["temperature"] == temperature), key=lambda r: r["k"])
        ks = [r["k"] for r in rs]
        line = ax.errorbar(
            ks,
            [r["speedup"] for r in rs],
            yerr=[[r["speedup"] - r["speedup_min"] for r in rs], [r["speedup_max"] - r["speedup"] for r in rs]],
            marker="o",
            capsize=4,
            label=f"measured, T={temperature}" + (" (one repeat: no spread)" if repeats == 1 else ""),
        )
        if rs and all(r["predicted_speedup"] is not None for r in rs):
            ax.plot(
                ks,
                [r["predicted_speedup"] for r in rs],
                "--",
                marker="x",
                markersize=8,
                label=f"predicted, T={temperature}",
            )
        for auto in (r for r in result["runs"] if r["k"] == "auto" and r["temperature"] == temperature):
            ax.axhline(
                auto["speedup"],
                ls=":",
                color=line[0].get_color(),
                label=f"k = auto, T={temperature}: {auto['speedup']:.2f}x",
            )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft length k")
    ax.set_ylabel("speed-up over plain decoding")
    ax.set_title(f"measured (median, min-max over {repeats} repeats) and predicted speed-up", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    first = directory / "speedup_vs_k.png"
    fig.savefig(first, dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    markers = "osD^vP*X"
    for i, r in enumerate(result["runs"]):  # distinct markers, later runs smaller: none hides another
        if r["beta_by_position"]:
            ax.plot(
                range(1, len(r["beta_by_position"]) + 1),
                r["beta_by_position"],
                marker=markers[i % len(markers)],
                markersize=max(3, 9 - i),
                alpha=0.85,
                label=f"k={r['k']}, T={r['temperature']}",
            )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position")
    ax.set_ylabel("beta (exact acceptance probability)")
    ax.set_ylim(0, 1.05)
    ax.set_title("acceptance probability by draft position", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    second = directory / "acceptance_by_position.png"
    fig.savefig(second, dpi=120)
    plt.close(fig)
    return [first, second]
