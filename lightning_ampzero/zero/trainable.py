"""``requires_grad`` kept the same on FSDP2's two copies of a parameter.

[Note: requires_grad changed inside a step]
FSDP2 holds two parameter objects per parameter: the sharded one (a DTensor, the one the optimizer
holds) and the gathered one, which the module shows while its group is gathered. FSDP2 copies
``requires_grad`` from the sharded to the gathered one when it gathers the group, and never the
other way. The root group is gathered when a step method starts (``register_root_method``), and
below stage 3 every group stays gathered from its forward to its backward, so a change made inside
a step was lost both ways (a new-user trial, against ``ddp_find_unused_parameters_true``):

* ``toggle_optimizer(g_opt)`` in a GAN's ``training_step`` freezes the other optimizer's
  parameters, which are the sharded ones: the gathered discriminator still required gradients, so
  the generator's backward trained it too, silently (stages 1-2: 0.16 from ddp after 8 steps);
* ``self.encoder.requires_grad_(False)`` inside ``training_step`` froze the gathered copies only:
  the next gather copied the sharded ``True`` back, so the layer kept training.

:func:`sync_requires_grad` settles the two copies: whichever changed since the last settlement
wins (the gathered one when both did: it is what the module showed the user), and the flag both
then hold is remembered on the FSDPParam. It runs when a step method starts (every group) and
before each forward of the root or of a child inside a step method (the gathered groups), so a
backward sees the flag the user set last and the next gather keeps it.
"""

from __future__ import annotations

from typing import Iterable

_LAST = "_ampzero_requires_grad"  # the flag both copies held at the last settlement


def record_requires_grad(groups: Iterable) -> None:
    """Remember the sharded parameters' flags as settled (after sharding, before any gather)."""
    for group in groups:
        for fp in group.fsdp_params:
            setattr(fp, _LAST, fp.sharded_param.requires_grad)


def sync_requires_grad(groups: Iterable, gathered_only: bool = False) -> None:
    """Give both copies of each parameter the flag the user set last (the Note above)."""
    for group in groups:
        if gathered_only and not group.is_unsharded:
            continue
        for fp in group.fsdp_params:
            sharded = fp.sharded_param
            last = getattr(fp, _LAST, sharded.requires_grad)
            gathered = fp.__dict__.get("_unsharded_param")  # absent before the first gather
            if gathered is not None and gathered.requires_grad != last:
                flag = gathered.requires_grad
                sharded.requires_grad_(flag)
            elif sharded.requires_grad != last:
                flag = sharded.requires_grad
                if gathered is not None:
                    gathered.requires_grad_(flag)
            else:
                continue
            setattr(fp, _LAST, flag)
