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

import functools
import warnings
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, ContextManager, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils._pytree import tree_leaves

from lightning_ampzero.config import ZeroConfig
from lightning_ampzero.precision.policy import warn_if_run_without_autocast
from lightning_ampzero.zero.comm import (
    HAS_CUSTOM_REDUCE_SCATTER,
    CommDtypePolicy,
    LowPrecisionReduceScatter,
    cast_inputs_to,
    gather_in_low_dtype,
    install_gloo_comms,
    install_mixed_wire,
)
from lightning_ampzero.zero.buffers import buffer_broadcast_of, install_buffer_broadcast
from lightning_ampzero.zero.groups import param_groups
from lightning_ampzero.zero.recover import in_step_method, reset_interrupted_step, step_entry
from lightning_ampzero.zero.scalars import average_scalar_gradients, prepare_parameters_, scalar_parameters
from lightning_ampzero.zero.trainable import record_requires_grad, sync_requires_grad
from lightning_ampzero.zero.units import Unit, kept_for_reuse, plan_units, region
from lightning_ampzero.zero.uses import sum_uses_in_fp32


def _reshard_after_forward(cfg: ZeroConfig, numel: int) -> "bool | int":
    """Per FSDP2 group (one ``fully_shard`` call): ``numel`` is the elements that group gathers."""
    if cfg.stage < 3:
        return False
    if numel < cfg.param_persistence_threshold:
        # [Note: persistent units] gathering a tiny unit twice costs two collective latencies
        # for almost no memory; DeepSpeed keeps such parameters gathered, and so do we.
        return False
    if cfg.hpz_partition_size > 1:
        return cfg.hpz_partition_size
    return True


def _kept_for_reuse(cfg: ZeroConfig, forward: list[Unit]) -> set[int]:
    """Stage 3: ids of the groups (``forward``: in forward order) kept gathered until their backward ([Note: reuse distance] in units.py)."""
    if cfg.stage != 3 or cfg.max_reuse_distance <= 0:
        return set()
    flags = kept_for_reuse([g.numel for g in forward], cfg.max_reuse_distance, cfg.param_persistence_threshold)
    return {id(g) for g, keep in zip(forward, flags) if keep}


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


def _numel(modules: list[nn.Module], exclude: "set[int] | frozenset[int]" = frozenset()) -> int:
    """Elements of the parameters under ``modules``, each parameter once, less those in ``exclude`` (ids)."""
    params = {id(p): p for m in modules for p in m.parameters() if id(p) not in exclude}
    return sum(p.numel() for p in params.values())


def _policy_groups(
    unit: Unit, module_policies: Mapping[nn.Module, MixedPrecisionPolicy], names: Mapping[int, str],
    stop: "set[int] | frozenset[int]" = frozenset(),
) -> list[tuple[Unit, MixedPrecisionPolicy]]:
    """The modules under ``unit`` that have a policy of their own, one group per policy, innermost group first.

    [Note: low-precision groups] FSDP2 takes one MixedPrecisionPolicy per ``fully_shard`` call,
    and a call may take a list of modules: one parameter group, one all-gather and one
    reduce-scatter for all of them, its pre-forward on the first module that runs and its
    post-forward once all have run (torch 2.13 ``_register_group_forward_hooks``). So the modules
    of a unit that share a policy (under "-mixed" the Linear layers of a block) make one group
    together, and the unit costs two groups instead of one per Linear. Measured on the CPU suite's
    bf16-mixed GPT (benchmarks/results/bf16_mixed_units/): one FSDP2 unit per Linear took 41 / 61
    / 121 collectives per step at stages 1 / 2 / 3 and 1.3-1.7x DeepSpeed's step time; grouped,
    11 / 16 / 31 and 0.92-1.12x, with identical losses (a model that fits one bucket has since become
    one unit below stage 3: [Note: units below stage 3] in units.py; and on gloo the safe modules
    no longer need a group at all: [Note: one group, two wire dtypes] and [Note: safe modules
    gathered in the low dtype inside their unit's group] in comm.py). A module inside another of the same group
    is covered by it; groups nested in one another are sharded innermost first (bottom-up, as
    every FSDP2 unit). ``stop``: ids of the modules of units sharded before this one (inside it):
    their modules belong to them (:func:`lightning_ampzero.zero.units.region`).
    """
    found: dict[MixedPrecisionPolicy, list[nn.Module]] = {}
    for sub in region(unit.modules, stop):
        policy = module_policies.get(sub)
        if policy is not None:
            found.setdefault(policy, []).append(sub)
    groups: list[tuple[list[nn.Module], MixedPrecisionPolicy, set[int]]] = []
    for policy, mods in found.items():
        below = {id(s) for m in mods for s in m.modules() if s is not m}
        mods = [m for m in mods if id(m) not in below]
        groups.append((mods, policy, below | {id(m) for m in mods}))
    ordered: list[tuple[Unit, MixedPrecisionPolicy]] = []
    while groups:
        # innermost: a group none of whose modules holds a module of another remaining group
        inner = [g for g in groups if not any(h is not g and any(id(m) in g[2] for m in h[0]) for h in groups)]
        if not inner:
            raise ValueError(
                f"module_policies nest modules of different policies inside each other both ways in unit"
                f" {unit.names}: FSDP2 shards bottom-up and cannot order them. Give the nested modules one policy."
            )
        mods, policy, _ = inner[0]
        groups.remove(inner[0])
        ordered.append((Unit(mods, [names[id(m)] for m in mods], _numel(mods)), policy))
    return ordered


