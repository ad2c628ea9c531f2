"""Triton kernels for the memory-bound parts of FP8 training on CUDA (compute capability 8.9+).

Triton has no CPU backend. Without a GPU they are checked two ways: ``tests/test_fp8_kernels.py``
compiles every kernel for sm_90 ahead of time (and reads the FP8 conversions in the PTX), and
``tests/test_fp8_interpreter.py`` runs every kernel under Triton's interpreter against the torch
path bit for bit, with the interpreter's own fp32 -> fp8 conversion (wrong: no ties-to-even,
subnormals flushed) replaced by torch's (see the docstring of
``tests/scripts/fp8_interpreter.py``). On a GPU, the same file's GPU test compares them again.

Each kernel reads the high-precision tensor once: the amax and the cast are fused
(``_cast_kernel`` with ``WITH_AMAX``: the delayed recipe's cast-and-record), and row-wise scaling
computes each row's amax and casts it in one program.

[Note: the transposed FP8 copy] ``cast_transpose`` casts with ``_cast_kernel`` and lets torch
write the transposed copy (one more pass over the 1-byte result, a small part of the GEMM that
reads it). A fused kernel that stored ``tl.trans`` of each 64x64 cast tile through ``tl.trans``
of its mask matched the torch path bit for bit in Triton's interpreter and on a 1000x770 input on
an H100, and left elements of the transposed output unwritten for inputs of 1, 5, 16 or 33 rows
by 48 columns (a small batch's gradient; an H100 with Triton 3.6, tests/test_gpu_fp8.py): the
weight gradient read uninitialised memory (inf, NaN). The cause inside Triton was not found;
the GPU test checks those row counts.

[Note: FP8 cast numerics] ``x * scale`` is an fp32 multiply (no add follows it, so no FMA
contraction can change its rounding), clamped to the format's max, then converted with
``cvt.rn.satfinite`` (round to nearest even, saturating): exactly the torch path's
``(x.float() * scale).clamp(-max, max).to(fp8)``. Per-tensor scales are computed by torch on
both paths. Row-wise scales are ``fp8_max / amax`` correctly rounded on both paths: ``div_rn``
here (Triton's fp32 ``/`` is approximate), a tensor-by-tensor ``div`` in the torch path (not
``float / tensor``, which torch computes as ``reciprocal() * fp8_max``, rounded twice).

[Note: FP8 NaN propagation] A NaN must survive every kernel as it does in torch, so that it
reaches the gradients and the loss scaler's overflow check instead of being quantized into a
finite value. Triton's defaults drop NaN (``tl.max``, ``tl.maximum`` and ``tl.clamp`` use
maxnum/minnum semantics: a NaN used to give a finite amax and cast to -448 / -57344). So:
amaxes are integer maxima of the magnitude bits (``bits & 0x7FFFFFFF``): for non-negative IEEE
values integer order is numeric order, and every NaN's magnitude bits exceed +inf's, so the
amax is NaN exactly when torch's is (one integer reduction; a custom NaN-aware combine
function would be as cheap on a GPU but runs element by element in Triton's interpreter). The
resulting positive NaN also wins ``tl.atomic_max``, which compares non-negative floats as
integers. The clamps use ``PropagateNan.ALL`` (``max.NaN`` / ``min.NaN`` in the PTX, checked by
``test_triton_kernels_compile_for_sm90``), so a NaN casts to the format's NaN; row-wise, a NaN
makes its row's scale and every element of the row NaN, as ``448 / NaN`` does in torch. NaN bit
patterns are not compared between the paths: torch keeps a NaN's sign, ``cvt`` writes a
canonical NaN.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_ampzero.fp8.kernels._torch import EPS, FP8_MAX

_BLOCK = 4096
_NAN = tl.constexpr(tl.PropagateNan.ALL)


@triton.jit
def _magnitude_bits(x):
    # |x| (fp32) as int32 bits: amaxes are integer maxima of these, see [Note: FP8 NaN propagation].
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _amax(x, axis):
    return tl.max(_magnitude_bits(x), axis=axis).to(tl.float32, bitcast=True)


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr, _amax(x, 0))


@triton.jit
def _cast_kernel(x_ptr, q_ptr, scale_ptr, amax_ptr, n, FP8_MAX: tl.constexpr, WITH_AMAX: tl.constexpr,
                 BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr)
    y = tl.clamp(x * s, -FP8_MAX, FP8_MAX, propagate_nan=_NAN)
    tl.store(q_ptr + offs, y.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    if WITH_AMAX:
        tl.atomic_max(amax_ptr, _amax(x, 0))


@triton.jit
def _rowwise_cast_kernel(x_ptr, q_ptr, scale_ptr, M, N, sx_m, sx_n, sq_m, sq_n, FP8_MAX: tl.constexpr,
                         EPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    # One program per BM rows: pass 1 finds each row's amax, pass 2 casts (the rows stay in L2).
    rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    row_mask = rm < M
    amax = tl.zeros([BM], dtype=tl.int32)  # as magnitude bits, so that a NaN wins
    for start in range(0, N, BN):
        rn = start + tl.arange(0, BN)
        mask = row_mask[:, None] & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * sx_m + rn[None, :] * sx_n, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(_magnitude_bits(x), axis=1))
    # Correctly rounded division (Triton's fp32 `/` is approximate): see [Note: FP8 cast numerics].
    amax_f = tl.maximum(amax.to(tl.float32, bitcast=True), EPS, propagate_nan=_NAN)
    scale = tl.math.div_rn(tl.full([BM], FP8_MAX, tl.float32), amax_f)
    tl.store(scale_ptr + rm, scale, mask=row_mask)
    for start in range(0, N, BN):
        rn = start + tl.arange(0, BN)
        mask = row_mask[:, None] & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * sx_m + rn[None, :] * sx_n, mask=mask, other=0.0).to(tl.float32)
        y = tl.clamp(x * scale[:, None], -FP8_MAX, FP8_MAX, propagate_nan=_NAN)
        tl.store(q_ptr + rm[:, None] * sq_m + rn[None, :] * sq_n,
                 y.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def amax(x: Tensor) -> Tensor:
    x = x.contiguous()
    out = torch.zeros(1, dtype=torch.float32, device=x.device)
    n = x.numel()
    if n:
        _amax_kernel[(triton.cdiv(n, _BLOCK),)](x, out, n, BLOCK=_BLOCK)
    return out.reshape(())


def cast(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Optional[Tensor] = None) -> Tensor:
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    n = x.numel()
    if n:
        scale = scale.float().reshape(1).contiguous()
        _cast_kernel[(triton.cdiv(n, _BLOCK),)](
            x, q, scale, amax_out if amax_out is not None else scale, n,
            FP8_MAX=FP8_MAX[fp8_dtype], WITH_AMAX=amax_out is not None, BLOCK=_BLOCK,
        )
    return q


def cast_transpose(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    q = cast(x, scale, fp8_dtype, amax_out)
    return q, q.t().contiguous()  # [Note: the transposed FP8 copy]


def cast_rowwise(x: Tensor, fp8_dtype: torch.dtype, dim: int = -1) -> tuple[Tensor, Tensor]:
    q = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    if dim in (-1, 1):
        src, dst = x, q
    else:  # column-wise: the same kernel over the transposed views (strides only, no copy)
        src, dst = x.t(), q.t()
    rows, cols = src.shape
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if x.numel():
        _rowwise_cast_kernel[(triton.cdiv(rows, 16),)](
            src, dst, scale, rows, cols, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
            FP8_MAX=FP8_MAX[fp8_dtype], EPS=EPS, BM=16, BN=256,
        )
    return q, (scale.unsqueeze(1) if dim in (-1, 1) else scale.unsqueeze(0))


#: (kernel, signature, constexprs) of every kernel, for ahead-of-time compilation checks.
KERNEL_SIGNATURES = [
    (_amax_kernel, {"x_ptr": "*bf16", "amax_ptr": "*fp32", "n": "i32"}, {"BLOCK": _BLOCK}),
    (_cast_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "amax_ptr": "*fp32", "n": "i32"},
     {"FP8_MAX": 448.0, "WITH_AMAX": True, "BLOCK": _BLOCK}),
    (_cast_kernel, {"x_ptr": "*fp32", "q_ptr": "*fp8e5", "scale_ptr": "*fp32", "amax_ptr": "*fp32", "n": "i32"},
     {"FP8_MAX": 57344.0, "WITH_AMAX": False, "BLOCK": _BLOCK}),
    (_rowwise_cast_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "M": "i32", "N": "i32",
                            "sx_m": "i32", "sx_n": "i32", "sq_m": "i32", "sq_n": "i32"},
     {"FP8_MAX": 448.0, "EPS": EPS, "BM": 16, "BN": 256}),
]
