"""`verispec serve` (one engine in this process, or `--replicas N` on Ray Serve) and `verispec
bench-serve` (servers under load). Parses, builds the Settings the engines load (server/run.py
and server/replicas.py load them through assemble) and prints the ready line. Knows nothing of
models or HTTP.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .. import assemble
from .common import (
    check_writable,
    draft_length_parent,
    draft_options_parent,
    fail,
    models_parent,
    non_negative,
    positive,
    read_prompts,
    settings_from,
)


def add_parsers(commands) -> None:
    srv = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server over a continuous batcher (needs the serve extra)",
        parents=[models_parent(), draft_length_parent(refuse_above=False), draft_options_parent()],
    )
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    srv.add_argument("--max-batch", type=positive, default=8, help="rows decoded together at most (default 8)")
    srv.add_argument(
        "--max-waiting",
        type=positive,
        default=64,
        help="requests waiting for a row at most; beyond it: 503 (default 64)",
    )
    srv.add_argument(
        "--max-model-len",
        type=positive,
        default=None,
        help="prompt + max_tokens per request at most (default: the model's context)",
    )
    srv.add_argument(
        "--prefill-chunk",
        type=positive,
        default=256,
        help="a longer prompt is read this many tokens per "
        "pass, so that the running requests wait at most one piece (default 256; under flash attention a multiple "
        "of 256 keeps rows equal to generate's, docs/EXACTNESS.md)",
    )
    srv.add_argument(
        "--model-name", default=None, help="the model's name in the API (default: the target's directory or file name)"
    )
    srv.add_argument(
        "--replicas",
        type=positive,
        default=None,
        help="run N engine replicas on Ray Serve behind this one "
        "endpoint (needs the ray extra; --threads is then per replica, default cores // N); default: one "
        "engine in this process",
    )
    srv.add_argument(
        "--ray-address",
        default=None,
        help="with --replicas: join this Ray cluster (e.g. auto, or HOST:6379) "
        "instead of starting a local one; the model paths must exist on every node",
    )

    bsv = commands.add_parser(
        "bench-serve",
        help="load `verispec serve` on this machine: throughput and latency against "
        "concurrency, for plain decoding, a fixed k and auto, interleaved",
        parents=[
            models_parent(
                target="target model of the servers started here; default: the built-in pair",
                draft="draft model of the servers started here (not of plain): a directory or .gguf file, "
                "'ngram', 'suffix', 'early-exit:L' or 'none'; default 'auto': the built-in draft with the "
                "built-in target, else suffix drafting",
            )
        ],
    )
    bsv.add_argument(
        "--url",
        help="a server already running on this machine (loopback) instead of starting them here "
        "(each started here runs in a process of its own, one after another)",
    )
    bsv.add_argument(
        "--modes",
        default="plain,4,auto",
        help="with no --url: the servers started here: plain, a draft length, auto (default plain,4,auto)",
    )
    bsv.add_argument(
        "--concurrency", default="1,2,4,8,16,32", help="concurrent requests, comma-separated (default 1,2,4,8,16,32)"
    )
    bsv.add_argument("--prompts", help='JSON lines with a "prompt" each (default: the built-in held-out prompts)')
    bsv.add_argument(
        "--requests", type=positive, default=None, help="requests per level and mode (default max(16, 2 x concurrency))"
    )
    bsv.add_argument(
        "--max-new-tokens",
        "--max-tokens",
        dest="max_new_tokens",
        type=positive,
        default=64,
        help="tokens each request generates at most, its max_tokens (default 64; --max-tokens: the old spelling)",
    )
    bsv.add_argument("--temperature", type=float, default=0.0, help="of each request (default 0)")
    bsv.add_argument(
        "--repeats",
        type=positive,
        default=1,
        help="sweeps over the levels, each one measured round of every mode at every level (default 1)",
    )
    bsv.add_argument(
        "--warmups",
        type=non_negative,
        default=1,
        help="rounds of every mode at every level before the measured "
        "ones, reported (warmup: true) but left out of the medians (default 1; 0: none)",
    )
    bsv.add_argument("--max-batch", type=positive, default=8, help="the servers' --max-batch (default 8)")
    bsv.add_argument("--k-max", type=int, default=8, help="auto's longest draft (default 8)")
    bsv.add_argument(
        "--max-model-len",
        type=positive,
        default=None,
        help="the servers' --max-model-len (default: the model's context)",
    )
    bsv.add_argument(
        "--peer",
        choices=["llama-server"],
        help="also llama.cpp's llama-server, interleaved with verispec's modes on the same GGUF files and "
        "prompt tokens: plain and with the same draft at each --peer-draft-n, as many slots as the "
        "concurrency, started for each of its rounds (needs --llama-cpp-bin)",
    )
    bsv.add_argument(
        "--llama-cpp-bin",
        metavar="DIR",
        help="with --peer llama-server: a directory holding llama.cpp's llama-server, built from the llama.cpp "
        "that llama-cpp-python vendors (benchmarks/build_llama_speculative.sh)",
    )
    bsv.add_argument(
        "--peer-draft-n",
        default="2,4,8",
        help="with --peer llama-server: its --spec-draft-n-max values, each a mode of its own (default 2,4,8)",
    )
    bsv.add_argument("--json", metavar="OUT", help="write every level and the medians here")
    bsv.add_argument("--csv", metavar="OUT", help="write the medians here")
    bsv.add_argument(
        "--plot", metavar="OUT", help="write a plot of throughput against concurrency here (PNG; needs matplotlib)"
    )


def _stop_note(settings: assemble.Settings) -> str:
    """', confidence stop P' where a model draft has one (none with --draft none, ngram, suffix or early exit)."""
    spec = settings.draft_spec
    model_draft = assemble.model_spec(spec) is not None
    return (
        f", confidence stop {settings.confidence_threshold:g}" if settings.confidence_threshold and model_draft else ""
    )


def serve(args: argparse.Namespace) -> int:
    try:
        from ..server.run import build, listen, load_served, run
    except ImportError as error:
        return fail(f"verispec serve needs the serve extra (pip install 'verispec[serve]'): {error}")
    if not 0 <= args.port <= 65535:
        return fail(f"--port must be in [0, 65535], got {args.port}")
    if args.ray_address is not None and args.replicas is None:
        return fail("--ray-address needs --replicas N (the engines run on Ray only then)")
    if args.replicas is not None:
        return _serve_replicas(args)
    settings = settings_from(args, k=args.k, k_max=args.k_max)
    sock = listen(args.host, args.port)  # before the models load: a port in use is one line, before the banner
    models = load_served(settings, args.model_name, assemble.to_stderr())
    app, scheduler = build(
        models.target,
        models.drafter,
        models.tokenizer,
        model_name=models.name,
        k=models.k,
        max_batch=args.max_batch,
        max_waiting=args.max_waiting,
        max_model_len=args.max_model_len,
        eos=models.eos,
        chat_template=models.chat_template,
        prefill_chunk=args.prefill_chunk,
    )
    print(
        f"verispec serve: {models.name} on http://{args.host}:{args.port}/v1 ({args.max_batch} rows, k={args.k}"
        f"{_stop_note(settings)}, context {scheduler.max_model_len}); Ctrl-C stops",
        file=sys.stderr,
    )
    run(app, args.host, args.port, sock)
    return 0


def _serve_replicas(args: argparse.Namespace) -> int:
    """`serve --replicas N`: the flags and models are checked here (loaded once, then dropped),
    then N replicas load them again from the same Settings on Ray Serve (server/replicas.py)
    until SIGINT or SIGTERM."""
    try:
        from ray import serve  # noqa: F401

        from ..server.replicas import Frontend, Plan, serve_until_signal
    except ImportError as error:
        return fail(f"verispec serve --replicas needs Ray Serve (pip install 'verispec[ray]'): {error}")
    from ..server.run import load_served, model_len

    threads = args.threads if args.threads is not None else max(1, (os.cpu_count() or 1) // args.replicas)
    settings = settings_from(args, k=args.k, k_max=args.k_max, threads=threads)
    models = load_served(settings, args.model_name, assemble.to_stderr())
    frontend = Frontend(
        models.name,
        models.target.vocab_size,
        model_len(models.target, args.max_model_len),
        models.eos,
        models.chat_template,
    )
    del models
    plan = Plan(
        settings,
        frontend,
        replicas=args.replicas,
        threads=threads,
        max_batch=args.max_batch,
        max_waiting=args.max_waiting,
        prefill_chunk=args.prefill_chunk,
    )

    def ready(url: str, ray_address: str) -> None:
        print(
            f"verispec serve: {frontend.model_name} on {url}/v1 ({args.replicas} replicas x {args.max_batch} rows, "
            f"{threads} threads each, k={args.k}{_stop_note(settings)}, context {frontend.max_model_len}; Ray at "
            f"{ray_address}); Ctrl-C stops",
            file=sys.stderr,
            flush=True,
        )

    try:
        serve_until_signal(plan, args.host, args.port, args.ray_address, ready)
    except (RuntimeError, ConnectionError) as error:  # Ray could not start or join, or a replica could not be built
        first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        return fail(f"the replicas did not start: {first.strip()} (Ray's logs: /tmp/ray/session_latest/logs)")
    return 0


def _server_flags(args: argparse.Namespace) -> list[str]:
    """The flags every server that bench-serve starts shares."""
    flags = [
        "--max-batch",
        str(args.max_batch),
        "--k-max",
        str(args.k_max),
        "--dtype",
        args.dtype,
        "--backend",
        args.backend,
        "--device",
        args.device,
        "--exact-kernels",
        args.exact_kernels,
        "--flash-attn",
        args.flash_attn,
        "--model-name",
        "bench",
    ]
    for flag in ("target", "max_model_len", "threads", "gguf_type"):
        if getattr(args, flag) is not None:
            flags += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return flags


def _start_servers(args: argparse.Namespace, modes: list[str], started: list) -> dict[str, str]:
    """One server per mode, one at a time (the first converts the built-in pair, cached; a
    calibration runs alone); each handle is appended to `started` as soon as it runs."""
    from ..server.run import Spawned

    servers = {}
    for mode in modes:
        draft = ["--draft", "none"] if mode == "plain" else ["--draft", args.draft] if args.draft else []
        handle = Spawned([*_server_flags(args), *draft, "--k", "0" if mode == "plain" else mode])
        started.append(handle)
        servers["plain" if mode == "plain" else f"k={mode}"] = handle.url
    return servers


def bench_serve(args: argparse.Namespace) -> int:
    import json
    from urllib.parse import urlparse

    try:
        from ..server.loadgen import as_dict, plot, summarize, write_csv
        from ..server.loadgen import bench_serve as run_levels
    except ImportError as error:
        return fail(f"verispec bench-serve needs the serve extra (pip install 'verispec[serve]'): {error}")
    levels = [int(x) for x in args.concurrency.split(",") if x.strip().isdigit()]
    if not levels or len(levels) != len(args.concurrency.split(",")) or min(levels) < 1 or max(levels) > 256:
        return fail(f"--concurrency must be integers in [1, 256], comma-separated, got {args.concurrency!r}")
    for flag in ("json", "csv", "plot"):
        if getattr(args, flag) is not None:
            check_writable(getattr(args, flag), f"--{flag}")
    from ..pair import HELDOUT_PROMPTS

    prompts = read_prompts(args.prompts or str(HELDOUT_PROMPTS), None)
    peers: dict = {}
    if args.peer is not None or args.llama_cpp_bin is not None:
        peers, prompts = _peer_modes(args, prompts)  # checked and built before any server starts
    started: list = []
    if args.url is not None:
        if urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
            return fail(f"--url must be a server on this machine (127.0.0.1, localhost or ::1), got {args.url!r}")
        servers = {"server": args.url.rstrip("/")}
    else:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if not modes or any(m not in ("plain", "auto") and not m.isdigit() for m in modes):
            return fail(f"--modes takes plain, auto and draft lengths, got {args.modes!r}")
        try:
            servers = _start_servers(args, modes, started)
        except RuntimeError as error:
            for handle in started:
                handle.stop()
            return fail(str(error))
    try:
        results = run_levels(
            {**servers, **peers},
            prompts,
            levels,
            args.requests,
            args.max_new_tokens,
            args.temperature,
            args.repeats,
            _say_level,
            args.warmups,
        )
    except RuntimeError as error:  # a peer's server that did not start for its round
        return fail(str(error))
    finally:
        for handle in started:
            handle.stop()
    # greedy outputs are compared with the peer's plain decoding (its first mode), else verispec's
    reference = next(iter(peers), "plain" if "plain" in servers else None)
    rows = summarize(results, args.peer, reference if args.temperature == 0 else None)
    for row in rows:
        print(_median_line(row))
    if args.json:
        report = {"command": " ".join(sys.argv), "levels": [as_dict(lv) for lv in results], "medians": rows}
        if peers:  # each peer mode's command line at concurrency 1 (-np and -c scale with the level's)
            report["peer_commands"] = {name: [str(m.program), *m.flags(1)] for name, m in peers.items()}
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.csv:
        write_csv(rows, args.csv)
    if args.plot:
        plot(rows, args.plot)
    return 0


def _peer_modes(args: argparse.Namespace, prompts: list[str]) -> tuple[dict, list[list[int]]]:
    """--peer llama-server: its modes (peer.py) on the GGUF files verispec's servers load, the
    context a verispec server gives a request and verispec's threads; and the prompts as token
    ids (the target's tokenizer, as verispec's servers encode them), sent to every server, so
    that both read the same tokens (llama-server would encode a text with its own rules)."""
    from ..llamacpp.lib import default_threads
    from ..server import peer

    if args.peer is None or args.llama_cpp_bin is None:
        raise ValueError("--peer llama-server and --llama-cpp-bin DIR go together")
    if args.url is not None:
        raise ValueError("--peer llama-server loads the GGUF files of the servers started here: it does not take --url")
    lengths = peer.parse_draft_lengths(args.peer_draft_n)
    peer.program(args.llama_cpp_bin)
    settings = settings_from(args).resolved()
    target, (draft,) = assemble.gguf_files(settings, [settings.draft])
    if draft is None:
        print(
            f"--peer llama-server: --draft {settings.draft} is no model, so llama-server runs plain only",
            file=sys.stderr,
        )
    context = args.max_model_len or peer.model_context(target)
    threads = args.threads or default_threads()
    modes = peer.modes(args.llama_cpp_bin, target, draft, lengths, threads, context, args.temperature)
    tokenizer = assemble.load_tokenizer(settings)
    return modes, [tokenizer.encode(text).ids for text in prompts]


def _say_level(level) -> None:
    print(
        f"{level.mode:>18} c={level.concurrency:<3} {level.throughput_tok_s:8.1f} tok/s"
        f"{' (warm-up)' if level.warmup else ''}  TTFT p50 {level.ttft_p50_s * 1e3:7.1f} ms"
        f"  ITL p50 {level.itl_p50_s * 1e3:6.1f} ms p99 {level.itl_p99_s * 1e3:6.1f} ms  errors {level.errors}",
        file=sys.stderr,
    )


def _median_line(row: dict) -> str:
    ratio = f"  {row['throughput_vs_plain']:.2f}x plain" if "throughput_vs_plain" in row else ""
    ratio += f"  {row['throughput_vs_best_other']:.2f}x the best other" if "throughput_vs_best_other" in row else ""
    ratio += (
        f" (95% {row['throughput_vs_best_other_ci95_low']:.2f}-{row['throughput_vs_best_other_ci95_high']:.2f})"
        if "throughput_vs_best_other_ci95_low" in row
        else ""
    )
    ratio += f"  {row['throughput_vs_peer_best']:.2f}x the peer's best" if "throughput_vs_peer_best" in row else ""
    extra = f"  acceptance {row['alpha_hat']:.2f}" if "alpha_hat" in row else ""
    if "identical_to" in row:
        extra += f"  identical to {row['identical_to']}: {row['identical_requests']}/{row['compared_requests']}"
    return (
        f"{row['mode']:>18} c={row['concurrency']:<3} {row['throughput_tok_s']:8.1f} tok/s{ratio}  TTFT p50 "
        f"{row['ttft_p50_s'] * 1e3:.1f} ms  ITL p50/p99 {row['itl_p50_s'] * 1e3:.1f}/{row['itl_p99_s'] * 1e3:.1f} ms"
        f"  TPOT p50 {row['tpot_p50_s'] * 1e3:.1f} ms{extra}"
    )