def _check_one_group_per_parameter(model: nn.Module, plan: list[Unit], names: Mapping[int, str]) -> None:
    """Refuse, before any ``fully_shard``, a parameter that two planned groups (or a group and the root) manage.

    FSDP2 would fail at the first forward ("is shared with a parameter already managed by another
    FSDP group"). ``plan_units`` merges the units that share a parameter ([Note: shared
    parameters] in units.py); what is left is a module given a policy of its own (``module_policies``)
    whose parameter another module outside it also holds.
    """
    def where(i: int) -> str:
        return "the root" if i == len(plan) else f"the group of {plan[i].names}"

    owner: dict[int, tuple[int, str]] = {}
    done: set[int] = set()
    for index, group in enumerate([*plan, Unit([model], [""], 0)]):
        for module in region(group.modules, done - {id(m) for m in group.modules}):
            for pname, p in module.named_parameters(recurse=False):
                holder = f"{names.get(id(module), '?')}.{pname}".lstrip(".")
                first = owner.setdefault(id(p), (index, holder))
                if first[0] != index:
                    raise ValueError(
                        f"Parameter {holder!r} is the same tensor as {first[1]!r}, but {where(index)} and"
                        f" {where(first[0])} would each shard it: FSDP2 shards a parameter in one group only and"
                        " would fail at the first step. Give both modules the same module policy (or none), so"
                        " that they are sharded together, or untie the parameter."
                    )
        done.update(id(m) for m in group.modules)


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
    modules that need a different policy: FSDP2 takes one policy per ``fully_shard`` call, so inside
    each unit the modules sharing a policy are sharded together as one group nested in the unit
    (see [Note: low-precision groups]), and the rest of the unit keeps ``mp_policy``; a unit made
    only of such modules takes their policy. A module with a policy outside every unit is a group
    of its own. The nested groups are not in the returned list. ``offload_policy`` (every unit):
    FSDP2's ``CPUOffloadPolicy`` for ``offload.offload_param='cpu'`` (offload/setup.py).

    Modules that share a parameter are sharded in one group ([Note: shared parameters] in
    units.py); a plan that would still shard a parameter in two groups is refused here. A model
    with persistent buffers (BatchNorm statistics) gets DDP's buffer broadcast on its forward
    ([Note: buffer broadcast] in buffers.py).
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
    prepare_parameters_(model)  # [Note: parameters FSDP2 refuses] in scalars.py
    scalars = scalar_parameters(model)  # [Note: 0-dim parameters] in scalars.py: replicated
    units = plan_units(model, cfg.wrap_modules, cfg.unit_size, cfg.stage)  # [Note: units below stage 3]
    module_policies = dict(module_policies or {})
    # stage 3: [Note: safe modules gathered in the low dtype inside their unit's group] in comm.py
    gather = {m: p.gather_dtype for m, p in module_policies.items()
              if cfg.stage == 3 and getattr(p, "gather_dtype", None) is not None}
    wire = _wire_dtypes(mesh, cfg, mp_policy, module_policies, offload=type(offload_policy) is not OffloadPolicy)
    names = {id(m): n for n, m in model.named_modules()}

    # Every fully_shard call is one FSDP2 group, planned first (in the order they are sharded:
    # bottom-up, inner groups first, so each unit, and last the root, keeps only what no inner
    # group claimed), checked, then sharded; ``groups`` keeps them for prefetch.
    plan: list[tuple[Unit, MixedPrecisionPolicy]] = []
    tops = {id(m) for u in units for m in u.modules}
    in_units = {id(s) for u in units for m in u.modules for s in m.modules()}
    # [precision] modules with a policy of their own outside every unit: one group per policy.
    outside = {m: p for m, p in module_policies.items() if m is not model and id(m) not in in_units}
    plan.extend(_policy_groups(Unit([model], [""], 0), outside, names, stop=tops))
    for unit in units:
        stop = tops - {id(m) for m in unit.modules}
        # [precision] the modules of the unit that share a policy, one group per policy.
        claimed: set[int] = set()
        for group, policy in _policy_groups(unit, module_policies, names, stop):
            plan.append((group, policy))
            claimed.update(id(p) for m in group.modules for p in m.parameters())
        rest = [m for m in unit.modules if m not in module_policies]
        if rest:
            params = {id(p): p for m in region(rest, stop) for p in m.parameters(recurse=False)}
            plan.append((Unit(rest, [names[id(m)] for m in rest],
                              sum(p.numel() for i, p in params.items() if i not in claimed)), mp_policy))
    _check_one_group_per_parameter(model, [g for g, _ in plan], names)

    groups: list[Unit] = []
    # [Note: reduce-scatters in flight] in comm.py: nothing reads a unit's reduced gradients before
    # backward ends (stage 3's gradient offload, which does, finishes them first: offload/grads.py).
    overlap = cfg.overlap_comm
    gloo: list[Unit] = []  # groups given the ring collectives
    # Forward order: a group's forward starts at its first module to run (module pre-order; see the
    # prefetch below). [Note: reuse distance] in units.py keeps the last ones gathered for their backward.
    pre = {id(m): i for i, m in enumerate(model.modules())}
    starts = lambda g: min(pre[id(m)] for m in g.modules)  # noqa: E731
    kept = _kept_for_reuse(cfg, sorted((g for g, _ in plan), key=starts))
    for group, policy in plan:
        reshard = False if id(group) in kept else _reshard_after_forward(cfg, group.numel)
        fully_shard(group.target, mesh=mesh, reshard_after_forward=reshard,
                    mp_policy=policy, offload_policy=offload_policy, ignored_params=scalars or None)
        comm_dtype = getattr(policy, "comm_dtype", None)
        if comm_dtype is not None:  # [precision] see [Note: stage 1 accumulation dtype] in comm.py
            group.modules[0].set_custom_reduce_scatter(LowPrecisionReduceScatter(comm_dtype))
        if mesh.ndim == 1 and install_gloo_comms(  # [Note: gloo collectives by a ring] in comm.py
                group.modules[0], mesh.get_group(), reduce_scatter=comm_dtype is None, overlap=overlap):
            gloo.append(group)
        groups.append(group)
    fully_shard(model, mesh=mesh, reshard_after_forward=cfg.stage == 3, mp_policy=mp_policy, offload_policy=offload_policy,
                ignored_params=scalars or None)
    average_scalar_gradients(scalars, mesh, model)
    # Stage 3 has its own prefetch chain (below); starting its all-gathers asynchronously measured no gain.
    if (mesh.ndim == 1 and install_gloo_comms(model, mesh.get_group(), overlap=overlap) and overlap and gloo
            and cfg.stage < 3):
        _prefetch_forward_on_gloo(model, gloo)
    if wire:  # [Note: one group, two wire dtypes] in comm.py; a safe module's submodules are it
        owners = {sub: dtype for m, dtype in wire.items() for sub in m.modules()}
        low = {sub: gather[m] for m in wire if m in gather for sub in m.modules()}
        for target in [g.modules[0] for g in groups] + [model]:
            install_mixed_wire(target, owners, overlap=overlap)
            if low:  # stage 3: also with an fp32 wire ([Note: the safe modules' gradients on gloo])
                gather_in_low_dtype(target, low)
        for module in (m for m in wire if m in gather):
            cast_inputs_to(module, gather[module])
    for module, dtype in gather.items():  # [Note: a safe module run with autocast off] in precision/policy.py
        warn_if_run_without_autocast(module, names.get(id(module), ""), dtype)
    if gather:  # [Note: a module used twice in one backward] in uses.py
        sum_uses_in_fp32(model, {sub: None for m in gather for sub in m.modules()})
    # [Note: buffer broadcast] in zero/buffers.py: running statistics as DDP keeps them.
    # Every rank of the mesh holds a replica of the buffers (FSDP2 shards parameters only).
    install_buffer_broadcast(model, mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group())
    for target in [g.modules[0] for g in groups] + [model]:
        _hook_view_bases(target)  # [Note: a group's output modified in place]

    if cfg.stage == 3 and cfg.prefetch_bucket_size > 0:
        # Prefetch follows execution order, which for the usual model (embeddings, blocks, head)
        # is module order: a group's forward starts at its first module to run (module pre-order)
        # and its backward where its forward ended (the last module to finish, module post-order,
        # backward runs it first). So a block's own group comes before its Linear group in both
        # passes, and the head's group before ln_f's in backward.
        post = {id(m): i for i, m in enumerate(_post_order(model))}
        budget = int(cfg.prefetch_bucket_size)
        # A persistent group (under param_persistence_threshold) stays gathered: it needs no
        # prefetch and must not take a slot of the chain, or the next resharded group would be
        # prefetched only by the persistent group running just before it (no overlap). A group
        # kept for reuse is gathered in forward like the others, and is still there for backward.
        chain = [g for g in groups if _reshard_after_forward(cfg, g.numel) is not False]
        forward = sorted(chain, key=starts)
        backward = sorted((g for g in chain if id(g) not in kept), key=lambda g: max(post[id(m)] for m in g.modules),
                          reverse=True)
        for group, targets in zip(forward, _prefetch_targets(forward, budget)):
            if targets:
                group.modules[0].set_modules_to_forward_prefetch(targets)
        for group, targets in zip(backward, _prefetch_targets(backward, budget)):
            if targets:
                group.modules[0].set_modules_to_backward_prefetch(targets)
    order = {id(m): i for i, m in enumerate(model.modules())}
    units.sort(key=lambda u: order[id(u.modules[0])])
    root_numel = sum(p.numel() for p in model.parameters()) - sum(u.numel for u in units)
    return units + [Unit([model], [""], root_numel)]


