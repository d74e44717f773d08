"""The command line: `main(argv)` and `parse_args`. Each command group lives in a module of its
own (generate, analysis, models, train, serve), thin: it parses, calls assemble and the library,
and prints; what they share is in common.py.

Every error a user can cause (a bad value, an unreadable checkpoint, flags that contradict each
other) becomes one line on stderr, `verispec: error: ...`, and exit status 2.
"""

from __future__ import annotations

import argparse

from .. import __version__
from ..models.checkpoint import CheckpointError
from . import analysis, check, generate, models, serve, train
from .common import FileError, Parser, contradiction, fail, flag_names

_COMMANDS = {
    "generate": generate.run,
    "plan": analysis.plan,
    "check": check.run,
    "quantize": models.quantize,
    "profile": analysis.profile,
    "bench": analysis.bench,
    "bench-serve": serve.bench_serve,
    "serve": serve.serve,
    "train": train.run,
    "perplexity": analysis.perplexity,
    "toy": models.toy,
    "convert": models.convert,
}


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="verispec", description="Exact speculative decoding.")
    parser.add_argument("--version", action="version", version=f"verispec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    generate.add_parser(commands)
    serve.add_parsers(commands)
    train.add_parser(commands)
    analysis.add_parsers(commands)
    models.add_parsers(commands)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; flags that contradict each other are one line and exit 2, as a bad value.
    generate's and serve's --k and --k-max are filled ('auto', 8) once the contradictions are known."""
    parser = _parser()
    args = parser.parse_args(argv)
    problem = contradiction(args)
    if problem is not None:
        parser.error(problem)
    if args.command not in ("generate", "serve"):
        return args
    filled = {"k": "auto" if args.k is None else args.k, "k_max": 8 if args.k_max is None else args.k_max}
    return argparse.Namespace(**{**vars(args), **filled})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except (
        UnicodeDecodeError
    ) as error:  # a text file that is not UTF-8 (a ValueError too, but its message names no file)
        return fail(f"a file is not UTF-8 text: {error.reason} at byte {error.start}")
    except (CheckpointError, ValueError, OSError) as error:
        message = " ".join(str(error).split())
        return fail(message if isinstance(error, FileError) else flag_names(message))
    except KeyboardInterrupt:
        return 130
