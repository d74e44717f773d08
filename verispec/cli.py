"""The command line: parses arguments, calls the library, prints. Nothing else lives here.

Every error a user can cause (a bad value, an unreadable checkpoint) becomes one line on
stderr, `verispec: error: ...`, and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch


from . import __version__
from .config import SamplingParams
from .policy import AdaptiveLength, FixedLength
from .drafters.model import ModelDrafter
from .engine import Batch
from .models.backend import BACKENDS, GGUF_TYPES, is_gguf, load, load_text_tokenizer
from .models.checkpoint import CheckpointError, load_pretrained, load_tokenizer, parse_dtype
from .models.hf import load_model
from .models.vocab import check_same_tokenizer, match_vocab_size
from .server.protocol import find_stop, safe_prefix
from .stats import SpecStats


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + message
        raise SystemExit(_fail(message))


def _fail(message: str) -> int:
    print(f"verispec: error: {message}", file=sys.stderr)
    return 2


def _draft_lengths(text: str) -> list[int | str]:
    """--k of bench: comma-separated draft lengths >= 0 or 'auto'."""
    ks = []
    for item in text.split(","):
        try:
            ks.append(_draft_length(item.strip()))
        except argparse.ArgumentTypeError as error:
            raise ValueError(f"--k: {error}") from None
    if any(isinstance(k, int) and k < 1 for k in ks):
        raise ValueError(f"--k: bench compares each draft length with plain decoding (its baseline): lengths must be >= 1 or 'auto', got {text!r}")
    return ks


def _temperatures(text: str) -> list[float]:
    try:
        values = [float(item) for item in text.split(",")]
    except ValueError:
        raise ValueError(f"--temperature must be comma-separated numbers, got {text!r}") from None
    if any(not value >= 0 for value in values):
        raise ValueError(f"--temperature must be >= 0, got {text!r}")
    return values


def _check_reports(args: argparse.Namespace) -> None:
    """bench's outputs and optional dependencies, checked before the benchmark runs."""
    import importlib.util

    for flag, path in (("--json", args.json), ("--csv", getattr(args, "csv", None))):
        if path is not None:
            _check_writable(path, flag)
    plot_dir = getattr(args, "plot_dir", None)
    if plot_dir is not None:
        _check_directory(plot_dir, "--plot-dir")
        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot-dir needs matplotlib (pip install matplotlib)")
    if args.peer == "hf" and importlib.util.find_spec("transformers") is None:
        raise ValueError("--peer hf needs transformers (pip install 'verispec[test]' or pip install transformers)")


def _at_least(low: int):
    """An argparse type: an integer >= low."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value
    return parse


_positive, _non_negative = _at_least(1), _at_least(0)


def _draft_length(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or 'auto', got {text!r}") from None


def _seed(text: str) -> int:
    """--seed of sampling: SamplingParams' range, [0, 2**63), as the server's "seed"."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**63), got {text!r}")
    return value


def _confidence(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1), got {text!r}")
    return value


def _add_confidence_argument(parser: argparse.ArgumentParser) -> None:
    """Off unless given, with `--k auto` too. Measured in a server (BENCHMARKS.md, two A/Bs after
    serve run 33, 5-6 measured rounds each): `auto` with a stop at 0.3 served 0.97-0.98 of
    `auto` without it at one request, 0.96 at four and 0.98 at eight (paired medians), and
    0.93 and 1.03 at two; earlier A/Bs had it at 1.01-1.09 (four rounds, serve run 29) and 0.978
    (15 rounds at one request, run 30)."""
    parser.add_argument("--confidence-threshold", type=_confidence, default=0.0,
                        help="a model draft stops early where its most likely token's probability is below this "
                             "(as transformers' assistant_confidence_threshold, llama.cpp's --draft-p-min; default 0 = off)")


def _add_sampling_arguments(parser: argparse.ArgumentParser, temperature: float) -> None:
    parser.add_argument("--temperature", type=float, default=temperature, help=f"0 = greedy (default {temperature:g})")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    parser.add_argument("--sampling", choices=["rejection", "invariant"], default="rejection",
                        help="rejection (default): accept a proposal with probability min(1, p/q); invariant: noise keyed by "
                             "(seed, position), so that a seed gives the tokens of plain decoding whatever the draft and k")


