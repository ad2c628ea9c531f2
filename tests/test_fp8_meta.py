"""Every ``torch._scaled_mm`` call of Fp8Linear held to CUDA's rules on a CPU-only machine.

[Note: CUDA GEMM rules on meta]
On CPU tensors ``torch._scaled_mm`` accepts any layout, so CPU tests alone never see what an
H100 would refuse. Its meta kernel (``torch/_meta_registrations.py``, the one torch.compile's
fake tensors run on CUDA) applies CUDA's checks: ``a`` row-major, ``b`` column-major, K and N
multiples of 16, fp32 scales of shape () or [M, 1] / [1, N]. The check below runs Fp8Linear's
forward and backward on CPU and, for each call Fp8Linear makes to ``kernels.scaled_mm``, replays
the same call on meta tensors with the operands' exact shapes, strides and dtypes (the cast
outputs as the torch path produced them, which is what CUDA runs without Triton; the Triton
casts write row-major outputs, checked on a GPU by tests/test_gpu_fp8.py), through
``kernels.scaled_mm`` itself with operands that report ``is_cuda`` (so a CUDA-only branch of it
would be taken), so the arguments reaching ``torch._scaled_mm`` are those CUDA would receive.

The meta kernel is stricter than eager cuBLAS in one corner: a one-row ``a`` with strides
(1, 1) is refused on meta and accepted by cuBLAS (``prepare_matrix_for_cublas``). We keep the
stricter rule: it is what a compiled model meets on CUDA.

Rules of the CUDA kernel that the meta kernel does not apply are added (``_cuda_only_rules``,
from ATen's ``ScaledBlas.cpp`` and ``RowwiseScaledMM.cu``, torch 2.13).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from lightning_ampzero.config import Fp8Config
from lightning_ampzero.fp8 import Fp8Linear, convert_to_fp8, kernels
from lightning_ampzero.fp8.fsdp import Fp8GatheredWeight
from lightning_ampzero.fp8.kernels import _torch as torch_path

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_ORIGINAL_SCALED_MM = torch._scaled_mm
_ORIGINAL_SUPPORTED = kernels.fp8_gemm_supported


class _SeenAsCuda(torch.Tensor):
    """A meta tensor that says it is on CUDA, so ``kernels.scaled_mm`` takes its CUDA branch."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor) if isinstance(t, _SeenAsCuda) else t


def _cuda_only_rules(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                     out_dtype: torch.dtype) -> None:
    # _scaled_mm_out_cuda: cuBLASLt has no E5M2 x E5M2 kernel.
    if a.dtype == E5M2 and b.dtype == E5M2:
        raise RuntimeError("Multiplication of two Float8_e5m2 matrices is not supported (cuBLASLt)")
    if sa.numel() == 1 and sb.numel() == 1:
        return
    # Row-wise scaling: on sm_89, and on sm_90 with cuBLAS < 12.9, the CUTLASS kernel runs it
    # (f8f8bf16_rowwise: bf16/fp16 output, mat2 E4M3, scales with unit inner stride).
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise RuntimeError(f"row-wise scaling writes bf16 or fp16 only, got out_dtype={out_dtype}")
    if b.dtype != E4M3:
        raise RuntimeError(f"row-wise scaling needs mat2 in float8_e4m3fn, got {b.dtype}")
    if not (sa.stride(1) == 1 or sa.size(1) == 1) or sb.stride(1) != 1:
        raise RuntimeError(f"row-wise scales need unit inner strides, got {sa.stride()} and {sb.stride()}")


def _scaled_mm_as_cuda(a, b, scale_a, scale_b, *args, out_dtype=None, **kwargs):
    if a.device.type != "meta":
        return _ORIGINAL_SCALED_MM(a, b, scale_a, scale_b, *args, out_dtype=out_dtype, **kwargs)
    a, b, scale_a, scale_b = (_plain(t) for t in (a, b, scale_a, scale_b))
    _cuda_only_rules(a, b, scale_a, scale_b, out_dtype or a.dtype)
    return _ORIGINAL_SCALED_MM(a, b, scale_a, scale_b, *args, out_dtype=out_dtype, **kwargs)


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta").as_subclass(_SeenAsCuda)


