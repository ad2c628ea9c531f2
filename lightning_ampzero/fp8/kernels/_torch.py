"""The torch path of the FP8 kernels: the reference numerics, used on CPU and wherever Triton is not.

Every function here has a Triton twin in ``_triton.py`` with the same contract; the two must
agree bit for bit (see [Note: FP8 cast numerics] and [Note: FP8 NaN propagation] in
``_triton.py``). Outputs are row-major whatever the input's strides, as the Triton kernels write
them: ``torch._scaled_mm`` on CUDA takes its first operand row-major only.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

#: Largest finite value of each FP8 format; casts saturate to it (never inf/NaN from overflow).
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
#: Amax floor: an all-zero tensor gets a finite scale instead of inf.
EPS = 1e-12


def amax(x: Tensor) -> Tensor:
    """max(|x|) as a 0-dim fp32 tensor (fp8 has no abs/amax kernels: upcast first)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.abs().amax().float()


def cast(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Optional[Tensor] = None) -> Tensor:
    """Saturating round-to-nearest-even cast of ``x * scale`` to ``fp8_dtype``.

    ``scale`` broadcasts against ``x`` (a 0-dim/1-element tensor for per-tensor scaling). If
    ``amax_out`` (1 element, fp32) is given, ``max(amax_out, amax(x))`` is written into it: the
    delayed recipe records the amax of the tensor it casts with a scale from history.
    """
    fmax = FP8_MAX[fp8_dtype]
    # Elementwise ops keep a transposed input's strides; the conversion writes row-major instead
    # (no extra pass), so a cast of a transposed view can be ``_scaled_mm``'s row-major operand.
    q = (x.float() * scale.float()).clamp_(-fmax, fmax).to(fp8_dtype, memory_format=torch.contiguous_format)
    if amax_out is not None:
        torch.maximum(amax_out, amax(x).reshape(amax_out.shape), out=amax_out)
    return q


def cast_transpose(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    """``cast(x)`` of a 2-D ``x`` and its transpose, both row-major (the two GEMM layouts)."""
    q = cast(x, scale, fp8_dtype, amax_out)
    return q, q.t().contiguous()


def cast_rowwise(x: Tensor, fp8_dtype: torch.dtype, dim: int = -1) -> tuple[Tensor, Tensor]:
    """Dynamic scaling with one scale per slice along ``dim`` of a 2-D ``x``.

    ``dim=-1``: one scale per row (shape [M, 1]); ``dim=0``: one per column (shape [1, N]).
    Returns ``(q, scale)`` with ``q = cast(x * scale)``.
    """
    a = x.abs().amax(dim=dim, keepdim=True).float().clamp_(min=EPS)
    # One correctly rounded division, as the Triton kernel's div_rn: ``FP8_MAX / a`` would be
    # ``a.reciprocal() * FP8_MAX`` (torch's __rtruediv__), one ulp off in about a quarter of rows.
    scale = torch.full_like(a, FP8_MAX[fp8_dtype]).div_(a)
    return cast(x, scale, fp8_dtype), scale