def _add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="auto", choices=BACKENDS,
                        help="auto (default): llama.cpp on the CPU when it is installed, else torch; llamacpp: GGUF on llama.cpp "
                             "(a Hugging Face directory is converted once, cached); torch: verispec's PyTorch model")
    parser.add_argument("--gguf-type", default=None, type=str.lower, choices=GGUF_TYPES, metavar="TYPE",
                        help="with llama.cpp: the type a Hugging Face directory is converted to (default f32; "
                             "refused when no model given is a directory: a GGUF file's type is its own)")
    parser.add_argument("--threads", type=_positive, default=None,
                        help="llama.cpp threads (default: every core this process may use; more than that is capped to it)")
    parser.add_argument("--exact-kernels", choices=["on", "off"], default="on",
                        help="on (default): llama.cpp settings under which a position's logits do not depend on the pass "
                             "(speculative output = plain output on every GGUF type; docs/EXACTNESS.md); off: llama.cpp's "
                             "default kernels, faster on some types, where greedy output may differ at near-ties")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N: where a torch model runs (llama.cpp runs on the CPU here)")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="verispec", description="Exact speculative decoding.")
    parser.add_argument("--version", action="version", version=f"verispec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = commands.add_parser("generate", help="stream a completion, then one line of statistics")
    gen.add_argument("prompt_text", nargs="?", metavar="PROMPT", help="the prompt; - reads it from standard input")
    gen.add_argument("--prompt", help="the prompt text (instead of PROMPT)")
    gen.add_argument("--prompts", metavar="FILE", help='JSON lines, one {"prompt": "..."} per line: one batch, one completion per prompt; a line may '
                     'set its row\'s own "seed", "temperature", "top_k", "top_p", "min_p", "max_new_tokens" (any other key is refused)')
    gen.add_argument("--json", metavar="OUT", help="also write the prompts, completions (text and token ids), finish reasons and statistics "
                     "to the file OUT; what is printed is the same with or without it (one prompt streams its text)")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="end a completion before this text, and stop decoding it there (repeatable); the escapes "
                          "\\n \\t \\r \\\\ \\\" \\' \\uXXXX are read, as a shell passes them as written: --stop '\\n\\n' ends at a blank line")
    gen.add_argument("--target", help="target model: a directory of Hugging Face-style weights or a .gguf file; default: the built-in pair's target")
    gen.add_argument("--draft", help="draft model directory or GGUF file, 'ngram' (prompt lookup), 'early-exit:L' (the target's first L layers) "
                     "or 'none' (no speculation); default: the built-in draft with the built-in target, else none")
    gen.add_argument("--k", type=_draft_length, default=None, help="draft length: tokens proposed per target pass, or 'auto' (default: chosen from a cost profile and the acceptance seen)")
    gen.add_argument("--k-max", type=int, default=None, help="with --k auto: the longest draft considered (default 8; a fixed --k above it is refused)")
    _add_sampling_arguments(gen, temperature=0.0)
    gen.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt at most (default 128)")
    gen.add_argument("--seed", type=_seed, default=None, help="random seed of the sampling (default: fresh entropy)")
    gen.add_argument("--no-speculation", action="store_true", help="plain autoregressive decoding of the target (no --k with it)")
    gen.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end-of-sequence token")
    _add_confidence_argument(gen)
    _add_backend_arguments(gen)

    srv = commands.add_parser("serve", help="an OpenAI-compatible HTTP server over a continuous batcher (needs the serve extra)")
    srv.add_argument("--target", help="target model directory or GGUF file; default: the built-in pair's target")
    srv.add_argument("--draft", help="draft model, 'ngram', 'early-exit:L' or 'none'; default: the built-in draft with the built-in target")
    srv.add_argument("--k", type=_draft_length, default="auto", help="draft length, or 'auto' (default): chosen per pass from the costs and acceptance seen")
    srv.add_argument("--k-max", type=int, default=8, help="with --k auto: the longest draft considered (default 8)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    srv.add_argument("--max-batch", type=_positive, default=8, help="rows decoded together at most (default 8)")
    srv.add_argument("--max-waiting", type=_positive, default=64, help="requests waiting for a row at most; beyond it: 503 (default 64)")
    srv.add_argument("--max-model-len", type=_positive, default=None, help="prompt + max_tokens per request at most (default: the model's context)")
    srv.add_argument("--prefill-chunk", type=_positive, default=256, help="a longer prompt is read this many tokens per pass, so that the "
                     "running requests wait at most one piece (default 256)")
    srv.add_argument("--model-name", default=None, help="the model's name in the API (default: the target's directory or file name)")
    srv.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    srv.add_argument("--replicas", type=_positive, default=None, help="run N engine replicas on Ray Serve behind this one endpoint "
                     "(needs the ray extra; --threads is then per replica, default cores // N); default: one engine in this process")
    srv.add_argument("--ray-address", default=None, help="with --replicas: join this Ray cluster (e.g. auto, or HOST:6379) instead of "
                     "starting a local one; the model paths must exist on every node")
    _add_confidence_argument(srv)
    _add_backend_arguments(srv)

    bsv = commands.add_parser("bench-serve", help="load `verispec serve` on this machine: throughput and latency against concurrency, "
                              "for plain decoding, a fixed k and auto, interleaved")
    bsv.add_argument("--url", help="a server already running on this machine (loopback) instead of starting them here "
                     "(each started here runs in a process of its own, one after another)")
    bsv.add_argument("--modes", default="plain,4,auto", help="with no --url: the servers started here: plain, a draft length, auto (default plain,4,auto)")
    bsv.add_argument("--concurrency", default="1,2,4,8,16,32", help="concurrent requests, comma-separated (default 1,2,4,8,16,32)")
    bsv.add_argument("--prompts", help="JSON lines with a \"prompt\" each (default: the built-in held-out prompts)")
    bsv.add_argument("--requests", type=_positive, default=None, help="requests per level and mode (default max(16, 2 x concurrency))")
    bsv.add_argument("--max-tokens", type=_positive, default=64, help="max_tokens of each request (default 64)")
    bsv.add_argument("--temperature", type=float, default=0.0, help="of each request (default 0)")
    bsv.add_argument("--repeats", type=_positive, default=1, help="sweeps over the levels, each one measured round of every mode at every level (default 1)")
    bsv.add_argument("--warmups", type=_non_negative, default=1, help="rounds of every mode at every level before the measured ones, "
                     "reported (warmup: true) but left out of the medians (default 1; 0: none)")
    bsv.add_argument("--max-batch", type=_positive, default=8, help="the servers' --max-batch (default 8)")
    bsv.add_argument("--target", help="target model for the servers started here; default: the built-in pair")
    bsv.add_argument("--draft", help="draft model, 'ngram' or 'early-exit:L' (default: the built-in draft with the built-in target)")
    bsv.add_argument("--k-max", type=int, default=8, help="auto's longest draft (default 8)")
    bsv.add_argument("--max-model-len", type=_positive, default=None, help="the servers' --max-model-len (default: the model's context)")
    bsv.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    bsv.add_argument("--json", metavar="OUT", help="write every level and the medians here")
    bsv.add_argument("--csv", metavar="OUT", help="write the medians here")
    bsv.add_argument("--plot", metavar="OUT", help="write a plot of throughput against concurrency here (PNG; needs matplotlib)")
    _add_backend_arguments(bsv)

    train = commands.add_parser("train", help="prepare the corpus, pretrain the target, cache its distributions, or distil the draft")
    train.add_argument("what", choices=["data", "target", "teacher", "draft", "export"],
                       help="teacher: cache the --teacher's top-k next-token distributions over the training split (resumable); "
                            "export: write OUT/model from OUT/checkpoint.pt (a run so far)")
    train.add_argument("--data", default="runs/data", help="data directory (tokenizer.json, train.bin, heldout.bin)")
    train.add_argument("--out", help="output directory (checkpoint.pt, then model/); default runs/WHAT")
    train.add_argument("--preset", help="architecture: target, draft or tiny (default: WHAT)")
    train.add_argument("--teacher", help="with 'draft': the target model directory to distil from (and measure acceptance against); "
                                          "with 'teacher': the target whose distributions are cached (default: the built-in target)")
    train.add_argument("--teacher-cache", help="with 'draft': distil from this cache of 'verispec train teacher' (no target pass per step)")
    train.add_argument("--top-k", type=_positive, default=32, help="with 'teacher': the most likely tokens kept per position, the rest pooled (default 32)")
    train.add_argument("--chunk-windows", type=_positive, default=64, help="with 'teacher': windows per chunk file, the unit of resumption (default 64)")
    train.add_argument("--vocab-size", type=int, default=8192, help="with 'data': BPE vocabulary size")
    train.add_argument("--steps", type=int, default=2000, help="optimizer steps (default 2000)")
    train.add_argument("--batch-size", type=int, default=16, help="sequences per step (default 16)")
    train.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    train.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    train.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    train.add_argument("--dtype", default="float32", help="autocast dtype: float32, or bfloat16 on CPUs with AMX")
    train.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (default 100)")
    train.add_argument("--eval-every", type=int, default=0, help="held-out loss every N steps; export the best (0 = off: export the last)")
    train.add_argument("--max-seconds", type=float, default=0.0, help="fit the schedule to this many seconds after 60 steps, and stop there at the latest (0 = no limit); "
                                                                     "with 'teacher': stop after the chunk that crosses it")
    train.add_argument("--stop-after", type=float, default=0.0, help="checkpoint and stop after this many seconds, the schedule unchanged: "
                                                                     "run the same command again to go on (0 = no limit)")

    bench = commands.add_parser("bench", help="plain vs speculative decoding of the same prompts, interleaved, in one run")
    bench.add_argument("--target", help="target model directory or GGUF file (default: the built-in pair's target)")
    bench.add_argument("--draft", help="draft model directory or GGUF file, 'ngram' or 'early-exit:L' (default: the built-in draft with the built-in target)")
    bench.add_argument("--prompts", required=True, help='JSON lines, one {"prompt": "..."} per line')
    bench.add_argument("--k", default="1,2,4", help="comma-separated draft lengths, 'auto' allowed (default 1,2,4)")
    bench.add_argument("--temperature", default="0", help="comma-separated temperatures (default 0)")
    bench.add_argument("--sampling", default="rejection", help="comma-separated modes: rejection, invariant (default rejection; invariant is not run at T = 0)")
    bench.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    bench.add_argument("--max-prompts", type=int, default=None, help="use only the first N prompts")
    bench.add_argument("--repeats", type=int, default=3, help="plain/speculative pairs per (k, temperature)")
    bench.add_argument("--seed", type=_seed, default=0, help="sampling seed (default 0)")
    bench.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16, for torch models")
    bench.add_argument("--json", help="write the results here")
    bench.add_argument("--csv", help="write one row per run here")
    bench.add_argument("--plot-dir", help="write speedup_vs_k.png and acceptance_by_position.png here")
    bench.add_argument("--peer", choices=["hf", "llamacpp"],
                       help="instead, greedy: hf = verispec vs transformers' generate (plain, assisted at the first k; prompt lookup with --draft ngram); "
                            "llamacpp = verispec on llama.cpp vs llama-cpp-python (plain, prompt lookup) and llama.cpp's own speculative decoding")
    bench.add_argument("--llama-cpp-bin", help="with --peer llamacpp: a directory holding llama.cpp's llama-speculative-simple (same llama.cpp version)")
    _add_confidence_argument(bench)
    _add_backend_arguments(bench)

    adv = commands.add_parser("plan", help="advise: alpha per position, c, predicted speed-up per k, the k to use")
    adv.add_argument("--target", help="target model directory or GGUF file (default: the built-in pair's target)")
    adv.add_argument("--draft", action="append", help="a candidate: draft directory or GGUF file, 'ngram' or 'early-exit:L' (repeatable; default: the built-in draft with the built-in target)")
    adv.add_argument("--prompts", required=True, help='JSON lines, one {"prompt": "..."} per line')
    adv.add_argument("--k-max", type=int, default=8, help="the longest draft considered (default 8)")
    adv.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    adv.add_argument("--max-new-tokens", type=int, default=64, help="tokens of each prompt's continuation scored (default 64)")
    adv.add_argument("--max-prompts", type=int, default=None, help="use only the first N prompts (default: all)")
    adv.add_argument("--seed", type=_seed, default=0, help="sampling seed (default 0)")
    adv.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16, for torch models")
    adv.add_argument("--json", help="write the report here")
    _add_backend_arguments(adv)

    chk = commands.add_parser("check", help="certify that decoding is lossless on your target, draft and settings (exit 0: all passed)")
    chk.add_argument("--target", help="target model directory or GGUF file (default: the built-in pair's target)")
    chk.add_argument("--draft", help="draft directory or GGUF file, 'ngram' or 'early-exit:L' (default: the built-in draft with the built-in target)")
    chk.add_argument("--prompts", help='JSON lines, one {"prompt": "..."} per line (default: the built-in held-out prompts)')
    chk.add_argument("--contexts", type=int, default=1, help="prompts whose continuations are the contexts of the distribution tests: the first where the draft proposes (default 1; each of the k positions is a context of its own)")
    chk.add_argument("--k", type=int, default=4, help="draft positions tested per context, and the draft length of (b) and (c) (default 4)")
    chk.add_argument("--draws", type=int, default=None, help="verifications per position (default 200000 at a vocabulary of 8192 "
                     "or less, fewer for a larger one, at least 20000; at least 1000)")
    chk.add_argument("--seeds", type=int, default=200, help="seeded rows of the invariant-mode comparison (default 200)")
    chk.add_argument("--max-new-tokens", type=int, default=16, help="tokens per row in the comparisons (default 16)")
    _add_sampling_arguments(chk, temperature=1.0)
    chk.add_argument("--seed", type=_seed, default=0, help="seed of every draw (default 0)")
    chk.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16, for torch models")
    chk.add_argument("--json", metavar="OUT", help="write the report here")
    _add_backend_arguments(chk)

    prof = commands.add_parser("profile", help="measure t_target(n), r(n) and the draft cost ratio c")
    prof.add_argument("--target", help="target model directory or GGUF file, or a preset name of verispec.train (random weights); default: the built-in pair")
    prof.add_argument("--draft", help="draft model directory, GGUF file or preset name: profile times a model's passes "
                      "(not 'ngram' or 'early-exit:L'; 'none': the target alone); default: the built-in draft with the built-in target")
    prof.add_argument("--k-max", type=int, default=8, help="verification passes of 1..k_max+1 positions are timed (default 8)")
    prof.add_argument("--batch-size", type=int, default=1, help="rows per pass (default 1)")
    prof.add_argument("--context", type=int, default=128, help="positions already in the cache when timing (default 128)")
    prof.add_argument("--repeats", type=int, default=15, help="timings per pass length; the median is kept (default 15)")
    prof.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16, for torch models")
    prof.add_argument("--compare-quantized", action="store_true",
                      help="also profile int8 and int4 (group 64) copies of the target, interleaved in one run, and print ratios")
    _add_backend_arguments(prof)

    quant = commands.add_parser("quantize", help="weight-only int8 (per channel) or int4 (group-wise) copy of a model")
    quant.add_argument("--model", required=True, help="float model directory")
    quant.add_argument("--out", required=True, help="directory to write")
    quant.add_argument("--bits", type=int, default=8, choices=[4, 8], help="8 (default, per output channel) or 4 (group-wise)")
    quant.add_argument("--group-size", type=int, default=64, help="with --bits 4: 32, 64 or 128")
    quant.add_argument("--calibration", help="with --bits 4: a data directory of 'verispec train data' (GPTQ on its training split)")
    quant.add_argument("--float-head", action="store_true", help="keep the output head in float (default: int8 per channel)")
    quant.add_argument("--calibration-windows", type=int, default=32, help="256-token windows of calibration text (default 32)")

    ppl = commands.add_parser("perplexity", help="held-out loss and perplexity of one or more models (e.g. float vs quantized)")
    ppl.add_argument("--model", required=True, action="append", help="model directory (repeatable)")
    ppl.add_argument("--data", default="runs/data", help="data directory of 'verispec train data' (its held-out split heldout.bin; default runs/data)")
    ppl.add_argument("--windows", type=int, default=64, help="256-token held-out windows (default 64)")

    conv = commands.add_parser("convert", help="write a Hugging Face model directory as one GGUF file, or a GGUF file in another type")
    conv.add_argument("--model", required=True, help="float model directory (Llama, Mistral or Qwen2; a quantized directory is refused), "
                      "or a .gguf file to quantize")
    conv.add_argument("--out", required=True, help="the .gguf file to write (written whole, then renamed into place)")
    conv.add_argument("--type", default="f32", type=str.lower, choices=GGUF_TYPES, metavar="TYPE",
                      help="f32 (default), f16, bf16, q8_0, q4_0 (from a directory: written by verispec's converter, matrices "
                           "whose rows are not whole 32-value blocks stay f16), or any type of llama-quantize: q4_1, q5_0, "
                           "q5_1, q2_k, q3_k_s/m/l, q4_k_s, q4_k_m, q5_k_s, q5_k_m, q6_k, iq4_nl, iq4_xs (llama.cpp's own "
                           "quantizer, llama_model_quantize; a .gguf input always goes through it); any case")

    toy = commands.add_parser("toy", help="write a tiny random target/draft pair (for smoke tests)")
    toy.add_argument("out", help="directory to create; holds target/ and draft/")
    toy.add_argument("--seed", type=int, default=0, help="random seed of the weights (default 0)")
    toy.add_argument("--sizes", default="tiny", choices=["tiny", "presets"], help="presets: the built-in pair's architectures (random weights)")
    return parser


def _load(path: str, args: argparse.Namespace, dtype):
    """A model on the backend --backend names; a fallback of `auto` is said once, on stderr."""
    device = _device(args)
    if device.type != "cpu" and is_gguf(path):
        raise ValueError(f"{path}: a GGUF file runs on llama.cpp, on the CPU here, not on --device {args.device}")
    model, note = load(path, args.backend, dtype, args.gguf_type or "f32", device=device, n_threads=_threads(args))
    if note:
        print(f"verispec: {note}", file=sys.stderr)
    if not isinstance(model, torch.nn.Module) and getattr(args, "peer", None) != "hf":
        torch.set_num_threads(1)  # llama.cpp has the cores; torch's work per step is a few [B, k+1, V] tensors
    return model


def _threads(args: argparse.Namespace) -> int | None:
    """--threads, capped at the cores this process may use (said once), after --exact-kernels is
    applied: both are llama.cpp settings of the whole process, fixed before its first model."""
    from . import llamacpp

    try:
        llamacpp.set_exact_kernels(getattr(args, "exact_kernels", "on") == "on")
    except RuntimeError:
        raise ValueError(f"--exact-kernels {args.exact_kernels}: this process already runs llama.cpp with the other setting") from None
    threads, cores = getattr(args, "threads", None), llamacpp.default_threads()
    if threads is not None and threads > cores:
        if not getattr(args, "_threads_said", False):
            print(f"verispec: --threads {threads} is more than the {cores} cores this process may use; using {cores}", file=sys.stderr)
            args._threads_said = True
        threads = cores
    return threads


def _device(args: argparse.Namespace) -> torch.device:
    try:
        device = torch.device(getattr(args, "device", "cpu"))
    except RuntimeError:
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: no CUDA device here (this torch is {torch.__version__})")
        if args.backend == "llamacpp":
            raise ValueError(f"--device {args.device}: the llama.cpp backend runs on the CPU here; use --backend torch")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {args.device}: there are {torch.cuda.device_count()} CUDA devices")
    return device


def _target(args: argparse.Namespace, dtype):
    """The target model and its text tokenizer (a one-line error without one). An early-exit
    draft reads the target's own layers, so with --backend auto the target runs on torch then."""
    drafts = args.draft if isinstance(args.draft, list) else [args.draft]
    if args.backend == "auto" and any(str(d).startswith("early-exit:") for d in drafts):
        args.backend = "torch"
    target = _load(args.target, args, dtype)
    _say_deviation(target)
    tokenizer = load_text_tokenizer(args.target, target)
    if tokenizer is None:
        raise ValueError(f"{args.target}: no tokenizer.json, so text cannot be encoded")
    return target, tokenizer


def _say_deviation(target) -> None:
    """One line when a llama.cpp target's logits depend on the pass that computes them
    (measured once per file, build and setting: models/deviation.py); nothing when they do not."""
    if not hasattr(target, "shape_invariant"):
        return
    from .llamacpp.deviation import startup_deviation

    found = startup_deviation(target)
    if found.largest > 0:
        setting = "on" if target.shape_invariant else "off"
        print(f"verispec: {target.path.name} ({target.config.description}): a logit differs by up to {found.largest:.3g} between "
              f"pass shapes here (--exact-kernels {setting}); greedy speculative output may differ from plain decoding at near-ties",
              file=sys.stderr)


def _drafter(spec: str, dtype, target, target_dir: str, args: argparse.Namespace):
    """A drafter from --draft: 'ngram' (prompt lookup, no model), 'early-exit:L' (the target's
    own first L layers) or a model (a directory or a GGUF file, on --backend; its vocabulary
    must be the target's)."""
    if spec == "ngram":
        from .drafters.ngram import PromptLookupDrafter

        return PromptLookupDrafter(device=target.device)
    if spec.startswith("early-exit:"):
        from .drafters.early_exit import EarlyExitDrafter
        from .models.llama import LlamaForCausalLM

        layers = spec.split(":", 1)[1]
        if not layers.isdigit():
            raise ValueError(f"--draft early-exit:L needs a layer count L, got {spec!r}")
        if not isinstance(target, LlamaForCausalLM):
            raise ValueError(f"--draft {spec}: early exit needs verispec's PyTorch Llama as the target (a Llama-family directory with --backend torch)")
        return EarlyExitDrafter(target, int(layers))
    draft = _load(spec, args, dtype)
    if hasattr(draft, "shape_invariant"):
        draft.shape_invariant = False  # only the target's logits must not depend on the pass: q is whatever the draft computed
    check_same_tokenizer(target_dir, spec, target.vocab_size, draft.vocab_size)
    return ModelDrafter(match_vocab_size(draft, target.vocab_size), getattr(args, "confidence_threshold", 0.0))


def _default_pair(args: argparse.Namespace) -> None:
    """No --target: the built-in pair (its draft too, unless --draft says otherwise)."""
    if args.target is None:
        from .pair import DRAFT_DIR, TARGET_DIR

        args.target = str(TARGET_DIR)
        if getattr(args, "draft", None) is None:
            args.draft = [str(DRAFT_DIR)] if args.command == "plan" else str(DRAFT_DIR)


ROW_SETTINGS = ("temperature", "top_k", "top_p", "min_p", "seed", "max_new_tokens")  # a --prompts line may set these for its row


def _prompt_texts(args: argparse.Namespace, settings: list[dict] | None = None) -> list[str]:
    """The prompts of `generate`: PROMPT, --prompt TEXT or --prompts FILE (exactly one of them);
    '-' reads the prompt from standard input. Text must be valid UTF-8. A --prompts line's own
    settings (ROW_SETTINGS) are appended to `settings`, one dict per prompt."""
    given = [name for name, value in (("PROMPT", args.prompt_text), ("--prompt", args.prompt), ("--prompts", args.prompts)) if value is not None]
    if not given:
        raise ValueError("no prompt: give PROMPT, --prompt TEXT, --prompts FILE, or - to read standard input")
    if len(given) > 1:
        raise ValueError(f"give one of PROMPT, --prompt and --prompts, not {' and '.join(given)}")
    if args.prompts is not None:
        texts = _read_prompts(args.prompts, None, settings)
    else:
        text = args.prompt if args.prompt is not None else args.prompt_text
        if text == "-":
            data = sys.stdin.buffer.read()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"standard input is not UTF-8 text (byte {error.start})") from None
        texts = [text]
    for number, text in enumerate(texts, 1):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # the command line's undecodable bytes arrive as lone surrogates
            raise ValueError(f"prompt {number} is not valid UTF-8 text") from None
    return texts


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'"}


