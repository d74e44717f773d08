"""Where the time of exact kernels goes, per file and setting: a target pass of 1, 2, 4, 8 and 16
positions (one row) under llama.cpp's defaults and under each of verispec's settings, each in a
fresh process (the settings are process-wide), the processes interleaved round by round.

    python benchmarks/settings_table.py FILE_OR_DIR ... [--contexts 128,512] [--rounds 2] [--json OUT]

A directory (the built-in target) is converted by `verispec` as `--gguf-type f32` would be. Prints,
per file and context, a markdown table: each setting's median milliseconds per pass, and in
brackets the ratio to llama.cpp's defaults at the same width. Timings are `verispec profile`'s
(analysis.profile.profile_costs: a verification pass of n positions at the context given, with
the placeholders a setting adds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

WIDTHS = (1, 2, 4, 8, 16)
SETTINGS = {  # name -> (exact kernels, --flash-attn, environment)
    "llama.cpp defaults (exact kernels off)": ("off", "auto", {}),
    "exact kernels, --flash-attn auto (verispec's default)": ("on", "auto", {}),
    "exact kernels, flash attention": ("on", "on", {}),
    "exact kernels, sgemm's attention": ("on", "off", {}),
    "exact kernels, no own head, no kernel probe (placeholders for every sgemm type)": (
        "on",
        "auto",
        {"VERISPEC_OWN_HEAD": "0", "VERISPEC_KERNEL_PROBE": "0"},
    ),
}

CHILD = """
import json, sys
from verispec.assemble import Settings, load_model
from verispec.analysis.profile import profile_costs
path, exact, flash, context = sys.argv[1], sys.argv[2] == "on", sys.argv[3], int(sys.argv[4])
settings = Settings(target=path, backend="llamacpp", exact_kernels=exact, flash_attn=flash)
model = load_model(settings, path)
costs = profile_costs(model, None, k_max=15, context_length=context, repeats=3, use_cache=False)
print(json.dumps({"target_s": costs.target_s, "flash": getattr(model, "flash_attention", None) if exact else None}))
"""


def one(path: str, setting: str, context: int) -> dict:
    import os

    exact, flash, env = SETTINGS[setting]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, path, exact, flash, str(context)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{path} / {setting}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--contexts", default="128,512")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", dest="out")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    runs: dict = {}
    for round_ in range(args.rounds):
        for path in args.files:
            for context in contexts:
                for setting in SETTINGS:
                    found = one(path, setting, context)
                    runs.setdefault((path, context, setting), []).append(found["target_s"])
                    print(
                        f"round {round_ + 1} {path} @{context} {setting}: t(1) {found['target_s'][0] * 1e3:.1f} ms",
                        file=sys.stderr,
                    )
    medians = {key: [statistics.median(t[n - 1] for t in times) for n in WIDTHS] for key, times in runs.items()}
    for path in args.files:
        for context in contexts:
            base = medians[(path, context, next(iter(SETTINGS)))]
            print(f"\n{path}, context {context}: ms per pass of n positions (x llama.cpp's defaults at that width)\n")
            print("| setting | " + " | ".join(f"n = {n}" for n in WIDTHS) + " |")
            print("|---|" + "---|" * len(WIDTHS))
            for setting in SETTINGS:
                row = medians[(path, context, setting)]
                cells = [f"{t * 1e3:.1f} ({t / b:.2f})" for t, b in zip(row, base)]
                print(f"| {setting} | " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as out:
            json.dump(
                [{"file": p, "context": c, "setting": s, "target_s": t} for (p, c, s), t in runs.items()], out, indent=1
            )


if __name__ == "__main__":
    main()
