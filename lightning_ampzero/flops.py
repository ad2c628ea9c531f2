"""Model FLOP utilisation: model FLOPs per token, and the GEMM peak measured on the machine.

MFU = model FLOPs per second / the peak FLOP/s of the processes that trained. Model FLOPs per
token follow the PaLM paper's appendix B: ``6 N + 12 L T d`` (N the parameters outside the
embeddings, counted once each; L the blocks, T the sequence length, d the width), so
recomputation by activation checkpointing and the optimizer step are not model work.

The peak is not a datasheet figure (a CPU has none that a process can reach): every rank runs
the same square matmul for a fraction of a second, at the same time and with the threads it
trained with, and the best rate of each is its peak. Measured in the same run as the training
it divides, so the ratio holds whatever else loads the machine at that moment, within its noise.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
from torch import nn

__all__ = ["compute_dtype", "gemm_peak_flops", "model_flops_per_token", "precision_peak_flops"]


def precision_peak_flops(precision: str, device: "torch.device | str" = "cpu") -> float:
    """The GEMM peak for a Lightning precision: the faster of its low-precision GEMM and fp32.

    A "16"/"bf16" run may compute its GEMMs in either (autocast keeps some in fp32, and a CPU
    without fp16 units runs an fp16 matmul at a fraction of the fp32 rate: 1 GFLOP/s against 93
    measured here), so the bar is the fastest of the two this machine offers.
    """
    dtype = compute_dtype(precision)
    peak = gemm_peak_flops(torch.float32, device)
    return peak if dtype is torch.float32 else max(peak, gemm_peak_flops(dtype, device))


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the GEMMs of a Lightning precision run in."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float32


def gemm_peak_flops(dtype: torch.dtype = torch.float32, device: "torch.device | str" = "cpu", *, n: int = 0,
                    seconds: float = 0.3, trials: int = 3) -> float:
    """Best FLOP/s of an ``n x n`` matmul in this process (its threads), over ``trials`` timed windows.

    ``n`` defaults to 1024 on CPU (large enough for the blocked kernels to reach their rate in a
    fraction of a second) and 8192 on an accelerator.
    """
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.mm(a, b)  # warm-up: kernel selection, page faults
    sync()
    best = 0.0
    for _ in range(trials):
        calls, start = 0, time.perf_counter()
        while True:
            torch.mm(a, b)
            calls += 1
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds / trials:
                break
        best = max(best, 2 * n**3 * calls / elapsed)
    return best


def model_flops_per_token(model: nn.Module, seq_len: int, n_layer: Optional[int] = None,
                          width: Optional[int] = None) -> float:
    """``6 N + 12 L T d`` for ``model`` (forward + backward of one token).

    N: the parameters less the embedding tables (a head tied to an embedding is counted: its
    matmul is model work). L and d default to the number of repeated blocks (as ZeRO's units find
    them) and the widest embedding's dimension; without embeddings or blocks the attention term is
    left out (a model without attention), which is ``6 N``.
    """
    from lightning_ampzero.zero.units import find_blocks

    params = {id(p): p for p in model.parameters()}
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    embedded = {id(m.weight) for m in embeddings}
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear) and id(m.weight) in embedded}
    numel = sum(p.numel() for key, p in params.items() if key not in embedded or key in tied)
    if n_layer is None:
        n_layer = len(find_blocks(model, ()))
    if width is None:
        width = max((m.embedding_dim for m in embeddings), default=0)
    return 6.0 * numel + 12.0 * n_layer * seq_len * width
