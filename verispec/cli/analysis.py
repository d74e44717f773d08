"""The measuring commands: `bench` (and its --peer comparisons), `plan`, `profile` and `perplexity` (`check`: check.py).
Each parses, loads its parts through assemble, calls verispec.analysis and prints (the long tables: cli/reports.py).
Knows nothing of how models are loaded or measured."""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import replace
from pathlib import Path

from .. import assemble
from ..analysis.llamacpp_program import (
    NGRAM_CACHE_LENGTH,
    NGRAM_DRAFT_LENGTHS,
    SEED_LIMIT,
    parse_lengths,
    parse_ngram_types,
)
from ..config import SamplingParams
from . import check, reports
from .common import (
    TARGET_HELP,
    check_directory,
    check_writable,
    draft_lengths,
    draft_options_parent,
    fail,
    models_parent,
    needs_draft,
    progress,
    read_prompts,
    sampling_from,
    sampling_parent,
    seed,
    seeds,
    settings_from,
    temperatures,
    truncation_parent,
    write_json,
)

PROFILED_HELP = (
    "draft model directory, .gguf file or preset name: profile times a model's passes (not 'ngram', 'suffix' "
    "or 'early-exit:L'; 'none': the target alone); default: the built-in draft with the built-in target, else none"
)
PROMPTS_HELP = 'JSON lines, one {"prompt": "..."} per line'
MEASURED_HELP = (
    "the draft measured: a directory or .gguf file, 'ngram' (prompt lookup), 'suffix' (suffix drafting), "
    "'early-exit:L' (the target's first L layers) or 'string:MODEL' (another tokenizer's draft drafting text at "
    "T = 0) ('none' leaves nothing to measure); default 'auto': the built-in draft with the built-in target, "
    "else 'suffix'"
)


def add_parsers(commands) -> None:
    _add_bench(commands)
    adv = commands.add_parser(
        "plan",
        help="advise: alpha per position, c, predicted speed-up per k, the k to use",
        parents=[
            models_parent(draft=f"a candidate (repeatable), {MEASURED_HELP}", repeatable=True),
            sampling_parent(temperature=0.0),
            draft_options_parent(),
        ],
    )
    adv.add_argument("--prompts", required=True, help=PROMPTS_HELP)
    adv.add_argument("--k-max", type=int, default=8, help="the longest draft considered (default 8)")
    adv.add_argument(
        "--max-new-tokens", type=int, default=64, help="tokens of each prompt's continuation scored (default 64)"
    )
    adv.add_argument("--max-prompts", type=int, default=None, help="use only the first N prompts (default: all)")
    adv.add_argument("--seed", type=seed, default=0, help="sampling seed (default 0)")
    adv.add_argument("--json", metavar="OUT", help="write the report here")

    check.add_parser(commands, MEASURED_HELP, PROMPTS_HELP)

    prof = commands.add_parser(
        "profile",
        help="measure t_target(n), r(n) and the draft cost ratio c",
        parents=[
            models_parent(
                target=f"{TARGET_HELP}, or a preset name of verispec.training (random weights)",
                draft=PROFILED_HELP,
            )
        ],
    )
    prof.add_argument(
        "--k-max", type=int, default=8, help="verification passes of 1..k_max+1 positions are timed (default 8)"
    )
    prof.add_argument("--batch-size", type=int, default=1, help="rows per pass (default 1)")
    prof.add_argument(
        "--context", type=int, default=128, help="positions already in the cache when timing (default 128)"
    )
    prof.add_argument(
        "--repeats", type=int, default=15, help="timings per pass length; the median is kept (default 15)"
    )
    prof.add_argument(
        "--compare-quantized",
        action="store_true",
        help="also profile int8 and int4 (group 64) copies of the target, interleaved in one run, and print ratios",
    )

    ppl = commands.add_parser(
        "perplexity", help="held-out loss and perplexity of one or more models (e.g. float vs quantized)"
    )
    ppl.add_argument("--model", required=True, action="append", help="model directory (repeatable)")
    ppl.add_argument(
        "--data",
        default="runs/data",
        help="data directory of 'verispec train data' (its held-out split heldout.bin; default runs/data)",
    )
    ppl.add_argument("--windows", type=int, default=64, help="256-token held-out windows (default 64)")


