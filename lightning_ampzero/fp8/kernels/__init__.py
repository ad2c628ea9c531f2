"""FP8 kernels: casts with amax and scale (Triton on CUDA, torch elsewhere) and the scaled GEMM.

The backend is chosen per call from the tensor: CUDA tensors on a GPU with FP8 support
(compute capability 8.9+) and Triton installed use ``_triton``; everything else uses ``_torch``
(the reference numerics). ``backend=`` forces one, for tests and benchmarks.

The GEMM is ``torch._scaled_mm`` wherever it runs (CPU, CUDA 8.9+). On a GPU without FP8 it is
*emulated*: the operands are dequantized and multiplied in fp32, so the numerics are those of
FP8 quantization but nothing is faster. That fallback warns once per process.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_ampzero.fp8.kernels import _torch
from lightning_ampzero.fp8.kernels._torch import EPS, FP8_MAX

__all__ = [
    "EPS",
    "FP8_MAX",
    "amax",
    "cast",
    "cast_rowwise",
    "cast_transpose",
    "fp8_gemm_supported",
    "kernel_backend",
    "scaled_mm",
]

_MIN_CAPABILITY = (8, 9)


@functools.lru_cache(maxsize=None)
def _cuda_fp8(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= _MIN_CAPABILITY


@functools.lru_cache(maxsize=None)
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _warn_no_fp8(name: str, capability: tuple[int, int]) -> None:
    # lru_cache makes this fire once per device kind, whatever the warnings filters say.
    warnings.warn(
        f"FP8 training on {name} (compute capability {capability[0]}.{capability[1]}): FP8 GEMMs and casts need"
        f" compute capability {_MIN_CAPABILITY[0]}.{_MIN_CAPABILITY[1]}+ (Ada, Hopper or newer). Falling back to"
        " emulation: the same FP8 quantization, GEMMs in higher precision, so no speed-up. Use bf16 without"
        " fp8 on this GPU for speed.",
        UserWarning,
        stacklevel=3,
    )


def fp8_gemm_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs on ``device`` (CPU: yes; CUDA: 8.9+). Warns once if not."""
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if _cuda_fp8(index):
            return True
        _warn_no_fp8(torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index))
    return False


def kernel_backend(t: Tensor, backend: Optional[str] = None) -> Any:
    """The module implementing the casts for tensor ``t``: ``_triton`` on capable CUDA, else ``_torch``."""
    if backend == "torch":
        return _torch
    if backend == "triton" or (
        t.is_cuda and _triton_available() and _cuda_fp8(t.device.index if t.device.index is not None else 0)
    ):
        from lightning_ampzero.fp8.kernels import _triton

        return _triton
    return _torch


def amax(x: Tensor, *, backend: Optional[str] = None) -> Tensor:
    return kernel_backend(x, backend).amax(x)


def cast(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Optional[Tensor] = None, *,
         backend: Optional[str] = None) -> Tensor:
    return kernel_backend(x, backend).cast(x, scale, fp8_dtype, amax_out)


def cast_transpose(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Optional[Tensor] = None, *,
                   backend: Optional[str] = None) -> tuple[Tensor, Tensor]:
    return kernel_backend(x, backend).cast_transpose(x, scale, fp8_dtype, amax_out)


def cast_rowwise(x: Tensor, fp8_dtype: torch.dtype, dim: int = -1, *,
                 backend: Optional[str] = None) -> tuple[Tensor, Tensor]:
    return kernel_backend(x, backend).cast_rowwise(x, fp8_dtype, dim)


def scaled_mm(a: Tensor, b: Tensor, a_inv_scale: Tensor, b_inv_scale: Tensor, out_dtype: torch.dtype,
              *, emulate: bool = False) -> Tensor:
    """``(a * a_inv_scale) @ (b * b_inv_scale)`` for FP8 ``a`` [M, K] (row-major) and ``b`` [K, N] (column-major).

    Scales are dequantization scales (``1 / scale``): fp32, 0-dim (tensor-wise) or [M, 1] and
    [1, N] (row-wise). Accumulation is fp32. Row-wise results are rounded to bf16 on every path
    (CUDA's row-wise kernel has no other output), then converted to ``out_dtype``.
    """
    rowwise = a_inv_scale.numel() > 1 or b_inv_scale.numel() > 1
    if rowwise and out_dtype != torch.bfloat16:
        # CUDA's row-wise FP8 GEMM writes bf16 only. Every device and the emulation round through
        # bf16 the same way, so that CPU runs (and tests) compute what a GPU computes.
        return scaled_mm(a, b, a_inv_scale, b_inv_scale, torch.bfloat16, emulate=emulate).to(out_dtype)
    if emulate or a.device.type == "cpu" or not fp8_gemm_supported(a.device):
        # [Note: the FP8 GEMM on CPU] torch's CPU _scaled_mm is a reference kernel: 0.17-0.36 s for
        # a 128x64x256 GEMM against 0.6 ms for the same product in fp32 (torch 2.13, one thread),
        # which made a 2-layer 64-wide GPT take 2-6 s a step in FP8 on CPU. FP8 operands are exact
        # in fp32, and the product accumulates in fp32 as _scaled_mm's does (the two differ in
        # rounding order only, 1e-6 relative): the same result, hundreds of times faster. CUDA
        # keeps _scaled_mm, whose layout rules the meta check holds every call to.
        out = (a.float() * a_inv_scale.float()) @ (b.float() * b_inv_scale.float())
        return out.to(out_dtype)
    if rowwise:
        # Strides exactly (1, 1) / (N, 1): _scaled_mm checks them literally.
        a_inv_scale = a_inv_scale.float().reshape(-1).clone().reshape(-1, 1)
        b_inv_scale = b_inv_scale.float().reshape(-1).clone().reshape(1, -1)
    else:
        a_inv_scale, b_inv_scale = a_inv_scale.reshape(()), b_inv_scale.reshape(())
    return torch._scaled_mm(a, b, a_inv_scale.float(), b_inv_scale.float(), out_dtype=out_dtype)
