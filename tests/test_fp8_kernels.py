"""FP8 kernels: the torch path's contract (saturation, rounding, NaN, amax recording, layouts,
row-wise scales and GEMM output), the Triton kernels compiled for sm_90 ahead of time, and, on a
GPU with FP8, Triton against torch bit for bit. Without a GPU the Triton kernels are executed by
Triton's interpreter in tests/test_fp8_interpreter.py.
"""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from _scripts import SCRIPTS
from lightning_ampzero.fp8 import kernels
from lightning_ampzero.fp8.kernels import _torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _load_shared():
    # tests/scripts is not on sys.path in pytest (its module names would shadow others): load the one file.
    spec = importlib.util.spec_from_file_location("fp8_interpreter_shared", SCRIPTS / "fp8_interpreter_shared.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


shared = _load_shared()


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


def test_rowwise_scale_is_correctly_rounded():
    """``448 / amax`` rounded once, as the Triton kernel's div_rn (not reciprocal-then-multiply)."""
    a = torch.cat([torch.tensor([1.3203048706054688]), torch.rand(2000, generator=torch.Generator().manual_seed(0))
                   * torch.logspace(-4, 4, 2000)])
    x = a.reshape(-1, 1) * torch.tensor([[1.0, -0.5]])  # each row's amax is a
    for fmt, fmax in ((E4M3, 448.0), (E5M2, 57344.0)):
        _, scale = kernels.cast_rowwise(x, fmt, backend="torch")
        # fp64 division rounded to fp32 is the correctly rounded fp32 quotient (53 >= 2 * 24 + 2).
        assert torch.equal(scale.flatten(), (fmax / a.double()).float())
    _, scale = kernels.cast_rowwise(x[:1], E4M3, backend="torch")
    assert scale.item() == 339.3155822753906  # reciprocal() * 448 gives 339.3155517578125


@pytest.mark.parametrize("fn", ["cast", "cast_transpose", "cast_rowwise_rows", "cast_rowwise_cols"])
def test_torch_path_outputs_are_row_major_for_transposed_inputs(fn):
    """A transposed 2-D input casts to row-major FP8, the layout ``_scaled_mm`` takes as its first operand."""
    base = torch.randn(48, 32, dtype=torch.bfloat16)
    scale = torch.tensor(5.0)
    results = {}
    for name, x in (("view", base.t()), ("copy", base.t().contiguous())):
        if fn == "cast":
            results[name] = [kernels.cast(x, scale, E4M3, backend="torch")]
        elif fn == "cast_transpose":
            results[name] = list(kernels.cast_transpose(x, scale, E4M3, backend="torch"))
        else:
            results[name] = list(kernels.cast_rowwise(x, E4M3, dim=-1 if fn.endswith("rows") else 0, backend="torch"))
    for got, want in zip(results["view"], results["copy"]):
        assert got.is_contiguous(), got.stride()
        assert shared.differences(got, want) == ""


def test_cast_of_transposed_input_passes_scaled_mm_layout_checks_on_meta():
    """On meta tensors ``_scaled_mm`` applies CUDA's layout rules: a column-major ``a`` is refused."""
    x = torch.empty(32, 48, dtype=torch.bfloat16, device="meta").t()  # [48, 32], column-major
    scale = torch.empty((), device="meta")
    b = torch.empty(16, 32, dtype=E4M3, device="meta").t()  # [32, 16], column-major as required
    q = kernels.cast(x, scale, E4M3, backend="torch")
    out = torch._scaled_mm(q, b, scale, scale, out_dtype=torch.bfloat16)
    assert out.shape == (48, 16)
    with pytest.raises(RuntimeError, match="row_major"):  # the check is real: the view itself is refused
        torch._scaled_mm(x.to(E4M3), b, scale, scale, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("emulate", [False, True])
def test_rowwise_gemm_rounds_through_bf16_on_every_path(emulate):
    """CUDA's row-wise FP8 GEMM writes bf16 only: CPU and the emulation round the same way."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g)
    xq, xs = kernels.cast_rowwise(x, E4M3, backend="torch")
    wq, ws = kernels.cast_rowwise(w, E4M3, backend="torch")
    args = (xq, wq.t(), xs.reciprocal(), ws.reciprocal().t())
    out = kernels.scaled_mm(*args, torch.float32, emulate=emulate)
    assert out.dtype == torch.float32
    assert torch.equal(out, out.bfloat16().float())  # every element is a bf16 value
    torch.testing.assert_close(out, kernels.scaled_mm(*args, torch.bfloat16, emulate=emulate).float(),
                               rtol=2**-8, atol=0)
    # Tensor-wise scaling keeps the fp32 output (CUDA writes fp32 there): the check above can fail.
    xt = kernels.cast(x, torch.tensor(50.0), E4M3, backend="torch")
    wt = kernels.cast(w, torch.tensor(50.0), E4M3, backend="torch")
    tensorwise = kernels.scaled_mm(xt, wt.t(), torch.tensor(0.02), torch.tensor(0.02), torch.float32, emulate=emulate)
    assert not torch.equal(tensorwise, tensorwise.bfloat16().float())


def test_nan_propagates_through_torch_casts():
    """A NaN makes the amax NaN and casts to NaN; row-wise it takes its row's scale (448 / NaN) and row."""
    x = torch.randn(6, 40)
    x[2, 7] = float("nan")
    assert kernels.amax(x, backend="torch").isnan()
    slot = torch.tensor([3.0])
    for fmt in (E4M3, E5M2):
        q = kernels.cast(x, torch.tensor(2.0), fmt, slot, backend="torch").float()
        assert q.isnan().nonzero().tolist() == [[2, 7]]
        q, s = kernels.cast_rowwise(x, fmt, backend="torch")
        assert s.isnan().flatten().tolist() == [i == 2 for i in range(6)]
        assert q.float().isnan().all(dim=1).tolist() == [i == 2 for i in range(6)]
        assert q.float()[[0, 1, 3, 4, 5]].isfinite().all()
    assert slot.isnan().all()  # recorded for the delayed recipe's history


@pytest.mark.parametrize("recipe,where", shared.CASES)
def test_nan_reaches_loss_scaler_on_torch_path(recipe, where):
    """A NaN in an Fp8Linear's input or output gradient makes the loss scaler skip the step (torch kernels).

    The same check with the Triton kernels runs under the interpreter: tests/test_fp8_interpreter.py.
    """
    result = shared.nan_reaches_scaler(recipe, where)
    assert result["found_inf"] and result["skipped"] == 1 and result["weight_unchanged"], result
    assert result["forward_finite"] == (where == "grad"), result


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_triton_kernels_compile_for_sm90():
    """Every Triton kernel lowers to a cubin for H100 with RNE-saturating FP8 conversions (no GPU needed).

    And every float min/max in them propagates NaN (``max.NaN``, ``min.NaN``): see
    [Note: FP8 NaN propagation] in ``_triton.py``.
    """
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from lightning_ampzero.fp8.kernels import _triton

    converts: set[str] = set()
    for kernel, signature, constexprs in _triton.KERNEL_SIGNATURES:
        compiled = triton.compile(triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        assert compiled.asm.get("cubin"), kernel.__name__
        ptx = compiled.asm["ptx"]
        converts |= set(re.findall(r"cvt\.[\w.]*e[45]m[23]x2\.f32", ptx))
        float_min_max = re.findall(r"\b(?:min|max)\.[\w.]*(?:f32|f16|bf16(?:x2)?)\b", ptx)
        dropping_nan = [op for op in float_min_max if ".NaN" not in op]
        assert not dropping_nan, f"{kernel.__name__}: {sorted(set(dropping_nan))} drop NaN"
        if kernel.__name__ != "_amax_kernel":  # the clamp is a float min/max
            assert float_min_max, kernel.__name__
    assert converts == {"cvt.rn.satfinite.e4m3x2.f32", "cvt.rn.satfinite.e5m2x2.f32"}, converts


def _cuda_fp8() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_fp8(), reason="needs a CUDA GPU with compute capability 8.9+")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("special", ["finite", "nan", "inf", "transposed"])
def test_triton_matches_torch_bit_for_bit(dtype, special):
    """The interpreter comparison of tests/test_fp8_interpreter.py on the GPU itself, at a larger size.

    Same NaN positions, same bits elsewhere (a NaN's own bits may differ: cvt writes a canonical NaN).
    """
    torch.manual_seed(0)
    x = torch.randn(1000, 770, device="cuda") * torch.logspace(-6, 3, 770, device="cuda")
    if special == "nan":
        x[17, 300] = float("nan")
    elif special == "inf":
        x[5, 6], x[900, 1] = float("inf"), float("-inf")
    x = x.to(dtype)
    if special == "transposed":
        x = x.t()
    assert kernels.kernel_backend(x) is not _torch
    same = shared.differences
    assert same(kernels.amax(x, backend="triton"), kernels.amax(x, backend="torch")) == ""
    for fmt in (E4M3, E5M2):
        scale = torch.tensor(0.37, device="cuda")
        a1, a2 = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
        q1, t1 = kernels.cast_transpose(x, scale, fmt, a1, backend="triton")
        q2, t2 = kernels.cast_transpose(x, scale, fmt, a2, backend="torch")
        assert same(q1, q2) == "" and same(t1, t2) == "" and same(a1, a2) == ""
        assert same(kernels.cast(x, scale, fmt, backend="triton"), q2) == ""
        for dim in (-1, 0):
            r1, s1 = kernels.cast_rowwise(x, fmt, dim, backend="triton")
            r2, s2 = kernels.cast_rowwise(x, fmt, dim, backend="torch")
            assert same(s1, s2) == "" and same(r1, r2) == "", (fmt, dim)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_fp8(), reason="needs a CUDA GPU with compute capability 8.9+")
@pytest.mark.parametrize("recipe,where", shared.CASES)
def test_nan_reaches_loss_scaler_on_gpu(recipe, where):
    """The NaN test above with the layer on the GPU: Triton casts and CUDA's _scaled_mm."""
    torch.set_default_device("cuda")
    try:
        result = shared.nan_reaches_scaler(recipe, where)
    finally:
        torch.set_default_device(None)
    assert result["found_inf"] and result["skipped"] == 1 and result["weight_unchanged"], result
