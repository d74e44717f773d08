"""The skinny CPU kernel: the same numbers as torch's linear for 1..16 rows (one or two groups
of <= 8), and a safe fallback."""

import pytest
import torch
import torch.nn.functional as F

from verispec.models import kernels


def test_kernel_loads_on_this_machine():
    """On an AVX2 CPU with a compiler the kernel must load; a silent fallback would hide a slowdown."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no AVX2")
    assert kernels.kernel_status() == "skinny kernel loaded"
    assert kernels._kernel.MAX_ROWS == kernels.MAX_ROWS


@pytest.mark.parametrize("rows", range(1, 17))
@pytest.mark.parametrize("k_dim, n_dim", [(64, 96), (67, 5), (768, 2048), (7, 3)])
def test_skinny_matches_linear(rows, k_dim, n_dim):
    generator = torch.Generator().manual_seed(rows * 1000 + k_dim)
    x = torch.randn(rows, k_dim, generator=generator)
    w = torch.randn(n_dim, k_dim, generator=generator)
    b = torch.randn(n_dim, generator=generator)
    with torch.no_grad():
        got = kernels.linear(x, w, b)
    assert got.shape == (rows, n_dim)
    assert torch.allclose(got, F.linear(x, w, b), atol=1e-4 * k_dim**0.5, rtol=1e-5)


def test_batched_shapes_and_fallbacks():
    x = torch.randn(2, 5, 16)  # 10 rows through the kernel, reshaped back
    w = torch.randn(10, 16)
    with torch.no_grad():
        assert torch.allclose(kernels.linear(x, w), F.linear(x, w), atol=1e-5)
        big = torch.randn(3, 6, 16)  # 18 rows: torch's linear
        assert torch.equal(kernels.linear(big, w), F.linear(big, w))
        bf16 = x.bfloat16()
        assert torch.equal(kernels.linear(bf16, w.bfloat16()), F.linear(bf16, w.bfloat16()))
    w.requires_grad_(True)  # training: autograd must flow, so torch's linear
    kernels.linear(x, w).sum().backward()
    assert w.grad is not None and w.grad.shape == w.shape