class CudaGemmCheck:
    """Replays every ``kernels.scaled_mm`` call as CUDA would run it (installed for one test by ``monkeypatch``).

    ``calls`` records (a shape, a stride, b shape, b stride, out dtype) of each call; a call that
    CUDA would refuse raises where Fp8Linear made it.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple] = []
        self._real = kernels.scaled_mm
        self._depth = 0  # kernels.scaled_mm may call itself (by its module-level name): one GEMM, one check
        monkeypatch.setattr(torch, "_scaled_mm", _scaled_mm_as_cuda)
        monkeypatch.setattr(kernels, "fp8_gemm_supported",
                            lambda device: device.type == "meta" or _ORIGINAL_SUPPORTED(device))
        monkeypatch.setattr(kernels, "scaled_mm", self._checked)

    def _checked(self, a, b, a_inv_scale, b_inv_scale, out_dtype, *, emulate=False):
        if self._depth or a.device.type == "meta":
            return self._real(a, b, a_inv_scale, b_inv_scale, out_dtype, emulate=emulate)
        self._depth += 1
        try:
            return self._check_and_run(a, b, a_inv_scale, b_inv_scale, out_dtype, emulate)
        finally:
            self._depth -= 1

    def _check_and_run(self, a, b, a_inv_scale, b_inv_scale, out_dtype, emulate):
        # Every tensor of the call on the operands' device (cuBLAS checks checkAllSameGPU).
        assert {t.device for t in (a, b, a_inv_scale, b_inv_scale)} == {a.device}
        self.calls.append((tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), out_dtype))
        try:
            # emulate=False: the layouts matter on every GPU that runs the FP8 GEMM.
            replay = self._real(*(_on_meta(t) for t in (a, b, a_inv_scale, b_inv_scale)), out_dtype)
        except RuntimeError as err:
            raise AssertionError(
                f"CUDA would refuse this _scaled_mm: a {tuple(a.shape)} stride {a.stride()} {a.dtype}, b"
                f" {tuple(b.shape)} stride {b.stride()} {b.dtype}, scales {tuple(a_inv_scale.shape)}"
                f" {tuple(b_inv_scale.shape)}, out {out_dtype}: {err}"
            ) from None
        real = self._real(a, b, a_inv_scale, b_inv_scale, out_dtype, emulate=emulate)
        assert replay.shape == real.shape and replay.dtype == real.dtype, (replay.shape, real.shape, replay.dtype)
        return real


# ---- the inputs: layouts a linear layer meets ------------------------------------------------
def _input(layout: str, m: int, k: int, dtype: torch.dtype, g: torch.Generator, device: str = "cpu") -> torch.Tensor:
    """``m`` rows of ``k`` features in one of LAYOUTS (values drawn from ``g`` on the CPU, views made on ``device``)."""
    def base(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    if layout == "2d":
        return base(m, k)
    if layout == "2d-transposed":  # a column-major view: reshape(-1, k) keeps it
        return base(k, m).t()
    if layout == "2d-sliced":  # rows with a gap between them
        return base(m, k + 8)[:, :k]
    if layout == "3d":
        return base(1, m, k)
    if layout == "3d-transposed":  # reshape(-1, k) is again a column-major view
        return base(1, k, m).transpose(1, 2)
    if layout == "3d-permuted":  # reshape(-1, k) copies
        return base(m, 1, k).transpose(0, 1)
    raise ValueError(layout)


LAYOUTS = ("2d", "2d-transposed", "2d-sliced", "3d", "3d-transposed", "3d-permuted")
SHAPES = ((32, 48), (24, 40), (48, 20))  # (in_features, out_features); two need padding
ROWS = (1, 5, 16, 33)
DTYPES = (torch.float32, torch.bfloat16)
RECIPES = [("tensorwise", "hybrid"), ("tensorwise", "e4m3"), ("delayed", "hybrid"), ("delayed", "e4m3"),
           ("rowwise", "e4m3")]


def _layer(recipe: str, fmt: str, k: int, n: int, *, transposed_weight: bool = False) -> nn.Module:
    cfg = Fp8Config(recipe=recipe, format=fmt, min_features=0, pad_dims=True)
    # Through convert_to_fp8, so the delayed recipe gets its scaling state (scales from history).
    layer = convert_to_fp8(nn.Sequential(nn.Linear(k, n)), cfg)[0]
    assert isinstance(layer, Fp8Linear)
    if transposed_weight:  # a weight stored [K, N] and used transposed (e.g. loaded from a Conv1D-style tensor)
        layer.weight = nn.Parameter(layer.weight.detach().t().contiguous().t())
    return layer


def _step(layer: nn.Module, x: torch.Tensor, g: torch.Generator, *, x_grad: bool = True) -> None:
    x = x.detach().requires_grad_(x_grad)
    y = layer(x)
    # The upstream gradient in a layout of its own (transposed), as a loss on y.t() would give.
    grad = torch.randn(*reversed(y.shape), generator=g).to(y.dtype)
    y.backward(grad.transpose(0, -1) if y.dim() == 2 else grad.permute(*range(y.dim() - 1, -1, -1)))


@pytest.mark.parametrize("recipe,fmt", RECIPES, ids=[f"{r}-{f}" for r, f in RECIPES])
def test_every_scaled_mm_call_meets_cuda_rules(monkeypatch, recipe, fmt):
    check = CudaGemmCheck(monkeypatch)
    g = torch.Generator().manual_seed(0)
    refused: list[str] = []
    configs = 0
    steps = 2 if recipe == "delayed" else 1  # the second step casts with scales from history
    for (k, n), m, layout, dtype in itertools.product(SHAPES, ROWS, LAYOUTS, DTYPES):
        layer = _layer(recipe, fmt, k, n)
        for step in range(steps):
            if step:  # the delayed recipe's second step casts with scales from its history
                assert all(layer._fp8_ready)
            before = len(check.calls)
            try:
                _step(layer, _input(layout, m, k, dtype, g), g)
            except AssertionError as err:
                refused.append(f"k={k} n={n} m={m} {layout} {dtype}: {err}")
                break
            # forward, grad_x, grad_w: three GEMMs, each one replayed
            assert len(check.calls) - before == 3
        configs += 1
    assert configs == len(SHAPES) * len(ROWS) * len(LAYOUTS) * len(DTYPES)
    summary = f"{len(refused)} of {configs} configurations make a call CUDA refuses:\n"
    assert not refused, summary + "\n".join(refused[:8])


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
def test_weight_layouts_and_partial_gradients(monkeypatch, recipe):
    """A transposed weight; a frozen input (only grad_w); a frozen weight (only grad_x)."""
    check = CudaGemmCheck(monkeypatch)
    g = torch.Generator().manual_seed(1)
    fmt = "e4m3" if recipe == "rowwise" else "hybrid"
    layer = _layer(recipe, fmt, 32, 48, transposed_weight=True)  # aligned: no padding copy hides the layout
    assert not layer.weight.is_contiguous()
    _step(layer, _input("2d", 5, 32, torch.bfloat16, g), g)
    assert len(check.calls) == 3
    _step(layer, _input("3d", 5, 32, torch.float32, g), g, x_grad=False)
    assert len(check.calls) == 5
    layer.weight.requires_grad_(False)
    _step(layer, _input("2d", 5, 32, torch.float32, g), g)
    assert len(check.calls) == 7
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 input, bf16 GEMM outputs
        _step(layer, _input("2d-transposed", 5, 32, torch.float32, g), g)
    assert len(check.calls) == 9


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_gathered_weight_gemms(monkeypatch, recipe):
    """msamp O1/O2: the weight arrives from FSDP2's all-gather already in FP8 (Fp8GatheredWeight)."""
    check = CudaGemmCheck(monkeypatch)
    g = torch.Generator().manual_seed(2)
    layer = _layer(recipe, "hybrid", 32, 48)
    w = layer.weight.detach()
    scale = torch_path.FP8_MAX[E4M3] / kernels.amax(w).reshape(1)
    # What fsdp_post_all_gather builds from the gathered uint8 buffer: [N, K] rows, as FSDP2 lays them out.
    data = kernels.cast(w, scale, E4M3).view(torch.uint8).view(E4M3)
    layer.weight = nn.Parameter(Fp8GatheredWeight(data, scale, torch.float32))
    for _ in range(2):
        _step(layer, _input("2d-transposed", 16, 32, torch.bfloat16, g), g)
    assert len(check.calls) == 6


