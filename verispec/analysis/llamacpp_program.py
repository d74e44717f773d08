"""llama.cpp's own `llama-speculative-simple`, run as a peer: its command lines, its log, its n-gram drafters.

Owns the program's name, the command line for its draft-model decoding (`--spec-type
draft-simple`) and for each of its model-free n-gram drafters (`--spec-type ngram-simple`,
`ngram-map-k`, `ngram-map-k4v`, `ngram-mod`, `ngram-cache`, no draft model), the parse of its
output (text, decode speed, drafted and accepted counts), and the choice of each n-gram
drafter's best draft length from a sweep. Knows nothing of verispec's engine or of the report's
other rows.

Sampling: the program's chain is set to verispec's (`sampler_names`: `--samplers top_k;temperature;top_p;min_p`,
only those on), so that both sample one distribution; its default applies temperature last, after top-p and
min-p, and adds penalties, DRY, XTC and typical-p (all off at their defaults), which the list leaves out.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

from ..config import SamplingParams
from ..llamacpp.lib import extra_buffers_fault

PROGRAM = "llama-speculative-simple"
DRAFT_SIMPLE = "draft-simple"  # its draft-model drafter's --spec-type
# the flag that sets each n-gram drafter's draft length in this llama.cpp version (common/arg.cpp);
# ngram-cache has none: its draft length is fixed at 8 (common/speculative.cpp, create_state_ngram_cache)
NGRAM_LENGTH_FLAGS: dict[str, str | None] = {
    "ngram-simple": "--spec-ngram-simple-size-m",
    "ngram-map-k": "--spec-ngram-map-k-size-m",
    "ngram-map-k4v": "--spec-ngram-map-k4v-size-m",
    "ngram-mod": "--spec-ngram-mod-n-max",
    "ngram-cache": None,
}
NGRAM_CACHE_LENGTH = 8
NGRAM_DRAFT_LENGTHS = (4, 8, 16, 48)  # the default sweep: short drafts to llama.cpp's own default (48)
# verispec's order (sampling.process_logits: temperature, top-k, top-p, min-p) in llama.cpp's sampler names
# (common/sampling.cpp); top-k keeps the same tokens before or after temperature, and before it is cheaper
SAMPLER_ORDER = ("top_k", "temperature", "top_p", "min_p")
SEED_LIMIT = 2**32 - 1  # llama.cpp's seeds are uint32, and 2**32 - 1 (LLAMA_DEFAULT_SEED) means a random one


def sampler_names(params: SamplingParams) -> list[str]:
    """llama.cpp's sampler chain for `params`, in verispec's order, only the filters that are on
    (temperature always: at 0 it keeps the most likely token alone, greedy as verispec's T = 0)."""
    on = {"top_k": params.top_k > 0, "temperature": True, "top_p": params.top_p < 1.0, "min_p": params.min_p > 0.0}
    return [name for name in SAMPLER_ORDER if on[name]]


def sampling_flags(params: SamplingParams) -> list[str]:
    """The program's sampling flags: the settings of `params`, its seed, and the chain in verispec's order."""
    if params.seed is None or not 0 <= params.seed < SEED_LIMIT:
        raise ValueError(f"llama.cpp's seeds are integers in [0, 2**32 - 1), got {params.seed}")
    return [
        "--temp",
        str(params.temperature),
        "--top-k",
        str(params.top_k),
        "--top-p",
        str(params.top_p),
        "--min-p",
        str(params.min_p),
        "--samplers",
        ";".join(sampler_names(params)),
        "-s",
        str(params.seed),
    ]


def parse_ngram_types(spec: str) -> list[str]:
    """'all' or a comma-separated list of n-gram drafter names, checked, in the order given."""
    names = list(NGRAM_LENGTH_FLAGS) if spec.strip() == "all" else [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in NGRAM_LENGTH_FLAGS]
    if not names or unknown:
        raise ValueError(f"--peer-ngram must be 'all' or a list of {', '.join(NGRAM_LENGTH_FLAGS)}, got {spec!r}")
    return list(dict.fromkeys(names))


def parse_lengths(text: str, flag: str = "--peer-ngram-lengths") -> list[int]:
    """`flag`'s comma-separated draft lengths, integers >= 1, in the order given."""
    try:
        lengths = [int(item) for item in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise ValueError(f"{flag} must list integers >= 1, got {text!r}")
    return list(dict.fromkeys(lengths))


def ngram_lengths(spec_type: str, lengths: Sequence[int]) -> list[int]:
    """The draft lengths to sweep for one drafter: `lengths`, or ngram-cache's fixed one."""
    return [NGRAM_CACHE_LENGTH] if NGRAM_LENGTH_FLAGS[spec_type] is None else list(lengths)


def ngram_system(spec_type: str, length: int) -> str:
    """The report's name of one n-gram drafter at one draft length."""
    return f"llama.cpp {spec_type} n={length} ({PROGRAM})"


def command(
    program: Path,
    target: Path,
    text: str,
    max_new_tokens: int,
    params: SamplingParams,
    threads: int,
    n_ctx: int,
    *,
    draft: Path | None = None,
    k: int = 4,
    p_min: float = 0.0,
    ngram: str | None = None,
    ngram_length: int | None = None,
    flash: bool = False,
) -> list[str]:
    """The program's command line: the draft model `draft` at draft length k (`draft-simple`); or
    with `ngram` set, that n-gram drafter at draft length `ngram_length` (default k), alone or, with
    a draft too, chained before it (`--spec-type NGRAM,draft-simple`: llama.cpp drafts by the
    n-gram where it finds one, by the model elsewhere); sampling as `params` (its seed included) in
    verispec's order. The prompt is taken as given (no escape processing); flash attention as
    `flash` (`-fa on|off`: the attention verispec's context runs, so that both sides run the same
    kernels); other settings at the program's defaults."""
    if draft is None and ngram is None:
        raise ValueError("give a draft model, an n-gram drafter or both")
    types, spec = [], []
    if ngram is not None:
        flag = NGRAM_LENGTH_FLAGS[ngram]
        types.append(ngram)
        spec += [flag, str(k if ngram_length is None else ngram_length)] if flag else []
    if draft is not None:
        types.append(DRAFT_SIMPLE)
        spec += ["-md", str(draft), "-td", str(threads), "--spec-draft-n-max", str(k)]
        spec += ["--spec-draft-p-min", str(p_min)] if p_min else []
    spec += ["--spec-type", ",".join(types)]
    return [
        str(program),
        "-m",
        str(target),
        *spec,
        "--no-escape",  # the prompt as given: by default it would read "\\n" in the text as a line end
        "-p",
        text,
        "-n",
        str(max_new_tokens),
        "-t",
        str(threads),
        "-c",
        str(n_ctx),
        "-fa",
        "on" if flash else "off",
        *(["--no-repack"] if extra_buffers_fault() else []),  # as llama-cpp-python runs here (llamacpp/lib.py)
        *sampling_flags(params),
    ]


def parse_output(stdout: str, stderr: str, prompt: str) -> dict | None:
    """Its continuation (it prints the prompt, then the continuation), decode speed and
    acceptance from its log; None when the log has no decode line."""
    speed = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", stderr)
    if speed is None:
        return None
    drafted, accepted = re.search(r"n_drafted\s*=\s*(\d+)", stderr), re.search(r"n_accept\s*=\s*(\d+)", stderr)
    printed = stdout.removeprefix("\n\n").removesuffix("\n\n")
    return {
        "text": printed.removeprefix(prompt),
        "decoded": int(speed.group(1)),
        "seconds": float(speed.group(2)),
        "drafted": int(drafted.group(1)) if drafted else 0,
        "accepted": int(accepted.group(1)) if accepted else 0,
    }


def run(command_line: list[str], prompt: str) -> dict:
    """Run the program on one prompt: its text, decode speed and acceptance."""
    for _attempt in range(3):  # its log is written by a thread of its own and can be cut short at exit: run it again
        done = subprocess.run(command_line, capture_output=True, text=True, errors="replace", timeout=600)
        result = parse_output(done.stdout, done.stderr, prompt)
        if done.returncode == 0 and result is not None:
            return result
    tail = " / ".join(done.stderr.strip().splitlines()[-3:])
    raise RuntimeError(f"{Path(command_line[0]).name} failed (exit {done.returncode}): {tail}")


def keep_best_lengths(rows: list[dict], sweeps: dict[str, tuple[str, int]]) -> list[dict]:
    """One row per n-gram drafter, its fastest draft length's (ties: the shorter), renamed to say
    which length won of which; `draft_length_sweep` keeps every length's tokens/s. `sweeps` maps
    a row's system name to (drafter, length); rows not in it pass unchanged, in order."""
    by_type: dict[str, list[dict]] = {}
    for row in rows:
        if row["system"] in sweeps:
            by_type.setdefault(sweeps[row["system"]][0], []).append(row)
    out = []
    for row in rows:
        if row["system"] not in sweeps:
            out.append(row)
            continue
        spec_type, _ = sweeps[row["system"]]
        group = by_type[spec_type]
        if row is not group[0]:
            continue
        best = max(group, key=lambda r: (r["tokens_per_s"], -sweeps[r["system"]][1]))
        lengths = [sweeps[r["system"]][1] for r in group]
        sweep = {str(length): r["tokens_per_s"] for length, r in zip(lengths, group)}
        won = sweeps[best["system"]][1]
        name = f"llama.cpp {spec_type} n={won}" + (
            f", best of {','.join(map(str, lengths))}" if len(lengths) > 1 else ", fixed"
        )
        out.append({**best, "system": name, "draft_length": won, "draft_length_sweep": sweep})
    return out
