"""Sharded checkpoints: every rank writes its own shards (DCP), rank 0 writes Lightning's metadata.

Layout of a checkpoint directory (the path Lightning's ModelCheckpoint names ``*.ckpt``):
``.metadata`` and ``__<rank>_*.distcp`` (torch.distributed.checkpoint: model and optimizer
states keyed ``state_dict`` and ``optimizer_<i>``) and ``meta.pt`` (everything else Lightning
saves: loop state, callbacks, LR schedulers, hyper-parameters, precision plugin state).

The same code serves every stage: DCP handles plain (stage 0, replicated; written once) and
DTensor (stages 1-3, sharded) tensors alike, and stores global shapes, so loading reshards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.optim import Optimizer

METADATA_FILE = "meta.pt"


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / METADATA_FILE).is_file() and (path / ".metadata").is_file()


def save_sharded(path: Path, state: Mapping[str, Any], metadata: dict[str, Any], *, is_global_zero: bool) -> None:
    """Write ``state`` (``state_dict`` and ``optimizer_<i>`` entries from get_*_state_dict) and ``metadata``."""
    import torch.distributed.checkpoint as dcp

    if path.is_file():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    dcp.save(dict(state), checkpoint_id=path)
    if is_global_zero:
        torch.save(metadata, path / METADATA_FILE)


def load_sharded(
    path: Path, module: nn.Module, optimizers: Sequence[Optimizer], *, strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Load model (and optimizer, where given) states in place into the partitioned ``module``; return the metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if not is_sharded_checkpoint(path):
        raise ValueError(
            f"{path} is not a sharded checkpoint directory written by strategy 'ampzero': it needs"
            f" {METADATA_FILE} and torch.distributed.checkpoint's .metadata (was the save interrupted?)."
        )
    state: dict[str, Any] = {"state_dict": get_model_state_dict(module)}
    for i, opt in enumerate(optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(module, opt)
    dcp.load(state, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=not strict))
    set_model_state_dict(module, state["state_dict"], options=StateDictOptions(strict=strict))
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(module, opt, state[f"optimizer_{i}"])
    return torch.load(path / METADATA_FILE, weights_only=bool(weights_only))
