"""What a draft length per row would cost on llama.cpp: ragged target passes, per-sequence KV streams or one unified.

Usage: python benchmarks/ragged_passes.py [FILE.gguf] [--rows 4,8] [--context 200] [--passes 9]

A per-row k makes a verification pass ragged: row b holds k_b + 1 positions. Per rows count this times (median
of `passes`, the cache rolled back between passes, verispec's placeholders off so llama.cpp sees the batch as
given) passes of uniform k = 4 and 8, and ragged ones: long rows (k = 8) and short rows (k = 0) interleaved in
sequence order (a server's rows join on free sequences, so classes interleave) and sorted (long rows first), with
llama.cpp's default one KV stream per sequence (its split_equal cuts a ubatch per run of consecutive sequences
with the same count) and with `kv_unified` (one stream: any batch is one ubatch). Then, under each layout, the
largest logit gap of one row's pass between two histories: alone, and beside rows whose rollbacks left free
cells before the row's latest cells (a unified cache fills the lowest free cells, so the row's cells leave
position order). Default FILE: the built-in target as f32 GGUF (converted once).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from verispec.llamacpp import LlamaCppModel
from verispec.llamacpp.lib import library


def _tokens(n: int, row: int, offset: int = 0) -> np.ndarray:
    return np.array([(7919 * (i + offset) + 13 * row) % 6000 + 5 for i in range(n)], np.int32)


def _decode(context, rows: dict[int, tuple[np.ndarray, int]], logits: bool = False):
    """rows: sequence -> (tokens, first position); placeholders off: llama.cpp gets the batch as it is."""
    tokens = np.concatenate([t for t, _ in rows.values()])
    positions = np.concatenate([np.arange(s, s + len(t)) for t, s in rows.values()]).astype(np.int32)
    seqs = np.concatenate([np.full(len(t), r) for r, (t, _) in rows.items()]).astype(np.int32)
    return context.decode(tokens, positions, seqs, logits, (lambda x: x.copy()) if logits else None)[0]


def _context(model, rows: int, length: int):
    cache = model.new_cache(rows, length)
    cache.context._fill_gaps = lambda *args, **kwargs: None
    return cache, cache.context


def _times(model, rows: int, context: int, passes: int) -> dict[str, float]:
    long, short = [9] * (rows // 2), [1] * (rows // 2)
    patterns = {
        "uniform k=4": [5] * rows,
        "uniform k=8": [9] * rows,
        "ragged 8/0 interleaved": [n for pair in zip(long, short) for n in pair],
        "ragged 8/0 sorted": long + short,
    }
    cache, ctx = _context(model, rows, context + 40)
    lib = library()
    for r in range(rows):
        _decode(ctx, {r: (_tokens(context, r), 0)})
    found: dict[str, list[float]] = {}
    for _ in range(passes):
        for name, counts in patterns.items():
            for r in range(rows):
                lib.llama_memory_seq_rm(ctx.memory, r, context, -1)
            started = time.perf_counter()
            _decode(ctx, {r: (_tokens(n, r, context), context) for r, n in enumerate(counts)})
            found.setdefault(name, []).append(time.perf_counter() - started)
    return {name: statistics.median(times[1:]) * 1e3 for name, times in found.items()}


def _history_gap(model) -> float:
    """Row 0's logits over 5 positions after 105: beside three rows whose rollbacks freed earlier cells, and alone."""
    lib, seen = library(), []
    for beside in (True, False):
        cache, ctx = _context(model, 4, 400)
        for r in range(4 if beside else 1):
            _decode(ctx, {r: (_tokens(100, r), 0)})
        _decode(ctx, {r: (_tokens(5, r, 100), 100) for r in range(4 if beside else 1)})
        if beside:
            lib.llama_memory_seq_rm(ctx.memory, 1, 50, -1)
            lib.llama_memory_seq_rm(ctx.memory, 2, 100, -1)
        seen.append(_decode(ctx, {0: (_tokens(5, 0, 105), 105)}, logits=True))
        del cache
    return float(np.abs(seen[0] - seen[1]).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="?", default=None)
    parser.add_argument("--rows", default="4,8")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--passes", type=int, default=9)
    args = parser.parse_args()
    if args.gguf is None:
        from verispec.models.gguf_convert import cached_gguf
        from verispec.pair import TARGET_DIR

        args.gguf = str(cached_gguf(TARGET_DIR, "f32"))
    lib = library()
    default_params = lib.llama_context_default_params
    for unified in (False, True):

        def params(unified=unified):
            p = default_params()
            p.kv_unified = unified
            return p

        lib.llama_context_default_params = params
        model = LlamaCppModel(args.gguf)
        layout = "kv_unified" if unified else "a KV stream per sequence"
        print(f"{layout} (flash attention {'on' if model.flash_attention else 'off'}):", flush=True)
        for rows in (int(x) for x in args.rows.split(",")):
            times = _times(model, rows, args.context, args.passes)
            print(f"  {rows} rows: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in times.items()), flush=True)
        print(f"  one row's largest logit gap, beside rolled-back rows against alone: {_history_gap(model):.3g}")
        del model
    lib.llama_context_default_params = default_params


if __name__ == "__main__":
    main()