# [Note: a group's output modified in place]
# FSDP2 gathers a group's parameters for backward from a hook on the group's forward output
# (``_register_pre_backward_hook``). A hook on a view is lost when the view is modified in place,
# and a Linear on a 3-D input returns a view (of its 2-D matmul); so ``h = self.fc2(x); h += x``
# or ``nn.ReLU(inplace=True)`` after such a Linear left the group of ``fc2`` unhooked. At stage 3
# its parameters were then freed when backward reached it, and the backward stopped with torch's
# ``setStorage ... storage of size 0``: under "-mixed" each block's Linears are such a group ([Note:
# low-precision groups]), and at any precision a unit that ends on a Linear (an output head whose
# logits are scaled in place). A new-user trial saw FSDP2's warning about it on every BERT layer.
# A hook on the view's base survives the in-place op (it fires with the gradient of the base's
# value before it), and the base's gradient is there before the Linear's backward runs; FSDP2's
# pre-backward is idempotent within a backward. So every group also hooks the bases of its view
# outputs, and FSDP2's warning, which that makes moot, is not shown.
def _hook_view_bases(module: nn.Module) -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state = module._get_fsdp_state()  # type: ignore[operator]
    register = state._register_pre_backward_hook
    if getattr(register, "_ampzero_view_bases", False):
        return

    def on_base(grad: torch.Tensor) -> torch.Tensor:
        # Only where the view's own hook was lost: otherwise this group is in its backward already.
        if state._training_state != TrainingState.PRE_BACKWARD:
            state._pre_backward(grad)
        return grad

    def hooked(output: object) -> object:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
            output = register(output)
        if torch.is_grad_enabled():
            for leaf in tree_leaves(output):
                base = getattr(leaf, "_base", None) if isinstance(leaf, torch.Tensor) else None
                if base is not None and leaf.requires_grad and base.grad_fn is not None:
                    base.register_hook(on_base)
        return output

    hooked._ampzero_view_bases = True  # type: ignore[attr-defined]
    state._register_pre_backward_hook = hooked


