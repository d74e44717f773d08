"""Where a lone row's one-position pass past the split puts its placeholder, timed on raw llama.cpp.

    python benchmarks/lone_pass_probe.py FILE.gguf [--cells 200,300,800,1300,1600] [--repeats 15]

Under flash attention ggml splits one query's cells over the threads (llama.cpp's one-position pass);
a pass of several queries does not, so verispec's lone passes past SPLIT_KV_FROM carry a placeholder
(context.py). Times, interleaved, at each cache length (medians, ratios to llama.cpp's pass):

  split        one token, one KV stream: llama.cpp's own pass (not shape-invariant)
  after it     the placeholder after the row's token, in its sequence (attends to all its cells; a server's
               lone row before d743171)
  two streams  the placeholder in a second sequence of its own KV stream (n_seq_max 2), no logits
  one stream   the placeholder in a second sequence of the same stream (kv_unified), no logits
  + logits     the one-stream placeholder with logits (verispec before d743171 gave it logits)

and checks that the row's logits in each placeholder shape equal, bit for bit, its logits in a pass
of two of its positions (the shape a verification pass has). Flash attention on, 2 threads, f16 cache.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from verispec.llamacpp.lib import library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("--cells", default="200,300,800,1300,1600")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    lib = library()
    cells = [int(x) for x in args.cells.split(",")]
    model = lib.llama_model_load_from_file(args.gguf.encode(), lib.llama_model_default_params())
    vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    batch = lib.llama_batch_init(512, 0, 1)

    def context(unified: bool, n_seq: int):
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = max(cells) * 2 + 512, 512, 512
        params.n_seq_max, params.kv_unified, params.flash_attn_type = n_seq, unified, 1
        params.n_threads = params.n_threads_batch = args.threads
        return lib.llama_init_from_model(model, params)

    def decode(ctx, tokens, positions, seqs, outputs) -> float:
        for i, (t, p, s, o) in enumerate(zip(tokens, positions, seqs, outputs)):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = t, p, 1, s, o
        batch.n_tokens = len(tokens)
        started = time.perf_counter()
        if lib.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return time.perf_counter() - started

    def row_logits(ctx) -> np.ndarray:
        return np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, 0), shape=(vocab,)).copy()

    tokens = np.random.default_rng(0).integers(100, min(vocab, 40000), max(cells) + 2).tolist()
    shapes = {"split": (False, 1), "after it": (False, 2), "two streams": (False, 2), "one stream": (True, 2)}
    shapes["+ logits"] = (True, 2)
    contexts = {name: context(*shape) for name, shape in shapes.items()}
    print(f"{args.gguf}: flash attention, {args.threads} threads; ms per one-position pass (ratio to split)")
    for n in cells:
        for ctx in contexts.values():
            lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
            for start in range(0, n, 256):
                end = min(n, start + 256)
                decode(ctx, tokens[start:end], range(start, end), [0] * (end - start), [0] * (end - start))
        times: dict[str, list[float]] = {name: [] for name in shapes}
        equal = {}
        for _ in range(args.repeats):
            for name, ctx in contexts.items():
                memory = lib.llama_get_memory(ctx)
                if name == "split":
                    times[name].append(decode(ctx, [tokens[n]], [n], [0], [1]))
                elif name == "after it":
                    times[name].append(decode(ctx, [tokens[n]] * 2, [n, n + 1], [0, 0], [1, 1]))
                else:
                    times[name].append(decode(ctx, [tokens[n]] * 2, [n, 0], [0, 1], [1, int(name == "+ logits")]))
                    lone = row_logits(ctx)
                    lib.llama_memory_seq_rm(memory, 1, 0, -1)
                    lib.llama_memory_seq_rm(memory, 0, n, -1)
                    decode(ctx, tokens[n : n + 2], [n, n + 1], [0, 0], [1, 1])
                    equal[name] = equal.get(name, True) and bool(np.array_equal(lone, row_logits(ctx)))
                lib.llama_memory_seq_rm(memory, 0, n, -1)
        ms = {name: statistics.median(t[1:]) * 1e3 for name, t in times.items()}
        found = "  ".join(f"{name} {v:.2f} ({v / ms['split']:.3f})" for name, v in ms.items())
        same = ", ".join(f"{name} {'=' if ok else '!='}" for name, ok in equal.items())
        print(f"{n:5d} cells: {found}   row logits vs a two-position pass: {same}", flush=True)


if __name__ == "__main__":
    main()
