"""Scaling recipes: FP8 formats per tensor role, scales from amaxes, the delayed recipe's state.

A tensor ``x`` is stored in FP8 as ``q = cast(x * scale)`` with ``scale = fp8_max / amax(x)``
(``/ 2**margin`` under ``delayed``), so its largest element lands on the format's largest
finite value; the GEMM multiplies by ``1 / scale`` again (``torch._scaled_mm`` takes these
dequantization scales).

[Note: delayed scaling state]
Under ``delayed`` each Fp8Linear has two persistent buffers, saved in checkpoints with the
model (DCP carries buffers; they are replicated, never sharded, under FSDP2):
``fp8_amax_history`` [3, history_len] fp32 and ``fp8_scale`` [3] fp32; row/entry 0 is the
input, 1 the weight, 2 the output gradient. Column 0 of the history is the current step's
amax; a cast records ``max(column 0, amax(tensor))`` while casting with ``fp8_scale`` (one
pass over the tensor; Triton fuses the two). Once per forward-backward,
:meth:`DelayedScalingSync.sync` all-reduces column 0 of every module in one collective (MAX
over data-parallel ranks, so every rank uses the same scales), sets
``fp8_scale = fp8_max / max(history) / 2**margin`` and rolls the history. It runs when the
last Fp8Linear backward of a forward-backward has finished (the sync object counts the training
forwards that will have a backward; forwards recomputed by activation checkpointing inside
backward do not count), on every rank at the same point since all ranks run the same modules
in the same order. So between steps, when checkpoints are written, column 0 is empty and the
state is the same on every rank: DCP saves rank 0's copy of these replicated buffers, which
must describe every rank. (A forward whose backward never ran leaves the sync pending; the next
training forward then runs it.) A scale of 0 means "no history yet" (a Python flag per role mirrors it, set by the sync and on load, so the hot path needs no host sync): that tensor is scaled dynamically (from
its current amax), as on the first step, so no run ever starts from a default scale of 1.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional

import torch
from torch import Tensor

from lightning_ampzero.config import Fp8Config
from lightning_ampzero.fp8 import kernels
from lightning_ampzero.fp8.kernels import EPS, FP8_MAX

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

#: Tensor roles, the row of the delayed recipe's state buffers.
INPUT, WEIGHT, GRAD = 0, 1, 2


def role_dtypes(config: Fp8Config) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """FP8 dtypes of (input, weight, output gradient): E4M3, E4M3, E5M2 for ``hybrid``."""
    grad = E5M2 if config.resolved_format == "hybrid" else E4M3
    return E4M3, E4M3, grad


def scale_from_amax(amax: Tensor, fp8_dtype: torch.dtype, margin: int = 0) -> Tensor:
    """``fp8_max / amax / 2**margin`` in fp32 (an all-zero tensor gets a finite scale)."""
    scale = FP8_MAX[fp8_dtype] / amax.float().clamp(min=EPS)
    return scale / 2.0**margin if margin else scale


class DelayedScalingSync:
    """The delayed recipe's once-per-step amax reduction and scale update, shared by a model's Fp8Linears.

    See [Note: delayed scaling state]. ``process_group`` (None = the default group) is the
    data-parallel group the amaxes are reduced over.
    """

    def __init__(self, config: Fp8Config, process_group: Any = None) -> None:
        self.config = config
        self.process_group = process_group
        self.pending = False  # a backward recorded amaxes since the last sync
        self.outstanding = 0  # training forwards whose backward has not run yet
        self._modules: list[weakref.ref] = []

    def register(self, modules: Iterable[torch.nn.Module]) -> None:
        self._modules.extend(weakref.ref(m) for m in modules)

    def modules(self) -> list[Any]:
        return [m for m in (r() for r in self._modules) if m is not None]

    def on_forward(self, will_backward: bool) -> Optional[bool]:
        """A training forward of one Fp8Linear (before its casts): what its backward passes to :meth:`on_backward`.

        True: counted (its backward may complete the step). False: a forward recomputed inside
        backward by activation checkpointing, not a new step (with non-reentrant checkpointing its
        backward never runs; with reentrant checkpointing it does, and marks the sync pending).
        None: no backward expected.
        """
        if torch._C._current_graph_task_id() != -1:
            return False
        if self.pending:
            self.sync()  # the previous step's backward did not reach every module
        if not will_backward:
            return None
        self.outstanding += 1
        return True

    def on_backward(self, counted: bool) -> None:
        """One Fp8Linear backward finished (after recording its gradient's amax)."""
        self.pending = True
        if counted and self.outstanding > 0:
            self.outstanding -= 1
            if self.outstanding == 0:
                self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        self.pending = False
        self.outstanding = 0
        mods = self.modules()
        if not mods:
            return
        hist = torch.stack([m.fp8_amax_history.float() for m in mods])  # [n, 3, H]
        current = hist[:, :, 0].contiguous()
        if self.config.reduce_amax:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1:
                dist.all_reduce(current, op=dist.ReduceOp.MAX, group=self.process_group)
        hist[:, :, 0] = current
        amax = hist.amax(dim=2)  # [n, 3]
        fp8_max = torch.tensor([FP8_MAX[d] for d in role_dtypes(self.config)], device=amax.device)
        old = torch.stack([m.fp8_scale.float() for m in mods])
        scale = torch.where(amax > 0, fp8_max / amax.clamp(min=EPS) / 2.0**self.config.margin, old)
        hist = hist.roll(1, dims=2)
        hist[:, :, 0] = 0
        ready = (scale > 0).tolist()  # one host sync per step
        for i, m in enumerate(mods):
            m.fp8_amax_history.copy_(hist[i])
            m.fp8_scale.copy_(scale[i])
            m._fp8_ready = tuple(ready[i])


def current_scale(module: Optional[Any], role: int, x: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Optional[Tensor]]:
    """The scale to cast ``x`` with, and the amax slot to record into (delayed recipe), for one role.

    ``module`` is the Fp8Linear under the delayed recipe, else None (dynamic scaling). A module
    in eval mode uses its scales but records nothing.
    """
    if module is None:
        return scale_from_amax(kernels.amax(x), fp8_dtype), None
    record = module.fp8_amax_history[role, 0:1] if module.training else None
    if module._fp8_ready[role]:
        return module.fp8_scale[role].float(), record
    a = kernels.amax(x)
    if record is not None:
        torch.maximum(record, a.reshape(1), out=record)
    return scale_from_amax(a, fp8_dtype), None
