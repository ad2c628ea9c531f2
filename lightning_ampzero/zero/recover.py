"""A step that an exception interrupted, and caught by the user's code: FSDP2's state made whole again.

[Note: a step interrupted by an exception]
FSDP2 keeps per-step state on the root module: whether the end-of-backward callback is queued,
which state started the forward, each group's training state. An exception that leaves a forward or
a backward half done (a hook that raises, an out-of-memory error the user's ``training_step``
catches to skip the batch, with manual optimization) leaves that state as it was at the exception.
FSDP2 then never queues its end-of-backward callback again, so the groups it runs (the root's,
and every one whose inputs need no gradient) are never reduced: a new-user trial saw the number of
reduce-scatters stop growing after such a step while training went on, each rank with gradients of
its own data only. Torch 2.13's answer is ``FSDPModule.reset_iter_state()`` on the root, after the
exception and before the next iteration: it waits on the collectives in flight, reshards every
group and clears the per-step trackers; the interrupted step's gradients are lost (torch leaves
those autograd had put on the gathered parameters of a group not reduced yet: cleared here too,
or the next backward would add into them; the one-group case of the test, where every gradient
computed before the exception is of that kind, differed from skipping the batch by 0.058).

:func:`reset_interrupted_step` does it where the strategy can see that a step was interrupted: when
a step method (``training_step``, ...) starts, from outside any other one, with that state not idle,
and when the root's forward starts while a previous backward's callback is still marked queued (a
retry inside the same ``training_step``; at its backward it would be too late: the reset frees the
gathered parameters that the forward saved for it). Collectives of ours still in flight ([Note: reduce-scatters in
flight] in comm.py) are finished first: every rank that raised at the same point posted the same
ring. It warns, because gradients the interrupted backward had already reduced stay in ``.grad``:
they must be zeroed before the next backward (Lightning's automatic optimization and the usual
manual loop, ``zero_grad`` before ``manual_backward``, do). A rank that raised alone is another
matter: the others wait in a collective, and the hang detector names it (watchdog.py).
Stage 0 is DDP, whose reducer has no such reset: the strategy stops with an error instead.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_ampzero.zero.comm import finish_in_flight
from lightning_ampzero.zero.groups import param_groups, reset_iter_state

INTERRUPTED_WARNING = (
    "An exception interrupted the previous forward or backward, and the training went on (it was caught)."
    " FSDP2's per-step state was reset (FSDPModule.reset_iter_state) so that gradients are reduced again;"
    " the interrupted step's gradients are lost, and any it had reduced already are still in .grad: call"
    " optimizer.zero_grad() before the next backward (Lightning's automatic optimization does)."
)


def _idle(model: FSDPModule, *, in_step: bool) -> bool:
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state = model._get_fsdp_state()
    ctx = state._state_ctx
    if ctx.post_backward_final_callback_queued:  # queued when a backward starts, cleared when it ends
        return False
    if in_step:  # inside a step method the forward has legitimately started
        return True
    if ctx.iter_forward_root is not None:
        return False
    # every FSDP2 state under the root (filled by FSDP2's lazy init; empty before the first forward)
    return all(s._training_state == TrainingState.IDLE for s in ctx.all_states) and all(
        g._training_state == TrainingState.IDLE for s in ctx.all_states for g in param_groups(s))


def reset_interrupted_step(model: nn.Module, *, in_step: bool = False) -> bool:
    """Reset the root ``model``'s FSDP2 state if an exception left it mid-step (the Note); True if it did.

    ``in_step``: called from inside a step method (the root's forward), where only a backward left
    unfinished counts.
    """
    if not isinstance(model, FSDPModule) or torch._C._current_graph_task_id() != -1:
        return False
    if _idle(model, in_step=in_step):
        return False
    finish_in_flight()
    reset_iter_state(model)  # torch 2.11 has no FSDPModule.reset_iter_state ([Note: FSDP2 across torch versions])
    # Torch's reset leaves the gradients autograd had put on the gathered parameters before the
    # exception (their group not reduced yet); the next backward would add into them.
    for state in model._get_fsdp_state()._state_ctx.all_states:
        for group in param_groups(state):
            for fsdp_param in group.fsdp_params:
                fsdp_param.unsharded_accumulated_grad = None
                if getattr(fsdp_param, "_unsharded_param", None) is not None:
                    fsdp_param._unsharded_param.grad = None
    if not dist.is_initialized() or dist.get_rank() == 0:  # every rank resets; one says so
        warnings.warn(INTERRUPTED_WARNING, stacklevel=user_stacklevel())
    return True


def user_stacklevel() -> int:
    """``stacklevel`` for a warning issued by its caller: the innermost frame of the user's code.

    The reset (:func:`reset_interrupted_step`) runs in a hook or around a step method, several
    frames below Lightning's loop, and a fixed level named ``contextlib.py`` or torch's
    ``module.py``; the user's ``training_step`` (a retry) or the line that called ``trainer.fit``
    is where a ``warnings`` filter by module or file should find it. A forward pre-hook's warning
    (precision/policy.py) finds the line that called the module.
    """
    import lightning
    import lightning_utilities

    libraries = tuple(os.path.dirname(m.__file__) + os.sep
                      for m in (torch, lightning, lightning_utilities, sys.modules["lightning_ampzero"]))
    frame, level = sys._getframe(1), 1  # level 1: the caller of warnings.warn
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(libraries) and name != contextlib.__file__:
            return level
        frame, level = frame.f_back, level + 1
    return 1


_depth = 0  # step methods running (validation_step may call training_step)


def in_step_method() -> bool:
    """Whether a step method of a root (``training_step``, ...) is running."""
    return _depth > 0


@contextmanager
def step_entry(model: nn.Module) -> Iterator[None]:
    """Around a step method of the root ``model``: the outermost one first resets an interrupted step."""
    global _depth
    if _depth == 0:
        reset_interrupted_step(model)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
