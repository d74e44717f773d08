"""The tables the measuring commands print: bench, its peer comparisons, plan and profile. Each
function takes a report (a dict or a result object of verispec.analysis) and returns its lines;
nothing here measures or loads anything.
"""

from __future__ import annotations

from ..analysis.llamacpp_program import PROGRAM


def bench_lines(result: dict, repeats: int) -> list[str]:
    """`verispec bench`: one row per (k, temperature, mode), then what the columns mean."""
    header = (
        f"{'k':>5} {'T':>4} {'mode':>9} {'base tok/s':>10} {'spec tok/s':>10} {'speedup':>16} {'decode':>6} "
        f"{'pred':>5} {'alpha_hat':>9} {'beta':>5} {'bound':>5} {'tok/pass':>8} {'tau':>4} identical"
    )
    lines = [header]
    for run in result["runs"]:
        predicted = "-" if run["predicted_speedup"] is None else f"{run['predicted_speedup']:.2f}"
        bound = "-" if run["invariant_bound"] is None else f"{run['invariant_bound']:.3f}"
        identical = run["greedy_identical"] if run["greedy_identical"] is not None else run["invariant_identical"]
        spread = f"{run['speedup']:.2f} [{run['speedup_min']:.2f},{run['speedup_max']:.2f}]"
        tau = "-" if run.get("draft_temperature") is None else f"{run['draft_temperature']:g}"
        lines.append(
            f"{run['k']!s:>5} {run['temperature']:>4} {run['sampling']:>9} {run['tokens_per_s_baseline']:>10.1f} "
            f"{run['tokens_per_s_speculative']:>10.1f} {spread:>16} {run['decode_speedup']:>6.2f} {predicted:>5} "
            f"{run['alpha_hat']:>9.3f} "
            f"{run['beta']:>5.3f} {bound:>5} {run['mean_tokens_per_pass']:>8.2f} {tau:>4} {identical}"
        )
    lines.append(
        "tok/pass includes the recovered/bonus token; speedup = median of per-pair ratios [min, max], prefill "
        "included; decode: the same without the prefill (what plan predicts); pred: the refined model's, prefill "
        "included; identical: "
        "the speculative tokens are the plain ones (greedy; invariant mode at T > 0); tau: the draft's proposal "
        "temperature most prompts ended at (q^(1/tau); --draft-temperature); bound: beta/(2 - beta) of "
        "the rejection run, the least invariant mode's acceptance can be; invariant mode's beta is its "
        "acceptance rate"
    )
    for run in result["runs"]:
        if run["noisy"]:
            lines.append(
                f"noisy: k={run['k']}, T={run['temperature']}: the plain baseline ranged "
                f"{run['baseline_spread']:.2f}x across {repeats} repeats (the machine was busy?): its speed-up "
                "is unreliable and not picked as the best k"
            )
    c = result["profile"]["c"]
    best = ", ".join(f"T={t}: k={b['k']} ({b['speedup']:.2f}x)" for t, b in result["best_k"].items())
    lines.append(
        f"draft reads {result['draft_bytes_per_token'] / 1e6:.1f} MB of weights per token (target "
        f"{result['target_bytes_per_pass'] / 1e6:.1f} MB per pass), c = {0.0 if c is None else c:.3f}; best k: "
        + (best or "none (every run was noisy)")
    )
    return lines


def peer_hf_lines(result: dict, max_new_tokens: int, repeats: int) -> list[str]:
    """`bench --peer hf`: verispec against transformers' generate."""
    lines = [f"{'system':>32} {'tok/s':>8} {'vs hf plain':>11} {'vs hf assisted':>14}  identical"]
    for row in result["runs"]:
        assisted = "-" if row["vs_transformers_assisted"] is None else f"{row['vs_transformers_assisted']:.2f}"
        lines.append(
            f"{row['system']:>32} {row['tokens_per_s']:>8.1f} {row['vs_transformers_plain']:>11.2f} "
            f"{assisted:>14}  {row['identical_to_transformers_plain']}"
        )
    for row in result["runs"]:
        diff = row["first_difference"]
        if diff is not None:
            lines.append(
                f"{row['system']}: first differs from transformers plain at prompt {diff['prompt']}, token "
                f"{diff['position']} ({diff['tokens'][1]} vs {diff['tokens'][0]}): the target's top-2 logit "
                f"gap there is {diff['top2_gap']:.4f}" + (" (a near-tie)" if diff["top2_gap"] < 0.05 else "")
            )
    lines.append(
        f"greedy, batch 1, {max_new_tokens} new tokens per prompt, {result['dtype']}, median of {repeats} rounds"
    )
    return lines