def _add_bench(commands) -> None:
    bench = commands.add_parser(
        "bench",
        help="plain vs speculative decoding of the same prompts, interleaved, in one run",
        parents=[models_parent(draft=MEASURED_HELP), draft_options_parent(), truncation_parent()],
    )
    bench.add_argument("--prompts", required=True, help=PROMPTS_HELP)
    bench.add_argument("--k", default="1,2,4", help="draft lengths, comma-separated, 'auto' allowed (default 1,2,4)")
    bench.add_argument("--temperature", default="0", help="temperatures, comma-separated (default 0)")
    bench.add_argument(
        "--sampling",
        default="rejection",
        help="modes, comma-separated: rejection, invariant (default rejection; invariant is not run at T = 0)",
    )
    bench.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    bench.add_argument("--max-prompts", type=int, default=None, help="use only the first N prompts")
    bench.add_argument("--repeats", type=int, default=3, help="plain/speculative pairs per (k, temperature)")
    bench.add_argument("--seed", type=seeds, default=[0], help="sampling seed (default 0); --peer llamacpp: a list")
    bench.add_argument("--json", metavar="OUT", help="write the results here")
    bench.add_argument("--csv", metavar="OUT", help="write one row per run here")
    bench.add_argument("--plot-dir", help="write speedup_vs_k.png and acceptance_by_position.png here")
    bench.add_argument(
        "--peer",
        choices=["hf", "llamacpp"],
        help="instead: hf = verispec vs transformers' generate, greedy (plain, assisted at the first k; "
        "prompt lookup with --draft ngram); llamacpp = verispec on llama.cpp vs llama-cpp-python "
        "(plain, prompt lookup) and llama.cpp's own speculative decoding, at one --temperature with "
        "--top-k/--top-p/--min-p, each sampling the same distribution",
    )
    bench.add_argument(
        "--llama-cpp-bin",
        help="with --peer llamacpp: a directory holding llama.cpp's llama-speculative-simple (same llama.cpp version)",
    )
    bench.add_argument(
        "--peer-ngram",
        metavar="all|TYPE,...",
        help="with --peer llamacpp and --llama-cpp-bin: also llama.cpp's n-gram drafters (ngram-simple, ngram-map-k, "
        "ngram-map-k4v, ngram-mod, ngram-cache), each at its fastest draft length of --peer-ngram-lengths",
    )
    bench.add_argument(
        "--peer-suffix",
        action="store_true",
        help="with --peer llamacpp: also verispec's suffix drafting at each --k (its corpus spans a round's prompts); "
        "with a draft also suffix+DRAFT, prompt lookup and each --peer-ngram before llama.cpp's draft (first k)",
    )
    bench.add_argument(
        "--peer-ngram-lengths",
        default=",".join(map(str, NGRAM_DRAFT_LENGTHS)),
        help=f"draft lengths swept for each n-gram drafter (default {','.join(map(str, NGRAM_DRAFT_LENGTHS))}; "
        f"ngram-cache's is fixed at {NGRAM_CACHE_LENGTH})",
    )


