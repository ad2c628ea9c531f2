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

[Note: gloo collectives through all-reduce]
Gloo's all-reduce is a tuned ring; its reduce-scatter and all-gather are not. Measured on this
2-core machine, 2 ranks, fp32 (benchmarks/bench_gloo_comm.py): for 20M elements an all-reduce
takes 82 ms, a reduce-scatter 195 ms and an all-gather 180 ms; for 0.5M, 4.8 / 2.9 / 2.1 ms. So
above :data:`GLOO_REDUCE_SCATTER_MIN_NUMEL` / :data:`GLOO_ALL_GATHER_MIN_NUMEL` elements the
groups of a gloo mesh reduce-scatter by an all-reduce of the whole input and a copy of the
rank's chunk (no extra memory: the input is FSDP2's own buffer, dead after the call), and
all-gather by an all-reduce of the output with the other ranks' chunks zeroed, summed as
integers so that x + 0 is x bit for bit (a float -0.0 + 0.0 would turn into +0.0). The sum of
two ranks' gradients is the same either way (a + b == b + a); with more ranks the order of the
sum may differ, as between any two all-reduce algorithms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

try:  # the custom-comm API of FSDP2 (torch >= 2.8); without it stage 1 keeps FSDP2's rule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGather
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatter
except ImportError:  # pragma: no cover - older torch
    _ReduceScatter = _AllGather = None  # type: ignore[assignment,misc]

HAS_CUSTOM_REDUCE_SCATTER = _ReduceScatter is not None
_RSBase: Any = _ReduceScatter if _ReduceScatter is not None else object
_AGBase: Any = _AllGather if _AllGather is not None else object


@dataclass(frozen=True)
class CommDtypePolicy(MixedPrecisionPolicy):
    """A MixedPrecisionPolicy whose group communicates its gradients in ``comm_dtype``.

    ``reduce_dtype`` stays what FSDP2 accumulates and reduce-scatters into (None: fp32);
    :func:`lightning_ampzero.zero.apply.apply_zero` installs a :class:`LowPrecisionReduceScatter`
    on each group sharded with this policy.
    """

    comm_dtype: Optional[torch.dtype] = None


class _PlainAlloc:
    """The ``allocate`` of FSDP2's custom comms: an ordinary tensor (FSDP2 frees it when done)."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class LowPrecisionReduceScatter(_PlainAlloc, _RSBase):
    """FSDP2 reduce-scatter that sends ``dtype``: mean in fp32, cast, sum in ``dtype``, cast back.

    Dividing by the world size before the cast, as the stage-0 DDP hook does (precision/ddp.py),
    keeps fp16 from overflowing on a sum whose mean fits, and gives stages 0 and 1 one order of
    operations.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

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


#: Elements of the full (unsharded) buffer from which gloo's all-reduce replaces its reduce-scatter,
#: and its all-gather ([Note: gloo collectives through all-reduce]; benchmarks/results/gloo_comm.md).
GLOO_REDUCE_SCATTER_MIN_NUMEL = 2_000_000
GLOO_ALL_GATHER_MIN_NUMEL = 12_000_000
#: Profiler labels around those all-reduces: benchmarks/suite/comm.py counts the all-reduce under
#: them as the reduce-scatter / all-gather it stands for (the dtype it was for, after "#").
RS_LABEL, AG_LABEL = "ampzero::reduce_scatter", "ampzero::all_gather"


def _int_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as integers, which gloo sums exactly: of its element width where gloo has
    that integer type, else as bytes (2-byte types: gloo has no int16)."""
    ints = {8: torch.int64, 4: torch.int32, 1: torch.uint8}
    return t.view(ints.get(t.element_size(), torch.uint8))


class GlooReduceScatter(_PlainAlloc, _RSBase):
    """Reduce-scatter on gloo: through an all-reduce from ``min_numel`` input elements."""

    def __init__(self, min_numel: Optional[int] = None) -> None:
        self.min_numel = GLOO_REDUCE_SCATTER_MIN_NUMEL if min_numel is None else min_numel

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> Optional[dist.Work]:
        if input_tensor.numel() < self.min_numel or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            return reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        world = dist.get_world_size(group)
        with torch.profiler.record_function(f"{RS_LABEL}#{input_tensor.dtype}"):
            # gloo's all-reduce has no AVG: the sum, then the division gloo's reduce-scatter makes.
            dist.all_reduce(input_tensor, op=dist.ReduceOp.SUM, group=group)
        output_tensor.copy_(input_tensor.view(world, -1)[dist.get_rank(group)])
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world)
        return None  # done: FSDP2 waits on nothing


class GlooAllGather(_PlainAlloc, _AGBase):
    """All-gather on gloo: through an all-reduce from ``min_numel`` output elements."""

    def __init__(self, min_numel: Optional[int] = None) -> None:
        self.min_numel = GLOO_ALL_GATHER_MIN_NUMEL if min_numel is None else min_numel

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> Optional[dist.Work]:
        if output_tensor.numel() < self.min_numel:
            all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            return all_gather(output_tensor, input_tensor, group=group, async_op=async_op)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        chunks = output_tensor.view(world, -1)
        if input_tensor.data_ptr() != chunks[rank].data_ptr():  # FSDP2 copies in place: usually the same
            chunks[rank].copy_(input_tensor.view(-1))
        for i in range(world):
            if i != rank:
                chunks[i].zero_()
        with torch.profiler.record_function(f"{AG_LABEL}#{output_tensor.dtype}"):
            return dist.all_reduce(_int_view(output_tensor), group=group, async_op=async_op)


def install_gloo_comms(fsdp_module: Any, group: dist.ProcessGroup, *, reduce_scatter: bool = True) -> bool:
    """Give a group of a gloo mesh :class:`GlooAllGather` (and :class:`GlooReduceScatter`); False elsewhere."""
    if _AllGather is None or dist.get_backend(group) != "gloo":
        return False
    fsdp_module.set_custom_all_gather(GlooAllGather())
    if reduce_scatter:
        fsdp_module.set_custom_reduce_scatter(GlooReduceScatter())
    return True
