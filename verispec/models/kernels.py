"""CPU kernels for decoding: a "skinny" matrix product for 1..16 rows (csrc/skinny_linear.cpp).

Owns `linear(x, weight, bias)`, which the model's projections call. It sends float32
inference with at most 16 rows on an AVX2 CPU to the skinny kernel (every weight read once,
used by all rows, so verifying k+1 <= 8 positions costs about one decoding pass, and 9..16
rows, larger k or a batch, well under torch's small-M path), and
everything else (training, prefill, other dtypes and devices) to `torch.nn.functional.linear`.
The kernel is compiled on first use with torch's C++ extension loader (a C++ compiler and
ninja; about a minute, then cached). Where that fails, or VERISPEC_KERNELS=0, the fallback
is used and `kernel_status()` says why. Knows nothing of models.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F

MAX_ROWS = 16  # the kernel's own limit (csrc: MAX_ROWS)
_NAME = "verispec_skinny_linear"
_kernel = None
_status = "not loaded"


def _load():
    global _kernel, _status
    if _status != "not loaded":
        return _kernel
    if os.environ.get("VERISPEC_KERNELS", "1") == "0":
        _status = "disabled by VERISPEC_KERNELS=0"
    elif torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        _status = f"CPU capability {torch.backends.cpu.get_cpu_capability()} lacks AVX2"
    else:
        try:
            import sys

            from torch.utils.cpp_extension import _get_build_directory, load

            source = Path(__file__).resolve().parent.parent / "csrc" / "skinny_linear.cpp"
            if not list(Path(_get_build_directory(_NAME, verbose=False)).glob("*.so")):
                print("verispec: compiling the CPU kernel (once; about a minute)", file=sys.stderr, flush=True)
            _kernel = load(
                _NAME, [str(source)], extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
                extra_ldflags=["-fopenmp"], verbose=False,
            )
            _status = "skinny kernel loaded"
        except Exception as error:  # no compiler, no ninja, ...: fall back, but say so
            _status = f"skinny kernel unavailable ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
    return _kernel


def kernel_status() -> str:
    _load()
    return _status


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N]."""
    rows = _kernel_rows(x) if weight.dtype == torch.float32 and not (torch.is_grad_enabled() and weight.requires_grad) else 0
    if rows:
        y = _kernel.skinny_linear(x.reshape(rows, x.shape[-1]).contiguous(), weight.contiguous())
        y = y.view(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def _kernel_rows(x: torch.Tensor) -> int:
    """How many rows x [..., K] has if the skinny kernels may take it, else 0."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    usable = 1 <= rows <= MAX_ROWS and x.dtype == torch.float32 and x.device.type == "cpu"
    return rows if usable and not (torch.is_grad_enabled() and x.requires_grad) and _load() is not None else 0


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (qweight [N, K] int8 * scale [N, 1]).T (+ bias)."""
    rows = _kernel_rows(x) if x.shape[-1] % 8 == 0 else 0
    if rows:
        y = _kernel.skinny_int8_linear(x.reshape(rows, x.shape[-1]).contiguous(), qweight, scale).view(*x.shape[:-1], -1)
    else:
        y = F.linear(x, (qweight.float() * scale[:, None]).to(x.dtype))
    return y if bias is None else y + bias


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group: int, dequantize, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(packed [N, K/2], scale [N, K/group]).T (+ bias)."""
    rows = _kernel_rows(x)
    if rows:
        y = _kernel.skinny_int4_linear(x.reshape(rows, x.shape[-1]).contiguous(), packed, scale, group).view(*x.shape[:-1], -1)
    else:
        y = F.linear(x, dequantize(packed, scale, group).to(x.dtype))
    return y if bias is None else y + bias


class Linear(torch.nn.Linear):
    """nn.Linear (same parameters and state-dict names) whose forward is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
