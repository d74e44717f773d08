"""`verispec check`: its flags, its run (verispec.analysis.check does the work) and its report as text. A time
limit (`--max-seconds`) or an interrupt ends it with every finished step printed and a verdict on what was checked."""

from __future__ import annotations

import argparse

from .. import assemble
from ..analysis.chisquare import FALSE_FAILURE
from .common import (
    check_writable,
    draft_options_parent,
    fail,
    models_parent,
    needs_draft,
    progress,
    read_prompts,
    sampling_from,
    sampling_parent,
    seed,
    settings_from,
    write_json,
)


def add_parser(commands, measured_help: str, prompts_help: str) -> None:
    chk = commands.add_parser(
        "check",
        help="certify that decoding is lossless on your target, draft and settings (exit 0: all passed)",
        parents=[models_parent(draft=measured_help), sampling_parent(temperature=1.0), draft_options_parent()],
    )
    chk.add_argument("--prompts", help=f"{prompts_help} (default: the built-in held-out prompts)")
    chk.add_argument(
        "--contexts",
        type=int,
        default=1,
        help="prompts whose continuations are the contexts of the distribution tests: the first where the "
        "draft proposes (default 1; each of the k positions is a context of its own)",
    )
    chk.add_argument(
        "--k",
        type=int,
        default=4,
        help="draft length: the draft positions tested per context, and the length of (b) and (c) (default 4)",
    )
    chk.add_argument(
        "--draws",
        type=int,
        default=None,
        help="verifications per position (default 200000 at a vocabulary "
        "of 8192 or less, fewer for a larger one, at least 20000; at least 1000)",
    )
    chk.add_argument(
        "--seeds", type=int, default=200, help="seeded rows of the invariant-mode comparison (default 200)"
    )
    chk.add_argument("--max-new-tokens", type=int, default=16, help="tokens per row in the comparisons (default 16)")
    chk.add_argument("--seed", type=seed, default=0, help="sampling seed of every draw (default 0)")
    chk.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="stop after this many seconds, between verifications, and report every finished step and a verdict on "
        "what was checked (an interrupt, Ctrl-C, does the same; default: no limit)",
    )
    chk.add_argument("--json", metavar="OUT", help="write the report here")


def run(args: argparse.Namespace) -> int:
    from ..analysis.check import run_check

    draws = 1000 if args.draws is None else args.draws
    for flag, value, least in (
        ("--contexts", args.contexts, 1),
        ("--k", args.k, 1),
        ("--draws", draws, 1000),
        ("--seeds", args.seeds, 1),
        ("--max-new-tokens", args.max_new_tokens, 1),
    ):
        if value < least:
            return fail(f"{flag} must be >= {least}, got {value}")
    if args.max_seconds is not None and not args.max_seconds > 0:
        return fail(f"--max-seconds must be > 0, got {args.max_seconds:g}")
    if args.json is not None:
        check_writable(args.json, "--json")
    params = sampling_from(args)
    from ..pair import HELDOUT_PROMPTS

    prompts_file = str(HELDOUT_PROMPTS) if args.prompts is None else args.prompts
    texts = read_prompts(prompts_file, None)
    settings = settings_from(args)
    needs_draft(settings, "check")
    say = assemble.to_stderr()
    target, tokenizer = assemble.load_target(settings, say)
    drafter = assemble.load_drafter(settings, target, say)
    prompts = [ids for ids in (tokenizer.encode(text).ids for text in texts) if ids]
    if len(prompts) < args.contexts:
        return fail(f"{prompts_file}: {len(prompts)} non-empty prompts, fewer than --contexts {args.contexts}")
    report = run_check(
        target,
        drafter,
        prompts,
        params,
        contexts=args.contexts,
        k=args.k,
        n=args.draws,
        seeds=args.seeds,
        max_new_tokens=args.max_new_tokens,
        progress=progress("check", always=True),
        max_seconds=args.max_seconds,
    )
    print("\n".join(format_report(report)))
    write_json(args.json, report.to_dict())
    return 0 if report.passed else 1


