"""FP8 kernels: the torch path's contract (saturation, rounding, amax recording, layouts), the
Triton kernels compiled for sm_90 ahead of time (this machine has no GPU: they are not executed
here), and, on a GPU with FP8, Triton against torch bit for bit.
"""

from __future__ import annotations

import re

import pytest
import torch

from lightning_ampzero.fp8 import kernels
from lightning_ampzero.fp8.kernels import _torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_cast_saturates_and_rounds_to_nearest_even():
    one = torch.tensor(1.0)
    q = kernels.cast(torch.tensor([500.0, -1e9, float("inf"), 1.0625, 1.1875, 0.0]), one, E4M3, backend="torch")
    # 1.0625 is halfway between 1.0 and 1.125 (E4M3 spacing 1/8 at 1): ties to even -> 1.0;
    # 1.1875 is halfway between 1.125 and 1.25 -> 1.25.
    assert q.float().tolist() == [448.0, -448.0, 448.0, 1.0, 1.25, 0.0]
    q = kernels.cast(torch.tensor([60000.0, -1e9]), one, E5M2, backend="torch")
    assert q.float().tolist() == [57344.0, -57344.0]  # never inf (a plain .to(e5m2) gives inf)
    assert torch.tensor([61440.0]).to(E5M2).float().isinf().all()


def test_cast_records_amax_and_transposes():
    x = torch.randn(33, 70, dtype=torch.bfloat16)
    slot = torch.tensor([0.5])
    scale = torch.tensor(3.0)
    q, qt = kernels.cast_transpose(x, scale, E5M2, slot, backend="torch")
    assert slot.item() == x.abs().max().float().item()
    assert qt.is_contiguous() and qt.shape == (70, 33)
    assert torch.equal(qt.t().view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(q.view(torch.uint8), (x.float() * 3.0).to(E5M2).view(torch.uint8))
    slot2 = torch.tensor([1e6])
    kernels.cast(x, scale, E5M2, slot2, backend="torch")
    assert slot2.item() == 1e6  # a running max: never lowered


@pytest.mark.parametrize("dim", [-1, 0])
def test_rowwise_scales_map_each_slice_amax_to_448(dim):
    x = torch.randn(20, 48) * torch.logspace(-3, 2, 48)
    q, s = kernels.cast_rowwise(x, E4M3, dim=dim, backend="torch")
    assert s.shape == ((20, 1) if dim == -1 else (1, 48))
    assert torch.allclose(q.float().abs().amax(dim=dim, keepdim=True), torch.full_like(s, 448.0))
    assert torch.allclose(q.float() / s, x, rtol=2**-4, atol=2**-10 / s.min().item())


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_triton_kernels_compile_for_sm90():
    """Every Triton kernel lowers to a cubin for H100 with RNE-saturating FP8 conversions (no GPU needed)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from lightning_ampzero.fp8.kernels import _triton

    converts: set[str] = set()
    for kernel, signature, constexprs in _triton.KERNEL_SIGNATURES:
        compiled = triton.compile(triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        assert compiled.asm.get("cubin"), kernel.__name__
        converts |= set(re.findall(r"cvt\.[\w.]*e[45]m[23]x2\.f32", compiled.asm["ptx"]))
    assert converts == {"cvt.rn.satfinite.e4m3x2.f32", "cvt.rn.satfinite.e5m2x2.f32"}, converts


def _cuda_fp8() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not _cuda_fp8(), reason="needs a CUDA GPU with compute capability 8.9+")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_matches_torch_bit_for_bit(dtype):
    torch.manual_seed(0)
    x = (torch.randn(1000, 770, device="cuda") * torch.logspace(-6, 3, 770, device="cuda")).to(dtype)
    assert kernels.kernel_backend(x) is not _torch
    assert torch.equal(kernels.amax(x, backend="triton"), kernels.amax(x, backend="torch"))
    for fmt in (E4M3, E5M2):
        scale = torch.tensor(0.37, device="cuda")
        a1, a2 = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
        q1, t1 = kernels.cast_transpose(x, scale, fmt, a1, backend="triton")
        q2, t2 = kernels.cast_transpose(x, scale, fmt, a2, backend="torch")
        assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))
        assert torch.equal(t1.view(torch.uint8), t2.view(torch.uint8))
        assert torch.equal(a1, a2)
        c1 = kernels.cast(x, scale, fmt, backend="triton")
        assert torch.equal(c1.view(torch.uint8), q2.view(torch.uint8))
        for dim in (-1, 0):
            r1, s1 = kernels.cast_rowwise(x, fmt, dim, backend="triton")
            r2, s2 = kernels.cast_rowwise(x, fmt, dim, backend="torch")
            assert torch.equal(s1, s2) and torch.equal(r1.view(torch.uint8), r2.view(torch.uint8))