def _refusal(check_fn) -> str:
    try:
        check_fn()
    except (AssertionError, RuntimeError) as err:
        return str(err)
    return ""


def test_the_check_refuses_what_cuda_refuses(monkeypatch):
    """The replay is not vacuous: each rule fires on a call that breaks it."""
    check = CudaGemmCheck(monkeypatch)
    a = torch.zeros(32, 64).to(E4M3)
    b_col = torch.zeros(48, 64).to(E4M3).t()
    one = torch.ones(())
    assert _refusal(lambda: kernels.scaled_mm(a, b_col, one, one, torch.bfloat16)) == ""
    cases = {
        "row-major b": lambda: kernels.scaled_mm(a, b_col.contiguous(), one, one, torch.bfloat16),
        "column-major a": lambda: kernels.scaled_mm(a.t().contiguous().t(), b_col, one, one, torch.bfloat16),
        "K=24": lambda: kernels.scaled_mm(a[:, :24].contiguous(), b_col[:24], one, one, torch.bfloat16),
        "N=40": lambda: kernels.scaled_mm(a, b_col[:, :40].contiguous().t().contiguous().t(), one, one, torch.bfloat16),
        "e5m2 x e5m2": lambda: kernels.scaled_mm(a.to(E5M2), b_col.float().to(E5M2).t().contiguous().t(), one, one,
                                                 torch.bfloat16),
        "row scale shape": lambda: kernels.scaled_mm(a, b_col, torch.ones(31, 1), torch.ones(1, 48), torch.bfloat16),
    }
    for name, call in cases.items():
        assert "CUDA would refuse" in _refusal(call), name
    assert len(check.calls) == 1 + len(cases)
    # Rules kernels.scaled_mm never breaks by construction, checked on the op directly.
    am, bm = (_on_meta(t) for t in (a, b_col))
    sa, sb = torch.ones(32, 1, device="meta"), torch.ones(1, 48, device="meta")
    direct = {
        "bf16 scales": (am, bm, one.bfloat16().to("meta"), one.bfloat16().to("meta"), torch.bfloat16),
        "row-wise fp32 out": (am, bm, sa, sb, torch.float32),
        "row-wise e5m2 b": (am, _on_meta(b_col.float().to(E5M2).t().contiguous().t()), sa, sb, torch.bfloat16),
        "row-wise strided scale": (am, bm, sa, torch.ones(48, 2, device="meta")[:, :1].t(), torch.bfloat16),
    }
    assert _refusal(lambda: torch._scaled_mm(am, bm, sa, sb, out_dtype=torch.bfloat16)) == ""
    for name, (x, y, s1, s2, out) in direct.items():
        assert _refusal(lambda: torch._scaled_mm(x, y, s1, s2, out_dtype=out)), name