def overlap_comm_note(cfg: ZeroConfig, backend: str) -> Optional[str]:
    """Why ``zero.overlap_comm=False`` does nothing with this stage and backend, or None where it acts."""
    if cfg.overlap_comm or (cfg.stage in (1, 2, 3) and backend == "gloo"):
        return None
    if cfg.stage == 0:
        why = "stage 0 is DDP, whose bucketed all-reduce always runs beside backward"
    else:
        why = f"on {backend}, FSDP2 overlaps its collectives on its own CUDA streams"
    return (f"zero.overlap_comm=False has no effect here: {why}. It acts at stages 1-3 on gloo (CPU);"
            " drop the setting to silence this warning.")


def hpz_note(cfg: ZeroConfig, world_size: int) -> Optional[str]:
    """Why ``zero.hpz_partition_size`` changes nothing here, or None where it acts (a trial saw no sign either way)."""
    if cfg.stage != 3 or cfg.hpz_partition_size <= 1 or cfg.hpz_partition_size != world_size:
        return None
    return (f"zero.hpz_partition_size={cfg.hpz_partition_size} equals the number of processes, so the copy kept"
            " for backward is sharded over all of them, as plain stage 3 shards it: hpZ changes nothing here. It"
            " keeps backward's all-gathers inside a node when set to the processes per node, with several nodes."
            " Units under zero.param_persistence_threshold stay gathered either way.")