def _unescape(text: str) -> str:
    """A --stop value with the escapes of C and JSON read, as a shell passes them literally:
    \\n \\t \\r \\\\ \\" \\' and \\uXXXX (a surrogate pair is one character); any other
    backslash stays. Other characters are kept as they are (no codec: non-ASCII text survives)."""
    def one(match: re.Match) -> str:
        code = match.group(1)
        if code[0] != "u":
            return _ESCAPES.get(code, match.group(0))
        if len(code) != 5:
            raise ValueError(f"--stop {text}: \\u needs four hex digits")
        return chr(int(code[1:], 16))

    value = re.sub(r"\\(u[0-9a-fA-F]{0,4}|.)", one, text, flags=re.DOTALL)
    try:
        return value.encode("utf-16", "surrogatepass").decode("utf-16")
    except UnicodeError:
        raise ValueError(f"--stop {text}: not valid UTF-8 text (half a surrogate pair)") from None


def _stop_strings(values: list[str]) -> list[str]:
    """The --stop values, escapes read; an empty one is refused."""
    stops = [_unescape(value) for value in values]
    if any(stop == "" for stop in stops):
        raise ValueError("--stop needs a non-empty string")
    return stops


def _kept(ids: list[int], before: int, stops: list[str], decode) -> int | None:
    """When the text of ids holds a stop string: the fewest of them (more than `before`, whose
    text held none) that hold it; else None."""
    if not stops or find_stop(decode(ids), stops) is None:
        return None
    return next(m for m in range(before + 1, len(ids) + 1) if find_stop(decode(ids[:m]), stops) is not None)


