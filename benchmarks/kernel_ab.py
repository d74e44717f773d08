"""A/B of the skinny CPU kernel: this checkout's against the one at a git revision, in one run.

Builds csrc/skinny_linear.cpp as it was at REV (under another extension name), then times a
target pass over n = 1..16 positions with each kernel in turn, interleaved round by round,
and prints r(n) = median time / median time of the old kernel at n = 1. Rows past the old
kernel's limit (8 before 1d19b2e) go to torch's linear there, as the old code did.

Usage: python benchmarks/kernel_ab.py REV [TARGET_DIR] [--rounds N]
(TARGET_DIR defaults to the built-in target; nothing else should run meanwhile.)
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    from torch.utils.cpp_extension import load

    from verispec.models import kernels
    from verispec.models.hf import load_model
    from verispec.pair import TARGET_DIR

    parser = argparse.ArgumentParser()
    parser.add_argument("rev")
    parser.add_argument("target", nargs="?", default=str(TARGET_DIR))
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--context", type=int, default=300)
    args = parser.parse_args()

    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{args.rev}:verispec/csrc/skinny_linear.cpp"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    old_cpp = Path(tempfile.mkdtemp()) / "skinny_old.cpp"
    old_cpp.write_text(source)
    flags = dict(extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"])
    old = load(f"verispec_skinny_ab_{args.rev[:12]}", [str(old_cpp)], **flags)
    new = kernels._load()
    print(f"kernel: {kernels.kernel_status()}")
    old_rows, new_rows = getattr(old, "MAX_ROWS", 8), kernels.MAX_ROWS

    model = load_model(args.target, torch.float32)
    cache = model.new_cache(1, args.context + 32)
    model.prefill([list(range(1, args.context))], cache)
    ns = list(range(1, 17))
    ids = {n: torch.randint(1, model.vocab_size, (1, n)) for n in ns}
    times: dict[tuple[str, int], list[float]] = {}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, ext, rows in (("old", old, old_rows), ("new", new, new_rows)):
                kernels._kernel, kernels.MAX_ROWS = ext, rows
                for n in ns:
                    lengths = cache.host_lengths
                    started = time.perf_counter()
                    model(ids[n], cache)
                    times.setdefault((name, n), []).append(time.perf_counter() - started)
                    cache.rollback(lengths)
    base = statistics.median(times[("old", 1)])
    print(
        f"r(n) = median pass time / old kernel's median at n = 1 ({base * 1e3:.1f} ms); {args.rounds} interleaved "
        f"rounds, context {args.context}"
    )
    print("| n | " + " | ".join(str(n) for n in ns) + " |")
    print("|---|" + "---|" * len(ns))
    for name, label in (("old", f"{args.rev[:7]} (old)"), ("new", "this checkout")):
        print(f"| {label} | " + " | ".join(f"{statistics.median(times[(name, n)]) / base:.2f}" for n in ns) + " |")


if __name__ == "__main__":
    main()