def _prefetch_forward_on_gloo(model: nn.Module, groups: list[Unit]) -> None:
    """Below stage 3 on gloo: each group's all-gather starts as the group before it starts its forward.

    Stages 1-2 gather every group once a step, in the next forward (backward frees them). On CPU
    FSDP2 waits on an all-gather as soon as it starts it, unless it was prefetched with
    ``async_op``; so each group prefetches the next one in forward order (the root the first one),
    asynchronously, and the ring's bytes ([Note: gloo collectives by a ring] in comm.py) move in
    gloo's threads during the group's forward. Memory: the next group is gathered one group earlier,
    and stages 1-2 hold the whole model gathered through backward anyway.
    """
    pre = {id(m): i for i, m in enumerate(model.modules())}
    forward = sorted(groups, key=lambda g: min(pre[id(m)] for m in g.modules))
    for before, group in zip([model] + [g.modules[0] for g in forward], forward):
        before.set_modules_to_forward_prefetch([group.modules[0]])
    for group in forward:
        group.modules[0]._set_unshard_async_op(True)


def _wire_dtypes(mesh: DeviceMesh, cfg: ZeroConfig, mp_policy: MixedPrecisionPolicy,
                 module_policies: dict[nn.Module, MixedPrecisionPolicy], *,
                 offload: bool = False) -> dict[nn.Module, torch.dtype]:
    """Decide, from the mesh, how the modules of a :class:`CommDtypePolicy` reduce; edits ``module_policies``.

    The precision plugin asks that the ``lower_precision_safe_modules`` send their gradients in
    the low dtype (CommDtypePolicy), below stage 3 accumulating them in fp32, at stage 3 also
    gathering their parameters in it (``gather_dtype``). How is a sharding matter, decided here
    where the mesh is known:

    * a 1-D gloo mesh: the modules stay in their unit's group and a MixedWireReduceScatter sends
      their part of its gradients in the low dtype ([Note: one group, two wire dtypes] in comm.py);
      at stage 3 their parameters also gather in the low dtype inside that group ([Note: safe
      modules gathered in the low dtype inside their unit's group] in comm.py), unless parameters
      are offloaded (``offload``: FSDP2 copies those in from the host its own way); returned as
      ``{module: wire dtype}`` and removed from ``module_policies``;
    * stage 1 elsewhere: a group of their own with LowPrecisionReduceScatter ([Note: stage 1
      accumulation dtype] in comm.py);
    * stage 2 elsewhere: a group of their own reduce-scattered in the low dtype by FSDP2 itself
      (stage 2 accumulates the fp32 shards, so only the wire is low; on CUDA FSDP2's packing
      into a low-dtype buffer is cheap and halves the transient buffer);
    * stage 3 elsewhere: a group of their own gathered and reduce-scattered in the low dtype by FSDP2;
    * on any gloo mesh, a policy with ``low_on_gloo=False`` (``lower_precision_safe_modules=None``):
      removed, the modules' gradients go in fp32 with their unit's; at stage 3 on a 1-D mesh, without
      parameter offload, their parameters still gather in the low dtype inside that group (returned
      with the wire dtype fp32). [Note: the safe modules' gradients on gloo] in precision/policy.py.
    """
    wire: dict[nn.Module, torch.dtype] = {}
    if not HAS_CUSTOM_REDUCE_SCATTER:
        return wire
    on_gloo = dist.get_backend(mesh.get_group(0)) == "gloo"
    gloo = mesh.ndim == 1 and on_gloo
    for module, policy in list(module_policies.items()):
        if not isinstance(policy, CommDtypePolicy) or policy.comm_dtype is None:
            continue
        if on_gloo and not policy.low_on_gloo:  # [Note: the safe modules' gradients on gloo] in precision/policy.py
            if gloo and cfg.stage == 3 and not offload and policy.gather_dtype is not None:
                wire[module] = torch.float32  # gathered low inside the unit's group, reduced with the rest
            del module_policies[module]
            continue
        if cfg.stage == 3:
            together = gloo and not offload and policy.gather_dtype is not None and policy.reduce_dtype == policy.comm_dtype
            same_compute = (mp_policy.param_dtype, mp_policy.reduce_dtype) == (None, None)
        else:
            together = gloo
            same_compute = (policy.param_dtype, policy.reduce_dtype) == (mp_policy.param_dtype, mp_policy.reduce_dtype)
        if together and same_compute:
            wire[module] = policy.comm_dtype
            del module_policies[module]
        elif cfg.stage >= 2:
            module_policies[module] = MixedPrecisionPolicy(
                param_dtype=policy.param_dtype, reduce_dtype=policy.comm_dtype, output_dtype=policy.output_dtype,
                cast_forward_inputs=policy.cast_forward_inputs)
    return wire