def _row_text(ids: list[int], stops: list[str], decode) -> str:
    """A row's text, ended before its first stop string."""
    text = decode(ids)
    at = find_stop(text, stops) if stops else None
    return text if at is None else text[:at]


def _request_stats(batch: Batch, row: int):
    """The RequestStats of a row of `generate`'s batch, running or just finished."""
    return dict(batch.finished).get(row) or batch.requests[batch.ids.index(row)]


def _decode_rows(batch: Batch, decode, stops: list[str], stream: bool) -> list[list[int]]:
    """Run a batch to its end; each row's tokens. A row whose text reaches a stop string keeps the
    fewest tokens that hold it, stops decoding (finish reason 'stop', its tokens counted to
    there) and leaves; the other rows go on. With `stream`, row 0's text is written to standard
    output as it comes (a tail that may begin a stop string, or an unfinished UTF-8 character,
    is held back until it is known)."""
    generated: list[list[int]] = [[] for _ in range(len(batch))]
    shown = ""
    try:
        while any(batch.active):
            chunk = batch.step()
            stopped = []
            for row, tokens in chunk.items():
                before = len(generated[row])
                generated[row] += tokens
                kept = _kept(generated[row], before, stops, decode) if tokens else None
                if kept is not None:
                    request = _request_stats(batch, row)
                    request.generated_tokens -= len(generated[row]) - kept
                    request.finish_reason = "stop"
                    del generated[row][kept:]
                    stopped.append(row)
            batch.cancel(stopped, "stop")
            if stream:
                shown = _show(_row_text(generated[0], stops, decode), shown, not any(batch.active), stops)
    finally:
        batch.close()
    return generated


def _show(text: str, shown: str, done: bool, stops: list[str]) -> str:
    """Write what of text can be shown now past what was (`shown`); what is shown now."""
    text = text[: safe_prefix(text, stops, done)]
    if text != shown:
        sys.stdout.write(text.removeprefix(shown))
        sys.stdout.flush()
    return text


