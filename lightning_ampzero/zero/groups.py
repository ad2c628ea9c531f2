"""FSDP2's parameter groups on every torch this package supports (torch 2.11 and 2.13 differ).

[Note: FSDP2 across torch versions]
Four differences between torch 2.11 (the version on the first GPU machine lent to this project)
and torch 2.13 (the one CI tests) reach this package's code; each stopped or silently broke runs
on torch 2.11 until handled here:

* **Groups per state.** torch 2.13's ``FSDPState`` holds a list, ``_fsdp_param_groups``
  (``_fsdp_param_group`` is a property that returns the first); torch 2.11 holds one
  ``_fsdp_param_group``, or None. Reading the list stopped every stage 1-3 run on torch 2.11
  (``'FSDPState' object has no attribute '_fsdp_param_groups'``). Readers use
  :func:`param_groups`.
* **Zero gradients for unused parameters.** torch 2.13's ``set_reduce_scatter_unused_params``
  makes a group's post-backward reduce a zero gradient for a trainable parameter without one,
  which [Note: parameters unused on some ranks] in unused.py relies on; torch 2.11 has no such
  option and ignores the flag. Where FSDP2 lacks it (:data:`FSDP2_REDUCES_UNUSED` False),
  :func:`give_unused_zero_gradients` does what it does, just before the post-backward.
* **Repeated post-backward calls.** At the end of a backward, torch 2.11 calls the
  post-backward of each state's group once per state, and the modules of a unit built from
  several blocks (``fully_shard([block0, block1])``) share one group; each call resets the group
  to idle, so the group's post-backward runs again, with nothing left to reduce. FSDP2 then does
  nothing, but wrappers that predict what it reduces (the gradient swap file, the unused
  tracker) took the repeat for a reduction: with ``offload_optimizer='nvme'`` at stage 3 every
  gradient was dropped and the parameters never moved. :func:`repeated_post_backward` tells
  such a call apart.
* **Recovery after an exception.** torch 2.13's ``FSDPModule.reset_iter_state()`` (which
  [Note: a step interrupted by an exception] in recover.py calls) does not exist on torch 2.11;
  :func:`reset_iter_state` does its steps there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

# torch 2.13 has FSDPModule.set_reduce_scatter_unused_params; torch 2.11 does not.
FSDP2_REDUCES_UNUSED = hasattr(FSDPModule, "set_reduce_scatter_unused_params")


def param_groups(state: Any) -> list[Any]:
    """The ``FSDPParamGroup``s of an ``FSDPState`` (empty when it manages no parameter)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def module_param_groups(module: Any) -> list[Any]:
    """The ``FSDPParamGroup``s of an ``FSDPModule``."""
    return param_groups(module._get_fsdp_state())


def has_local_gradient(fp: Any) -> bool:
    """Whether FSDP2's post-backward has a gradient of this rank to reduce for the FSDPParam ``fp``
    (its own test: one accumulated over micro-batches, or the gathered parameter's ``.grad``)."""
    return hasattr(fp, "_unsharded_param") and (
        fp.unsharded_accumulated_grad is not None or fp.unsharded_param.grad is not None)


def has_local_gradients(group: Any) -> bool:
    """Whether the group's post-backward has a gradient of this rank to reduce."""
    return any(has_local_gradient(fp) for fp in group.fsdp_params)


def repeated_post_backward(group: Any, caller: str) -> bool:
    """True for a post-backward of ``group`` that ``caller`` already saw in this backward and that has
    nothing to reduce: torch 2.11's repeat (the Note). A call with gradients counts as a real one
    (a module used twice in one forward), and so does every call outside a backward."""
    task = torch._C._current_graph_task_id()
    seen = getattr(group, "_ampzero_backward_of", None)
    if seen is None:
        seen = group._ampzero_backward_of = {}
    repeated = task != -1 and seen.get(caller) == task
    seen[caller] = task
    return repeated and not has_local_gradients(group)


def give_unused_zero_gradients(group: Any) -> None:
    """What torch 2.13's ``reduce_scatter_unused_params`` does (the Note): a zero gradient for each
    trainable parameter of ``group`` that has none, so FSDP2's post-backward reduces it."""
    for fp in group.fsdp_params:
        if not hasattr(fp, "_unsharded_param"):
            continue
        param = fp.unsharded_param
        if param.requires_grad and fp.unsharded_accumulated_grad is None and param.grad is None:
            param.grad = torch.zeros_like(param)


def reset_iter_state(model: Any) -> None:
    """FSDP2's ``reset_iter_state()`` on the root ``model`` (torch 2.13), or the same steps on torch 2.11,
    which has no such method: wait for the collectives in flight, reshard every group, clear the
    per-iteration trackers. The interrupted iteration's gradients in flight are lost."""
    if hasattr(model, "reset_iter_state"):
        model.reset_iter_state()
        return
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state = model._get_fsdp_state()
    stream = state._device_handle.current_stream()
    comm = state._comm_ctx
    for name in ("all_gather_state", "reduce_scatter_state"):
        pending = getattr(comm, name, None)
        if pending is not None and pending.event is not None:
            stream.wait_event(pending.event)
        setattr(comm, name, None)
    comm.post_forward_order.clear()
    for each in state._state_ctx.all_states:
        each._modules_to_run_forward.clear()
        each._training_state = TrainingState.IDLE
        for group in param_groups(each):
            result = group._all_gather_result
            if result is not None:
                if result.all_gather_event is not None:
                    stream.wait_event(result.all_gather_event)
                if result.all_gather_work is not None:
                    result.all_gather_work.wait()
                group._all_gather_result = None
            if group._post_reduce_event is not None:
                stream.wait_event(group._post_reduce_event)
                group._post_reduce_event = None
            if group._all_reduce_state is not None and group._all_reduce_state.event is not None:
                stream.wait_event(group._all_reduce_state.event)
            group._all_reduce_state = None
            if group._reshard_after_forward_event is not None:
                group._wait_all_gather_streams_on_event(group._reshard_after_forward_event)
                group._reshard_after_forward_event = None
            group._partial_reduce_output = None
            group._post_forward_indices.clear()
            group._training_state = TrainingState.IDLE
            group._to_sharded()
    state._state_ctx.iter_forward_root = None
    state._state_ctx.post_backward_final_callback_queued = False
