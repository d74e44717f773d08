"""Start-up: from the command to the first token, verispec against llama-cpp-python, per GGUF file.

    python benchmarks/startup.py FILE.gguf [FILE.gguf ...] [--rounds 5] [--prompt TEXT]

Each round runs, in fresh processes taking turns, `verispec generate PROMPT --target FILE
--draft none --max-new-tokens 1` and a script that imports llama_cpp, loads the file with `Llama`
and completes one token of the same prompt; both wall times include the interpreter, imports,
loading and prefill. The first round of each is a warm-up (the page cache, verispec's compiled
step and its per-file measurements are then in place: what a user's second run sees) and is
reported apart. Prints a table of medians and the ratio verispec / llama-cpp-python.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

LLAMA = """
import sys
from verispec.llamacpp.lib import library
library()  # llama.cpp set up as verispec sets it up (no AMX buffers where they fault)
import llama_cpp
model = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=512, verbose=False)
model.create_completion(sys.argv[2], max_tokens=1, temperature=0.0)
"""


def timed(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, text=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt", default="The three primary colors are")
    args = parser.parse_args()
    columns = ["file", "first run: verispec / llama-cpp-python (s)", "later runs: verispec (s)", "llama-cpp-python (s)"]
    print("| " + " | ".join([*columns, "ratio"]) + " |")
    print("|---|---|---|---|---|")
    for path in args.files:
        verispec = [sys.executable, "-m", "verispec", "generate", args.prompt, "--target", path, "--draft", "none"]
        verispec += ["--max-new-tokens", "1"]
        llama = [sys.executable, "-c", LLAMA, path, args.prompt]
        ours, theirs = [], []
        for _ in range(args.rounds + 1):
            ours.append(timed(verispec))
            theirs.append(timed(llama))
        ratio = statistics.median(ours[1:]) / statistics.median(theirs[1:])
        print(
            f"| {path} | {ours[0]:.2f} / {theirs[0]:.2f} | {statistics.median(ours[1:]):.2f} "
            f"| {statistics.median(theirs[1:]):.2f} | {ratio:.2f} |"
        )


if __name__ == "__main__":
    main()
