"""CPU kernels for decoding: a "skinny" matrix product for 1..16 rows (csrc/skinny_linear.cpp).

Owns `linear(x, weight, bias)`, which the model's projections call. float32 inference with at
most 16 rows on an AVX2/AVX-512 CPU may go to the skinny kernel (every weight read once, used
by all rows, so verifying k+1 <= 8 positions costs about one decoding pass) or to torch's
`F.linear`: whichever measured faster for that row count and weight shape on this machine
(`VERISPEC_KERNELS=auto`, the default; the timings are measured on first use, kept with the
compiled kernel and listed by `kernel_choices()`). `VERISPEC_KERNELS=1` always uses the kernel,
`0` never. Everything else (training, prefill, other dtypes and devices) goes to `F.linear`.

The kernel is compiled on first use with torch's C++ extension loader (a C++ compiler and
ninja; about a minute) into a directory keyed by the source's hash, the torch and Python
versions and the CPU capability, so installs of different versions never rebuild each
other's; under an flock of its own, so that a build killed midway does not leave the next start
waiting for good (`_build_lock`). Where that fails the fallback is used, said once on stderr and by `kernel_status()`.
Knows nothing of models.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..paths import cache_home

MAX_ROWS = 16  # the kernel's own limit (csrc: MAX_ROWS)
_NAME = "verispec_skinny_linear"
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "skinny_linear.cpp"
_kernel = None
_status = "not loaded"
_build_dir: Path | None = None
_choices: dict[str, dict] = {}  # "rows x N x K" -> {"kernel_s", "torch_s", "kernel": bool}
_COLD_BYTES = 128 << 20  # weights cycled through when timing a choice: more than any L3 here


def _mode() -> str:
    mode = os.environ.get("VERISPEC_KERNELS", "auto")
    return mode if mode in ("0", "1", "auto") else "auto"


MODE = _mode()  # VERISPEC_KERNELS, read once: "auto" (measured), "1" (the kernel) or "0" (torch's linear)
_use_kernel: dict[tuple[int, int, int], bool] = {}  # (rows, N, K) -> the choice: the hot path's lookup


def build_key(source: bytes | None = None) -> str:
    """What a compiled kernel depends on, hashed: its source, the compiler flags, torch's and
    Python's versions and the CPU capability (the build directory's name)."""
    source = _SOURCE.read_bytes() if source is None else source
    parts = [
        source,
        " ".join(_CFLAGS).encode(),
        torch.__version__.encode(),
        sys.version.split()[0].encode(),
        torch.backends.cpu.get_cpu_capability().encode(),
    ]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def cache_root() -> Path:
    return cache_home() / "kernels"


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Hold an flock on build_dir (the OS drops it when its process dies) while torch's loader
    runs, and under it delete torch's own `lock` file: torch's loader waits, without end, for that
    file to go, and a build killed midway (Ctrl-C, a killed test run) leaves it behind, so that
    every later start hung. Holding the flock means no other verispec process is building here."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock alone
        yield
        return
    with open(build_dir / "verispec.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
        (build_dir / "lock").unlink(missing_ok=True)
        yield


def _load():
    global _kernel, _status, _build_dir, _choices
    if _status != "not loaded":
        return _kernel
    if MODE == "0":
        _status = "disabled by VERISPEC_KERNELS=0"
    elif torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        _status = f"CPU capability {torch.backends.cpu.get_cpu_capability()} lacks AVX2"
    else:
        key = build_key()
        _build_dir = cache_root() / f"{_NAME}-{key}"
        try:
            from torch.utils.cpp_extension import load

            _build_dir.mkdir(parents=True, exist_ok=True)
            if not list(_build_dir.glob("*.so")):
                print(
                    f"verispec: compiling the CPU kernel into {_build_dir} (once; about a minute)",
                    file=sys.stderr,
                    flush=True,
                )
            with _build_lock(_build_dir):
                _kernel = load(
                    f"{_NAME}_{key}",
                    [str(_SOURCE)],
                    build_directory=str(_build_dir),
                    extra_cflags=_CFLAGS,
                    extra_ldflags=["-fopenmp"],
                    verbose=False,
                )
            _status = "skinny kernel loaded"
            try:
                _choices = json.loads((_build_dir / "choices.json").read_text())
            except (OSError, ValueError):
                _choices = {}
        except Exception as error:  # no compiler, no ninja, ...: fall back, but say so (once per process)
            _status = f"skinny kernel unavailable ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
            print(f"verispec: {_status}; using torch's linear for every product", file=sys.stderr, flush=True)
    return _kernel


def kernel_status() -> str:
    _load()
    return _status


def kernel_choices() -> dict[str, dict]:
    """The measured choices so far: "rows x N x K" -> kernel and torch seconds, and which is used."""
    return dict(_choices)


def _faster_is_kernel(rows: int, weight: torch.Tensor) -> bool:
    """Whether the skinny kernel beat F.linear for this row count and weight shape (measured
    now on first use, with the weights read from memory as in decoding: medians of 3 rounds,
    interleaved; kept in the build directory)."""
    if MODE != "auto":
        return MODE == "1"
    known = _use_kernel.get((rows, weight.shape[0], weight.shape[1]))
    if known is not None:
        return known
    key = f"{rows}x{weight.shape[0]}x{weight.shape[1]}"
    choice = _choices.get(key)
    if choice is None:
        # Decoding reads each weight from memory, not from a cache: time both on copies of the
        # weight that together exceed any L3, one product per copy in turn.
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
        copies = [
            weight.detach().clone() for _ in range(max(2, -(-_COLD_BYTES // (weight.numel() * weight.element_size()))))
        ]
        times: dict[str, list[float]] = {"kernel": [], "torch": []}
        for _ in range(4):
            for name, run in (("kernel", _kernel.skinny_linear), ("torch", F.linear)):
                start = time.perf_counter()
                for w in copies:
                    run(x, w)
                times[name].append((time.perf_counter() - start) / len(copies))
        kernel_s, torch_s = (
            statistics.median(t[1:]) for t in (times["kernel"], times["torch"])
        )  # the first round warms up
        choice = _choices[key] = {"kernel_s": kernel_s, "torch_s": torch_s, "kernel": kernel_s <= torch_s}
        if _build_dir is not None:
            try:
                tmp = _build_dir / f"choices.json.{os.getpid()}"
                tmp.write_text(json.dumps(_choices, indent=1))
                tmp.replace(_build_dir / "choices.json")
            except OSError:
                pass  # a read-only cache: measured again next time
    _use_kernel[(rows, weight.shape[0], weight.shape[1])] = choice["kernel"]
    return choice["kernel"]


def calibrate(model: torch.nn.Module, max_rows: int = MAX_ROWS) -> list[dict]:
    """Measure (or read) the kernel/torch choice for every float32 `Linear` shape of the model
    at 1..max_rows rows now, outside any timed loop. Returns one record per (shape, rows)."""
    if _load() is None or MODE != "auto":
        return []
    shapes = {
        tuple(m.weight.shape) for m in model.modules() if isinstance(m, Linear) and m.weight.dtype == torch.float32
    }
    records = []
    with torch.no_grad():
        for n, k in sorted(shapes):
            weight = next(
                m.weight for m in model.modules() if isinstance(m, Linear) and tuple(m.weight.shape) == (n, k)
            )
            for rows in range(1, min(max_rows, MAX_ROWS) + 1):
                _faster_is_kernel(rows, weight)
                records.append({"rows": rows, "shape": (n, k), **_choices[f"{rows}x{n}x{k}"]})
    return records


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N]."""
    rows = (
        _kernel_rows(x)
        if weight.dtype == torch.float32 and not (torch.is_grad_enabled() and weight.requires_grad)
        else 0
    )
    if rows and _faster_is_kernel(rows, weight):
        y = _kernel.skinny_linear(x.reshape(rows, x.shape[-1]).contiguous(), weight.contiguous())
        y = y.view(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def _kernel_rows(x: torch.Tensor) -> int:
    """How many rows x [..., K] has if the skinny kernels may take it, else 0."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    usable = 1 <= rows <= MAX_ROWS and x.dtype == torch.float32 and x.device.type == "cpu"
    return rows if usable and not (torch.is_grad_enabled() and x.requires_grad) and _load() is not None else 0


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ (qweight [N, K] int8 * scale [N, 1]).T (+ bias)."""
    rows = _kernel_rows(x) if x.shape[-1] % 8 == 0 else 0
    if rows:
        y = _kernel.skinny_int8_linear(x.reshape(rows, x.shape[-1]).contiguous(), qweight, scale).view(
            *x.shape[:-1], -1
        )
    else:
        y = F.linear(x, (qweight.float() * scale[:, None]).to(x.dtype))
    return y if bias is None else y + bias


def int4_linear(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group: int, dequantize, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ dequantize(packed [N, K/2], scale [N, K/group]).T (+ bias)."""
    rows = _kernel_rows(x)
    if rows:
        y = _kernel.skinny_int4_linear(x.reshape(rows, x.shape[-1]).contiguous(), packed, scale, group).view(
            *x.shape[:-1], -1
        )
    else:
        y = F.linear(x, dequantize(packed, scale, group).to(x.dtype))
    return y if bias is None else y + bias


class Linear(torch.nn.Linear):
    """nn.Linear (same parameters and state-dict names) whose forward is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
