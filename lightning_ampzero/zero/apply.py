"""``apply_zero(model, mesh, cfg)``: ZeRO stages 1-3 as FSDP2 transforms, in place.

Stage semantics on FSDP2 (DESIGN.md):

* stage 1: optimizer state sharded. Parameters are gathered once per optimizer step and kept
  for forward and backward (``reshard_after_forward=False``); under gradient accumulation
  the full gradients accumulate locally and are reduce-scattered once, at the last
  micro-batch (see :func:`no_sync`).
* stage 2: + gradients sharded: reduce-scatter after every micro-batch's backward.
* stage 3: + parameters sharded: gathered per unit just before use and freed right after
  (``reshard_after_forward=True``, or an int for hpZ), with explicit prefetch and small
  units kept gathered (persistence threshold).

Stage 0 is plain DDP and handled by the strategy; it never reaches this module.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping, Optional

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from lightning_ampzero.config import ZeroConfig
from lightning_ampzero.zero.units import Unit, find_blocks, group_units, leftover_modules


def _reshard_after_forward(cfg: ZeroConfig, unit: Unit) -> "bool | int":
    if cfg.stage < 3:
        return False
    if unit.numel < cfg.param_persistence_threshold:
        # [Note: persistent units] gathering a tiny unit twice costs two collective latencies
        # for almost no memory; DeepSpeed keeps such parameters gathered, and so do we.
        return False
    if cfg.hpz_partition_size > 1:
        return cfg.hpz_partition_size
    return True


def _prefetch_targets(units: list[Unit], budget: int) -> list[list[nn.Module]]:
    """For each unit, the following units whose elements fit in ``budget`` (at least one)."""
    targets: list[list[nn.Module]] = []
    for i in range(len(units)):
        chosen, used = [], 0
        for nxt in units[i + 1 :]:
            if chosen and used + nxt.numel > budget:
                break
            chosen.append(nxt.modules[0])
            used += nxt.numel
        targets.append(chosen)
    return targets


def apply_zero(
    model: nn.Module,
    mesh: DeviceMesh,
    cfg: ZeroConfig,
    mp_policy: Optional[MixedPrecisionPolicy] = None,
    *,
    module_policies: Optional[Mapping[nn.Module, MixedPrecisionPolicy]] = None,
    offload_policy: Optional[OffloadPolicy] = None,
) -> list[Unit]:
    """Shard ``model`` in place for ``cfg.stage`` (1-3); returns the communication units, root last.

    ``mp_policy`` applies to every unit. ``module_policies`` (from the precision plugin) names
    modules that need a different policy: FSDP2 takes one policy per unit, so each becomes a unit
    of its own, nested inside its block's unit (or, if it is a unit already, that unit takes the
    policy). The nested units are not in the returned list. ``offload_policy`` (every unit):
    FSDP2's ``CPUOffloadPolicy`` for ``offload.offload_param='cpu'`` (offload/setup.py).
    """
    if cfg.stage == 0:
        raise ValueError("apply_zero handles stages 1-3; stage 0 is plain DDP (the strategy wraps it).")
    if cfg.hpz_partition_size > 1 and mesh.size() % cfg.hpz_partition_size:
        raise ValueError(
            f"zero.hpz_partition_size={cfg.hpz_partition_size} must divide the data-parallel world size"
            f" {mesh.size()}."
        )
    mp_policy = mp_policy or MixedPrecisionPolicy()
    offload_policy = offload_policy or OffloadPolicy()  # the base class means "no offload"
    blocks = find_blocks(model, cfg.wrap_modules)
    units = group_units(blocks, cfg.unit_size)
    for run in leftover_modules(model, blocks):
        units.extend(group_units(run, cfg.unit_size))
    # [precision] modules with a policy of their own (e.g. the Linear layers under "-mixed"),
    # sharded first: bottom-up, a unit's parameters are those no inner unit claimed.
    module_policies = dict(module_policies or {})
    single = {id(u.modules[0]) for u in units if len(u.modules) == 1}
    for name, module in model.named_modules():
        if module in module_policies and module is not model and id(module) not in single:
            numel = sum(p.numel() for p in module.parameters())
            fully_shard(module, mesh=mesh, reshard_after_forward=_reshard_after_forward(cfg, Unit([module], [name], numel)),
                        mp_policy=module_policies[module], offload_policy=offload_policy)
    # Bottom-up: inner units first, so the root unit keeps only what no unit claimed.
    for unit in units:
        if len(unit.modules) == 1:
            target, policy = unit.target, module_policies.get(unit.modules[0], mp_policy)
        else:
            # [precision] a grouped unit leaves out the members sharded above with their own policy.
            rest = [m for m in unit.modules if m not in module_policies]
            if not rest:
                continue
            target, policy = (rest[0] if len(rest) == 1 else rest), mp_policy
        fully_shard(target, mesh=mesh, reshard_after_forward=_reshard_after_forward(cfg, unit), mp_policy=policy,
                    offload_policy=offload_policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=cfg.stage == 3, mp_policy=mp_policy, offload_policy=offload_policy)

    # Prefetch follows execution order, which for the usual model (embeddings, blocks, head)
    # is module order; units are sorted by the position of their first module.
    order = {id(m): i for i, m in enumerate(model.modules())}
    units.sort(key=lambda u: order[id(u.modules[0])])
    if cfg.stage == 3 and cfg.prefetch_bucket_size > 0 and len(units) > 1:
        budget = int(cfg.prefetch_bucket_size)
        for unit, targets in zip(units, _prefetch_targets(units, budget)):
            if targets:
                unit.modules[0].set_modules_to_forward_prefetch(targets)
        reverse = units[::-1]
        for unit, targets in zip(reverse, _prefetch_targets(reverse, budget)):
            if targets:
                unit.modules[0].set_modules_to_backward_prefetch(targets)
    root_numel = sum(p.numel() for p in model.parameters()) - sum(u.numel for u in units)
    return units + [Unit([model], [""], root_numel)]


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def no_sync(model: nn.Module, stage: int) -> Iterator[None]:
    """Context for a non-final micro-batch of gradient accumulation.

    Stages 1 and 2 keep their parameters gathered across micro-batches (no re-gather: the full
    parameters are part of their memory budget anyway). Stage 1 also keeps full gradients
    locally and reduces them once; stages 2 and 3 reduce-scatter every micro-batch, which is
    what bounds their gradient memory to a shard.
    """
    modules = fsdp_modules(model)
    if stage in (1, 2):
        for m in modules:
            m.set_reshard_after_backward(False, recurse=False)
    if stage == 1:
        for m in modules:
            m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for m in modules:
            m.set_reshard_after_backward(True, recurse=False)
            m.set_requires_gradient_sync(True, recurse=False)
