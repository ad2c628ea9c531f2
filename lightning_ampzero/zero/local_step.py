"""The optimizer step of stages 1-3 on each rank's plain shard tensors instead of FSDP2's DTensors.

[Note: the optimizer step on local shards]
At stages 1-3 every parameter the optimizer holds is a DTensor (FSDP2's shard), and so are its
gradient and its state (``exp_avg``, ...). Each tensor operation of the step then goes through
DTensor's dispatch (sharding propagation, a new DTensor for every result) before the same kernel
runs on the local shard. For an optimizer that works element by element that costs more than the
arithmetic it wraps: measured on the suite's GPT (6 x 256, 77 parameters, 2 CPU ranks, thread CPU
time of ``step()``, median of 22): AdamW's default on CPU (for-loop) 11.8 ms on the DTensors,
5.7 ms on the local shards; ``fused=True`` 2.8 / 1.8 ms; so ZeRO's split of the optimizer's work
over the ranks was eaten by the dispatch, and stage 1-3's step took as long as DDP's over the whole
model. Here the optimizer steps on the local shards: for the duration of ``step()`` each param
group holds plain tensors sharing storage with the shards (their ``.grad`` the gradient's shard),
the state is re-keyed to them with each DTensor state replaced by its local tensor, and afterwards
everything is put back; a state tensor the step created (the first step's ``exp_avg``) is wrapped
into a DTensor laid out as its parameter, which is what the DTensor step creates. The kernels are
the same ones on the same data, so the result is the same bits (tested for every optimizer below,
tests/test_zero_local_step.py); checkpoints see DTensor parameters and states as before.

Only where that holds: optimizers whose step is element by element, by exact class (a subclass may
compute a norm over the whole tensor, which on a shard would be wrong), without step hooks (they
would see the local tensors), ``differentiable`` or ``capturable``, and with every gradient laid out
as its parameter. Anything else steps on the DTensors as before. ``foreach=None`` must pick the
implementation the DTensor step picks (foreach on CUDA, the for-loop on CPU: torch decides by device
and tensor type, and registers DTensor as a foreach type). Plain local shards resolve as their
DTensors do; a local tensor of another type (the FP8 all-gather's weight wrapper) would get the
for-loop where the DTensors get foreach, which on an H100 changed the result (rel 0.087 after 8
AdamW steps), so the DTensors' choice is pinned for the step. A tensor ``lr`` (where Adam's own rule
can overrule the choice) keeps the DTensor step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import (_default_to_fused_or_foreach, _global_optimizer_post_hooks,
                                   _global_optimizer_pre_hooks)

#: Element-by-element optimizers of torch whose step, on DTensor shards, runs each kernel on the local shard.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adamax,
               torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adadelta)


def steps_on_local_shards(optimizer: Any) -> bool:
    """Whether :func:`on_local_shards` would move ``optimizer``'s step onto local tensors (the Note)."""
    if type(optimizer) not in ELEMENTWISE:
        return False
    if (optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
            or _global_optimizer_pre_hooks or _global_optimizer_post_hooks):
        return False
    sharded = False
    for group in optimizer.param_groups:
        if group.get("differentiable") or group.get("capturable") or isinstance(group.get("lr"), torch.Tensor):
            return False
        for p in group["params"]:
            if isinstance(p, DTensor):
                grad = p.grad
                if grad is not None and (not isinstance(grad, DTensor) or grad.placements != p.placements
                                         or grad.device_mesh != p.device_mesh):
                    return False
                sharded = True
    return sharded


@contextlib.contextmanager
def on_local_shards(optimizer: Any) -> Iterator[None]:
    """Within this block ``optimizer.step()`` works on the local shards of its DTensor parameters (the Note).

    Does nothing for an optimizer :func:`steps_on_local_shards` turns down.
    """
    if not steps_on_local_shards(optimizer):
        yield
        return
    swapped: list[tuple[dict, list, Any, list[tuple[DTensor, torch.Tensor]]]] = []
    try:
        for group in optimizer.param_groups:
            params, pairs, local_params = group["params"], [], []
            for p in params:
                if not isinstance(p, DTensor):
                    local_params.append(p)
                    continue
                local = p._local_tensor.detach()  # a new leaf on the shard's storage
                if p.grad is not None:
                    local.grad = p.grad._local_tensor
                state = optimizer.state.get(p)
                if state:
                    optimizer.state[local] = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in state.items()}
                local_params.append(local)
                pairs.append((p, local))
            foreach = group.get("foreach")
            if foreach is None and not group.get("fused"):
                on_dtensors = _default_to_fused_or_foreach(params, False)[1]
                if _default_to_fused_or_foreach(local_params, False)[1] != on_dtensors:
                    group["foreach"] = on_dtensors
            group["params"] = local_params
            swapped.append((group, params, foreach, pairs))
        yield
    finally:
        for group, params, foreach, pairs in swapped:
            group["params"] = params
            if "foreach" in group:
                group["foreach"] = foreach
            for p, local in pairs:
                local.grad = None
                state = optimizer.state.pop(local, None)
                if state:
                    _put_back(optimizer.state[p], state, p, local)


def _put_back(old: dict, new: dict, p: DTensor, local: torch.Tensor) -> None:
    """Write the state the local step left (``new``) into the parameter's own (``old``) as DTensors."""
    for key, value in new.items():
        before = old.get(key)
        if isinstance(before, DTensor) and value is before._local_tensor:
            continue  # updated in place: the DTensor already holds it
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == local.shape:
            # created by this step (the first step's moments): laid out as its parameter
            value = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                       stride=p.stride())
        old[key] = value