def _generate(args: argparse.Namespace) -> int:
    import json

    row_settings: list[dict] = []
    texts = _prompt_texts(args, row_settings)
    stops = _stop_strings(args.stop)
    if args.json is not None:
        _check_writable(args.json, "--json")
    _default_pair(args)
    dtype = parse_dtype(args.dtype)
    target, tokenizer = _target(args, dtype)
    no_draft = args.draft in (None, "none") or args.no_speculation  # 'none' as in serve: the built-in target alone too
    drafter = None if no_draft else _drafter(args.draft, dtype, target, args.target, args)
    eos = target.config.eos_token_id
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else () if eos is None else (eos,)  # transformers configs may list several
    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
        max_new_tokens=args.max_new_tokens, stop_token_ids=() if args.ignore_eos else eos, sampling=args.sampling,
    )
    if any(row_settings):  # a --prompts line's own settings override the flags for its row
        params = [replace(params, **row) for row in row_settings]
    prompt_ids = [tokenizer.encode(text).ids for text in texts]
    if not all(prompt_ids):
        return _fail(f"prompt {next(i for i, ids in enumerate(prompt_ids, 1) if not ids)} encodes to no tokens")
    from .engine import check_context

    budgets = [p.max_new_tokens for p in params] if isinstance(params, list) else args.max_new_tokens
    check_context(target, prompt_ids, budgets)  # before the cost profile, which reads that long a context
    k = AdaptiveLength(k_max=args.k_max) if args.k == "auto" else FixedLength(args.k)  # validated before any work
    if isinstance(target, torch.nn.Module):
        from .models.kernels import kernel_status

        from .models.kernels import calibrate

        kernel_status()  # load (or build, once) the CPU kernel now, not inside the timed loop
        calibrate(target, len(prompt_ids) * (max(args.k_max, args.k if isinstance(args.k, int) else 0) + 1))  # and measure it against torch's
        if isinstance(getattr(drafter, "model", None), torch.nn.Module):
            calibrate(drafter.model, len(prompt_ids) * 2)
    elif drafter is not None:
        from .llamacpp import step_status

        step_status()  # build (once) the compiled step now, not inside the timed run
    plain_step_s = None
    if args.k == "auto" and drafter is not None:  # a quick cost profile: the policy chooses well from the start
        from .analysis.profile import profile_costs

        longest = max(map(len, prompt_ids))
        profile = profile_costs(target, getattr(drafter, "model", None), args.k_max, batch_size=len(prompt_ids),
                                context_length=longest + max(budgets if isinstance(budgets, list) else [budgets]) // 2, repeats=3)
        k = AdaptiveLength(k_max=args.k_max, prior_c=profile.c or 0.0, prior_r=profile.r, prior_batch=len(prompt_ids))
        plain_step_s = profile.target_s[0]
    stats = SpecStats()
    stream = len(texts) == 1
    if stream:
        sys.stdout.write(texts[0])
    decode = partial(tokenizer.decode, skip_special_tokens=True)
    generated = _decode_rows(Batch(target, prompt_ids, params, drafter, k, stats), decode, stops, stream)
    results = [{"prompt": prompt, "text": _row_text(ids, stops, decode), "token_ids": ids, "finish_reason": request.finish_reason}
               for prompt, ids, request in zip(texts, generated, stats.requests)]
    if stream:
        print()
    else:
        for result in results:
            print(result["prompt"] + result["text"])
            print()
    print(stats.summary(plain_step_s))
    if args.json is not None:
        Path(args.json).write_text(json.dumps({"results": results, "stats": stats.to_dict()}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def _check_writable(path: str, flag: str) -> None:
    """A one-line error now, not after the work, when `path` cannot be written."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {path}: is a directory")
    if not target.parent.is_dir():
        raise ValueError(f"{flag} {path}: no directory {target.parent}")
    if not os.access(target.parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"{flag} {path}: not writable")


def _check_directory(path: str, flag: str) -> None:
    """A one-line error now, not after the work, when the output directory `path` cannot be made
    (its missing parents are made) or written."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{flag} {path}: a file, not a directory")
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: not writable")


def _progress(command: str, always: bool = False):
    """A progress line per phase on stderr, when stderr is a terminal or `always` (long runs say what they do)."""
    def say(message: str) -> None:
        if always or sys.stderr.isatty():
            print(f"verispec {command}: {message}", file=sys.stderr, flush=True)
    return say


def _model(name: str, dtype, args: argparse.Namespace):
    """A model (directory or GGUF file, on --backend), or a preset of verispec.train with random
    weights on torch (costs only)."""
    from .models.llama import LlamaForCausalLM, init_weights
    from .models.presets import PRESETS

    if not Path(name).exists() and name in PRESETS:
        return init_weights(LlamaForCausalLM(PRESETS[name])).to(dtype).eval()
    return _load(name, args, dtype)


def _plan(args: argparse.Namespace) -> int:
    import json

    from .analysis.plan import plan

    if args.k_max < 1:
        return _fail(f"--k-max must be >= 1, got {args.k_max}")
    if args.json:
        _check_writable(args.json, "--json")
    _default_pair(args)
    dtype = parse_dtype(args.dtype)
    target, tokenizer = _target(args, dtype)
    drafts = {name: _drafter(name, dtype, target, args.target, args) for name in args.draft}
    prompts = [tokenizer.encode(text).ids for text in _read_prompts(args.prompts, args.max_prompts)]
    params = SamplingParams(temperature=args.temperature, seed=args.seed, max_new_tokens=args.max_new_tokens)
    report = plan(target, drafts, prompts, params, args.k_max, progress=_progress("plan"))
    for candidate in report["candidates"]:
        share = "" if candidate["proposal_share"] == 1.0 else f", proposes at {candidate['proposal_share']:.0%} of positions"
        print(f"draft {candidate['draft']}: beta {candidate['beta']:.3f}, c {candidate['c']:.3f}{share} -> {candidate['advice']}")
        print("  alpha by position: " + " ".join(f"{a:.2f}" if n else "-" for a, n in zip(candidate["alpha_by_position"], candidate["alpha_samples"]))
              + " ('-': no samples that deep)" * (0 in candidate["alpha_samples"]))
        print("  predicted speed-up: " + " ".join(f"k={k}:{s:.2f}" for k, s in enumerate(candidate["predicted_speedup"])))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def _check(args: argparse.Namespace) -> int:
    import json

    from .analysis.check import format_report, run_check

    for flag, value, least in (("--contexts", args.contexts, 1), ("--k", args.k, 1), ("--draws", 1000 if args.draws is None else args.draws, 1000),
                               ("--seeds", args.seeds, 1), ("--max-new-tokens", args.max_new_tokens, 1)):
        if value < least:
            return _fail(f"{flag} must be >= {least}, got {value}")
    if args.json is not None:
        _check_writable(args.json, "--json")
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                            sampling=args.sampling)
    if args.prompts is None:
        from .pair import HELDOUT_PROMPTS

        args.prompts = str(HELDOUT_PROMPTS)
    texts = _read_prompts(args.prompts, None)
    _default_pair(args)
    if args.draft is None:
        return _fail("--draft is needed with --target (a directory or GGUF file, 'ngram' or 'early-exit:L')")
    dtype = parse_dtype(args.dtype)
    target, tokenizer = _target(args, dtype)
    drafter = _drafter(args.draft, dtype, target, args.target, args)
    prompts = [ids for ids in (tokenizer.encode(text).ids for text in texts) if ids]
    if len(prompts) < args.contexts:
        return _fail(f"{args.prompts}: {len(prompts)} non-empty prompts, fewer than --contexts {args.contexts}")
    report = run_check(target, drafter, prompts, params, contexts=args.contexts, k=args.k, n=args.draws, seeds=args.seeds,
                       max_new_tokens=args.max_new_tokens, progress=_progress("check", always=True))
    print("\n".join(format_report(report)))
    if args.json is not None:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0 if report.passed else 1


def _quantize(args: argparse.Namespace) -> int:
    from .models.checkpoint import save_pretrained
    from .models.quantize import quantize_model, weight_bytes

    from .models.quantize import GROUP_SIZES

    if args.bits == 4 and args.group_size not in GROUP_SIZES:
        return _fail(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {args.group_size}")
    _check_directory(args.out, "--out")
    model = load_pretrained(args.model)
    before = weight_bytes(model)
    calibration = None
    if args.calibration:
        from .training.data import load_tokens

        tokens = load_tokens(args.calibration, "train")
        starts = torch.randint(0, len(tokens) - 257, (args.calibration_windows,), generator=torch.Generator().manual_seed(0))
        calibration = torch.stack([tokens[s : s + 256] for s in starts.tolist()])
    quantize_model(model, args.bits, args.group_size, calibration, head_bits=None if args.float_head else 8)
    save_pretrained(model, args.out, max_shard_bytes=50_000_000, tokenizer_from=args.model)
    print(f"wrote {args.out}: int{args.bits} ({model.quantization['method']}) weights, {before / 1e6:.1f} MB -> {weight_bytes(model) / 1e6:.1f} MB read per pass")
    return 0


def _profile(args: argparse.Namespace) -> int:
    from .models.kernels import kernel_status
    from .analysis.profile import profile_costs

    if args.k_max < 1:
        return _fail(f"--k-max must be >= 1, got {args.k_max}")
    if args.draft is not None and (args.draft == "ngram" or args.draft.startswith("early-exit:")):
        return _fail(f"--draft {args.draft}: profile times a draft model's passes (a directory, GGUF file or preset name); "
                     "for prompt lookup or early exit, plan measures acceptance and cost")
    _default_pair(args)
    if args.draft == "none":
        args.draft = None
    if args.compare_quantized:  # verispec's own int8/int4 formats run on PyTorch
        if args.backend == "llamacpp":
            return _fail("--compare-quantized compares verispec's PyTorch int8/int4 formats (--backend torch); "
                         "for llama.cpp's types, profile each --gguf-type")
        args.backend = "torch"
    dtype = parse_dtype(args.dtype)
    target = _model(args.target, dtype, args)
    draft = _model(args.draft, dtype, args) if args.draft else None
    if args.compare_quantized:
        return _compare_quantized(target, args)
    limit = getattr(target.config, "max_position_embeddings", None)
    if isinstance(limit, int) and args.context + args.k_max + 1 > limit:
        return _fail(f"--context {args.context} plus --k-max {args.k_max} + 1 exceeds the model's context of {limit} positions")
    choices = []
    if isinstance(target, torch.nn.Module):
        from .models.kernels import calibrate

        choices = [c for c in calibrate(target, args.batch_size * (args.k_max + 1)) if c["rows"] in (args.batch_size, args.batch_size * (args.k_max + 1))]
    _progress("profile")(f"timing passes of 1..{args.k_max + 1} positions{' and the draft' if draft is not None else ''}, {args.repeats} times each")
    profile = profile_costs(target, draft, args.k_max, args.batch_size, args.context, args.repeats)
    if isinstance(target, torch.nn.Module):
        engine = f"{args.dtype}, {kernel_status()}"
    else:
        from .llamacpp import step_status, system_info

        engine = f"llama.cpp, {target.config.description}, {target.n_threads} threads; {system_info()}; {step_status()}"
    print(f"target {target.config.num_parameters / 1e6:.1f}M params, batch {args.batch_size}, context bucket {profile.context_length}; {engine}")
    for n, (t, r) in enumerate(zip(profile.target_s, profile.r), 1):
        print(f"t_target({n}) = {t * 1e3:7.2f} ms   r({n}) = {r:.2f}")
    if draft is not None:
        print(f"t_draft = {profile.draft_s * 1e3:.2f} ms per token ({draft.config.num_parameters / 1e6:.1f}M params)   c = {profile.c:.3f}")
    for choice in choices:  # the kernel chosen per weight shape and row count, by measuring both here
        n, k = choice["shape"]
        print(f"linear {n}x{k}, {choice['rows']} rows: skinny kernel {choice['kernel_s'] * 1e3:.3f} ms, torch {choice['torch_s'] * 1e3:.3f} ms"
              f" -> {'skinny kernel' if choice['kernel'] else 'torch'}")
    return 0


def _compare_quantized(target, args: argparse.Namespace) -> int:
    """float32 vs int8 vs int4 copies of one target: rounds of short profiles, interleaved."""
    import copy
    import statistics

    from .models.quantize import quantize_model, weight_bytes
    from .analysis.profile import profile_costs

    variants = {"float32": target, "int8": quantize_model(copy.deepcopy(target), 8), "int4-g64": quantize_model(copy.deepcopy(target), 4, 64)}
    times: dict[str, list[tuple[float, ...]]] = {name: [] for name in variants}
    for _ in range(3):  # rounds: drift lands on every variant alike
        for name, model in variants.items():
            times[name].append(profile_costs(model, None, args.k_max, args.batch_size, args.context, args.repeats, use_cache=False).target_s)
    base = statistics.median(t[0] for t in times["float32"])
    print(f"{'model':>9} {'weight MB':>9} {'t(1) ms':>8} {'vs float32':>10} {'r(' + str(args.k_max + 1) + ')':>6}")
    for name, model in variants.items():
        t1 = statistics.median(t[0] for t in times[name])
        tk = statistics.median(t[-1] for t in times[name])
        print(f"{name:>9} {weight_bytes(model) / 1e6:>9.1f} {t1 * 1e3:>8.2f} {t1 / base:>10.2f} {tk / t1:>6.2f}")
    print("t(1): one decoding step (forward, process_logits, verify, host sync); weight MB: read per pass")
    return 0


def _read_prompts(path: str, limit: int | None, settings: list[dict] | None = None) -> list[str]:
    """The "prompt" strings of a JSON-lines file (the first `limit`). With `settings`, each
    line's ROW_SETTINGS are checked (as SamplingParams checks them, named with the line; a key
    that is neither one nor "prompt" is refused, as the server refuses one) and appended to it,
    one dict per prompt."""
    import json

    if limit is not None and limit < 1:
        raise ValueError(f"--max-prompts must be >= 1, got {limit}")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start})") from None
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            prompt = record["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            prompt = None
        if not isinstance(prompt, str):
            raise ValueError(f'{path}:{number}: expected a JSON object with a "prompt" string')
        prompts.append(prompt)
        if settings is not None:
            unknown = sorted(set(record) - {"prompt", *ROW_SETTINGS})
            if unknown:  # a misspelt setting would silently not apply
                raise _FileError(f'{path}:{number}: unknown key "{unknown[0]}" (a line may set "prompt", '
                                 + ", ".join(f'"{key}"' for key in ROW_SETTINGS) + ")")
            row = {key: record[key] for key in ROW_SETTINGS if key in record}
            try:
                SamplingParams(**row)
            except ValueError as error:
                raise _FileError(f"{path}:{number}: {error}") from None
            settings.append(row)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts[:limit]


def _peer(args: argparse.Namespace) -> int:
    import json

    from .analysis.peer_hf import run_peer_bench

    k = next((int(k) for k in args.k.split(",") if k.isdigit()), 4)
    tokenizer = load_tokenizer(args.target)
    if tokenizer is None:
        return _fail(f"{args.target}: no tokenizer.json, so prompts cannot be encoded")
    prompts = [tokenizer.encode(text).ids for text in _read_prompts(args.prompts, args.max_prompts)]
    lookup = args.draft == "ngram"
    dtype = parse_dtype(args.dtype)
    result = run_peer_bench(args.target, None if lookup else args.draft, prompts, k, args.max_new_tokens, args.repeats, prompt_lookup=lookup,
                            dtype=dtype, load=lambda path: _load(path, args, dtype))
    print(f"{'system':>32} {'tok/s':>8} {'vs hf plain':>11} {'vs hf assisted':>14}  identical")
    for row in result["runs"]:
        assisted = "-" if row["vs_transformers_assisted"] is None else f"{row['vs_transformers_assisted']:.2f}"
        print(f"{row['system']:>32} {row['tokens_per_s']:>8.1f} {row['vs_transformers_plain']:>11.2f} {assisted:>14}  {row['identical_to_transformers_plain']}")
    for row in result["runs"]:
        diff = row["first_difference"]
        if diff is not None:
            print(f"{row['system']}: first differs from transformers plain at prompt {diff['prompt']}, token {diff['position']} "
                  f"({diff['tokens'][1]} vs {diff['tokens'][0]}): the target's top-2 logit gap there is {diff['top2_gap']:.4f}"
                  + (" (a near-tie)" if diff["top2_gap"] < 0.05 else ""))
    print(f"greedy, batch 1, {args.max_new_tokens} new tokens per prompt, {result['dtype']}, median of {args.repeats} rounds")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def _peer_llamacpp(args: argparse.Namespace) -> int:
    import json

    from .models.backend import gguf_file
    from .llamacpp import unavailable
    from .analysis.peer_llamacpp import run_llamacpp_peer_bench

    reason = unavailable()
    if reason:
        return _fail(f"--peer llamacpp: {reason}")
    ks = _draft_lengths(args.k)
    temperature = _temperatures(args.temperature)[0]
    texts = _read_prompts(args.prompts, args.max_prompts)
    gguf_type = args.gguf_type or "f32"
    target, draft = gguf_file(args.target, gguf_type), None if args.draft == "ngram" else gguf_file(args.draft, gguf_type)
    result = run_llamacpp_peer_bench(target, draft, texts, ks, args.max_new_tokens, args.repeats, temperature, args.seed, args.threads,
                                     args.llama_cpp_bin, confidence_threshold=args.confidence_threshold)
    versus = any(row["vs_llamacpp_speculative_best"] is not None for row in result["runs"])
    print(f"{'system':>52} {'tok/s':>8} {'vs plain':>8} {'vs llama.cpp spec best':>22} {'alpha_hat':>9} {'own ms/pass':>11}  identical")
    for row in result["runs"]:
        best = f"{row['vs_llamacpp_speculative_best']:.2f}" if versus else "-"
        alpha = "-" if row.get("alpha_hat") is None else f"{row['alpha_hat']:.3f}"
        own = "-" if "own_ms_per_pass" not in row else f"{row['own_ms_per_pass']:.2f} ({row['own_share_of_target_pass']:.0%})"
        print(f"{row['system']:>52} {row['tokens_per_s']:>8.1f} {row['vs_llamacpp_plain']:>8.2f} {best:>22} {alpha:>9} {own:>11}  "
              f"{row.get('identical_to_llamacpp_plain', '-')} ({row.get('identical_prompts', '-')}/{result['prompts']})")
    print(f"target {result['target_description']}, draft {result['draft_description']}; T={temperature}, batch 1, {args.max_new_tokens} new tokens "
          f"per prompt, {result['threads']} threads, decode-only tokens/s, median of {args.repeats} rounds; own ms/pass: verispec's time "
          "outside llama.cpp per target pass (share of the target pass)"
          + (f"; rows marked 'confidence {args.confidence_threshold:g}' stop drafting below that probability (llama.cpp's program: "
             f"--spec-draft-p-min {args.confidence_threshold:g})" if args.confidence_threshold else "") + f"; {result['compiled_step']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .analysis.bench import run_bench, write_reports

    _check_reports(args)
    ks, temperatures = _draft_lengths(args.k), _temperatures(args.temperature)
    samplings = [mode.strip() for mode in args.sampling.split(",")]
    if not samplings or any(mode not in ("rejection", "invariant") for mode in samplings):
        return _fail(f"--sampling must list rejection and/or invariant, got {args.sampling!r}")
    _default_pair(args)
    if args.peer == "llamacpp":
        return _peer_llamacpp(args)
    if args.peer:
        return _peer(args)
    dtype = parse_dtype(args.dtype)
    target, tokenizer = _target(args, dtype)
    prompts = [tokenizer.encode(text).ids for text in _read_prompts(args.prompts, args.max_prompts)]
    drafter = _drafter(args.draft, dtype, target, args.target, args)
    if isinstance(target, torch.nn.Module):  # build and measure the CPU kernel now: no compile time inside a timing
        from .models.kernels import calibrate

        calibrate(target, max(k for k in ks if k != "auto") + 1 if any(k != "auto" for k in ks) else 9)
    # start() resets a drafter completely, so one object serves every run
    result = run_bench(target, lambda: drafter, prompts, ks, temperatures, args.max_new_tokens, args.repeats, args.seed,
                       getattr(drafter, "model", None), samplings=samplings)
    print(f"{'k':>5} {'T':>4} {'mode':>9} {'base tok/s':>10} {'spec tok/s':>10} {'speedup':>16} {'pred':>5} {'alpha_hat':>9} {'beta':>5} {'bound':>5} {'tok/pass':>8} identical")
    for run in result["runs"]:
        predicted = "-" if run["predicted_speedup"] is None else f"{run['predicted_speedup']:.2f}"
        bound = "-" if run["invariant_bound"] is None else f"{run['invariant_bound']:.3f}"
        identical = run["greedy_identical"] if run["greedy_identical"] is not None else run["invariant_identical"]
        spread = f"{run['speedup']:.2f} [{run['speedup_min']:.2f},{run['speedup_max']:.2f}]"
        print(f"{run['k']!s:>5} {run['temperature']:>4} {run['sampling']:>9} {run['tokens_per_s_baseline']:>10.1f} {run['tokens_per_s_speculative']:>10.1f} {spread:>16} {predicted:>5}"
              f" {run['alpha_hat']:>9.3f} {run['beta']:>5.3f} {bound:>5} {run['mean_tokens_per_pass']:>8.2f} {identical}")
    print("tok/pass includes the recovered/bonus token; speedup = median of per-pair ratios [min, max]; identical: the speculative "
          "tokens are the plain ones (greedy; invariant mode at T > 0); bound: beta/(2 - beta) of the rejection run, the least "
          "invariant mode's acceptance can be; invariant mode's beta is its acceptance rate")
    for run in result["runs"]:
        if run["noisy"]:
            print(f"noisy: k={run['k']}, T={run['temperature']}: the plain baseline ranged {run['baseline_spread']:.2f}x across "
                  f"{args.repeats} repeats (the machine was busy?): its speed-up is unreliable and not picked as the best k")
    c = result["profile"]["c"]
    print(f"draft reads {result['draft_bytes_per_token'] / 1e6:.1f} MB of weights per token (target {result['target_bytes_per_pass'] / 1e6:.1f} MB per pass), "
          f"c = {0.0 if c is None else c:.3f}; best k: "
          + (", ".join(f"T={t}: k={b['k']} ({b['speedup']:.2f}x)" for t, b in result["best_k"].items()) or "none (every run was noisy)"))
    for path in write_reports(result, args.json, args.csv, args.plot_dir):
        print(f"wrote {path}")
    return 0


def _perplexity(args: argparse.Namespace) -> int:
    import math

    from .training.train import held_out_loss

    if args.windows < 1:
        return _fail(f"--windows must be >= 1, got {args.windows}")
    if not (Path(args.data) / "heldout.bin").is_file():
        return _fail(f"--data {args.data}: no held-out split (heldout.bin) there; 'verispec train data --out DIR' makes one")
    print(f"{'model':>40} {'loss (nats/token)':>18} {'perplexity':>10}")
    for name in args.model:
        loss = held_out_loss(load_model(name), args.data, max_windows=args.windows)
        print(f"{name:>40} {loss:>18.4f} {math.exp(loss):>10.2f}")
    print(f"held-out split of {args.data}, {args.windows} windows of 256 tokens")
    return 0


def _train(args: argparse.Namespace) -> int:
    from .training import train

    out = args.out or f"runs/{args.what}"
    _check_directory(args.out or (args.data if args.what == "data" else out), "--data" if args.what == "data" and not args.out else "--out")
    if args.what == "data":
        print(f"wrote {train.prepare_data(args.out or args.data, args.vocab_size)}")
        return 0
    if args.what == "teacher":
        from .pair import TARGET_DIR
        from .training.teacher import build_teacher_cache

        out, missing = build_teacher_cache(args.teacher or TARGET_DIR, args.data, args.out or "runs/teacher", seq_len=args.seq_len,
                                           top_k=args.top_k, chunk_windows=args.chunk_windows, batch_size=args.batch_size,
                                           dtype=args.dtype, max_seconds=args.max_seconds, progress=sys.stderr.isatty())
        print(f"wrote {out}" + (f": {missing} chunks still missing (run it again to go on)" if missing else ": complete"))
        return 0
    if args.what == "draft" and args.teacher is None:
        return _fail("train draft needs --teacher DIR (the target to distil from)")
    if args.what == "export" and args.preset is None:
        return _fail("train export needs --preset NAME (the run's architecture)")
    preset = args.preset or args.what
    if preset not in train.PRESETS:
        return _fail(f"--preset must be one of {sorted(train.PRESETS)}, got {preset!r}")
    if args.what == "export":
        if args.out is None:
            return _fail("train export needs --out DIR (the run directory holding checkpoint.pt)")
        print(f"wrote {train.export_checkpoint(train.PRESETS[preset], args.out, args.data)}")
        return 0
    cfg = train.TrainConfig(
        out=out, data=args.data, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
        seed=args.seed, dtype=args.dtype, checkpoint_every=args.checkpoint_every, eval_every=args.eval_every,
        max_seconds=args.max_seconds, stop_after=args.stop_after,
        teacher=args.teacher if args.what == "draft" else None,
        teacher_cache=args.teacher_cache if args.what == "draft" else None,
    )
    result = train.train(train.PRESETS[preset], cfg, progress=sys.stderr.isatty())
    print(f"wrote {result / 'model'}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    import time

    from .models.gguf_convert import convert

    _check_writable(args.out, "--out")
    start = time.perf_counter()
    try:
        if is_gguf(args.model):
            from .llamacpp.quantize import quantize

            path = quantize(args.model, args.out, args.type)
        else:
            path = convert(args.model, args.out, args.type)
    except ImportError as error:
        return _fail(f"verispec convert needs the gguf package (pip install 'verispec[llamacpp]'): {error}")
    print(f"wrote {path}: {args.type}, {path.stat().st_size / 1e6:.1f} MB in {time.perf_counter() - start:.1f} s")
    return 0


def _toy(args: argparse.Namespace) -> int:
    from .models.toy import make_toy_pair

    _check_directory(args.out, "OUT")
    target, draft = make_toy_pair(args.out, seed=args.seed, sizes=args.sizes)
    print(f"wrote {target} and {draft} (random weights)")
    return 0


def load_serve_models(args: argparse.Namespace):
    """The models of `verispec serve`, as the single-process server and every Ray replica load
    them (`args` may be a dict of its options: a replica gets them so). Resolves --target (the
    built-in pair) in `args`."""
    from .server.chat import load_chat_template
    from .server.run import ServedModels

    args = argparse.Namespace(**args) if isinstance(args, dict) else args
    no_draft = args.draft == "none"
    _default_pair(args)
    dtype = parse_dtype(args.dtype)
    target, tokenizer = _target(args, dtype)
    drafter = None if no_draft else _drafter(args.draft, dtype, target, args.target, args)
    eos = target.config.eos_token_id
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else () if eos is None else (eos,)
    k = AdaptiveLength(k_max=args.k_max) if args.k == "auto" else FixedLength(args.k)
    return ServedModels(target, tokenizer, drafter, k, eos, args.model_name or Path(args.target).name, load_chat_template(args.target))


def load_serve_tokenizer(options: dict):
    """The target's text tokenizer alone (the Ray ingress's): a directory's tokenizer.json, read
    without its weights; a GGUF file's own vocabulary (the file is mapped, not copied)."""
    args = argparse.Namespace(**options)
    if is_gguf(args.target):
        return _target(args, parse_dtype(args.dtype))[1]
    return load_tokenizer(args.target)


def _stop_note(args: argparse.Namespace) -> str:
    """', confidence stop P' where a model draft has one (none with --draft none or ngram)."""
    model_draft = not str(args.draft).startswith(("none", "ngram", "early-exit:"))
    return f", confidence stop {args.confidence_threshold:g}" if args.confidence_threshold and model_draft else ""


def _serve(args: argparse.Namespace) -> int:
    try:
        from .server.run import build, listen, run
    except ImportError as error:
        return _fail(f"verispec serve needs the serve extra (pip install 'verispec[serve]'): {error}")
    if not 0 <= args.port <= 65535:
        return _fail(f"--port must be in [0, 65535], got {args.port}")
    if args.ray_address is not None and args.replicas is None:
        return _fail("--ray-address needs --replicas N (the engines run on Ray only then)")
    if args.replicas is not None:
        return _serve_replicas(args)
    sock = listen(args.host, args.port)  # before the models load: a port in use is one line, before the banner
    models = load_serve_models(args)
    app, scheduler = build(models.target, models.drafter, models.tokenizer, model_name=models.name, k=models.k, max_batch=args.max_batch,
                           max_waiting=args.max_waiting, max_model_len=args.max_model_len, eos=models.eos,
                           chat_template=models.chat_template, prefill_chunk=args.prefill_chunk)
    print(f"verispec serve: {models.name} on http://{args.host}:{args.port}/v1 ({args.max_batch} rows, k={args.k}{_stop_note(args)}, "
          f"context {scheduler.max_model_len}); Ctrl-C stops", file=sys.stderr)
    run(app, args.host, args.port, sock)
    return 0


def _serve_replicas(args: argparse.Namespace) -> int:
    """`serve --replicas N`: the flags and models are checked here (loaded once, then dropped),
    then N replicas load them again on Ray Serve (server/replicas.py) until SIGINT or SIGTERM."""
    try:
        from ray import serve  # noqa: F401

        from .server.replicas import Frontend, Plan, serve_until_signal
    except ImportError as error:
        return _fail(f"verispec serve --replicas needs Ray Serve (pip install 'verispec[ray]'): {error}")
    from .server.run import model_len

    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.replicas)
    models = load_serve_models(args)
    frontend = Frontend(models.name, models.target.vocab_size, model_len(models.target, args.max_model_len), models.eos,
                        models.chat_template)
    del models
    options = vars(args).copy()
    plan = Plan(partial(load_serve_models, options), partial(load_serve_tokenizer, options), frontend, replicas=args.replicas,
                threads=args.threads, max_batch=args.max_batch, max_waiting=args.max_waiting, prefill_chunk=args.prefill_chunk)

    def ready(url: str, ray_address: str) -> None:
        print(f"verispec serve: {frontend.model_name} on {url}/v1 ({args.replicas} replicas x {args.max_batch} rows, "
              f"{args.threads} threads each, k={args.k}{_stop_note(args)}, context {frontend.max_model_len}; Ray at {ray_address}); Ctrl-C stops",
              file=sys.stderr, flush=True)

    try:
        serve_until_signal(plan, args.host, args.port, args.ray_address, ready)
    except (RuntimeError, ConnectionError) as error:  # Ray could not start or join, or a replica could not be built
        first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        return _fail(f"the replicas did not start: {first.strip()} (Ray's logs: /tmp/ray/session_latest/logs)")
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    import json
    from urllib.parse import urlparse

    try:
        from .server.loadgen import as_dict, bench_serve, plot, summarize, write_csv
        from .server.run import Spawned
    except ImportError as error:
        return _fail(f"verispec bench-serve needs the serve extra (pip install 'verispec[serve]'): {error}")
    levels = [int(x) for x in args.concurrency.split(",") if x.strip().isdigit()]
    if not levels or len(levels) != len(args.concurrency.split(",")) or min(levels) < 1 or max(levels) > 256:
        return _fail(f"--concurrency must be integers in [1, 256], comma-separated, got {args.concurrency!r}")
    for flag in ("json", "csv", "plot"):
        if getattr(args, flag) is not None:
            _check_writable(getattr(args, flag), f"--{flag}")
    from .pair import HELDOUT_PROMPTS

    prompts = _read_prompts(args.prompts or str(HELDOUT_PROMPTS), None)
    started = []
    if args.url is not None:
        host = urlparse(args.url).hostname
        if host not in ("127.0.0.1", "localhost", "::1"):
            return _fail(f"--url must be a server on this machine (127.0.0.1, localhost or ::1), got {args.url!r}")
        servers = {"server": args.url.rstrip("/")}
    else:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        bad = [m for m in modes if m not in ("plain", "auto") and not m.isdigit()]
        if bad or not modes:
            return _fail(f"--modes takes plain, auto and draft lengths, got {args.modes!r}")
        common = ["--max-batch", str(args.max_batch), "--k-max", str(args.k_max), "--dtype", args.dtype, "--backend", args.backend,
                  "--device", args.device, "--model-name", "bench"]
        for flag in ("target", "max_model_len", "threads", "gguf_type"):
            if getattr(args, flag) is not None:
                common += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        servers = {}
        try:
            for mode in modes:  # one at a time: the first converts the built-in pair (cached), a calibration runs alone
                drafter = ["--draft", "none"] if mode == "plain" else ["--draft", args.draft] if args.draft else []
                handle = Spawned([*common, *drafter, "--k", "0" if mode == "plain" else mode])
                started.append(handle)
                servers["plain" if mode == "plain" else f"k={mode}"] = handle.url
        except RuntimeError as error:
            for handle in started:
                handle.stop()
            return _fail(str(error))
    try:
        def say(level) -> None:
            print(f"{level.mode:>8} c={level.concurrency:<3} {level.throughput_tok_s:8.1f} tok/s{' (warm-up)' if level.warmup else ''}  TTFT p50 {level.ttft_p50_s * 1e3:7.1f} ms"
                  f"  ITL p50 {level.itl_p50_s * 1e3:6.1f} ms p99 {level.itl_p99_s * 1e3:6.1f} ms  errors {level.errors}", file=sys.stderr)

        results = bench_serve(servers, prompts, levels, args.requests, args.max_tokens, args.temperature, args.repeats, say, args.warmups)
    finally:
        for handle in started:
            handle.stop()
    rows = summarize(results)
    for row in rows:
        ratio = f"  {row['throughput_vs_plain']:.2f}x plain" if "throughput_vs_plain" in row else ""
        ratio += f"  {row['throughput_vs_best_other']:.2f}x the best other" if "throughput_vs_best_other" in row else ""
        ratio += (f" (95% {row['throughput_vs_best_other_ci95_low']:.2f}-{row['throughput_vs_best_other_ci95_high']:.2f})"
                  if "throughput_vs_best_other_ci95_low" in row else "")
        print(f"{row['mode']:>8} c={row['concurrency']:<3} {row['throughput_tok_s']:8.1f} tok/s{ratio}  TTFT p50 {row['ttft_p50_s'] * 1e3:.1f} ms"
              f"  ITL p50/p99 {row['itl_p50_s'] * 1e3:.1f}/{row['itl_p99_s'] * 1e3:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "levels": [as_dict(lv) for lv in results], "medians": rows}, indent=2))
    if args.csv:
        write_csv(rows, args.csv)
    if args.plot:
        plot(rows, args.plot)
    return 0


_COMMANDS = {
    "generate": _generate, "plan": _plan, "check": _check, "quantize": _quantize, "profile": _profile,
    "bench": _bench, "bench-serve": _bench_serve, "serve": _serve, "train": _train, "perplexity": _perplexity, "toy": _toy, "convert": _convert,
}


# The library's parameter names, as the command line spells them (errors name the flag the user typed)
_FLAGS = {"top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p", "max_new_tokens": "--max-new-tokens",
          "k_max": "--k-max", "ks": "--k", "repeats": "--repeats", "batch_size": "--batch-size", "context_length": "--context",
          "confidence_threshold": "--confidence-threshold"}
_WORDS = {"k": "--k", "temperature": "--temperature"}  # common words too: rewritten only as the subject of "... must be"


class _FileError(ValueError):
    """An error in a file: it names the file's own keys, not flags."""


def _flag_names(message: str) -> str:
    message = re.sub(r"(?:^|(?<=: ))(" + "|".join(_WORDS) + r")(?= must )", lambda m: _WORDS[m.group(1)], message)
    return re.sub(r"(?<![\w-])(" + "|".join(_FLAGS) + r")(?![\w-])", lambda m: _FLAGS[m.group(1)], message)


def _contradiction(args: argparse.Namespace) -> str | None:
    """Flags that contradict each other, in words; None when none do."""
    if args.command == "generate" and args.no_speculation and args.k not in (None, 0):
        return f"--no-speculation decodes without a draft, so --k {args.k} contradicts it (leave --k out)"
    if args.command == "generate" and isinstance(args.k, int) and args.k_max is not None and args.k > args.k_max:
        return f"--k {args.k} is above --k-max {args.k_max}: --k-max bounds --k auto's choice (give --k auto, or leave --k-max out)"
    if getattr(args, "gguf_type", None) is not None and args.target is not None and is_gguf(args.target):
        drafts = args.draft if isinstance(args.draft, list) else [args.draft]
        if not any(_converted(d) for d in drafts):
            return (f"--gguf-type {args.gguf_type}: the target {args.target} is a GGUF file, whose type is its own "
                    "(--gguf-type is the type a Hugging Face directory is converted to)")
    return None


def _converted(draft: str | None) -> bool:
    """Whether a --draft value names a model directory, which llama.cpp runs converted to --gguf-type."""
    return draft is not None and not is_gguf(draft) and draft not in ("none", "ngram") and not draft.startswith("early-exit:")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; flags that contradict each other are one line and exit 2, as a bad value."""
    parser = _parser()
    args = parser.parse_args(argv)
    problem = _contradiction(args)
    if problem is not None:
        parser.error(problem)
    if args.command == "generate":
        args.k = "auto" if args.k is None else args.k
        args.k_max = 8 if args.k_max is None else args.k_max
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except UnicodeDecodeError as error:  # a text file that is not UTF-8 (a ValueError too, but its message names no file)
        return _fail(f"a file is not UTF-8 text: {error.reason} at byte {error.start}")
    except (CheckpointError, ValueError, OSError) as error:
        message = " ".join(str(error).split())
        return _fail(message if isinstance(error, _FileError) else _flag_names(message))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
