"""0-dim parameters (a learnable temperature, CLIP's ``logit_scale``): replicated, gradients averaged.

[Note: 0-dim parameters]
FSDP2 refuses to shard a 0-dim parameter (``fully_shard`` raises "doesn't support scalar
parameters"), so stages 1-3 stopped at setup on any model holding one (a new-user trial: CLIP).
There is nothing to shard in one element anyway: such parameters are left out of every FSDP2
group (``ignored_params``) and kept whole on every rank, as DeepSpeed keeps parameters under its
persistence threshold, and as DDP keeps every parameter. FSDP2 then does not reduce their
gradients; a hook after each backward's accumulation into ``.grad`` averages them over the ranks
as DDP does (divided by the world size, then summed), so every rank steps the same value. Under
gradient accumulation with stage 1's local micro-batches the hook averages every micro-batch: the
earlier micro-batches' part is already the same on every rank, and the mean is linear, so the sum
is the mean of the ranks' sums. The optimizer, clipping (a replicated gradient counts once,
zero/clip.py) and checkpoints see an ordinary tensor beside the DTensors. Like DDP without
``find_unused_parameters``, every rank must give such a parameter a gradient in each backward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def scalar_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The 0-dim parameters of ``model`` (each once, however many modules share it)."""
    return {p for p in model.parameters() if p.dim() == 0}


def average_scalar_gradients(params: set[nn.Parameter], mesh: DeviceMesh) -> None:
    """Hook each trainable parameter of ``params`` to average its gradient over ``mesh`` (the Note)."""
    group: Optional[dist.ProcessGroup] = mesh.get_group() if mesh.ndim == 1 else None  # 2-D: every rank
    world = dist.get_world_size(group)
    if world == 1:
        return

    def average(param: torch.Tensor) -> None:
        if param.grad is not None:
            param.grad.div_(world)
            dist.all_reduce(param.grad, group=group)

    for p in params:
        if p.requires_grad and not getattr(p, "_ampzero_averaged", False):
            p.register_post_accumulate_grad_hook(average)
            p._ampzero_averaged = True  # type: ignore[attr-defined]  # a second setup adds no second hook
