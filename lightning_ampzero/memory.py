"""Per-rank model-state memory: measured from the tensors, and the ZeRO formula beside it.

Measurement counts storages, not tensors: views into one FSDP2 all-gather or reduce-scatter
buffer are counted once, and a freed FSDP2 buffer (storage resized to 0) counts nothing.

Categories (fp32 Adam; Ψ parameters, N data-parallel ranks):

=========  ==============  ==============  =================================
stage      parameters      gradients       optimizer states (+ master copy)
=========  ==============  ==============  =================================
0 (DDP)    4Ψ              4Ψ              8Ψ (updated in place: no master)
1          4Ψ gathered     4Ψ (accumulated 12Ψ/N (8 states + 4 fp32 shard)
                           until the step)
2          4Ψ gathered     4Ψ/N            12Ψ/N
3          4Ψ/N            4Ψ/N            8Ψ/N (the shard is the master)
=========  ==============  ==============  =================================

This is the ZeRO paper's (p + g + K) accounting with the parameter copy a rank computes
with in "parameters" and the fp32 copy the optimizer updates in K: under stages 1-2 FSDP2
keeps both (the gathered copy for forward/backward and the sharded fp32 copy), under stage 3
the shard is the only copy. Low-precision variants change the byte counts per element
(``param_bytes``, ``grad_bytes``, ``master_bytes``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Optional

import torch
from torch import nn

from lightning_ampzero._local import local_tensor

CATEGORIES = ("params", "grads", "optimizer")


@dataclass(frozen=True)
class ModelStateBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def zero_formula(
    numel: int,
    world_size: int,
    stage: int,
    *,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    state_bytes: int = 8,
    master_bytes: int = 4,
) -> ModelStateBytes:
    """Expected model-state bytes per rank (see the table in this module's docstring).

    ``state_bytes``: optimizer states per parameter (8 for Adam's two fp32 moments);
    ``master_bytes``: the fp32 copy the optimizer updates, counted in the optimizer column
    whenever the compute parameters are a separate copy (stages 1-2, or a low-precision
    ``param_bytes``).
    """
    n, psi = world_size, numel
    separate_master = stage in (1, 2) or param_bytes != master_bytes
    master = master_bytes if separate_master else 0
    if stage == 0:
        return ModelStateBytes(param_bytes * psi, grad_bytes * psi, (state_bytes + master) * psi)
    params = param_bytes * psi if stage in (1, 2) else param_bytes * psi // n
    grads = grad_bytes * psi if stage == 1 else grad_bytes * psi // n
    return ModelStateBytes(params, grads, (state_bytes + master) * psi // n)


class _Storages:
    def __init__(self) -> None:
        self.seen: set[int] = set()

    def skip(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages (memory that is not the model's: offload's)."""
        for t in tensors:
            self.add(t)

    def add(self, t: Optional[torch.Tensor]) -> int:
        if t is None or not isinstance(t, torch.Tensor):
            return 0
        s = local_tensor(t).untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() in self.seen:
            return 0
        self.seen.add(s.data_ptr())
        return s.nbytes()


def fsdp_param_groups(module: nn.Module) -> list:
    """FSDP2's parameter groups (one per ``fully_shard`` unit) under ``module``, each once."""
    from torch.distributed.fsdp import FSDPModule

    from lightning_ampzero.zero.groups import module_param_groups

    groups: dict[int, Any] = {}
    for m in module.modules():
        if isinstance(m, FSDPModule):
            for group in module_param_groups(m):  # [Note: FSDP2 across torch versions]
                groups.setdefault(id(group), group)
    return list(groups.values())


def _fsdp_params(module: nn.Module) -> list:
    return [fp for group in fsdp_param_groups(module) for fp in group.fsdp_params]


def measure_model_state(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> dict[str, int]:
    """Bytes of parameters (sharded, gathered), gradients and optimizer state held now on this rank.

    Returns ``params_sharded``, ``params_gathered``, ``grads``, ``optimizer`` and ``offloaded``.
    Offload (lightning_ampzero.offload) is not counted where it put the states: shards and gradients in
    a swap file are on the drive, and an offloading optimizer's master weights and moments are in its
    store. ``offloaded`` is the host memory the offload holds instead: the store's host copy or NVMe
    buffers, the parameter swapper's read pool (and its swap file, on tmpfs), the shards and gradient shards FSDP2's
    ``CPUOffloadPolicy`` keeps on the host (what the estimate's ``cpu`` column counts).
    """
    from lightning_ampzero.offload.grads import grad_swapper
    from lightning_ampzero.offload.params import param_swapper

    seen = _Storages()
    sharded = gathered = grads = 0
    swapped_params = param_swapper(module)
    for swapper in (swapped_params, grad_swapper(module)):
        if swapper is not None:
            seen.skip(swapper.held_tensors())
    offloaded = swapped_params.host_bytes() if swapped_params is not None else 0
    fsdp = _fsdp_params(module)
    covered: set[int] = set()
    for fp in fsdp:
        if getattr(fp, "offload_to_cpu", False):  # CPUOffloadPolicy (offload_param="cpu" on an accelerator)
            offloaded += seen.add(fp._sharded_param_data) + seen.add(fp.sharded_param.grad)
        else:
            sharded += seen.add(fp._sharded_param_data)
        covered.add(id(fp.sharded_param))
        unsharded = getattr(fp, "_unsharded_param", None)
        if unsharded is not None:
            gathered += seen.add(unsharded)
            covered.add(id(unsharded))
    for p in module.parameters():
        if id(p) not in covered:
            gathered += seen.add(p)
    for fp in fsdp:
        grads += seen.add(fp.sharded_param.grad)
        grads += seen.add(getattr(fp, "unsharded_accumulated_grad", None))
        unsharded = getattr(fp, "_unsharded_param", None)
        if unsharded is not None:
            grads += seen.add(unsharded.grad)
    for p in module.parameters():
        grads += seen.add(p.grad)
    opt_bytes = 0
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)  # LightningOptimizer
        if hasattr(opt, "host_bytes"):  # OffloadedAdam: its state is views of its store
            offloaded += opt.host_bytes()
            continue
        for state in opt.state.values():
            for v in state.values():
                opt_bytes += seen.add(v)
    return {"params_sharded": sharded, "params_gathered": gathered, "grads": grads, "optimizer": opt_bytes,
            "offloaded": offloaded}


def device_bytes(measured: dict[str, int]) -> int:
    """The model states a :func:`measure_model_state` result holds on the device: all but ``offloaded``,
    which is in host memory (a peak over both would mix the two memories)."""
    return sum(v for k, v in measured.items() if k != "offloaded")


def unsharded_grad_bytes(module: nn.Module) -> int:
    """Bytes of FSDP2's unsharded gradients held now (a unit's, between its backward and its reduce-scatter).

    Part of ``measure_model_state``'s ``grads``; the estimate counts them in the working set.
    """
    seen = _Storages()
    total = 0
    for fp in _fsdp_params(module):
        total += seen.add(getattr(fp, "unsharded_accumulated_grad", None))
        unsharded = getattr(fp, "_unsharded_param", None)
        if unsharded is not None:
            total += seen.add(unsharded.grad)
    return total


def as_zero_categories(measured: dict[str, int], stage: int) -> ModelStateBytes:
    """Map a measurement to the formula's columns (where the sharded fp32 copy belongs depends on the stage)."""
    if stage in (1, 2):
        return ModelStateBytes(measured["params_gathered"], measured["grads"], measured["optimizer"] + measured["params_sharded"])
    return ModelStateBytes(measured["params_gathered"] + measured["params_sharded"], measured["grads"], measured["optimizer"])


class PeakModelState:
    """Keeps the per-category peak of successive :func:`measure_model_state` samples."""

    def __init__(self) -> None:
        self.peak: dict[str, int] = {}

    def sample(self, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> dict[str, int]:
        m = measure_model_state(module, optimizers)
        for k, v in m.items():
            self.peak[k] = max(self.peak.get(k, 0), v)
        return m
