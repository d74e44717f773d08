"""verispec's plain decoding on a shared CPU: idle, beside another llama.cpp process, beside a busy loop.

For each setting (llama.cpp's default: every core, OpenMP threads that spin 300,000 times at a
barrier before they sleep; verispec's default: every core, 1,000 spins, set by verispec/__init__.py;
OpenMP's passive waits; one thread), one child process decodes `--new` tokens plainly with the built-in
target (GGUF f32 unless --target), `--rounds` times, and reports tokens/s. Each child runs idle,
then beside a competitor: another llama.cpp process (a child of this script that decodes without
end with llama.cpp's default settings, 2 threads) or a plain busy loop (one Python process).
Settings and competitors are interleaved round by round; medians and ratios to idle are printed.

    python benchmarks/shared_cpu.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {  # name -> (environment changes of the child, its n_threads: None = verispec's choice)
    "default": (
        {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "300000"},
        2,
    ),  # llama.cpp's: every core, libgomp's default waits
    "verispec": ({"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": ""}, None),  # verispec's defaults: 1,000 spins, every core
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": ""}, 2),  # threads sleep at once at a barrier
    "spin300": ({"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "300"}, None),  # spin 300 times, then sleep
    "threads1": ({"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "300000"}, 1),
}

CHILD = r"""
import json, sys, time
# verispec first: it sets how long OpenMP threads spin, which libgomp reads once, when torch loads it
import verispec
import torch
from verispec import SamplingParams, generate_all
from verispec.llamacpp import LlamaCppModel
path, new, threads = sys.argv[1], int(sys.argv[2]), (int(sys.argv[3]) or None)
model = LlamaCppModel(path, n_threads=threads)
prompt = list(range(100, 120))
generate_all(model, [prompt], SamplingParams(temperature=0, max_new_tokens=8), None, k=0)  # warm
start = time.perf_counter()
tokens = generate_all(model, [prompt], SamplingParams(temperature=0, max_new_tokens=new), None, k=0)[0]
print(json.dumps({"tok_s": len(tokens) / (time.perf_counter() - start)}))
"""

COMPETITOR = r"""
import sys
from verispec import SamplingParams, generate_all
from verispec.llamacpp import LlamaCppModel
model = LlamaCppModel(sys.argv[1], n_threads=2)
while True:
    generate_all(model, [list(range(50, 70))], SamplingParams(temperature=0, max_new_tokens=200), None, k=0)
"""


def _env(changes: dict) -> dict:
    env = dict(os.environ)
    for key, value in changes.items():
        if value == "":
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_child(path: str, new: int, setting: str, timeout: float) -> float:
    changes, threads = SETTINGS[setting]
    env = _env(changes)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, path, str(new), str(threads or 0)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        return float("nan")
    return json.loads(done.stdout.strip().splitlines()[-1])["tok_s"]


def start_competitor(kind: str, path: str) -> subprocess.Popen | None:
    if kind == "idle":
        return None
    if kind == "busy":
        return subprocess.Popen([sys.executable, "-c", "while True: pass"])
    # another llama.cpp process with llama.cpp's (libgomp's) default waits, as an unmodified program has
    env = _env({"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "300000"})
    process = subprocess.Popen(
        [sys.executable, "-c", COMPETITOR, path], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    time.sleep(4)  # loaded and decoding
    return process


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=None, help="GGUF file (default: the built-in target, f32)")
    parser.add_argument("--settings", default="default,verispec,spin300,passive,threads1")
    parser.add_argument("--competitors", default="idle,llama,busy")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    path = args.target
    if path is None:
        from verispec.models.gguf_convert import cached_gguf
        from verispec.pair import TARGET_DIR

        path = str(cached_gguf(TARGET_DIR, "f32"))
    settings, competitors = args.settings.split(","), args.competitors.split(",")
    found = {(s, c): [] for s in settings for c in competitors}
    for round_ in range(args.rounds):
        for competitor in competitors:
            process = start_competitor(competitor, path)
            try:
                for setting in settings:
                    found[setting, competitor].append(run_child(path, args.new, setting, args.timeout))
            finally:
                if process is not None:
                    process.kill()
                    process.wait()
        print(
            f"round {round_ + 1}: " + json.dumps({f"{s}/{c}": round(v[-1], 1) for (s, c), v in found.items()}),
            file=sys.stderr,
            flush=True,
        )
    rows = []
    print(
        f"| setting | {' | '.join(f'{c} tok/s' for c in competitors)} | "
        f"{' | '.join(f'{c} / idle' for c in competitors if c != 'idle')} |"
    )
    print("|---" * (2 * len(competitors)) + "|")
    for setting in settings:
        medians = {c: statistics.median(found[setting, c]) for c in competitors}
        ratios = {c: medians[c] / medians["idle"] for c in competitors if c != "idle"} if "idle" in medians else {}
        rows.append(
            {
                "setting": setting,
                "medians": medians,
                "ratios": ratios,
                "runs": {c: found[setting, c] for c in competitors},
            }
        )
        print(
            f"| {setting} | {' | '.join(f'{medians[c]:.1f}' for c in competitors)} | "
            f"{' | '.join(f'{r:.2f}' for r in ratios.values())} |"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"target": path, "new": args.new, "rounds": args.rounds, "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
