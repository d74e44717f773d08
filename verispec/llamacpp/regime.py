"""Which attention a shape-invariant context runs: flash attention's or sgemm's, per file and CPU.

Owns the `--flash-attn auto|on|off` setting (`set_flash_attention`, `flash_attention_setting`) and
the choice `flash_for(model)`. Both regimes are exact (context.py's placeholder rules;
docs/EXACTNESS.md); they differ in cost, and which costs less depends on the CPU: flash
attention takes each query on its own (no placeholder for a row of one token in a pass of
several rows, but verification passes pay at long contexts), sgemm's attention takes several
queries per sequence at once (every row of one token gets a placeholder). A file whose matrices
all take dot-product kernels (the K-quants) runs flash attention under `auto` (its one-token
passes then need no placeholder at all); a file with a matrix llamafile's sgemm takes (f32, f16,
q8_0, ...) runs whichever of the two measured faster here (`measure`, `faster`): both regimes time
the same passes, a row verifying k + 1 positions and several rows of one or a few positions each,
and the choice is remembered per (file, llama.cpp build, CPU), so that a file's numerics do not
depend on the timing of a later run or on the thread count (measured with the first model's).
Knows nothing of sampling or speculation.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import numpy as np

from . import memo
from .lib import library

FLASH_ATTN_CHOICES = ("auto", "on", "off")  # llama.cpp's -fa / --flash-attn values
SHAPES = ((1, 4), (1, 8), (4, 1), (4, 4), (8, 1), (8, 2))  # (rows, positions per row) of the timed passes
CONTEXT = 192  # cells of every row before a timed pass
_setting = "auto"


def set_flash_attention(value: str) -> None:
    """The process's --flash-attn: `auto` (measured per file), `on` or `off` (every file); read
    when a model's first shape-invariant context is made."""
    global _setting
    if value not in FLASH_ATTN_CHOICES:
        raise ValueError(f"--flash-attn must be one of {', '.join(FLASH_ATTN_CHOICES)}, got {value!r}")
    _setting = value


def flash_attention_setting() -> str:
    return _setting


def flash_for(model) -> bool:
    """Whether `model`'s shape-invariant contexts run flash attention (an f32 KV cache never does:
    llama.cpp casts it to f16 for flash attention)."""
    if model.kv_type != "f16" or _setting == "off":
        return False
    if _setting == "on" or not model.sgemm_weights:
        return True
    return remembered(model)["flash"]


_unsettled: dict[tuple, dict] = {}  # choices this process made from measurements that disagreed


def faster(times: dict[str, list[float]]) -> bool:
    """Flash attention where its passes cost less than sgemm's attention's, by the geometric mean
    of the per-shape ratios (each shape counts alike, whatever its absolute cost)."""
    ratios = [f / s for f, s in zip(times["flash"], times["sgemm"])]
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios)) < 1.0


def remembered(model) -> dict:
    """`measure(model)` twice with its choice, from the cache directory when it was measured before
    for this file, llama.cpp build and CPU (whatever the thread count: the regime sets the numerics).
    A choice is remembered only where the two measurements agree on it: one taken while another
    process loaded the cores is not kept for good. Where they disagree this process takes the
    choice of both together (the same one for every model of the file it loads) and the next
    process measures again."""
    path = Path(model.path)
    stat = path.stat()
    parts = [str(path.resolve()), stat.st_size, stat.st_mtime_ns, SHAPES]
    if tuple(map(str, parts)) in _unsettled:
        return _unsettled[tuple(map(str, parts))]

    def found() -> dict:
        first, second = measure(model), measure(model)
        both = {name: [a + b for a, b in zip(first[name], second[name])] for name in first}
        agreed = faster(first) == faster(second)
        return {
            "flash": faster(both),
            "shapes": [list(s) for s in SHAPES],
            "flash_s": first["flash"],
            "sgemm_s": first["sgemm"],
            "flash_s_again": second["flash"],
            "sgemm_s_again": second["sgemm"],
            "remember": agreed,
        }

    result = memo.remembered("attention", parts, found, f"which attention runs faster on {Path(model.path).name}")
    if not result.get("remember", True):
        _unsettled[tuple(map(str, parts))] = result
    return result


class _Forced:
    """The model as a context reads it, with one attention regime forced (contexts made from it
    are freed, not kept)."""

    def __init__(self, model, flash: bool):
        self._model, self.flash_attention = model, flash

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def release_context(self, context) -> None:
        context.free()


def measure(model, passes: int = 5) -> dict[str, list[float]]:
    """Median seconds of a target pass of each of SHAPES at CONTEXT cells per row, under flash
    attention and under sgemm's (shape-invariant contexts, the placeholders they add included),
    the two interleaved shape by shape."""
    from .context import Context

    rows = max(r for r, _ in SHAPES)
    contexts = {name: Context(_Forced(model, name == "flash"), rows, CONTEXT + 16) for name in ("flash", "sgemm")}
    vocab = model.vocab_size
    for context in contexts.values():
        tokens = np.array([(7919 * i + 13 * r) % vocab for r in range(rows) for i in range(CONTEXT)], np.int32)
        positions = np.tile(np.arange(CONTEXT), rows)
        context.decode(tokens, positions, np.repeat(np.arange(rows), CONTEXT), False)
    times: dict[str, list[float]] = {"flash": [], "sgemm": []}
    for count, width in SHAPES:
        tokens = np.array([(31 * i + r) % vocab for r in range(count) for i in range(width)], np.int32)
        positions = np.tile(np.arange(CONTEXT, CONTEXT + width), count)
        seqs = np.repeat(np.arange(count), width)
        found: dict[str, list[float]] = {"flash": [], "sgemm": []}
        for _ in range(passes):
            for name, context in contexts.items():
                started = time.perf_counter()
                context.decode(tokens, positions, seqs, True, _first_logit)
                found[name].append(time.perf_counter() - started)
                for seq in range(count):
                    library().llama_memory_seq_rm(context.memory, seq, CONTEXT, -1)
        for name in times:
            times[name].append(statistics.median(found[name][1:]))
    for context in contexts.values():
        context.free()
    return times


def _first_logit(logits: np.ndarray) -> np.ndarray:
    return logits[:, :1].copy()
