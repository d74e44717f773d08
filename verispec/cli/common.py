"""What every command of the command line shares: the parser class and its one-line errors, the
argument types, the shared argument groups (argparse parent parsers), the settings read from
parsed arguments, output checks, prompt files, and the rewriting of library names into flags.

One vocabulary: a flag means the same thing in every command that takes it. --target and --draft
are models (--draft also 'ngram', 'suffix', 'early-exit:L' or 'none'), --k a draft length (a list where
a command compares several), --seed the sampling seed and --temperature the sampling temperature (each a list
where bench compares several), --top-k/--top-p/--min-p the filters after temperature, --repeats the
repetitions of a measurement, --json an output file. Knows nothing of models.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from ..assemble import Settings, model_spec
from ..config import SamplingParams
from ..llamacpp.regime import FLASH_ATTN_CHOICES
from ..models.backend import BACKENDS, GGUF_TYPES, is_gguf


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + message
        raise SystemExit(fail(message))


def fail(message: str) -> int:
    print(f"verispec: error: {message}", file=sys.stderr)
    return 2


class FileError(ValueError):
    """An error in a file: it names the file's own keys, not flags."""


# ---- argument types


def at_least(low: int):
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


positive, non_negative = at_least(1), at_least(0)


def draft_length(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or 'auto', got {text!r}") from None


def draft_lengths(text: str) -> list[int | str]:
    """--k of bench: comma-separated draft lengths >= 1 or 'auto'."""
    ks = []
    for item in text.split(","):
        try:
            ks.append(draft_length(item.strip()))
        except argparse.ArgumentTypeError as error:
            raise ValueError(f"--k: {error}") from None
    if any(isinstance(k, int) and k < 1 for k in ks):
        raise ValueError(
            "--k: bench compares each draft length with plain decoding (its baseline): "
            f"lengths must be >= 1 or 'auto', got {text!r}"
        )
    return ks


def temperatures(text: str) -> list[float]:
    """--temperature of bench: comma-separated temperatures >= 0."""
    try:
        values = [float(item) for item in text.split(",")]
    except ValueError:
        raise ValueError(f"--temperature must be comma-separated numbers, got {text!r}") from None
    if any(not value >= 0 for value in values):
        raise ValueError(f"--temperature must be >= 0, got {text!r}")
    return values


def seed(text: str) -> int:
    """--seed: the sampling seed, in SamplingParams' range [0, 2**63), as the server's "seed"."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**63), got {text!r}")
    return value


def seeds(text: str) -> list[int]:
    """--seed of bench: comma-separated sampling seeds, each as --seed takes it, repeats dropped."""
    values = []
    for item in text.split(","):
        try:
            values.append(seed(item.strip()))
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"must be comma-separated integers in [0, 2**63), got {text!r}") from None
    return list(dict.fromkeys(values))


def draft_temperature(text: str) -> float | None:
    """--draft-temperature: 'auto' (None: chosen by measured acceptance) or a proposal temperature in [0, 1]."""
    if text.strip() == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be 'auto' or a number in [0, 1], got {text!r}")
    return value


def confidence(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1), got {text!r}")
    return value


# ---- shared argument groups (parent parsers: built afresh for each command, whose defaults may differ)

TARGET_HELP = (
    "target model: a directory of Hugging Face-style weights or a .gguf file; default: the built-in pair's target"
)
DRAFT_HELP = (
    "draft model directory or .gguf file, 'ngram' (prompt lookup), 'suffix' (suffix drafting), 'early-exit:L' "
    "(the target's first L layers), 'string:MODEL' (a draft of another tokenizer drafting text at T = 0) or "
    "'none' (no speculation); default 'auto': the built-in draft with the built-in target, else suffix drafting"
)


def models_parent(
    target: str = TARGET_HELP, draft: str = DRAFT_HELP, repeatable: bool = False
) -> argparse.ArgumentParser:
    """--target, --draft, --dtype and the backend's settings."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--target", help=target)
    parent.add_argument("--draft", action="append" if repeatable else "store", help=draft)
    parent.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16, for torch models")
    parent.add_argument(
        "--backend",
        default="auto",
        choices=BACKENDS,
        help="auto (default): llama.cpp on the CPU when it is installed, else torch; llamacpp: GGUF on "
        "llama.cpp (a Hugging Face directory is converted once, cached); torch: verispec's PyTorch model",
    )
    parent.add_argument(
        "--gguf-type",
        default=None,
        type=str.lower,
        choices=GGUF_TYPES,
        metavar="TYPE",
        help="with llama.cpp: the type a Hugging Face directory is converted to (default f32; "
        "refused when no model given is a directory: a GGUF file's type is its own)",
    )
    parent.add_argument(
        "--threads",
        type=positive,
        default=None,
        help="llama.cpp threads (default: every core this process may use; more than that is capped to it)",
    )
    parent.add_argument(
        "--exact-kernels",
        choices=["on", "off"],
        default="on",
        help="on (default): llama.cpp settings under which a position's logits do not depend on the pass "
        "(speculative output = plain output on every GGUF type; docs/EXACTNESS.md); off: llama.cpp's "
        "default kernels, faster on some types, where greedy output may differ at near-ties",
    )
    parent.add_argument(
        "--flash-attn",
        choices=FLASH_ATTN_CHOICES,
        default="auto",
        help="attention of a llama.cpp target under exact kernels: auto (default): flash attention for files whose "
        "matrices all take dot-product kernels (K-quants), else whichever of flash and sgemm's attention measured "
        "faster on this CPU (once per file, remembered); on / off: flash attention / sgemm's for every file "
        "(both exact; docs/EXACTNESS.md)",
    )
    parent.add_argument(
        "--device",
        default="cpu",
        help="cpu (default), cuda or cuda:N: where a torch model runs (llama.cpp runs on the CPU here)",
    )
    return parent


def draft_length_parent(refuse_above: bool = True) -> argparse.ArgumentParser:
    """--k (one draft length or 'auto') and --k-max, as generate and serve take them; both
    default to None here so that a contradiction can tell what was given (parse_args fills them)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--k",
        type=draft_length,
        default=None,
        help="draft length: tokens proposed per target pass, or 'auto' (default): chosen per pass "
        "from the costs and acceptance seen",
    )
    refused = "; a fixed --k above a --k-max given with it is refused" if refuse_above else ""
    parent.add_argument(
        "--k-max", type=int, default=None, help=f"with --k auto: the longest draft considered (default 8{refused})"
    )
    return parent


def draft_options_parent() -> argparse.ArgumentParser:
    """How a model draft proposes. --confidence-threshold: off unless given, with `--k auto` too: a stop
    chosen per pass by the draft's own confidence competes with the policy's choice of k.
    --draft-temperature: the proposal temperature tau (proposal.py), auto by default."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--draft-temperature",
        type=draft_temperature,
        default=None,
        metavar="auto|TAU",
        help="a model draft proposes from its distribution q sharpened to q^(1/TAU) (1 = q, 0 = its most likely "
        "token, as llama.cpp's draft); auto (default): each request's TAU by the acceptance measured at every TAU",
    )
    parent.add_argument(
        "--confidence-threshold",
        type=confidence,
        default=0.0,
        help="a model draft stops early where its most likely token's probability is below this (as "
        "transformers' assistant_confidence_threshold, llama.cpp's --draft-p-min; default 0 = off)",
    )
    return parent


