"""A design probe (not built): flash attention's placeholder in a sequence of its own.

    python benchmarks/spare_sequence_probe.py FILE.gguf [--cells 520] [--repeats 20]

Past SPLIT_KV_FROM a one-position pass under flash attention gets a placeholder after its token,
so that llama.cpp does not split the query's cells over the threads (its split changes the sums).
The placeholder is a second query over all the cells. Put in an empty sequence instead (a KV stream
of its own), it still keeps the pass off the split path (ggml splits only one query of one
stream) but attends to its one cell. Checks that the real position's logits are bit for bit those
of a two-query pass, and times a one-position pass three ways: the split (llama.cpp's, not
invariant), the placeholder after the token (verispec's now), the placeholder in a spare sequence.
"""

from __future__ import annotations

import argparse

import numpy as np

from verispec.llamacpp import LlamaCppModel
from verispec.llamacpp.context import Context
from verispec.llamacpp.lib import library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("--cells", type=int, default=520)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    model = LlamaCppModel(args.target)
    if not model.flash_attention:
        raise SystemExit(f"{args.target}: runs sgemm's attention here; the probe is for flash attention")
    context, lib, cells = Context(model, 2, args.cells + 64), library(), args.cells
    prompt = np.random.default_rng(0).integers(100, min(model.vocab_size, 40000), cells).astype(np.int32)
    context.decode(prompt, np.arange(cells, dtype=np.int32), np.zeros(cells, np.int32), False)

    def run(positions: list[int], seqs: list[int], invariant: bool = True) -> tuple[np.ndarray, float]:
        context.invariant = invariant
        tokens = np.array([1234, 555][: len(seqs)], np.int32)
        found, seconds = context.decode(
            tokens, np.array(positions, np.int32), np.array(seqs, np.int32), True, read=lambda x: x.copy()
        )
        lib.llama_memory_seq_rm(context.memory, 0, cells, -1)
        lib.llama_memory_seq_rm(context.memory, 1, -1, -1)
        return found[0], seconds

    two = run([cells, cells + 1], [0, 0])[0]
    spare = run([cells, 0], [0, 1])[0]
    print(f"the real position's logits, spare sequence vs two queries: equal {np.array_equal(two, spare)}")
    ways = {
        "one query, split (llama.cpp's; not invariant)": ([cells], [0], False),
        "placeholder after the token (verispec's)": ([cells, cells + 1], [0, 0], True),
        "placeholder in a spare sequence": ([cells, 0], [0, 1], True),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):  # interleaved
        for name, way in ways.items():
            times[name].append(run(*way)[1])
    base = np.median(times[next(iter(ways))])
    for name, seconds in times.items():
        print(f"{name}: {np.median(seconds) * 1e3:.2f} ms ({np.median(seconds) / base:.2f}x)")


if __name__ == "__main__":
    main()
