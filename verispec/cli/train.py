"""`verispec train data|target|teacher|draft|export`: the corpus, the target's pretraining, the
teacher cache, the draft's distillation and the export of a run. Parses, checks the output
directory first and calls verispec.training. Knows nothing of decoding.
"""

from __future__ import annotations

import argparse
import sys

from .common import check_directory, fail, positive


def add_parser(commands) -> None:
    train = commands.add_parser(
        "train", help="prepare the corpus, pretrain the target, cache its distributions, or distil the draft"
    )
    train.add_argument(
        "what",
        choices=["data", "target", "teacher", "draft", "export"],
        help="teacher: cache the --teacher's top-k next-token distributions over the training split "
        "(resumable); export: write OUT/model from OUT/checkpoint.pt (a run so far)",
    )
    train.add_argument(
        "--data",
        help="data directory (tokenizer.json, train.bin, heldout.bin; default runs/data); with 'draft --target "
        "FILE.gguf': the text to distil on, a .txt or .jsonl file or a directory (default: the standard library)",
    )
    train.add_argument(
        "--target",
        help="with 'draft': a GGUF file to train a draft for, on this CPU, with its tokenizer (writes OUT/draft.gguf "
        "and OUT/MODEL_CARD.md; resumable: run the same command again to go on)",
    )
    train.add_argument(
        "--minutes", type=float, default=60.0, help="with 'draft --target': the whole run's time budget (default 60)"
    )
    train.add_argument(
        "--layers",
        type=int,
        default=2,
        help="with 'draft --target': the draft's layers, started from the target's first",
    )
    train.add_argument("--out", help="output directory (checkpoint.pt, then model/); default runs/WHAT")
    train.add_argument("--preset", help="architecture: target, draft or tiny (default: WHAT)")
    train.add_argument(
        "--teacher",
        help="with 'draft': the target model directory to distil from (and measure acceptance "
        "against); with 'teacher': the target whose distributions are cached (default: the built-in target)",
    )
    train.add_argument(
        "--teacher-cache",
        help="with 'draft': distil from this cache of 'verispec train teacher' (no target pass per step)",
    )
    train.add_argument(
        "--teacher-top-k",
        type=positive,
        default=32,
        help="with 'teacher': the most likely tokens kept per position, the rest pooled (default 32)",
    )
    train.add_argument(
        "--chunk-windows",
        type=positive,
        default=64,
        help="with 'teacher': windows per chunk file, the unit of resumption (default 64)",
    )
    train.add_argument("--vocab-size", type=int, default=8192, help="with 'data': BPE vocabulary size")
    train.add_argument("--steps", type=int, default=2000, help="optimizer steps (default 2000)")
    train.add_argument("--batch-size", type=int, default=16, help="sequences per step (default 16)")
    train.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    train.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    train.add_argument(
        "--train-seed",
        type=int,
        default=0,
        help="random seed of the initial weights and of the batches drawn (default 0)",
    )
    train.add_argument("--dtype", default="float32", help="autocast dtype: float32, or bfloat16 on CPUs with AMX")
    train.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (default 100)")
    train.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="held-out loss every N steps; export the best (0 = off: export the last)",
    )
    train.add_argument(
        "--max-seconds",
        type=float,
        default=0.0,
        help="fit the schedule to this many seconds after 60 steps, and stop there at the latest "
        "(0 = no limit); with 'teacher': stop after the chunk that crosses it",
    )
    train.add_argument(
        "--stop-after",
        type=float,
        default=0.0,
        help="checkpoint and stop after this many seconds, the "
        "schedule unchanged: run the same command again to go on (0 = no limit)",
    )


