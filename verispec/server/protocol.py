"""OpenAI's completion request, checked field by field, and the shapes of the answers.

Owns `parse_completion` (a JSON body -> `CompletionRequest`, or `BadRequest` naming the field
and what is wrong: wrong types, out-of-range values, unknown fields, a prompt that does not fit
the context with its max_tokens), `check_text` (no lone surrogate in any string of a body),
`error_body` (OpenAI's error object) and the helpers for stop strings and streamed text.
Knows nothing of models or of HTTP itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import SAMPLING_MODES, SamplingParams
from ..sampling import row_seed

MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_N = 16
MAX_PROMPTS = 64
MAX_STOP_LENGTH = 256
MAX_LOGPROBS = 5  # OpenAI's limit on alternatives per token
SUPPORTED = {
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "n",
    "user",
    "sampling",
    "stream_options",
    "logprobs",
    "echo",
    "best_of",
    "presence_penalty",
    "frequency_penalty",
    "suffix",
}


class BadRequest(Exception):
    """A request the server refuses: `status` (400, 404, 413, ...), a message naming the field (`param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def error_body(
    message: str, param: str | None = None, kind: str = "invalid_request_error", code: str | int | None = None
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class CompletionRequest:
    prompts: list[list[int]]  # token ids, one list per prompt
    params: list[SamplingParams]  # one per choice: prompt i's choice j is params[i * n + j]
    n: int
    stop: list[str]
    stream: bool
    include_usage: bool  # stream_options.include_usage
    logprobs: int | None = None  # each token's log-probability and this many alternatives (OpenAI: at most 5)


def check_text(body) -> None:
    """Every string of a JSON body, keys included, must be Unicode text: JSON's escapes can spell
    a lone surrogate ("\\ud800"), which no tokenizer takes and no UTF-8 encoder writes. BadRequest
    naming the first such string ('prompt[1]', 'messages[0].content'); its top field is `param`."""
    pending = [(body, "", None)]  # (value, where, top field); a stack, not recursion: JSON may nest deeply
    while pending:
        value, where, top = pending.pop()
        if isinstance(value, str):
            _refuse_surrogate(value, f"'{where}'" if where else "the request body", top)
        elif isinstance(value, dict):
            for key in reversed(list(value)):  # the first field in the body is reported first
                name = f"{where}.{_printable(key)}" if where else _printable(key)
                _refuse_surrogate(key, f"the field name '{name}'", top or name)
                pending.append((value[key], name, top or name))
        elif isinstance(value, list):
            pending.extend((value[i], f"{where}[{i}]", top) for i in reversed(range(len(value))))


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _refuse_surrogate(text: str, what: str, param: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise BadRequest(
            f"{what} holds a lone surrogate ({text[error.start]!a}): text must be valid Unicode", param
        ) from None


def _number(body: dict, name: str, default: float, low: float, high: float, *, low_open: bool = False) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"'{name}' must be a number, got {value!r}", name)
    if value < low or value > high or (low_open and value == low):
        raise BadRequest(f"'{name}' must be in {'(' if low_open else '['}{low}, {high}], got {value!r}", name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer, got {value!r}", name)
    if not low <= value <= high:
        raise BadRequest(f"'{name}' must be in [{low}, {high}], got {value!r}", name)
    return value


def _prompts(value, encode, vocab_size: int) -> list[list[int]]:
    """prompt: a string, a list of strings, a list of token ids, or a list of token-id lists."""
    if (
        isinstance(value, str)
        or isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        items = [value]
    elif isinstance(value, list) and value and all(isinstance(x, (str, list)) for x in value):
        items = value
    elif isinstance(value, list) and not value:
        raise BadRequest("'prompt' is empty", "prompt")
    else:
        raise BadRequest(
            "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists", "prompt"
        )
    if len(items) > MAX_PROMPTS:
        raise BadRequest(f"'prompt' holds {len(items)} prompts; at most {MAX_PROMPTS} per request", "prompt")
    prompts = []
    for i, item in enumerate(items):
        where = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            if not item:
                raise BadRequest(f"'{where}' is an empty string", "prompt")
            ids = list(encode(item))
            if not ids:
                raise BadRequest(f"'{where}' encodes to no tokens", "prompt")
        else:
            if not item:
                raise BadRequest(f"'{where}' is an empty list of token ids", "prompt")
            bad = [t for t in item if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
            if bad:
                raise BadRequest(f"'{where}' holds {bad[0]!r}: token ids are integers in [0, {vocab_size})", "prompt")
            ids = list(item)
        prompts.append(ids)
    return prompts


def parse_completion(
    body, *, model_name: str, encode, vocab_size: int, max_model_len: int, eos: tuple[int, ...]
) -> CompletionRequest:
    """The checked request, or BadRequest (the first problem found, naming its field)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - SUPPORTED)
    if unknown:
        raise BadRequest(f"unrecognized request argument '{unknown[0]}'", unknown[0])
    model = body.get("model", model_name)
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"'model' must be a string, got {model!r}", "model")
    if model not in (None, model_name):
        raise BadRequest(
            f"the model '{model}' does not exist; this server serves '{model_name}'", "model", 404, "not_found_error"
        )
    if "prompt" not in body:
        raise BadRequest("'prompt' is required", "prompt")
    for name in ("echo",):
        if body.get(name) not in (None, False):
            raise BadRequest(f"'{name}' is not supported", name)
    logprobs = _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    if body.get("suffix") not in (None, ""):
        raise BadRequest("'suffix' is not supported", "suffix")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise BadRequest(f"'{name}' other than 0 is not supported: it would change the target's distribution", name)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise BadRequest("'user' must be a string", "user")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    top_k = _integer(body, "top_k", 0, -1, vocab_size)
    top_k = 0 if top_k in (-1, 0) else top_k  # -1: off, as in vLLM
    n = _integer(body, "n", 1, 1, MAX_N)
    best_of = _integer(body, "best_of", n, 1, MAX_N)
    if best_of != n:
        raise BadRequest("'best_of' other than n is not supported", "best_of")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise BadRequest(f"'seed' must be an integer in [0, 2**63), got {seed!r}", "seed")
    sampling = body.get("sampling", "rejection")
    if sampling not in SAMPLING_MODES:
        raise BadRequest(f"'sampling' must be one of {', '.join(SAMPLING_MODES)}, got {sampling!r}", "sampling")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise BadRequest(f"'stream' must be a boolean, got {stream!r}", "stream")
    options = body.get("stream_options")
    if options is not None and (
        not isinstance(options, dict)
        or set(options) - {"include_usage"}
        or not isinstance(options.get("include_usage", False), bool)
    ):
        raise BadRequest("'stream_options' must be an object with a boolean 'include_usage'", "stream_options")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("'stop' must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP:
        raise BadRequest(f"'stop' holds {len(stop)} strings; at most {MAX_STOP}", "stop")
    if any(not s or len(s) > MAX_STOP_LENGTH for s in stop):
        raise BadRequest(f"each 'stop' string must hold 1 to {MAX_STOP_LENGTH} characters", "stop")
    prompts = _prompts(body["prompt"], encode, vocab_size)
    longest = max(len(p) for p in prompts)
    room = max_model_len - longest
    if room < 1:
        raise BadRequest(
            f"the prompt has {longest} tokens; this server's context holds {max_model_len} (--max-model-len)", "prompt"
        )
    max_tokens = _integer(body, "max_tokens", min(16, room), 1, 2**31)
    if longest + max_tokens > max_model_len:
        raise BadRequest(
            f"the prompt ({longest} tokens) plus max_tokens ({max_tokens}) exceeds the context of {max_model_len} "
            f"tokens (--max-model-len); at most {room} tokens can be generated",
            "max_tokens",
        )
    params = [
        SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            max_new_tokens=max_tokens,
            stop_token_ids=eos,
            sampling=sampling,
            seed=None if seed is None else row_seed(seed, j),
        )
        for _ in prompts
        for j in range(n)
    ]
    return CompletionRequest(
        prompts, params, n, stop, bool(stream), bool((options or {}).get("include_usage", False)), logprobs
    )


def find_stop(text: str, stop: list[str], start: int = 0) -> int | None:
    """Where the earliest stop string begins in text (searching from `start`), or None."""
    found = [i for s in stop if (i := text.find(s, start)) >= 0]
    return min(found) if found else None


def safe_prefix(text: str, stop: list[str], finished: bool) -> int:
    """How much of text can be sent now: not an incomplete UTF-8 character (decoded as U+FFFD at
    the end) nor, until the end, a tail that could begin a stop string."""
    if finished:
        return len(text)
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    safe = end
    for s in stop:
        for length in range(min(len(s) - 1, end), 0, -1):  # the longest tail that begins s
            if text[end - length : end] == s[:length]:
                safe = min(safe, end - length)
                break
    return safe
