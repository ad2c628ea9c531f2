"""Which modules become FSDP2 communication units, and how they are grouped by bucket size.

A unit is one all-gather of parameters and one reduce-scatter of gradients. Too many small
units pay collective latency on every one; too few large ones cannot overlap communication
with compute and (stage 3) hold more gathered parameters at once. DeepSpeed exposes this as
bucket sizes, so we do the same: consecutive blocks are packed into a unit until the next
block would push it past ``ZeroConfig.unit_size`` elements.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

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


def repeated_block_classes(root: nn.Module) -> set[type]:
    """Classes that occur at least twice as children of a ModuleList/Sequential: transformer blocks and alike."""
    counts: Counter[type] = Counter()
    for module in root.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            for child in module.children():
                if _param_numel(child) > 0:
                    counts[type(child)] += 1
    repeated = {cls for cls, n in counts.items() if n >= 2 and cls not in (nn.ModuleList, nn.Sequential)}
    # Prefer composite blocks (a transformer block) over the leaf layers repeated inside them
    # (the two Linears of an MLP); a model made only of leaf layers keeps its leaves.
    composite = {cls for cls in repeated if any(
        any(True for _ in child.children()) for child in root.modules() if type(child) is cls
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
        classes = repeated_block_classes(root)
        match = lambda m: type(m) in classes  # noqa: E731

    blocks: list[tuple[str, nn.Module]] = []
    inside: set[int] = set()
    for name, module in root.named_modules():
        if id(module) in inside or module is root:
            continue
        if match(module) and _param_numel(module) > 0:
            blocks.append((name, module))
            inside.update(id(m) for m in module.modules())
    return blocks


def leftover_modules(root: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[list[tuple[str, nn.Module]]]:
    """Modules holding parameters outside every block (embeddings, final norm, head), in runs.

    FSDP2 never reshards the root unit after forward (it is needed first in backward), so
    parameters left to the root stay gathered through forward and backward. Under stage 3
    that would keep the embeddings and the output head (often the largest layers) whole on
    every rank; giving them units of their own lets them be sharded like the blocks. A run is
    a sequence of such modules with no block between them: they can share a unit.
    """
    in_block = {id(m) for _, b in blocks for m in b.modules()}
    block_ids = {id(b) for _, b in blocks}
    runs: list[list[tuple[str, nn.Module]]] = [[]]
    for name, module in root.named_modules():
        if module is root:
            continue
        if id(module) in block_ids:
            runs.append([])
        elif id(module) not in in_block and any(True for _ in module.parameters(recurse=False)):
            runs[-1].append((name, module))
    return [r for r in runs if r]


def group_units(blocks: list[tuple[str, nn.Module]], unit_size: int) -> list[Unit]:
    """Pack consecutive blocks into units of at most ``unit_size`` elements (a bigger block stands alone)."""
    units: list[Unit] = []
    for name, module in blocks:
        n = _param_numel(module)
        last = units[-1] if units else None
        if last is not None and last.numel + n <= unit_size:
            last.modules.append(module)
            last.names.append(name)
            last.numel += n
        else:
            units.append(Unit([module], [name], n))
    return units


def one_unit_below_stage3(numel: int, unit_size: int) -> bool:
    """Whether a model of ``numel`` elements is a single unit below stage 3 (:func:`plan_units`)."""
    return numel <= unit_size


def plan_units(root: nn.Module, wrap_modules: tuple[str, ...], unit_size: int, stage: int) -> list[Unit]:
    """The communication units of ``root`` at ``stage``, in no particular order (the root unit not included).

    [Note: units below stage 3] Below stage 3 the parameters are gathered once per step and stay
    gathered, so units decide nothing about parameter memory, only how gradients are bucketed
    for the reduce-scatter: a unit's unsharded gradients live until its reduction. A model that
    fits one bucket (``unit_size`` elements) is therefore reduced as one, as DeepSpeed reduces
    it in one bucket: the root holds every module, and with the precision's low-precision groups
    (zero/apply.py) a step costs one group per dtype instead of two per unit plus the
    leftovers'. A larger model keeps the units of stage 3: per-block units, and units of their
    own for the leftovers (:func:`leftover_modules`), whose gradients would otherwise wait in
    the root through the whole backward (an output head and embeddings are often the largest).
    """
    if stage < 3 and one_unit_below_stage3(_param_numel(root), unit_size):
        return []
    blocks = find_blocks(root, wrap_modules)
    units = group_units(blocks, unit_size)
    for run in leftover_modules(root, blocks):
        units.extend(group_units(run, unit_size))
    return units