def _check_reports(args: argparse.Namespace) -> None:
    """bench's outputs and optional dependencies, checked before the benchmark runs."""
    for flag, path in (("--json", args.json), ("--csv", args.csv)):
        if path is not None:
            check_writable(path, flag)
    if args.plot_dir is not None:
        check_directory(args.plot_dir, "--plot-dir")
        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot-dir needs matplotlib (pip install matplotlib)")
    if args.peer_ngram is not None and (args.peer != "llamacpp" or args.llama_cpp_bin is None):
        raise ValueError("--peer-ngram needs --peer llamacpp and --llama-cpp-bin")
    if args.peer_ngram is not None:
        parse_ngram_types(args.peer_ngram), parse_lengths(args.peer_ngram_lengths)
    if args.peer_suffix and args.peer != "llamacpp":
        raise ValueError("--peer-suffix needs --peer llamacpp")
    if args.peer == "hf" and importlib.util.find_spec("transformers") is None:
        raise ValueError("--peer hf needs transformers (pip install 'verispec[test]' or pip install transformers)")
    if args.peer == "llamacpp" and max(args.seed) >= SEED_LIMIT:
        raise ValueError(f"--seed: llama.cpp's seeds are integers in [0, 2**32 - 1), got {max(args.seed)}")
    if len(args.seed) > 1 and args.peer != "llamacpp":
        raise ValueError(f"--seed takes several seeds only with --peer llamacpp, got {','.join(map(str, args.seed))}")


