"""Gradient clipping over the global gradient when the gradients are sharded.

Each rank holds only its shard of a DTensor gradient, so the norm is assembled from local
sums of powers with one all-reduce; replicated gradients (plain tensors, identical on every
rank after DDP's all-reduce) are counted once, not once per rank. The formula is
torch.nn.utils.clip_grad_norm_'s (``coef = max_norm / (total + 1e-6)``, clamped at 1), so a
sharded run clips exactly as an unsharded one does.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_ampzero._local import local_tensor
from lightning_ampzero.process import collective_device


def _local(t: Tensor) -> tuple[Tensor, bool]:
    """This rank's part of ``t``, and whether it is a shard (so norms must be summed over ranks)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return local_tensor(t), any(p.is_shard() for p in t.placements)
    return t, False


def _group_of(grads: list[Tensor]) -> Optional[dist.ProcessGroup]:
    from torch.distributed.tensor import DTensor

    for g in grads:
        if isinstance(g, DTensor):
            return g.device_mesh.get_group()
    return None


@torch.no_grad()
def global_grad_norm(parameters: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norm_type = float(norm_type)
    pieces = [_local(g) for g in grads]
    device = pieces[0][0].device
    sharded = [t for t, s in pieces if s and t.numel()]
    replicated = [t for t, s in pieces if not s and t.numel()]

    def _reduce(ts: list[Tensor]) -> Tensor:
        if not ts:
            return torch.zeros((), device=device, dtype=torch.float32)
        norms = torch._foreach_norm(ts, norm_type)
        stacked = torch.stack([n.float() for n in norms])
        return stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum()

    shard_part, repl_part = _reduce(sharded), _reduce(replicated)
    group = _group_of(grads)
    if group is not None and dist.is_initialized():
        # Offloaded gradients are on the CPU, and NCCL reduces CUDA tensors only.
        shard_part = shard_part.to(collective_device(group, device))
        dist.all_reduce(shard_part, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM, group=group)
        shard_part = shard_part.to(device)
    if math.isinf(norm_type):
        return torch.maximum(shard_part, repl_part)
    return (shard_part + repl_part).pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0) -> Tensor:
    """Clip in place so the global gradient norm is at most ``max_norm``; returns the norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    total = global_grad_norm(params, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    locals_ = [_local(p.grad)[0] for p in params]
    by_device: dict[tuple, list[Tensor]] = {}
    for t in locals_:
        by_device.setdefault((t.device, t.dtype), []).append(t)
    for (device, _), ts in by_device.items():
        torch._foreach_mul_(ts, coef.to(device))
    return total


@torch.no_grad()
def clip_grad_value_(parameters: Iterable[Tensor], clip_value: float) -> None:
    """Element-wise clipping: the same on a shard as on the whole tensor."""
    for p in parameters:
        if p.grad is not None:
            _local(p.grad)[0].clamp_(min=-clip_value, max=clip_value)
