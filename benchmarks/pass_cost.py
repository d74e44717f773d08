"""Time the target's passes on llama.cpp by shape: rows x positions per row, at two contexts.

Usage: python benchmarks/pass_cost.py FILE.gguf [--rows 1,4,16] [--contexts 256,512] [--flash-attn auto|on|off]
Prints, per (rows, context), the median milliseconds of a forward of T positions per row
(T = 1, 2, 4, 8, 17) after the context was prefilled, the cache rolled back between passes: what
a plain pass (T = 1) and a verification pass of k + 1 positions cost under the installed
verispec's llama.cpp settings. Run it at two commits to compare their settings.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec.llamacpp import LlamaCppModel, regime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--contexts", default="256,512")
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--flash-attn", choices=regime.FLASH_ATTN_CHOICES, default="auto")
    args = parser.parse_args()
    regime.set_flash_attention(args.flash_attn)
    model = LlamaCppModel(args.gguf)
    print(f"{args.gguf}: flash attention {'on' if model.flash_attention else 'off'} (--flash-attn {args.flash_attn})")
    for rows in (int(x) for x in args.rows.split(",")):
        for context in (int(x) for x in args.contexts.split(",")):
            cache = model.new_cache(rows, context + 40)
            model.prefill([[(7919 * i + 13 * r) % 6000 + 5 for i in range(context)] for r in range(rows)], cache)
            found = []
            for positions in (1, 2, 3, 4, 5, 8, 17):
                tokens = torch.tensor([[(31 * i + r) % 6000 + 5 for i in range(positions)] for r in range(rows)])
                times = []
                for _ in range(args.passes):
                    cache.rollback([context] * rows)
                    started = time.perf_counter()
                    model(tokens, cache)
                    times.append(time.perf_counter() - started)
                found.append(f"T={positions} {statistics.median(times[1:]) * 1e3:.1f}")
            print(f"rows {rows:2d} context {context}: " + "  ".join(found) + " ms", flush=True)
            del cache


if __name__ == "__main__":
    main()
