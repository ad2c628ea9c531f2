"""Which modules become FSDP2 communication units, and how they are grouped by bucket size.

A unit is one all-gather of parameters and one reduce-scatter of gradients. Too many small
units pay collective latency on every one; too few large ones cannot overlap communication
with compute and (stage 3) hold more gathered parameters at once. DeepSpeed exposes this as
bucket sizes, so we do the same: consecutive blocks are packed into a unit until the next
block would push it past ``ZeroConfig.unit_size`` elements.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch.distributed as dist
from torch import nn


@dataclass
class Unit:
    modules: list[nn.Module]
    names: list[str]
    numel: int

    @property
    def target(self) -> "nn.Module | list[nn.Module]":
        return self.modules[0] if len(self.modules) == 1 else self.modules


def _param_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def block_kind(module: nn.Module) -> object:
    """What makes two modules repeats of one block: their class, or for a plain ``nn.Sequential`` its layout.

    Every ``nn.Sequential`` is one class, so the class alone cannot tell a repeated
    ``Sequential(Linear, GELU, Linear)`` block from the container that holds the blocks. Taken
    by class, such a model had no composite block and its inner ``Linear``s became the blocks
    (a new-user trial, issue 16's note): compile then compiled each ``Linear`` alone (nothing, in
    practice) and checkpointing saved every layer's input. A subclass of ``nn.Sequential`` is a
    class the user wrote and is taken by its class, as any other module.
    """
    if type(module) is nn.Sequential:
        return (nn.Sequential, tuple(block_kind(child) for child in module.children()))
    return type(module)


def repeated_block_classes(root: nn.Module) -> set[object]:
    """Kinds (:func:`block_kind`) that occur at least twice as children of a ModuleList/Sequential: transformer blocks and alike."""
    counts: Counter[object] = Counter()
    for module in root.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            for child in module.children():
                if _param_numel(child) > 0:
                    counts[block_kind(child)] += 1
    repeated = {kind for kind, n in counts.items() if n >= 2 and kind is not nn.ModuleList}
    # Prefer composite blocks (a transformer block) over the leaf layers repeated inside them
    # (the two Linears of an MLP); a model made only of leaf layers keeps its leaves.
    composite = {kind for kind in repeated if any(
        any(True for _ in child.children()) for child in root.modules() if block_kind(child) == kind
    )}
    return composite or repeated


def find_blocks(root: nn.Module, wrap_modules: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """Outermost modules matching the wrap policy, in module order (no block inside another)."""
    if wrap_modules:
        known = {type(m).__name__ for m in root.modules()}
        missing = [n for n in wrap_modules if n not in known]
        if missing:
            from lightning_ampzero._schema import suggest

            raise ValueError(
                f"zero.wrap_modules names {missing[0]!r}, but the model has no module of that class."
                f"{suggest(missing[0], known)} Classes in the model: {', '.join(sorted(known))}."
            )
        match = lambda m: type(m).__name__ in wrap_modules  # noqa: E731
    else:
        kinds = repeated_block_classes(root)
        match = lambda m: block_kind(m) in kinds  # noqa: E731

    blocks: list[tuple[str, nn.Module]] = []
    inside: set[int] = set()
    for name, module in root.named_modules():
        if id(module) in inside or module is root:
            continue
        if match(module) and _param_numel(module) > 0:
            blocks.append((name, module))
            inside.update(id(m) for m in module.modules())
    return blocks


def network_of(root: nn.Module) -> "Callable[[str], Optional[str]]":
    """``name -> the network the module of that name belongs to``: a child of the root with layers of its own.

    [Note: one network per unit] A LightningModule often holds several networks as its children
    (a GAN's generator and discriminator, a teacher and a student) and runs them in separate
    forwards of one step. An FSDP2 group that spans two of them is used out of order: it runs
    its post-forward only once every one of its modules has run (torch 2.13
    ``_register_group_forward_hooks``), and it frees its parameters at the first of its
    post-backwards, which a later forward of one network registers on that network's inputs.
    A GAN that runs the generator once, then the discriminator's step, then the generator's
    step through the same generator output, had the generator's output head and the
    discriminator in one unit (the modules after the last block): the generator's step freed the
    head in the middle of its backward, and the backward stopped with torch's ``setStorage ...
    storage of size 0`` (a new-user trial, issue 16's note). So a unit never packs modules of
    two such networks. A child that is itself a layer (a ``head = nn.Linear`` on the
    LightningModule, the layers of a model written directly in it) belongs to no network and
    still shares a unit with its neighbours, and so do the children of an ``nn.Sequential`` root
    (its blocks, run in turn); modules that share a parameter are one unit all the same
    (:func:`_merge_shared`).
    """
    if isinstance(root, (nn.Sequential, nn.ModuleList)):
        return lambda name: None  # its children are its layers, run one after the other
    networks = {name for name, child in root.named_children()
                if any(any(True for _ in m.parameters(recurse=False)) for m in child.modules() if m is not child)}
    return lambda name: head if (head := name.split(".", 1)[0]) in networks else None


def _joins(network: "Optional[Callable[[str], Optional[str]]]", names: list[str], name: str) -> bool:
    """Whether the module ``name`` may share a unit with the modules ``names`` ([Note: one network per unit])."""
    if network is None:
        return True
    mine, theirs = network(name), {network(n) for n in names} - {None}
    return mine is None or not theirs or mine in theirs


def leftover_modules(root: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[list[tuple[str, nn.Module]]]:
    """Modules holding parameters outside every block (embeddings, final norm, head), in runs.

    FSDP2 never reshards the root unit after forward (it is needed first in backward), so
    parameters left to the root stay gathered through forward and backward. Under stage 3
    that would keep the embeddings and the output head (often the largest layers) whole on
    every rank; giving them units of their own lets them be sharded like the blocks. A run is
    a sequence of such modules with no block between them: they can share a unit.

    [Note: parameters of non-leaf modules] A module that holds parameters itself and also has
    children with parameters (a ViT's ``ViTEmbeddings``: ``cls_token`` and ``position_embeddings``
    beside a child Conv2d; ``self.pos = nn.Parameter(...)`` on a model that is not the root)
    must not share a list group with its children: ``fully_shard([parent, child])`` hands FSDP2
    overlapping modules ("Cannot concatenate overlapping meshes" in setup). Such a module
    stands for its whole subtree instead, as one entry of its run (its children are not listed):
    ``fully_shard(parent)`` manages every parameter below it that no inner group claimed. When
    blocks lie below it, it is a run of its own, sharded after the units inside it (bottom-up,
    :func:`plan_units` orders them), and its group then holds its own parameters and whatever
    below it no unit took: the same nesting FSDP2 uses for the root.

    A module with no ``forward`` of its own (``nn.ParameterList``, ``nn.ParameterDict``, a plain
    holder whose parameters its parent reads) is never called, so FSDP2's hooks on it would never
    gather its parameters: its parent's forward would read shards. It is not listed: whatever
    covers its parent (a block, a covering module, or the root) gathers its parameters.
    """
    in_block = {id(m) for _, b in blocks for m in b.modules()}
    block_ids = {id(b) for _, b in blocks}
    network = network_of(root)
    runs: list[list[tuple[str, nn.Module]]] = [[]]
    covered: set[int] = set()  # below a module that stands for its subtree

    def join(name: str, module: nn.Module) -> None:
        # [Note: one network per unit]: a run ends where another network's modules begin
        if not _joins(network, [n for n, _ in runs[-1]], name):
            runs.append([])
        runs[-1].append((name, module))

    for name, module in root.named_modules():
        if module is root or id(module) in covered:
            continue
        if id(module) in block_ids:
            runs.append([])
        elif type(module).forward is nn.Module.forward:
            continue  # never called: left to what covers its parent
        elif id(module) not in in_block and any(True for _ in module.parameters(recurse=False)):
            below = [m for m in module.modules() if m is not module]
            if not any(any(True for _ in m.parameters(recurse=False)) for m in below):
                join(name, module)  # a leaf as far as parameters go
            elif not any(id(m) in block_ids for m in below):
                join(name, module)
                covered.update(id(m) for m in below)
            else:
                runs.extend([[(name, module)], []])
    return [r for r in runs if r]


def group_units(blocks: list[tuple[str, nn.Module]], unit_size: int,
                network: "Optional[Callable[[str], Optional[str]]]" = None) -> list[Unit]:
    """Pack consecutive blocks into units of at most ``unit_size`` elements (a bigger block stands alone).

    ``network`` (:func:`network_of`): blocks of two networks never share a unit ([Note: one network per unit]).
    """
    units: list[Unit] = []
    for name, module in blocks:
        n = _param_numel(module)
        last = units[-1] if units else None
        if last is not None and _joins(network, last.names, name) and last.numel + n <= unit_size:
            last.modules.append(module)
            last.names.append(name)
            last.numel += n
        else:
            units.append(Unit([module], [name], n))
    return units


def kept_for_reuse(numels: "Sequence[int]", max_reuse_distance: float, persistence_threshold: float) -> list[bool]:
    """For stage-3 groups of ``numels`` elements in forward order: which stay gathered until their backward.

    [Note: reuse distance] DeepSpeed's ``stage3_max_reuse_distance``: a parameter is not released
    after its forward when it is used again within that many elements of parameters fetched in
    between. A group's parameters are next used by its own backward, and in between run the
    forwards of the groups after it and the backwards of those of them that were freed. So the
    groups are kept from the last of the forward back, while the elements of the kept groups after
    them stay under ``max_reuse_distance``; the first group that is freed ends it (every group
    before it has at least as much in between). The last group of the forward has a distance of
    0: FSDP2 would gather it again at once (the reason torchtitan keeps its last block gathered).
    Groups under ``persistence_threshold`` stay gathered anyway and are not counted: they are
    never gathered again. zero/apply.py shards by this, estimate.py counts its memory.
    """
    kept = [False] * len(numels)
    later = 0  # elements of the kept groups after this one, gathered in between
    for i in reversed(range(len(numels))):
        if numels[i] < persistence_threshold:
            continue
        if later >= max_reuse_distance:
            break
        kept[i] = True
        later += numels[i]
    return kept


def one_unit_below_stage3(numel: int, unit_size: int) -> bool:
    """Whether a model of ``numel`` elements is a single unit below stage 3 (:func:`plan_units`)."""
    return numel <= unit_size


def plan_units(root: nn.Module, wrap_modules: tuple[str, ...], unit_size: int, stage: int) -> list[Unit]:
    """The communication units of ``root`` at ``stage`` (the root unit not included), inner units first.

    [Note: units below stage 3] Below stage 3 the parameters are gathered once per step and stay
    gathered, so units decide nothing about parameter memory, only how gradients are bucketed
    for the reduce-scatter: a unit's unsharded gradients live until its reduction. A model that
    fits one bucket (``unit_size`` elements) is therefore reduced as one, as DeepSpeed reduces
    it in one bucket: the root holds every module, and a step costs one group (two with the
    precision's low-precision groups off gloo, zero/apply.py) instead of one or two per unit
    plus the leftovers'. A larger model keeps the units of stage 3: per-block units, and units of their
    own for the leftovers (:func:`leftover_modules`), whose gradients would otherwise wait in
    the root through the whole backward (an output head and embeddings are often the largest).

    The units are returned in an order ``fully_shard`` can take them in: a unit whose module lies
    below another unit's module comes first ([Note: parameters of non-leaf modules]). Units that
    share a parameter are one unit ([Note: shared parameters]).
    """
    if stage < 3 and one_unit_below_stage3(_param_numel(root), unit_size):
        return []
    blocks = find_blocks(root, wrap_modules)
    units = group_units(blocks, unit_size, network_of(root))
    for run in leftover_modules(root, blocks):
        units.extend(group_units(run, unit_size))
    return _bottom_up(_merge_shared(root, units, unit_size, stage))


def region(tops: "list[nn.Module]", stop: "set[int] | frozenset[int]") -> list[nn.Module]:
    """The modules ``fully_shard(tops)`` manages once the groups whose modules' ids are in ``stop`` exist.

    FSDP2 (torch 2.13 ``_get_managed_modules``) walks the children of its modules and stops at a
    module that already belongs to a group; shared modules are visited once.
    """
    out: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        seen.add(id(module))
        out.append(module)
        for child in module.children():
            if id(child) not in seen and id(child) not in stop:
                visit(child)

    for top in tops:
        if id(top) not in seen:
            visit(top)
    return out


def _param_owners(root: nn.Module, units: list[Unit]) -> dict[int, tuple[nn.Parameter, list[tuple[int, str]]]]:
    """``id(param) -> (param, [(group, holder's name)])``: group ``i`` is ``units[i]``, -1 the root."""
    tops = {id(m) for u in units for m in u.modules}
    names = {id(m): n for n, m in root.named_modules()}
    owners: dict[int, tuple[nn.Parameter, list[tuple[int, str]]]] = {}
    for index, modules in [(-1, [root])] + [(i, u.modules) for i, u in enumerate(units)]:
        for module in region(modules, tops - {id(m) for m in modules}):
            for pname, p in module.named_parameters(recurse=False):
                holder = f"{names.get(id(module), '?')}.{pname}".lstrip(".")
                owners.setdefault(id(p), (p, []))[1].append((index, holder))
    return owners


def _merge_shared(root: nn.Module, units: list[Unit], unit_size: int, stage: int) -> list[Unit]:
    """Units that share a parameter become one unit; a unit sharing one with the root is left to the root.

    [Note: shared parameters] FSDP2 shards each parameter in exactly one group and refuses, at
    the first forward, a parameter that two groups manage ("is shared with a parameter already
    managed by another FSDP group"); inside one ``fully_shard`` call a parameter held by two
    modules is sharded once. So every set of units whose modules hold one parameter object
    (GPT-2's and OPT's ``lm_head.weight`` is ``wte.weight``; T5's ``shared``, encoder and
    decoder ``embed_tokens`` and ``lm_head``; a hand-made tie between blocks) is merged into one
    list group, whatever the bucket size; one that shares a parameter with the modules the root
    manages is dissolved into the root. The cost, at stage 3: the merged group is gathered from
    the first of its modules to run to the last (GPT-2's embedding stays gathered through the
    forward, as the root would keep it); a parameter shared by every block makes the blocks one
    unit, and we warn when a merge makes a unit larger than the bucket. The low-precision groups
    nested in a unit keep a tied module with its unit (precision/policy.py ``safe_modules``).
    """
    owners = _param_owners(root, units)
    parent = list(range(len(units) + 1))  # union-find; the last slot is the root

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    why: dict[int, str] = {}
    for _, holders in owners.values():
        groups = {g if g >= 0 else len(units) for g, _ in holders}
        if len(groups) > 1:
            first, *rest = groups
            for g in rest:
                a, b = find(first), find(g)
                parent[min(a, b)] = max(a, b)  # the root (the largest index) stays the representative
            for g in groups:
                why.setdefault(g, " and ".join(sorted({h for _, h in holders})))
    root_set = find(len(units))
    merged: dict[int, list[int]] = {}
    for i in range(len(units)):
        r = find(i)
        if r != root_set:
            merged.setdefault(r, []).append(i)
    order = {id(m): k for k, m in enumerate(root.modules())}
    out: list[Unit] = []
    for members in merged.values():
        if len(members) == 1:
            out.append(units[members[0]])
            continue
        pairs = sorted({id(m): (n, m) for i in members for n, m in zip(units[i].names, units[i].modules)}.values(),
                       key=lambda nm: order.get(id(nm[1]), -1))
        inside = {id(s) for _, m in pairs for s in m.modules() if s is not m}
        pairs = [(n, m) for n, m in pairs if id(m) not in inside]  # covered by another module of the unit
        unit = Unit([m for _, m in pairs], [n for n, _ in pairs], 0)
        out.append(unit)
        unit.numel = _region_numel(unit, units)
        rank_zero = not dist.is_initialized() or dist.get_rank() == 0  # every rank plans alike; one says so
        if stage == 3 and rank_zero and unit.numel > max(unit_size, *(units[i].numel for i in members)):
            reason = next((why[i] for i in members if i in why), "a shared parameter")
            warnings.warn(
                f"{reason} are one parameter, so the units holding them ({', '.join(unit.names)}) are one FSDP2"
                f" unit of {unit.numel:,} elements (zero.reduce_bucket_size allows {unit_size:,}): stage 3 keeps"
                " it gathered from the first of these modules to run until the last.", stacklevel=3,
            )
    for unit in out:
        unit.numel = _region_numel(unit, out)
    return out


def _region_numel(unit: Unit, units: list[Unit]) -> int:
    """Elements the group of ``unit`` gathers: its region, each parameter once."""
    stop = {id(m) for u in units if u is not unit for m in u.modules} - {id(m) for m in unit.modules}
    params = {id(p): p for m in region(unit.modules, stop) for p in m.parameters(recurse=False)}
    return sum(p.numel() for p in params.values())


def _bottom_up(units: list[Unit]) -> list[Unit]:
    """``units`` ordered so that a unit comes before every unit whose modules reach its modules."""
    below: list[set[int]] = [{id(s) for m in u.modules for s in m.modules() if s is not m} for u in units]
    tops = [{id(m) for m in u.modules} for u in units]
    done: list[Unit] = []
    left = list(range(len(units)))
    while left:
        ready = [i for i in left if not any(j != i and tops[j] & below[i] for j in left)]
        if not ready:
            cycle = [", ".join(units[i].names) for i in left]
            raise ValueError(
                f"FSDP2 units {cycle} each hold modules inside the other (through modules registered under"
                " two parents), so no unit can be sharded before the other. Register each shared module"
                " once (keep a plain attribute, not a submodule, for the second reference), or pass"
                " zero.wrap_modules so that the shared module is inside one unit."
            )
        done.extend(units[i] for i in ready)
        left = [i for i in left if i not in ready]
    return done