def truncation_parent() -> argparse.ArgumentParser:
    """--top-k, --top-p and --min-p, as SamplingParams takes them (applied after temperature, in that order)."""
    parent = argparse.ArgumentParser(add_help=False)
    _add_truncation(parent)
    return parent


def _add_truncation(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--min-p", type=float, default=0.0, help="0 = off")


def sampling_parent(temperature: float) -> argparse.ArgumentParser:
    """The sampling flags, as SamplingParams takes them."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--temperature", type=float, default=temperature, help=f"0 = greedy (default {temperature:g})")
    _add_truncation(parent)
    parent.add_argument(
        "--sampling",
        choices=["rejection", "invariant"],
        default="rejection",
        help="rejection (default): accept a proposal with probability min(1, p/q); invariant: noise keyed "
        "by (seed, position), so that a seed gives the tokens of plain decoding whatever the draft and k",
    )
    return parent


# ---- settings


def settings_from(args: argparse.Namespace, **given) -> Settings:
    """The Settings of a command's parsed model and backend flags (those it has); `given`
    overrides them and adds the rest (generate and serve give --k and --k-max: other commands'
    --k is a list of lengths or a number of positions, their --k-max the longest draft timed)."""
    names = ("target", "draft", "backend", "dtype", "device", "threads", "gguf_type", "confidence_threshold")
    names += ("draft_temperature",)
    values = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    if hasattr(args, "exact_kernels"):
        values["exact_kernels"] = args.exact_kernels == "on"
    if hasattr(args, "flash_attn"):
        values["flash_attn"] = args.flash_attn
    return Settings(**{**values, **given})


def sampling_from(args: argparse.Namespace, **given) -> SamplingParams:
    """The sampling flags of `sampling_parent` as SamplingParams; `given` adds or overrides fields."""
    flags = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed)
    return SamplingParams(**{**flags, "sampling": args.sampling, **given})


def needs_draft(settings: Settings, command: str) -> None:
    """A one-line error when a command that measures a draft against its target has none."""
    if settings.draft_spec is None:
        given = "--draft none" if settings.draft == "none" else "--target without --draft"
        raise ValueError(
            f"{command} measures a draft against its target, so {given} leaves nothing to measure: "
            "give --draft (a directory or GGUF file, 'ngram', 'suffix' or 'early-exit:L')"
        )


# ---- files


def write_json(path: str | None, report: dict) -> None:
    """A command's --json report, if asked for, and a line saying where."""
    if path:
        Path(path).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {path}")


def check_writable(path: str, flag: str) -> None:
    """A one-line error now, not after the work, when `path` cannot be written."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {path}: is a directory")
    if not target.parent.is_dir():
        raise ValueError(f"{flag} {path}: no directory {target.parent}")
    if not os.access(target.parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"{flag} {path}: not writable")


def check_directory(path: str, flag: str) -> None:
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


def progress(command: str, always: bool = False):
    """A progress line per phase on stderr, when stderr is a terminal or `always` (long runs say what they do)."""

    def say(message: str) -> None:
        if always or sys.stderr.isatty():
            print(f"verispec {command}: {message}", file=sys.stderr, flush=True)

    return say


ROW_SETTINGS = ("temperature", "top_k", "top_p", "min_p", "seed", "max_new_tokens")  # a --prompts line may set these


def read_prompts(path: str, limit: int | None, settings: list[dict] | None = None) -> list[str]:
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
            settings.append(_row_settings(record, f"{path}:{number}"))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts[:limit]


def _row_settings(record: dict, where: str) -> dict:
    unknown = sorted(set(record) - {"prompt", *ROW_SETTINGS})
    if unknown:  # a misspelt setting would silently not apply
        raise FileError(
            f'{where}: unknown key "{unknown[0]}" (a line may set "prompt", '
            + ", ".join(f'"{key}"' for key in ROW_SETTINGS)
            + ")"
        )
    row = {key: record[key] for key in ROW_SETTINGS if key in record}
    try:
        SamplingParams(**row)
    except ValueError as error:
        raise FileError(f"{where}: {error}") from None
    return row


# ---- errors in the user's words

# The library's parameter names, as the command line spells them (errors name the flag the user typed)
_FLAGS = {
    "top_p": "--top-p",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "max_new_tokens": "--max-new-tokens",
    "k_max": "--k-max",
    "ks": "--k",
    "repeats": "--repeats",
    "batch_size": "--batch-size",
    "context_length": "--context",
    "confidence_threshold": "--confidence-threshold",
}
_WORDS = {
    "k": "--k",
    "temperature": "--temperature",
    "dtype": "--dtype",
}  # rewritten only as the subject of "... must be"


def flag_names(message: str) -> str:
    message = re.sub(r"(?:^|(?<=: ))(" + "|".join(_WORDS) + r")(?= must )", lambda m: _WORDS[m.group(1)], message)
    return re.sub(r"(?<![\w-])(" + "|".join(_FLAGS) + r")(?![\w-])", lambda m: _FLAGS[m.group(1)], message)


def contradiction(args: argparse.Namespace) -> str | None:
    """Flags that contradict each other, in words; None when none do."""
    if args.command == "generate" and args.no_speculation and args.k not in (None, 0):
        return f"--no-speculation decodes without a draft, so --k {args.k} contradicts it (leave --k out)"
    if args.command == "generate" and isinstance(args.k, int) and args.k_max is not None and args.k > args.k_max:
        return (
            f"--k {args.k} is above --k-max {args.k_max}: --k-max bounds --k auto's choice "
            "(give --k auto, or leave --k-max out)"
        )
    if getattr(args, "gguf_type", None) is not None and args.target is not None and is_gguf(args.target):
        drafts = args.draft if isinstance(args.draft, list) else [args.draft]
        if not any(_converted(d) for d in drafts):
            return (
                f"--gguf-type {args.gguf_type}: the target {args.target} is a GGUF file, whose type is its own "
                "(--gguf-type is the type a Hugging Face directory is converted to)"
            )
    return None


def _converted(draft: str | None) -> bool:
    """Whether a --draft value names a model directory, which llama.cpp runs converted to --gguf-type."""
    model = model_spec(draft)
    return model is not None and not is_gguf(model)