def peer_llamacpp_lines(result: dict, max_new_tokens: int, repeats: int, confidence_threshold: float) -> list[str]:
    """`bench --peer llamacpp`: verispec on llama.cpp against llama-cpp-python and llama.cpp's own
    speculative decoding; then each verispec row's proposal temperatures, where its drafter reports them."""
    versus = result.get("llamacpp_speculative_best") is not None
    ngram = any(row.get("vs_llamacpp_ngram_best") is not None for row in result["runs"])
    header = (
        f"{'system':>52} {'tok/s':>8} {'vs plain':>8} {'vs llama.cpp spec best':>22} "
        + (f"{'vs n-gram best':>14} " if ngram else "")
        + f"{'alpha_hat':>19} {'own ms/pass':>11}  identical"
    )
    side = result.get("verispec_side")  # what verispec's side ran, read back at run time
    lines = [] if side is None else [_verispec_side(side)]
    lines.append(header)
    for row in result["runs"]:
        best = _with_range(row["vs_llamacpp_speculative_best"], row["vs_llamacpp_speculative_best_range"], ".2f")
        alpha = _with_range(row.get("alpha_hat"), row.get("alpha_hat_range"), ".2f")
        own = (
            "-"
            if "own_ms_per_pass" not in row
            else f"{row['own_ms_per_pass']:.2f} ({row['own_share_of_target_pass']:.0%})"
        )
        lines.append(
            f"{row['system']:>52} {row['tokens_per_s']:>8.1f} {row['vs_llamacpp_plain']:>8.2f} "
            f"{best if versus else '-':>22} "
            + (f"{row['vs_llamacpp_ngram_best']:>14.2f} " if ngram else "")
            + f"{alpha:>19} {own:>11}  {row.get('identical_to_llamacpp_plain', '-')} "
            f"({row.get('identical_prompts', '-')}/{result['pairs']})"
            + (
                ""
                if "identical_to_verispec_plain" not in row
                else f"; = verispec plain: {row['identical_to_verispec_plain']}"
            )
        )
    for row in result["runs"]:
        if row.get("proposal_tau"):
            chosen = ", ".join(f"{tau} in {n}" for tau, n in row["proposal_tau"].items())
            measured = " ".join(f"{tau}:{value:.3f}" for tau, value in row["proposal_acceptance"].items())
            lines.append(
                f"{row['system']}: proposal temperature at the end of each run: {chosen} of "
                f"{sum(row['proposal_tau'].values())} runs"
                + (f"; acceptance per verified position by tau: {measured}" if measured else "")
            )
    stop = (
        f"; rows marked 'confidence {confidence_threshold:g}' stop drafting below that probability (llama.cpp's "
        f"program: --spec-draft-p-min {confidence_threshold:g})"
        if confidence_threshold
        else ""
    )
    lines.append(
        f"target {result['target_description']}, draft {result['draft_description']}; {_sampling(result)}; batch 1, "
        f"{max_new_tokens} new tokens per prompt, {result['threads']} threads, decode-only tokens/s: median over "
        f"{result['pairs']} (prompt, seed) pairs ({result['prompts']} prompts x seeds "
        f"{','.join(map(str, result['seeds']))}) of each pair's median of {repeats} rounds; ratios: median of the "
        f"per-pair ratios [min, max]; alpha_hat: accepted / drafted [per-pair min, max]; own ms/pass: verispec's time "
        f"outside llama.cpp per target pass (share of the target pass){stop}; {result['compiled_step']}"
    )
    if ngram:
        lines.append(
            f"llama.cpp's n-gram drafters: {PROGRAM} --spec-type TYPE, no draft model, each at its fastest draft "
            f"length of {','.join(map(str, result['ngram_draft_lengths']))} (n=; ngram-cache's is fixed), other "
            "settings at its defaults"
        )
    return lines