def _post_order(module: nn.Module, seen: Optional[set[int]] = None) -> Iterator[nn.Module]:
    """``module.modules()`` in post-order (children before their parent), each module once."""
    seen = set() if seen is None else seen
    seen.add(id(module))
    for child in module.children():
        if id(child) not in seen:
            yield from _post_order(child, seen)
    yield module


def register_root_method(module: nn.Module, *names: str) -> None:
    """Make ``module.<name>()``, for each of ``names``, run FSDP2's root pre/post-forward, as ``forward`` does.

    torch's ``register_fsdp_forward_method`` with one difference. Lightning calls
    ``training_step`` (etc.), which usually calls ``self(x)``: a forward nested in the
    registered method, on the same root group. The inner post-forward leaves the group idle, and
    FSDP2 then ignores ``reshard_after_forward=False`` in the outer one (torch 2.13
    ``FSDPParamGroup.reshard`` checks it only in the FORWARD state), so stages 1-2 freed the
    root's parameters after every forward and gathered them again for backward: one extra
    all-gather of the root per micro-batch (measured: 3 all-gathers of the model per step with
    2 micro-batches, where ZeRO's formula has 1). The outer post-forward now sees the group
    still in forward and keeps it gathered.
    """
    if not isinstance(module, FSDPModule):
        return
    state = module._get_fsdp_state()
    buffers = buffer_broadcast_of(module)  # [Note: buffer broadcast]: DDP broadcasts in its forward, that runs the step
    groups = _param_groups_of(module, fresh=True)  # at setup: a second fit may have sharded it again
    for name in names:
        _wrap_root_method(module, name, state, buffers, groups)
    if not getattr(module, "_ampzero_in_step_hooks", False):
        # [Note: backward inside a step method]: the root, and what a step method calls of it
        hook = functools.partial(_before_forward_in_step, module)
        for target in (module, *module.children()):
            target.register_forward_pre_hook(hook, prepend=True)
        # [Note: a child called outside a step method]: a wrapped model's parts, called directly
        outside = functools.partial(_check_called_outside_step, module)
        for target in _entry_points(module):
            target.register_forward_pre_hook(outside, prepend=True)
        object.__setattr__(module, "_ampzero_in_step_hooks", True)


#: How deep below the LightningModule a part of the model is still checked when called directly
#: (:func:`_entry_points`): a Hugging Face model's encoder or decoder (``self.model.model.encoder``).
_ENTRY_DEPTH = 3


def _entry_points(root: nn.Module) -> list[nn.Module]:
    """The modules two or three levels below ``root`` holding parameters: what code outside a step calls.

    Hugging Face's encoder-decoder ``generate()`` runs ``get_encoder()(...)`` (T5's ``model.encoder``,
    BART's and Whisper's ``model.model.encoder``), never the wrapped model's own forward. The
    in-step hook stays on the root and its children; this one is cheap in a step (it returns at
    once) and there are few such modules. Not the blocks of a ``ModuleList`` (their parent's loop
    calls them, and they are what ``compile`` compiles, where a hook is a graph break) nor a
    compiled module.
    """
    out: list[nn.Module] = []
    level = list(root.children())
    for _ in range(_ENTRY_DEPTH - 1):
        level = [g for c in level if not isinstance(c, (nn.ModuleList, nn.ModuleDict)) for g in c.children()]
        out.extend(m for m in level if not isinstance(m, (nn.ModuleList, nn.ModuleDict))
                   and getattr(m, "_compiled_call_impl", None) is None and next(m.parameters(), None) is not None)
    return list({id(m): m for m in out}.values())


