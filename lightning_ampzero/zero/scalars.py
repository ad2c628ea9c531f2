"""0-dim parameters (a learnable temperature, CLIP's ``logit_scale``): replicated, gradients averaged;
the other parameters FSDP2 refuses (:func:`prepare_parameters_`).

[Note: 0-dim parameters]
FSDP2 refuses to shard a 0-dim parameter (``fully_shard`` raises "doesn't support scalar
parameters"), so stages 1-3 stopped at setup on any model holding one (a new-user trial: CLIP).
There is nothing to shard in one element anyway: such parameters are left out of every FSDP2
group (``ignored_params``) and kept whole on every rank, as DeepSpeed keeps parameters under its
persistence threshold, and as DDP keeps every parameter. FSDP2 then does not reduce their
gradients; hooks after each backward's accumulation into ``.grad`` average them over the ranks
as DDP does (divided by the world size, then summed; all of them in one all-reduce at the end of
the backward, :class:`_Averager`), so every rank steps the same value. Under
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

from lightning_ampzero.process import collective_device


def prepare_parameters_(model: nn.Module) -> None:
    """Refuse, naming them, the parameters FSDP2 cannot shard; make non-contiguous ones contiguous.

    [Note: parameters FSDP2 refuses]
    Besides 0-dim parameters (above), three kinds stopped stages 1-3 with torch's own words (a
    new-user trial), where DDP (stage 0) trains them:

    * a lazy module's parameter never given its shape (``nn.LazyLinear`` without a first forward):
      torch's "Attempted to use an uninitialized parameter", from inside this package. Sharding
      needs the shape; a dummy forward before fit gives it (torch's LazyModule documentation).
    * the sparse gradients of a trainable ``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag(sparse=True)``
      (a frozen one trains: it has no gradient to reduce):
      "Could not run 'fsdp::chunk_cat' with arguments from the 'SparseCPU' backend" and 60 lines
      of dispatcher listing, in the first backward. FSDP2 reduce-scatters dense buffers only.
    * a non-contiguous parameter (``nn.Parameter(w.t())``, a conv weight in ``channels_last``):
      "FSDP does not support non-contiguous parameters yet", naming neither parameter nor remedy.
      Its values do not depend on the layout, so it is made contiguous in place (``.data``, the
      same Parameter object; before any optimizer holds it), and trains as DDP trains it, to the
      rounding of a GEMM that reads the other layout (6e-8 in the trial; ``channels_last`` is then
      lost for those weights).
    """
    from torch.nn.parameter import is_lazy

    lazy = [n for n, p in model.named_parameters() if is_lazy(p)]
    if lazy:
        raise ValueError(
            f"Parameter(s) {', '.join(lazy[:5])}{', ...' if len(lazy) > 5 else ''} have no shape yet: a lazy module"
            " (nn.LazyLinear, nn.LazyConv2d, ...) gets it from its first forward, and ZeRO stages 1-3 shard"
            " parameters by their shape before training starts. Run one forward on a dummy batch where the model is"
            " built (in __init__ or configure_model()), as torch's LazyModule documentation says."
        )
    sparse = [n or type(m).__name__ for n, m in model.named_modules()  # frozen: no gradient, nothing to reduce
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]
    if sparse:
        raise ValueError(
            f"{', '.join(sparse[:5])}{', ...' if len(sparse) > 5 else ''}: sparse=True makes sparse gradients,"
            " which ZeRO stages 1-3 (FSDP2) cannot reduce-scatter: it reduces dense buffers. Use sparse=False"
            " (with Adam/AdamW in place of SparseAdam), or stage 0 (DDP all-reduces sparse gradients)."
        )
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_contiguous():
                p.data = p.data.contiguous()


def scalar_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The 0-dim parameters of ``model`` (each once, however many modules share it)."""
    return {p for p in model.parameters() if p.dim() == 0}


class _Averager:
    """The post-accumulate-grad hook of a model's 0-dim parameters: one all-reduce per backward.

    Each hook that fires records its parameter, and the first of a backward queues one callback
    on the autograd engine, which runs when the backward ends: it averages every recorded gradient
    in a single all-reduce per dtype (stacked), not one collective per parameter (a ReZero-style
    model has a gate per residual branch). The order is the parameters' order in the model, the
    same on every rank, whatever order the hooks fired in.
    """

    def __init__(self, params: list[nn.Parameter], group: Optional[dist.ProcessGroup], world: int) -> None:
        self.index = {id(p): i for i, p in enumerate(params)}
        self.group, self.world = group, world
        self.ready: list[nn.Parameter] = []

    def __call__(self, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        if not self.ready:
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
        self.ready.append(param)  # type: ignore[arg-type]

    def flush(self) -> None:
        ready, self.ready = sorted(self.ready, key=lambda p: self.index[id(p)]), []
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in ready:
            assert p.grad is not None
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.stack(grads).div_(self.world)
            # Offloaded parameters' gradients are on the CPU, and NCCL reduces CUDA tensors only.
            flat = flat.to(collective_device(self.group, flat.device))
            dist.all_reduce(flat, group=self.group)
            for g, mean in zip(grads, flat.unbind()):
                g.copy_(mean)


def average_scalar_gradients(params: set[nn.Parameter], mesh: DeviceMesh, model: Optional[nn.Module] = None) -> None:
    """Hook each trainable parameter of ``params`` to average its gradient over ``mesh`` (the Note).

    ``model`` gives the parameters their order (the same on every rank); without it, ``params``
    must be iterated alike on every rank.
    """
    group: Optional[dist.ProcessGroup] = mesh.get_group() if mesh.ndim == 1 else None  # 2-D: every rank
    world = dist.get_world_size(group)
    if world == 1:
        return
    trainable = list(dict.fromkeys(  # model.parameters() gives a shared parameter once; dict keeps the order
        p for p in (model.parameters() if model is not None else params)
        if p in params and p.requires_grad and not getattr(p, "_ampzero_averaged", False)))
    averager = _Averager(trainable, group, world)
    for p in trainable:
        p.register_post_accumulate_grad_hook(averager)
        p._ampzero_averaged = True  # type: ignore[attr-defined]  # a second setup adds no second hook
