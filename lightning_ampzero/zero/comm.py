"""Reduce a group's gradients in a low dtype while FSDP2 keeps and accumulates them in fp32.

[Note: stage 1 accumulation dtype]
FSDP2 accumulates the gradients of a group whose reduction it skips (``set_requires_gradient_sync
(False)``, our stage 1 between micro-batches) in the group's ``reduce_dtype``. Under "-mixed" the
``lower_precision_safe_modules`` reduce in bf16/fp16, so with a ``reduce_dtype`` of the low
dtype their full gradients were summed over micro-batches in bf16/fp16. DeepSpeed sums them in
fp32 and only communicates in the low dtype. Stage 1 therefore gives those groups
``reduce_dtype=None`` (fp32: accumulation and FSDP2's buffers), plus :class:`LowPrecisionReduceScatter`
as the group's reduce-scatter, which casts to the low dtype for the wire only. Stages 2 and 3
reduce every micro-batch and accumulate the fp32 shards, so they keep FSDP2's own low-dtype
reduce-scatter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

try:  # the custom-comm API of FSDP2 (torch >= 2.8); without it stage 1 keeps FSDP2's rule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatter
except ImportError:  # pragma: no cover - older torch
    _ReduceScatter = None  # type: ignore[assignment,misc]

HAS_CUSTOM_REDUCE_SCATTER = _ReduceScatter is not None


@dataclass(frozen=True)
class CommDtypePolicy(MixedPrecisionPolicy):
    """A MixedPrecisionPolicy whose group communicates its gradients in ``comm_dtype``.

    ``reduce_dtype`` stays what FSDP2 accumulates and reduce-scatters into (None: fp32);
    :func:`lightning_ampzero.zero.apply.apply_zero` installs a :class:`LowPrecisionReduceScatter`
    on each group sharded with this policy.
    """

    comm_dtype: Optional[torch.dtype] = None


class LowPrecisionReduceScatter(_ReduceScatter if _ReduceScatter is not None else object):  # type: ignore[misc]
    """FSDP2 reduce-scatter that sends ``dtype``: mean in fp32, cast, sum in ``dtype``, cast back.

    Dividing by the world size before the cast, as the stage-0 DDP hook does (precision/ddp.py),
    keeps fp16 from overflowing on a sum whose mean fits, and gives stages 0 and 1 one order of
    operations.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Optional[dist.Work]:
        if op == dist.ReduceOp.AVG:
            # divide straight into the low-dtype buffer: no fp32 temporary the size of the input
            send = torch.empty(input_tensor.shape, dtype=self.dtype, device=input_tensor.device)
            torch.div(input_tensor, dist.get_world_size(group), out=send)
            op = dist.ReduceOp.SUM
        elif op == dist.ReduceOp.SUM:  # FSDP2 divides before / after the call itself
            send = input_tensor.to(self.dtype)
        else:
            raise NotImplementedError(
                f"LowPrecisionReduceScatter handles the AVG and SUM reductions FSDP2 uses by default, got {op}:"
                " leave the gradient divide factor of stage 1 -mixed modules at its default."
            )
        received = torch.empty(output_tensor.shape, dtype=self.dtype, device=output_tensor.device)
        # Looked up at call time, so tools that patch torch.distributed (traffic counters) see it.
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        reduce_scatter(received, send, op=op, group=group)
        output_tensor.copy_(received)
        return None  # done: FSDP2 waits on nothing