def run(args: argparse.Namespace) -> int:
    from ..training import train

    if args.target is not None:
        if args.what != "draft":
            return fail(f"--target is for 'train draft', not 'train {args.what}'")
        return _gguf_draft(args)
    args.data = args.data or "runs/data"
    out = args.out or f"runs/{args.what}"
    data_only = args.what == "data" and not args.out
    check_directory(args.out or (args.data if args.what == "data" else out), "--data" if data_only else "--out")
    if args.what == "data":
        print(f"wrote {train.prepare_data(args.out or args.data, args.vocab_size)}")
        return 0
    if args.what == "teacher":
        return _teacher(args)
    if args.what == "draft" and args.teacher is None:
        return fail("train draft needs --teacher DIR (the target to distil from)")
    if args.what == "export" and args.preset is None:
        return fail("train export needs --preset NAME (the run's architecture)")
    preset = args.preset or args.what
    if preset not in train.PRESETS:
        return fail(f"--preset must be one of {sorted(train.PRESETS)}, got {preset!r}")
    if args.what == "export":
        if args.out is None:
            return fail("train export needs --out DIR (the run directory holding checkpoint.pt)")
        print(f"wrote {train.export_checkpoint(train.PRESETS[preset], args.out, args.data)}")
        return 0
    cfg = train.TrainConfig(
        out=out,
        data=args.data,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        seed=args.train_seed,
        dtype=args.dtype,
        checkpoint_every=args.checkpoint_every,
        eval_every=args.eval_every,
        max_seconds=args.max_seconds,
        stop_after=args.stop_after,
        teacher=args.teacher if args.what == "draft" else None,
        teacher_cache=args.teacher_cache if args.what == "draft" else None,
    )
    result = train.train(train.PRESETS[preset], cfg, progress=sys.stderr.isatty())
    print(f"wrote {result / 'model'}")
    return 0


def _teacher(args: argparse.Namespace) -> int:
    from ..pair import TARGET_DIR
    from ..training.teacher import build_teacher_cache

    out, missing = build_teacher_cache(
        args.teacher or TARGET_DIR,
        args.data,
        args.out or "runs/teacher",
        seq_len=args.seq_len,
        top_k=args.teacher_top_k,
        chunk_windows=args.chunk_windows,
        batch_size=args.batch_size,
        dtype=args.dtype,
        max_seconds=args.max_seconds,
        progress=sys.stderr.isatty(),
    )
    print(f"wrote {out}" + (f": {missing} chunks still missing (run it again to go on)" if missing else ": complete"))
    return 0


def _gguf_draft(args: argparse.Namespace) -> int:
    from ..models.backend import is_gguf
    from ..training.gguf_draft import DraftRun, train_gguf_draft

    if not is_gguf(args.target):
        return fail(f"--target {args.target}: a GGUF file is needed (a directory: convert it, or use --teacher)")
    if args.teacher or args.teacher_cache:
        return fail("--target trains with its own teacher; leave out --teacher and --teacher-cache")
    try:
        check_directory(args.out or "runs/draft", "--out")
        run = DraftRun(
            target=args.target,
            out=args.out or "runs/draft",
            data=args.data,
            minutes=args.minutes,
            layers=args.layers,
            seed=args.train_seed,
        )
        path = train_gguf_draft(run, say=lambda line: print(line, flush=True))
        line = _offer_to_auto(run, path)
    except ValueError as error:
        return fail(str(error))
    with open(path.parent / "MODEL_CARD.md", "a") as card:
        card.write(f"\n{line}\n")
    print(line)
    print(f"wrote {path} and {path.parent / 'MODEL_CARD.md'}")
    return 0


def _offer_to_auto(run, path) -> str:
    """`verispec plan` for the new draft on held-out text of its run (greedy, 8 prompts of 32 tokens, 64 new
    tokens each); where it predicts a speed-up, --draft auto takes the draft for that file from now on."""
    import numpy as np

    from ..analysis.plan import plan
    from ..assemble import Settings, load_drafter, load_target
    from ..config import SamplingParams
    from ..models.trained_drafts import register

    settings = Settings(target=run.target, draft=str(path))
    target, _ = load_target(settings)
    held = np.load(path.parent / "corpus" / "heldout.npy")
    step = max(32, (len(held) - 32) // 8)
    prompts = [held[i : i + 32].tolist() for i in range(0, len(held) - 32, step)][:8]
    report = plan(target, {"trained": load_drafter(settings, target)}, prompts, SamplingParams(max_new_tokens=64))
    return auto_line(report["candidates"][0], run.target, path, register)


def auto_line(candidate: dict, target: str, path, register) -> str:
    """Register the draft for --draft auto where plan's best k predicts more than plain decoding; the line says."""
    k = candidate["recommended_k"]
    speedup, beta, c = candidate["predicted_speedup"][k], candidate["beta"], candidate["c"]
    measured = f"plan on held-out text here: beta {beta:.3f}, c {c:.3f}"
    if k >= 1 and speedup > 1.0:
        register(target, path)
        return f"{measured}, predicted {speedup:.2f}x at k = {k}: --draft auto takes this draft for {target}"
    best = max(candidate["predicted_speedup"][1:])
    return (
        f"{measured}, predicted at most {best:.2f}x of plain decoding: --draft auto keeps suffix drafting for "
        f"{target} (--draft {path} uses the draft anyway)"
    )
