"""`verispec generate`: prompts in, streamed text and one line of statistics out.

Owns the prompt sources (PROMPT, --prompt, --prompts FILE, '-' for standard input), --stop
strings (escapes read; a row that reaches one stops decoding there) and the printing. The models
come from assemble, the decoding from engine.Batch. Knows nothing of how models are loaded.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

from .. import assemble
from ..drafters.cross_vocab import cannot_pay
from ..engine import Batch
from ..server.protocol import find_stop, safe_prefix
from ..stats import SpecStats
from .common import (
    check_writable,
    draft_length_parent,
    draft_options_parent,
    fail,
    models_parent,
    read_prompts,
    sampling_from,
    sampling_parent,
    seed,
    settings_from,
)


def add_parser(commands) -> None:
    gen = commands.add_parser(
        "generate",
        help="stream a completion, then one line of statistics",
        parents=[models_parent(), draft_length_parent(), sampling_parent(temperature=0.0), draft_options_parent()],
    )
    gen.add_argument("prompt_text", nargs="?", metavar="PROMPT", help="the prompt; - reads it from standard input")
    gen.add_argument("--prompt", help="the prompt text (instead of PROMPT)")
    gen.add_argument(
        "--prompts",
        metavar="FILE",
        help='JSON lines, one {"prompt": "..."} per line: one batch, one completion per prompt; a line may '
        'set its row\'s own "seed", "temperature", "top_k", "top_p", "min_p", "max_new_tokens" '
        "(any other key is refused)",
    )
    gen.add_argument(
        "--json",
        metavar="OUT",
        help="also write the prompts, completions (text and token ids), finish reasons and statistics "
        "to the file OUT; what is printed is the same with or without it (one prompt streams its text)",
    )
    gen.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end a completion before this text, and stop decoding it there (repeatable); the escapes "
        "\\n \\t \\r \\\\ \\\" \\' \\uXXXX are read, as a shell passes them as written: --stop '\\n\\n' "
        "ends at a blank line",
    )
    gen.add_argument(
        "--max-new-tokens", type=int, default=128, help="tokens to generate per prompt at most (default 128)"
    )
    gen.add_argument("--seed", type=seed, default=None, help="random seed of the sampling (default: fresh entropy)")
    gen.add_argument(
        "--no-speculation", action="store_true", help="plain autoregressive decoding of the target (no --k with it)"
    )
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end-of-sequence token")


def run(args: argparse.Namespace) -> int:
    import json

    row_settings: list[dict] = []
    texts = prompt_texts(args, row_settings)
    stops = stop_strings(args.stop)
    if args.json is not None:
        check_writable(args.json, "--json")
    settings = settings_from(args, k=args.k, k_max=args.k_max).resolved()
    say = assemble.to_stderr()
    target, tokenizer = assemble.load_target(settings, say)
    drafter = None if args.no_speculation else assemble.load_drafter(settings, target, say)
    eos = () if args.ignore_eos else assemble.eos_ids(target)
    params = sampling_from(args, max_new_tokens=args.max_new_tokens, stop_token_ids=eos)
    if any(row_settings):  # a --prompts line's own settings override the flags for its row
        params = [replace(params, **row) for row in row_settings]
    prompt_ids = [tokenizer.encode(text).ids for text in texts]
    if not all(prompt_ids):
        return fail(f"prompt {next(i for i, ids in enumerate(prompt_ids, 1) if not ids)} encodes to no tokens")
    from ..engine import check_context

    budgets = [p.max_new_tokens for p in params] if isinstance(params, list) else [args.max_new_tokens]
    check_context(
        target, prompt_ids, budgets if isinstance(params, list) else args.max_new_tokens
    )  # before the profile
    rows = len(prompt_ids)
    for note in (cannot_pay(drafter, prompt_ids, settings.draft), drafter is not None and settings.draft_note):
        if note:  # after every check of the input: an error stays one line
            say(note)
    longest_k = max(settings.k_max, settings.k if isinstance(settings.k, int) else 0)
    assemble.prepare_engine(target, drafter, rows * (longest_k + 1), rows * 2)
    context = max(map(len, prompt_ids)) + max(budgets) // 2
    policy, plain_step_s = assemble.measured_policy(settings, target, drafter, rows, context)
    stats = SpecStats()
    stream = len(texts) == 1
    if stream:
        sys.stdout.write(texts[0])
    decode = partial(tokenizer.decode, skip_special_tokens=True)
    generated = decode_rows(Batch(target, prompt_ids, params, drafter, policy, stats), decode, stops, stream)
    results = [
        {
            "prompt": prompt,
            "text": row_text(ids, stops, decode),
            "token_ids": ids,
            "finish_reason": request.finish_reason,
        }
        for prompt, ids, request in zip(texts, generated, stats.requests)
    ]
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


def prompt_texts(args: argparse.Namespace, settings: list[dict] | None = None) -> list[str]:
    """The prompts: PROMPT, --prompt TEXT or --prompts FILE (exactly one of them); '-' reads
    the prompt from standard input. Text must be valid UTF-8. A --prompts line's own settings
    (common.ROW_SETTINGS) are appended to `settings`, one dict per prompt."""
    given = [
        name
        for name, value in (("PROMPT", args.prompt_text), ("--prompt", args.prompt), ("--prompts", args.prompts))
        if value is not None
    ]
    if not given:
        raise ValueError("no prompt: give PROMPT, --prompt TEXT, --prompts FILE, or - to read standard input")
    if len(given) > 1:
        raise ValueError(f"give one of PROMPT, --prompt and --prompts, not {' and '.join(given)}")
    if args.prompts is not None:
        texts = read_prompts(args.prompts, None, settings)
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


def unescape(text: str) -> str:
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


def stop_strings(values: list[str]) -> list[str]:
    """The --stop values, escapes read; an empty one is refused."""
    stops = [unescape(value) for value in values]
    if any(stop == "" for stop in stops):
        raise ValueError("--stop needs a non-empty string")
    return stops


def _kept(ids: list[int], before: int, stops: list[str], decode) -> int | None:
    """When the text of ids holds a stop string: the fewest of them (more than `before`, whose
    text held none) that hold it; else None."""
    if not stops or find_stop(decode(ids), stops) is None:
        return None
    return next(m for m in range(before + 1, len(ids) + 1) if find_stop(decode(ids[:m]), stops) is not None)


def row_text(ids: list[int], stops: list[str], decode) -> str:
    """A row's text, ended before its first stop string."""
    text = decode(ids)
    at = find_stop(text, stops) if stops else None
    return text if at is None else text[:at]


def _request_stats(batch: Batch, row: int):
    """The RequestStats of a row of the batch, running or just finished."""
    return dict(batch.finished).get(row) or batch.requests[batch.ids.index(row)]


def decode_rows(batch: Batch, decode, stops: list[str], stream: bool) -> list[list[int]]:
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
                shown = _show(row_text(generated[0], stops, decode), shown, not any(batch.active), stops)
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