def test_the_check_catches_a_cast_that_keeps_the_input_strides(monkeypatch):
    """Issue 14, item 4: a torch-path cast that keeps a transposed input's strides hands CUDA a column-major ``a``.

    The cast below is the torch path as it was before that fix (``(x * s).clamp().to(fp8)``
    preserves x's memory layout); the check must refuse the forward GEMM it feeds.
    """

    def stride_keeping_cast(x, scale, fp8_dtype, amax_out=None):
        fmax = torch_path.FP8_MAX[fp8_dtype]
        q = (x.float() * scale.float()).clamp_(-fmax, fmax).to(fp8_dtype)
        if amax_out is not None:
            torch.maximum(amax_out, torch_path.amax(x).reshape(amax_out.shape), out=amax_out)
        return q

    def stride_keeping_cast_rowwise(x, fp8_dtype, dim=-1):
        scale = torch_path.FP8_MAX[fp8_dtype] / x.abs().amax(dim=dim, keepdim=True).float().clamp(min=torch_path.EPS)
        return stride_keeping_cast(x, scale, fp8_dtype), scale

    monkeypatch.setattr(torch_path, "cast", stride_keeping_cast)
    monkeypatch.setattr(torch_path, "cast_rowwise", stride_keeping_cast_rowwise)
    CudaGemmCheck(monkeypatch)
    g = torch.Generator().manual_seed(3)
    for recipe, fmt in RECIPES:
        layer = _layer(recipe, fmt, 32, 48)
        _step(layer, _input("2d", 16, 32, torch.float32, g), g)  # row-major input: accepted
        message = _refusal(lambda: _step(layer, _input("2d-transposed", 16, 32, torch.float32, g), g))
        assert "self must be row_major" in message, (recipe, message)