def _verispec_side(side: dict) -> str:
    """'verispec side: exact kernels off, flash attention on, 2 threads'."""
    exact, flash = ("on" if side[name] else "off" for name in ("exact_kernels", "flash_attention"))
    return f"verispec side: exact kernels {exact}, flash attention {flash}, {side['threads']} threads"


def _with_range(value: float | None, span: list[float] | None, spec: str) -> str:
    """'0.42 [0.30,0.51]', or '-' without a value."""
    if value is None:
        return "-"
    return f"{value:{spec}}" + ("" if span is None else f" [{span[0]:{spec}},{span[1]:{spec}}]")


def _sampling(result: dict) -> str:
    """The sampling settings every system used, and llama.cpp's sampler chain."""
    if result["temperature"] == 0:
        return "greedy (T=0)"
    filters = [
        f"{name} {result[key]:g}"
        for name, key, off in (("top-k", "top_k", 0), ("top-p", "top_p", 1.0), ("min-p", "min_p", 0.0))
        if result[key] != off
    ]
    return (
        f"T={result['temperature']:g}"
        + (", " + ", ".join(filters) if filters else ", no truncation")
        + f" on every system (llama.cpp: --samplers {result['llama_cpp_samplers']}, verispec's order)"
    )


def plan_lines(report: dict) -> list[str]:
    """`verispec plan`: per candidate, beta, c, alpha by position and the predicted speed-up per k."""
    lines = []
    for candidate in report["candidates"]:
        share = (
            ""
            if candidate["proposal_share"] == 1.0
            else f", proposes at {candidate['proposal_share']:.0%} of positions"
        )
        lines.append(
            f"draft {candidate['draft']}: beta {candidate['beta']:.3f}, c {candidate['c']:.3f}{share} -> "
            f"{candidate['advice']}"
        )
        by_tau = candidate.get("acceptance_by_tau") or {}
        if candidate.get("draft_temperature") is not None:
            lines.append(
                f"  draft proposal temperature {candidate['draft_temperature']:g} (q^(1/tau); acceptance by tau: "
                + " ".join(f"{tau:g}:{mean:.3f}" for tau, mean in by_tau.items())
                + ")"
            )
        alphas = zip(candidate["alpha_by_position"], candidate["alpha_samples"])
        lines.append(
            "  alpha by position: "
            + " ".join(f"{a:.2f}" if n else "-" for a, n in alphas)
            + " ('-': no samples that deep)" * (0 in candidate["alpha_samples"])
        )
        lines.append(
            "  predicted speed-up: " + " ".join(f"k={k}:{s:.2f}" for k, s in enumerate(candidate["predicted_speedup"]))
        )
    if len(report["candidates"]) > 1:
        best = max(report["candidates"], key=lambda c: c["predicted_speedup"][c["recommended_k"]])
        speedup = best["predicted_speedup"][best["recommended_k"]]
        lines.append(
            f"best: --draft {best['draft']} --k {best['recommended_k']} (predicted {speedup:.2f}x)"
            if best["recommended_k"]
            else "best: do not speculate (no candidate's k beats plain decoding)"
        )
    return lines


def profile_lines(costs, draft, choices: list[dict]) -> list[str]:
    """`verispec profile`: t_target(n) and r(n), the draft's cost, and the kernel chosen per shape."""
    lines = [
        f"t_target({n}) = {t * 1e3:7.2f} ms   r({n}) = {r:.2f}"
        for n, (t, r) in enumerate(zip(costs.target_s, costs.r), 1)
    ]
    if draft is not None:
        lines.append(
            f"t_draft = {costs.draft_s * 1e3:.2f} ms per token ({draft.config.num_parameters / 1e6:.1f}M params)   "
            f"c = {costs.c:.3f}"
        )
    for choice in choices:  # the kernel chosen per weight shape and row count, by measuring both here
        n, k = choice["shape"]
        lines.append(
            f"linear {n}x{k}, {choice['rows']} rows: skinny kernel {choice['kernel_s'] * 1e3:.3f} ms, torch "
            f"{choice['torch_s'] * 1e3:.3f} ms -> {'skinny kernel' if choice['kernel'] else 'torch'}"
        )
    return lines
