"""Materialising a model built on the meta device, after it was sharded.

Lightning's own helper calls ``reset_parameters`` top-down, so a parent's deliberate init
would be overwritten by its children's defaults; we go bottom-up (children first), so a
module that initialises its whole subtree (like models.gpt.GPT) has the last word.
"""

from __future__ import annotations

import torch
from torch import nn


def check_built_for_stage3(module: nn.Module) -> None:
    """Stage 3 promises no rank holds the whole model: refuse a model built outside configure_model()."""
    built = [(n, p) for n, p in module.named_parameters() if not p.is_meta]
    if built:
        numel = sum(p.numel() for _, p in built)
        raise RuntimeError(
            f"ZeRO stage 3 shards parameters so that no rank ever holds the whole model, but"
            f" {len(built)} parameters ({numel:,} elements, e.g. {built[0][0]!r}) were created outside"
            " the sharded context. Build the model in your LightningModule's `configure_model()` hook"
            " (the strategy runs it on the meta device and materialises only each rank's shard), or"
            " use stage 2, which shards optimizer state and gradients of a model built anywhere."
        )


@torch.no_grad()
def materialize_meta_(module: nn.Module, device: torch.device) -> None:
    if not any(t.is_meta for t in module.parameters()) and not any(t.is_meta for t in module.buffers()):
        return
    module.to_empty(device=device)
    initialised: set[int] = set()

    def visit(m: nn.Module) -> None:
        for child in m.children():
            visit(child)
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()
            initialised.update(id(p) for p in m.parameters())

    import warnings

    with warnings.catch_warnings():
        # On a CPU mesh torch warns that random ops on DTensors "may not have complete support":
        # each rank fills its own shard from its own generator, which is what sharded init means
        # here (modules wanting values identical to an unsharded init use models/init.py).
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        visit(module)
    missing = [n for n, p in module.named_parameters() if id(p) not in initialised]
    if missing:
        raise RuntimeError(
            f"Parameters {missing[:3]} were built on the meta device but no module that owns them defines"
            " `reset_parameters()`, so they would start as uninitialised memory. Give their module a"
            " `reset_parameters()` method that initialises them."
        )
