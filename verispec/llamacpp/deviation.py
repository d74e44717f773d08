"""How much a model's logits at a position depend on the pass that computes them.

Owns `pass_shape_deviation` (the largest logit gap, over real contexts, between a position
scored by one-position passes and the same position scored in a pass of several positions, in a
batch beside another row, or in a larger cache) and `startup_deviation` (the same on a fixed
short context, remembered per file, llama.cpp build and CPU, for a one-line note at start-up).

Speculative decoding is exact against plain decoding only when these gaps are 0: the rule
keeps the target's distribution, but a target that scores a verification pass differently from
a plain pass has two distributions. Works for any model with the model protocol (`new_cache`,
`prefill`, `forward`, `rollback`). Knows nothing of sampling or speculation.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import memo
from .lib import exact_kernels


@dataclass(frozen=True)
class Deviation:
    """Largest absolute logit gap from one-position passes in a one-row cache (the reference)."""

    positions: float  # the same positions scored in one pass of several positions
    rows: float  # ... in passes of two rows, beside another context (several positions, then one a pass)
    cache: float  # ... in a cache four times as large, two positions a pass
    contexts: int  # how many contexts were measured

    @property
    def largest(self) -> float:
        return max(self.positions, self.rows, self.cache)


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


@torch.no_grad()
def pass_shape_deviation(model, contexts: list[list[int]], positions: int = 4) -> Deviation:
    """Score the last `positions` tokens of each context (at least positions + 1 tokens long)
    one at a time, then in the three other pass shapes; the largest gaps found."""
    usable = [c for c in contexts if len(c) > positions]
    if not usable:
        raise ValueError(f"pass_shape_deviation needs a context of more than {positions} tokens")
    gaps = {"positions": 0.0, "rows": 0.0, "cache": 0.0}
    device = getattr(model, "device", torch.device("cpu"))
    for i, context in enumerate(usable):
        body, tail = context[:-positions], torch.tensor([context[-positions:]], device=device)  # tail [1, T]
        room = len(context) + 2
        cache = model.new_cache(1, room)
        model.prefill([body], cache)
        reference = torch.cat([model(tail[:, j : j + 1], cache) for j in range(positions)], dim=1)  # [1, T, V]
        cache.rollback([len(body)])
        gaps["positions"] = max(gaps["positions"], _gap(model(tail, cache), reference))
        del cache
        other = usable[(i + 1) % len(usable)]
        other = (other * (len(body) // len(other) + 1))[: len(body)]  # another row, the same length
        both = model.new_cache(2, room)
        model.prefill([body, other], both)
        two = torch.cat([tail, torch.tensor([other[-positions:]], device=device)])  # [2, T]
        gaps["rows"] = max(gaps["rows"], _gap(model(two, both)[:1], reference))
        both.rollback([len(body)] * 2)
        one_each = torch.cat([model(two[:, j : j + 1], both)[:1] for j in range(positions)], dim=1)  # [1, T, V]
        gaps["rows"] = max(gaps["rows"], _gap(one_each, reference))
        del both
        large = model.new_cache(1, 4 * room)
        model.prefill([body], large)
        split = torch.cat([model(tail[:, j : j + 2], large) for j in range(0, positions, 2)], dim=1)
        gaps["cache"] = max(gaps["cache"], _gap(split, reference))
        del large
    return Deviation(contexts=len(usable), **gaps)


def _synthetic_context(vocab_size: int, length: int = 40) -> list[int]:
    """Fixed token ids spread over the vocabulary: the numerics, not the text, are measured."""
    return [(7919 * i + 13) % vocab_size for i in range(1, length + 1)]


def startup_deviation(model) -> Deviation:
    """`pass_shape_deviation` on two fixed contexts, remembered in the cache directory per
    (file, its size and time, llama.cpp's build line, the CPU, the process's kernel settings)."""
    path = Path(model.path)
    stat = path.stat()
    parts = [
        str(path.resolve()),
        stat.st_size,
        stat.st_mtime_ns,
        exact_kernels(),
        getattr(model, "shape_invariant", None),
        getattr(model, "flash_attention", None),
        "attention regimes: three",  # which placeholder rules (context.py) it holds for
        model.n_threads,
    ]
    contexts = [_synthetic_context(model.vocab_size), _synthetic_context(model.vocab_size, 33)[::-1]]
    what = f"the logit gap between pass shapes of {Path(model.path).name}"
    return Deviation(**memo.remembered("deviation", parts, lambda: asdict(pass_shape_deviation(model, contexts)), what))


_DEFAULTS_CHILD = """
import json, sys
from verispec import llamacpp
llamacpp.set_exact_kernels(False)
from verispec.llamacpp.deviation import pass_shape_deviation
model = llamacpp.LlamaCppModel(sys.argv[1], n_threads=int(sys.argv[2]))
print(json.dumps(pass_shape_deviation(model, json.load(open(sys.argv[3]))).largest))
"""


def default_settings_deviation(model, contexts: list[list[int]], timeout: float = 600) -> float | None:
    """`pass_shape_deviation(...).largest` of a llama.cpp model's file under llama.cpp's default
    kernels (`--exact-kernels off`), measured in a fresh process (the settings are the process's);
    None where that process fails."""
    import subprocess
    import sys
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json") as handle:
        json.dump(contexts, handle)
        handle.flush()
        done = subprocess.run(
            [sys.executable, "-c", _DEFAULTS_CHILD, str(model.path), str(model.n_threads), handle.name],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    if done.returncode != 0:
        return None
    return float(done.stdout.strip().splitlines()[-1])