def bench(args: argparse.Namespace) -> int:
    from ..analysis.bench import run_bench, write_reports

    _check_reports(args)
    ks, temps = draft_lengths(args.k), temperatures(args.temperature)
    truncation = dict(top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    SamplingParams(**truncation)  # checked now, named as flags
    samplings = [mode.strip() for mode in args.sampling.split(",")]
    if not samplings or any(mode not in ("rejection", "invariant") for mode in samplings):
        return fail(f"--sampling must list rejection and/or invariant, got {args.sampling!r}")
    if args.peer == "llamacpp" and len(temps) > 1:
        return fail(f"--peer llamacpp runs one --temperature at a time, got {args.temperature}")
    settings = settings_from(args)
    if not args.peer:
        needs_draft(settings, "bench")
    settings = settings.resolved()
    if args.peer and (
        (settings.draft == "suffix" and args.peer != "llamacpp")
        or assemble.combined(settings.draft)
        or assemble.drafts_text(settings.draft)
    ):
        return fail(
            f"--peer {args.peer} compares verispec with the peer's own drafters (a draft model or prompt lookup); "
            f"it does not take --draft {settings.draft}"
        )
    if args.peer == "llamacpp":
        return _peer_llamacpp(args, settings, ks, SamplingParams(temperature=temps[0], **truncation))
    if args.peer:
        return _peer_hf(args, settings)
    say = assemble.to_stderr()
    target, tokenizer = assemble.load_target(settings, say)
    prompts = [tokenizer.encode(text).ids for text in read_prompts(args.prompts, args.max_prompts)]
    drafter = assemble.load_drafter(settings, target, say)
    fixed = [k for k in ks if k != "auto"]
    assemble.prepare_engine(target, rows=max(fixed) + 1 if fixed else 9)  # no compile time inside a timing
    # start() resets a drafter completely, so one object serves every run
    result = run_bench(
        target,
        lambda: drafter,
        prompts,
        ks,
        temps,
        args.max_new_tokens,
        args.repeats,
        args.seed[0],
        getattr(drafter, "model", None),
        samplings=samplings,
        truncation=truncation,
    )
    print("\n".join(reports.bench_lines(result, args.repeats)))
    for path in write_reports(result, args.json, args.csv, args.plot_dir):
        print(f"wrote {path}")
    return 0


def _peer_hf(args: argparse.Namespace, settings: assemble.Settings) -> int:
    from functools import partial

    from ..analysis.peer_hf import run_peer_bench
    from ..models.checkpoint import load_tokenizer

    k = next((int(k) for k in args.k.split(",") if k.isdigit()), 4)
    tokenizer = load_tokenizer(settings.target)
    if tokenizer is None:
        return fail(f"{settings.target}: no tokenizer.json, so prompts cannot be encoded")
    prompts = [tokenizer.encode(text).ids for text in read_prompts(args.prompts, args.max_prompts)]
    lookup = settings.draft == "ngram"
    load = partial(assemble.load_model, settings, say=assemble.to_stderr(), keep_torch_threads=True)
    result = run_peer_bench(
        settings.target,
        None if lookup else settings.draft_spec,
        prompts,
        k,
        args.max_new_tokens,
        args.repeats,
        prompt_lookup=lookup,
        dtype=settings.torch_dtype,
        load=load,
    )
    print("\n".join(reports.peer_hf_lines(result, args.max_new_tokens, args.repeats)))
    write_json(args.json, result)
    return 0


def _peer_llamacpp(args: argparse.Namespace, settings: assemble.Settings, ks: list, sampling: SamplingParams) -> int:
    from ..analysis.peer_llamacpp import run_llamacpp_peer_bench

    threads = assemble.llamacpp_threads(settings, assemble.to_stderr())  # process-wide: before the library loads
    if reason := assemble.llamacpp_unavailable():
        return fail(f"--peer llamacpp: {reason}")
    ngram_types = parse_ngram_types(args.peer_ngram) if args.peer_ngram is not None else []
    texts = read_prompts(args.prompts, args.max_prompts)
    target, (draft,) = assemble.gguf_files(settings, [settings.draft])
    result = run_llamacpp_peer_bench(
        target,
        draft,
        texts,
        ks,
        args.max_new_tokens,
        args.repeats,
        sampling,
        args.seed,
        threads,
        args.llama_cpp_bin,
        confidence_threshold=args.confidence_threshold,
        draft_temperature=args.draft_temperature,
        ngram_types=ngram_types,
        ngram_draft_lengths=parse_lengths(args.peer_ngram_lengths),
        suffix=args.peer_suffix or settings.draft == "suffix",  # --draft suffix (auto's choice): its systems
    )
    print("\n".join(reports.peer_llamacpp_lines(result, args.max_new_tokens, args.repeats, args.confidence_threshold)))
    write_json(args.json, result)
    return 0


def plan(args: argparse.Namespace) -> int:
    from ..analysis.plan import plan as run_plan

    if args.k_max < 1:
        return fail(f"--k-max must be >= 1, got {args.k_max}")
    if args.json:
        check_writable(args.json, "--json")
    given = args.draft or [None]
    for name in given:
        needs_draft(settings_from(args, draft=name), "plan")
    settings = settings_from(args, draft=given[0], extra_drafts=tuple(given[1:])).resolved()
    candidates = [settings.draft, *settings.extra_drafts]
    say = assemble.to_stderr()
    target, tokenizer = assemble.load_target(settings, say)
    drafts = {name: assemble.load_drafter(settings, target, say, spec=name) for name in candidates}
    texts = read_prompts(args.prompts, args.max_prompts)
    prompts = [tokenizer.encode(text).ids for text in texts]
    for name, drafter in drafts.items():
        if hasattr(drafter, "mode_line"):  # a draft of another tokenizer: the mode and how much of the draft it uses
            say(f"--draft {name}: {drafter.mode_line(texts)}")
    params = sampling_from(args, max_new_tokens=args.max_new_tokens)
    report = run_plan(target, drafts, prompts, params, args.k_max, progress=progress("plan"))
    print("\n".join(reports.plan_lines(report)))
    write_json(args.json, report)
    return 0


def profile(args: argparse.Namespace) -> int:
    from ..analysis.profile import profile_costs

    if args.k_max < 1:
        return fail(f"--k-max must be >= 1, got {args.k_max}")
    if args.draft is not None and (
        args.draft in assemble.MODEL_FREE or args.draft.startswith("early-exit:") or assemble.combined(args.draft)
    ):
        return fail(
            f"--draft {args.draft}: profile times a draft model's passes (a directory, GGUF file or preset "
            "name); for prompt lookup, suffix drafting or early exit, plan measures acceptance and cost"
        )
    if args.compare_quantized and args.backend == "llamacpp":  # verispec's own int8/int4 formats run on PyTorch
        return fail(
            "--compare-quantized compares verispec's PyTorch int8/int4 formats (--backend torch); "
            "for llama.cpp's types, profile each --gguf-type"
        )
    settings = settings_from(args, backend="torch" if args.compare_quantized else args.backend)
    if settings.auto_draft:  # a target of the user's and no --draft: the target alone (auto's drafter runs no model)
        settings = replace(settings, draft="none")
    settings = settings.resolved()
    say = assemble.to_stderr()
    target = assemble.load_profiled(settings, settings.target, say)
    draft = assemble.load_profiled(settings, settings.draft_spec, say) if settings.draft_spec else None
    if args.compare_quantized:
        return _compare_quantized(target, args)
    limit = getattr(target.config, "max_position_embeddings", None)
    if isinstance(limit, int) and args.context + args.k_max + 1 > limit:
        return fail(
            f"--context {args.context} plus --k-max {args.k_max} + 1 exceeds the model's context of {limit} positions"
        )
    rows = (args.batch_size, args.batch_size * (args.k_max + 1))
    choices = [c for c in assemble.prepare_engine(target, rows=rows[1]) if c["rows"] in rows]
    progress("profile")(
        f"timing passes of 1..{args.k_max + 1} positions{' and the draft' if draft is not None else ''}, "
        f"{args.repeats} times each"
    )
    costs = profile_costs(target, draft, args.k_max, args.batch_size, args.context, args.repeats)
    print(
        f"target {target.config.num_parameters / 1e6:.1f}M params, batch {args.batch_size}, context bucket "
        f"{costs.context_length}; {assemble.engine_description(target, args.dtype)}"
    )
    print("\n".join(reports.profile_lines(costs, draft, choices)))
    return 0


def _compare_quantized(target, args: argparse.Namespace) -> int:
    """float32 vs int8 vs int4 copies of one target: rounds of short profiles, interleaved."""
    import copy
    import statistics

    from ..analysis.profile import profile_costs
    from ..models.quantize import quantize_model, weight_bytes

    variants = {
        "float32": target,
        "int8": quantize_model(copy.deepcopy(target), 8),
        "int4-g64": quantize_model(copy.deepcopy(target), 4, 64),
    }
    times: dict[str, list[tuple[float, ...]]] = {name: [] for name in variants}
    for _ in range(3):  # rounds: drift lands on every variant alike
        for name, model in variants.items():
            costs = profile_costs(model, None, args.k_max, args.batch_size, args.context, args.repeats, use_cache=False)
            times[name].append(costs.target_s)
    base = statistics.median(t[0] for t in times["float32"])
    print(f"{'model':>9} {'weight MB':>9} {'t(1) ms':>8} {'vs float32':>10} {'r(' + str(args.k_max + 1) + ')':>6}")
    for name, model in variants.items():
        t1 = statistics.median(t[0] for t in times[name])
        tk = statistics.median(t[-1] for t in times[name])
        print(f"{name:>9} {weight_bytes(model) / 1e6:>9.1f} {t1 * 1e3:>8.2f} {t1 / base:>10.2f} {tk / t1:>6.2f}")
    print("t(1): one decoding step (forward, process_logits, verify, host sync); weight MB: read per pass")
    return 0


def perplexity(args: argparse.Namespace) -> int:
    import math

    from ..models.hf import load_model
    from ..training.train import held_out_loss

    if args.windows < 1:
        return fail(f"--windows must be >= 1, got {args.windows}")
    if not (Path(args.data) / "heldout.bin").is_file():
        return fail(
            f"--data {args.data}: no held-out split (heldout.bin) there; 'verispec train data --out DIR' makes one"
        )
    print(f"{'model':>40} {'loss (nats/token)':>18} {'perplexity':>10}")
    for name in args.model:
        loss = held_out_loss(load_model(name), args.data, max_windows=args.windows)
        print(f"{name:>40} {loss:>18.4f} {math.exp(loss):>10.2f}")
    print(f"held-out split of {args.data}, {args.windows} windows of 256 tokens")
    return 0
