"""Markdown tables for BENCHMARKS.md from the JSON files of `verispec bench`, `bench --peer hf|llamacpp` and `plan`.

Usage: python benchmarks/tables.py FILE.json [...]  (the kind of each file is read from its fields)
"""

from __future__ import annotations

import json
import sys


def bench_table(result: dict) -> str:
    lines = [
        "| k | T | mode | speed-up, median [min, max] | predicted | predicted / measured | alpha_hat | beta | bound "
        "β/(2−β) | tokens / pass | identical to plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        predicted = r["predicted_speedup"]
        error = "-" if predicted is None else f"{predicted / r['speedup']:.2f}"
        same = r["greedy_identical"] if r["greedy_identical"] is not None else r.get("invariant_identical")
        identical = "-" if same is None else ("yes" if same else "NO")
        bound = "-" if r.get("invariant_bound") is None else f"{r['invariant_bound']:.3f}"
        lines.append(
            f"| {r['k']} | {r['temperature']:g} | {r.get('sampling', 'rejection')} | {r['speedup']:.2f} "
            f"[{r['speedup_min']:.2f}, {r['speedup_max']:.2f}] | "
            f"{'-' if predicted is None else f'{predicted:.2f}'} | {error} | {r['alpha_hat']:.3f} | {r['beta']:.3f} | "
            f"{bound} | "
            f"{r['mean_tokens_per_pass']:.2f} | {identical} |"
        )
    c = result["profile"]["c"]
    best = ", ".join(f"T={t}: k={b['k']} ({b['speedup']:.2f}x)" for t, b in result.get("best_k", {}).items())
    lines.append("")
    lines.append(
        f"Draft weights read per token {result.get('draft_bytes_per_token', 0) / 1e6:.1f} MB (target "
        f"{result.get('target_bytes_per_pass', 0) / 1e6:.1f} MB per pass); "
        f"c = {0.0 if c is None else c:.3f}; r(n) = "
        + " ".join(f"{x:.2f}" for x in result["profile"]["r"])
        + f"; best k: {best}."
    )
    by_position = [r for r in result["runs"] if r["k"] != "auto" and r["beta_by_position"]]
    if by_position:
        longest = max(by_position, key=lambda r: (r["temperature"] == 0, r["k"]))
        lines.append(
            f"beta by draft position (k = {longest['k']}, T = {longest['temperature']:g}): "
            + " ".join(f"{b:.2f}" for b in longest["beta_by_position"])
            + "."
        )
    return "\n".join(lines)


def peer_table(result: dict) -> str:
    lines = [
        "| system | tokens/s | vs transformers plain | vs transformers assisted | tokens identical |",
        "|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        assisted = "-" if r["vs_transformers_assisted"] is None else f"{r['vs_transformers_assisted']:.2f}"
        lines.append(
            f"| {r['system']} | {r['tokens_per_s']:.1f} | {r['vs_transformers_plain']:.2f} | {assisted} | "
            f"{'yes' if r['identical_to_transformers_plain'] else 'NO'} |"
        )
    return "\n".join(lines)


def llamacpp_peer_table(result: dict) -> str:
    lines = [
        "| system | decode tokens/s | vs llama.cpp plain | vs llama.cpp speculative (its best k) | alpha_hat | tokens "
        "/ pass | "
        "verispec's own ms per pass (share of the target pass) | identical to llama.cpp plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        best = _ranged(r["vs_llamacpp_speculative_best"], r.get("vs_llamacpp_speculative_best_range"), ".2f")
        alpha = _ranged(r.get("alpha_hat"), r.get("alpha_hat_range"), ".3f")
        passes = "-" if "mean_tokens_per_pass" not in r else f"{r['mean_tokens_per_pass']:.2f}"
        own = "-" if "own_ms_per_pass" not in r else f"{r['own_ms_per_pass']:.2f} ({r['own_share_of_target_pass']:.0%})"
        same = (
            "-"
            if "identical_prompts" not in r
            else f"{r['identical_prompts']}/{result.get('pairs', result['prompts'])}"
        )
        lines.append(
            f"| {r['system']} | {r['tokens_per_s']:.1f} | {r['vs_llamacpp_plain']:.2f} | {best} | {alpha} | {passes} | "
            f"{own} | {same} |"
        )
    return "\n".join(lines)


def _ranged(value, span, spec: str) -> str:
    """'1.20 [0.90-1.60]' (a median and its range over (prompt, seed) pairs), or '-'."""
    if value is None:
        return "-"
    return f"{value:{spec}}" + ("" if span is None else f" [{span[0]:{spec}}-{span[1]:{spec}}]")


def plan_table(report: dict) -> str:
    k_max = report["k_max"]
    lines = [
        "| candidate | beta | c | alpha by position | "
        + " | ".join(f"S({k})" for k in range(1, k_max + 1))
        + " | recommended |",
        "|---|---|---|---|" + "---|" * k_max + "---|",
    ]
    for c in report["candidates"]:
        lines.append(
            f"| {c['draft']} | {c['beta']:.3f} | {c['c']:.3f} | "
            + " ".join(f"{a:.2f}" for a in c["alpha_by_position"])
            + " | "
            + " | ".join(f"{s:.2f}" for s in c["predicted_speedup"][1:])
            + f" | {c['advice']} |"
        )
    return "\n".join(lines)


def main(paths: list[str]) -> None:
    for path in paths:
        data = json.load(open(path))
        print(f"<!-- {path} -->")
        if "candidates" in data:
            print(plan_table(data))
        elif data["runs"] and "vs_llamacpp_plain" in data["runs"][0]:
            print(llamacpp_peer_table(data))
        elif data["runs"] and "system" in data["runs"][0]:
            print(peer_table(data))
        else:
            print(bench_table(data))
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