def format_report(report) -> list[str]:
    """A CheckReport (verispec.analysis.check) as lines of text."""
    d = report.deviation
    lines = []
    if d is not None:
        lines.append(
            f"engine numerics: the largest logit gap between pass shapes over {d['contexts']} contexts is "
            f"{d['largest']:.3g} "
            f"(positions {d['positions']:.3g}, rows {d['rows']:.3g}, cache {d['cache']:.3g})"
            + ("" if d["largest"] == 0 else "; rows that differ by less than it can move are numerics, not the rule")
        )
        default = d.get("llama_cpp_defaults")
        if default is not None:
            lines.append(
                f"    with llama.cpp's default kernels (--exact-kernels off) it would be {default:.3g}: "
                + (
                    "verispec's exact kernels changed this file's numerics"
                    if default > d["largest"]
                    else "no setting had to change for this file"
                )
            )
    lines += [
        (
            f"(a) the rule at real contexts, {report.draws:,} verifications per position, chi-square at a "
            f"{FALSE_FAILURE:g} false-failure rate ({report.settings['sampling']} mode"
            + (f", draft proposal temperature {report.proposal_tau:g}" if report.proposal_tau is not None else "")
            + "):"
        )
    ]
    for t in report.tests:
        what = f"proposal {t.proposal}" if t.proposal is not None else "x ~ q"
        lines.append(
            f"    context {t.context + 1} position {t.position} ({what}): beta {t.beta:.3f}, accepted "
            f"{t.accepted:.3f}, "
            f"chi-square {t.statistic:.1f} (df {t.df}, threshold {t.threshold:.1f}), detects TV >= "
            f"{t.detectable_tv:.4f}: "
            f"{'pass' if t.passed else 'FAIL'}"
        )
    lines += [f"    not tested: {reason}" for reason in report.skipped]
    if report.control is not None:
        c = report.control
        lines.append(
            f"(d) negative control (recovered token drawn from p) at context {c['context'] + 1} position "
            f"{c['position']}: "
            f"planted TV {c['planted_tv']:.4f}, chi-square {c['statistic']:.1f} (threshold {c['threshold']:.1f}): "
            f"{'caught' if c['passed'] else 'NOT CAUGHT (the planted error is below what the test detects)'}"
        )
    if report.invariant is not None:
        i = report.invariant
        ties = _ties(i, "score gaps", " nats")
        lines.append(
            f"(b) invariant mode, speculative = plain: {i['equal']}/{i['rows']} seeded rows{ties}"
            + ("" if "(b)" in report.finished else " (before the cut)")
            + ": "
            f"{'pass' if i['passed'] else 'FAIL'}"
        )
    g = report.greedy
    if g is not None:
        ties = _ties(g, "top-2 logit gaps", "")
        lines.append(
            f"(c) greedy, speculative = plain: {g['equal']}/{g['rows']} rows{ties}: {'pass' if g['passed'] else 'FAIL'}"
        )
    if report.cut is None:
        lines.append(f"{'PASSED' if report.passed else 'FAILED'} in {report.seconds:.0f} s")
        return lines
    left = [step for step in report.steps if step not in report.finished]
    checked = ", ".join(report.finished) or "nothing"
    verdict = "PASSED what was checked" if report.passed else "FAILED" if report.finished or report.tests else "NOT RUN"
    lines.append(
        f"{verdict} in {report.seconds:.0f} s, cut by {report.cut}: finished {checked}; not finished " + ", ".join(left)
    )
    return lines


def _ties(part: dict, what: str, unit: str) -> str:
    """' (the other N: GAPS within the deviation: ...)' for the rows of (b) or (c) that differ at near-ties."""
    if not part["near_ties"]:
        return ""
    gaps = ", ".join(f"{g:.1e}" for g in part["gaps"])
    return f" (the other {part['near_ties']}: {what} within the deviation: {gaps}{unit})"
