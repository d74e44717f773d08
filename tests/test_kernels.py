"""The skinny CPU kernel: the same numbers as torch's linear for 1..16 rows (one or two groups
of <= 8), and a safe fallback; chosen over torch's linear only where it measured faster; its
build directory keyed by what the build depends on."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from verispec.models import kernels


@pytest.fixture(autouse=True)
def kernel_always(monkeypatch, request):
    """The numeric tests check the kernel itself: VERISPEC_KERNELS=1 (not the measured choice)."""
    if "auto_choice" not in request.node.name:
        monkeypatch.setattr(kernels, "MODE", "1")


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


def test_auto_choice_uses_the_faster_of_the_two_as_measured(monkeypatch):
    if kernels.kernel_status() != "skinny kernel loaded":
        pytest.skip(kernels.kernel_status())
    monkeypatch.setattr(kernels, "MODE", "auto")
    monkeypatch.setattr(kernels, "_use_kernel", {})
    x, w = torch.randn(3, 64), torch.randn(40, 64)
    monkeypatch.setitem(kernels._choices, "3x40x64", {"kernel_s": 2.0, "torch_s": 1.0, "kernel": False})
    with torch.no_grad():
        assert torch.equal(kernels.linear(x, w), F.linear(x, w))  # torch's, bit for bit
        monkeypatch.setitem(kernels._choices, "3x40x64", {"kernel_s": 1.0, "torch_s": 2.0, "kernel": True})
        kernels._use_kernel.clear()
        assert torch.equal(kernels.linear(x, w), kernels._kernel.skinny_linear(x, w))
        kernels._choices.pop("5x24x64", None)
        kernels.linear(torch.randn(5, 64), torch.randn(24, 64))  # first use: measured now, and kept
    choice = kernels.kernel_choices()["5x24x64"]
    assert (
        choice["kernel_s"] > 0
        and choice["torch_s"] > 0
        and choice["kernel"] == (choice["kernel_s"] <= choice["torch_s"])
    )
    kernels._choices.pop("5x24x64")


def test_the_build_directory_is_keyed_by_source_and_versions(monkeypatch):
    kernels.kernel_status()
    if kernels._build_dir is not None:  # the loaded kernel lives in the directory of its own key
        assert kernels._build_dir.name == f"verispec_skinny_linear-{kernels.build_key()}"
    source = b"int main() {}"
    key = kernels.build_key(source)
    assert key == kernels.build_key(source) and len(key) == 16
    assert kernels.build_key(source + b" ") != key
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert kernels.build_key(source) != key


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_start():
    """torch's loader waits without end for its `lock` file to go; a build killed midway leaves it.
    A new process must load the kernel anyway (without the fix it waits until the timeout)."""
    if kernels.kernel_status() != "skinny kernel loaded":
        pytest.skip(kernels.kernel_status())
    stale = kernels._build_dir / "lock"
    stale.touch()  # as a build killed midway leaves it
    try:
        done = subprocess.run(
            [sys.executable, "-c", "from verispec.models.kernels import kernel_status; print(kernel_status())"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a new process waited for the stale lock for 120 s")
    finally:
        stale.unlink(missing_ok=True)
    assert done.returncode == 0 and done.stdout.strip() == "skinny kernel loaded", done.stderr