def _wrap_root_method(module: nn.Module, name: str, state: Any, buffers: Any, groups: list) -> None:
    """``module.<name>`` inside FSDP2's root pre/post-forward (:func:`register_root_method`)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    method = getattr(module, name)

    def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
        with step_entry(module):  # [Note: a step interrupted by an exception] in recover.py
            if buffers is not None:
                buffers.enter()
            try:
                sync_requires_grad(groups)  # [Note: requires_grad changed inside a step] in trainable.py
                args, kwargs = state._pre_forward(module, args, kwargs)
                out = method(*args, **kwargs)
                for group in param_groups(state):
                    if group._training_state == TrainingState.IDLE and not group._reshard_after_forward:
                        group._training_state = TrainingState.FORWARD  # a nested forward already ran
                return state._post_forward(module, args, out)
            finally:
                if buffers is not None:
                    buffers.exit()

    object.__setattr__(module, name, functools.wraps(method)(wrapped))


# [Note: backward inside a step method]
# Under manual optimization the backward (and the optimizer step) runs inside ``training_step``,
# that is inside the root's forward as :func:`register_root_method` makes it, and the step method
# usually calls a child (``self.model(input_ids=...)``), whose forward FSDP2's root never sees.
# So FSDP2 registered no hook on the loss: the backward left the root group's gradients on its
# gathered parameters, never reduced, and ``opt.step()`` found no gradient on the shards. At stages
# 1-2 with a model of one group (the default) every step was lost, silently (a new-user trial: the
# parameters after a step equal to the initial ones, bit for bit). Three things make it FSDP2's
# usual order again: :func:`prepare_manual_backward` hooks the loss as the root's forward would
# (FSDP2 then queues its end-of-backward callback, which reduces the root group and reshards it);
# :func:`after_manual_step` frees the root group's gathered copy after an optimizer step (it holds
# the old values); and a forward inside the step method, of the root or of a child, gathers the
# root group again when it is not (:func:`_before_forward_in_step`), so a GAN's second forward
# sees the updated parameters. Before that forward it also resets a step an exception interrupted
# ([Note: a step interrupted by an exception] in recover.py: a retry in the same step method).
def _before_forward_in_step(root: FSDPModule, module: nn.Module, args: object) -> None:
    if torch._C._current_graph_task_id() != -1:
        return
    group = root._get_fsdp_state()._fsdp_param_group
    if reset_interrupted_step(root, in_step=True) or in_step_method():
        if group is not None and not group.is_unsharded:
            root.unshard()
        # [Note: requires_grad changed inside a step] in trainable.py: a toggle_optimizer() just now
        sync_requires_grad(_param_groups_of(root), gathered_only=True)
    elif module is not root:
        _check_called_outside_step(root, module, args)


def _check_called_outside_step(root: FSDPModule, module: nn.Module, args: object) -> None:
    if torch._C._current_graph_task_id() != -1 or in_step_method():
        return
    # [Note: a child called outside a step method]
    # A hook (a sampling callback's on_train_epoch_end) calling ``self.model`` while the root's
    # parameters are sharded failed deep in the model with torch's "got mixed torch.Tensor and
    # DTensor", on every rank that called it: FSDP2 gathers the root only in the root's forward.
    # Gathering here would fix it only when every rank calls, and hang a call on rank 0 alone
    # (the common case) until the watchdog: so say where the model is whole instead. Units
    # inside the child gather themselves (every rank calling it after fit works at stage 3), and
    # a child holding none of the root's parameters (a torchmetrics metric) needs nothing. The
    # same for the parts a child's methods call directly (:func:`_entry_points`): T5's
    # generate() after fit at stage 2 stopped on torch's error (a new-user trial).
    group = root._get_fsdp_state()._fsdp_param_group
    if group is None or group.is_unsharded:
        return
    held = {id(fp.sharded_param) for fp in group.fsdp_params}
    if any(id(p) in held for p in module.parameters()):
        raise RuntimeError(OUTSIDE_STEP.format(name=own_class_name(module)))


OUTSIDE_STEP = (
    "{name} was called outside the LightningModule's step methods while ZeRO keeps its parameters sharded. "
    "Stages 1-3 gather them in each step and shard them again after the backward. Call it inside a step method, "
    "or from the validation hooks (validation_step, on_validation_epoch_end), where evaluation has gathered the "
    "model, on every rank or on rank 0 alone: for example, generate samples in on_validation_epoch_end instead of "
    "on_train_epoch_end. After trainer.fit() has returned, save the model on every rank "
    "(lightning_ampzero.hf.save_pretrained(model, out_dir)) and load it whole in one process "
    "(from_pretrained(out_dir)), or run trainer.predict() with generate() in predict_step.")


def _param_groups_of(root: nn.Module, fresh: bool = False) -> list:
    """The model's FSDP2 parameter groups, listed once (the step's hooks walk them), their flags recorded."""
    groups = root.__dict__.get("_ampzero_param_groups")
    if groups is None or fresh:
        from lightning_ampzero.memory import fsdp_param_groups

        groups = fsdp_param_groups(root)
        record_requires_grad(groups)
        object.__setattr__(root, "_ampzero_param_groups", groups)
    return groups


def gathers_in_other_dtypes(model: nn.Module) -> bool:
    """Whether some unit gathers parameters in a dtype other than their own (stage 3 "-mixed": the Linears)."""
    from lightning_ampzero.memory import fsdp_param_groups

    for group in fsdp_param_groups(model):
        if getattr(group, "_ampzero_gathers_low", False):  # per parameter: gather_in_low_dtype in comm.py
            return True
        wanted = group.mp_policy.param_dtype  # (FSDPParam's own dtype attributes exist only after lazy init)
        if wanted is not None and any(fp.sharded_param.dtype != wanted for fp in group.fsdp_params):
            return True
    return False


def run_outside_steps_in(root: nn.Module, context: Callable[[], ContextManager[None]]) -> None:
    """Run a call of ``root`` or of a child outside the step methods inside ``context()`` (the outermost call).

    [Note: a stage-3 model called after fit]
    At stage 3 under "-mixed" the ``lower_precision_safe_modules`` (the Linears) gather in the low
    dtype, which autocast hides inside the step methods. Called outside them (after
    ``trainer.fit()``, in ``on_train_end`` or ``on_validation_epoch_end``, on every rank: the
    README's "every rank calling it works"), the Linears returned bf16 where the rest of the model
    is fp32, and Llama stopped in attention on "query, key, and value to have the same dtype",
    BERT on "mat1 and mat2 must have the same dtype" (a new-user trial), where ddp runs in fp32.
    Such calls now run under the precision plugin's forward context (its autocast), as
    ``trainer.predict()`` would: the outputs are bf16-mixed outputs, not fp32 ones (inside an
    autocast the caller entered, the caller's applies). The strategy
    installs this only where some unit gathers in another dtype, so stages 0-2 still match ddp.
    """
    if getattr(root, "_ampzero_outside_context", None) is not None:
        return
    depth = [0]
    stack = ExitStack()

    def enter(module: nn.Module, args: object) -> None:
        if depth[0] == 0 and (in_step_method() or torch._C._current_graph_task_id() != -1):
            return
        if depth[0] == 0 and not _user_autocast():
            stack.enter_context(context())
        depth[0] += 1

    def leave(module: nn.Module, args: object, output: object) -> None:
        if depth[0] == 0:
            return
        depth[0] -= 1
        if depth[0] == 0:
            stack.close()

    for target in (root, *root.children()):
        target.register_forward_pre_hook(enter)
        target.register_forward_hook(leave, always_call=True)
    object.__setattr__(root, "_ampzero_outside_context", context)


def _user_autocast() -> bool:
    """An autocast the caller entered (its dtype wins over the precision's, as a trial expected)."""
    return torch.is_autocast_enabled("cpu") or (torch.cuda.is_available() and torch.is_autocast_enabled("cuda"))


def prepare_manual_backward(root: nn.Module, loss: object) -> None:
    """Before a backward inside a step method: FSDP2's root hooks ``loss`` (the Note above)."""
    if isinstance(root, FSDPModule) and in_step_method():
        root._get_fsdp_state()._register_pre_backward_hook(loss)


def after_manual_step(root: nn.Module) -> None:
    """After an optimizer step inside a step method: the root group's gathered copy is stale (the Note above)."""
    if isinstance(root, FSDPModule) and in_step_method():
        group = root._get_fsdp_state()._fsdp_param_group
        if group is not None and group.is_unsharded:
            root.reshard()


def reshard_stale(units: list[FSDPModule]) -> None:
    """After an optimizer step outside a step method: reshard every unit a forward left gathered.

    [Note: a step without a backward]
    A unit is resharded by its backward. Lightning can step the optimizer after training steps
    whose backward it skipped: StochasticWeightAveraging's last epoch runs forward only (to
    recompute BatchNorm statistics) and still calls ``optimizer.step()``, which applies the
    gradients left from the last real step (as under ddp). The units those forwards gathered (all
    of them at stages 1-2, the root at stage 3) stayed gathered, so the module kept showing the
    gathered copy from before the step while the optimizer had moved the shards: after fit the
    model read the old weights, 0.02 from ddp's on a ResNet (a new-user trial), and a checkpoint
    save, which reshards, changed that. The copy is stale once the shards moved: drop it.
    """
    for unit in units:
        group = unit._get_fsdp_state()._fsdp_param_group
        if group is not None and group.is_unsharded:
            unit.reshard()


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def own_class_name(module: nn.Module) -> str:
    """The name of the class the user wrote: ``fully_shard`` gives a unit a subclass named ``FSDP<name>``."""
    return next(c for c in type(module).__mro__ if not c.__module__.startswith("torch.distributed.")).__name__


@contextmanager
def no_sync(model: nn.Module, stage: int) -> Iterator[None]:
    """Context for a non-final micro-batch of gradient accumulation.

    Stages 1 and 2 keep their parameters gathered across micro-batches (no re-gather: the full
    parameters are part of their memory budget anyway). Stage 1 also keeps full gradients
    locally and reduces them once; stages 2 and 3 reduce-scatter every micro-batch, which is
    what bounds their gradient memory to a shard.
    """
    modules = fsdp_modules(model)
    buffers = buffer_broadcast_of(model)
    if buffers is not None:
        buffers.gradient_sync = False  # DDP's no_sync: the next forward does not broadcast buffers
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
        if buffers is not None:
            buffers.gradient_sync = True
