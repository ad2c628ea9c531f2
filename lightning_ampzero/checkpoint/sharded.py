"""Sharded checkpoints: every rank writes its own shards (DCP), rank 0 writes Lightning's metadata.

Layout of a checkpoint directory (the path Lightning's ModelCheckpoint names ``*.ckpt``):
``.metadata`` and ``__<rank>_*.distcp`` (torch.distributed.checkpoint: model and optimizer
states keyed ``state_dict`` and ``optimizer_<i>``) and ``meta.pt`` (everything else Lightning
saves: loop state, callbacks, LR schedulers, hyper-parameters, precision plugin state).

The same code serves every stage: DCP handles plain (stage 0, replicated; written once) and
DTensor (stages 1-3, sharded) tensors alike and stores global shapes and fully qualified
names, so a checkpoint loads into any world size and any stage (resharding on load).

[Note: atomic saves] A save goes to ``<path>.incomplete`` and is renamed to ``<path>`` only
after every rank has written its shards and rank 0 its metadata. A save killed part-way
(process killed, disk full) therefore never touches the previous checkpoint at ``<path>`` and
leaves a directory whose name says it is incomplete; loading it is refused with that reason.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.optim import Optimizer

METADATA_FILE = "meta.pt"
INCOMPLETE_SUFFIX = ".incomplete"


def incomplete_path(path: Path) -> Path:
    return path.with_name(path.name + INCOMPLETE_SUFFIX)


def is_sharded_checkpoint(path: Path) -> bool:
    return (
        path.is_dir()
        and not path.name.endswith(INCOMPLETE_SUFFIX)
        and (path / METADATA_FILE).is_file()
        and (path / ".metadata").is_file()
    )


def save_sharded(
    path: Path,
    state: Mapping[str, Any],
    metadata: dict[str, Any],
    *,
    is_global_zero: bool,
    barrier: Callable[[], None] = lambda: None,
) -> None:
    """Write ``state`` (``state_dict`` and ``optimizer_<i>`` entries from get_*_state_dict) and ``metadata`` atomically."""
    import torch.distributed.checkpoint as dcp

    staging = incomplete_path(path)
    if is_global_zero:
        if staging.exists():
            shutil.rmtree(staging)  # left by an earlier interrupted save of the same name
        staging.mkdir(parents=True)
    barrier()
    dcp.save(dict(state), checkpoint_id=staging)  # collective: returns once .metadata is written
    if is_global_zero:
        torch.save(metadata, staging / METADATA_FILE)
        _replace_dir(staging, path)
    barrier()


def _replace_dir(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst``; an existing ``dst`` is removed only once ``src`` is in place."""
    if dst.is_file():
        dst.unlink()
    old = None
    if dst.exists():
        old = dst.with_name(dst.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old)


def _check_loadable(path: Path) -> None:
    if path.name.endswith(INCOMPLETE_SUFFIX):
        raise ValueError(
            f"{path} is an interrupted save (its name ends in {INCOMPLETE_SUFFIX!r}: the process stopped"
            " before every rank had written its shards). Resume from the previous complete checkpoint."
        )
    if not path.exists() and incomplete_path(path).exists():
        raise FileNotFoundError(
            f"{path} does not exist: its save was interrupted (the partial data is in"
            f" {incomplete_path(path)}). Resume from the previous complete checkpoint."
        )
    if not is_sharded_checkpoint(path):
        raise ValueError(
            f"{path} is not a sharded checkpoint directory written by strategy 'ampzero': it needs"
            f" {METADATA_FILE} and torch.distributed.checkpoint's .metadata."
        )


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

    _check_loadable(path)
    state: dict[str, Any] = {"state_dict": get_model_state_dict(module)}
    for i, opt in enumerate(optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(module, opt)
    dcp.load(state, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=not strict))
    set_model_state_dict(module, state["state_dict"], options=StateDictOptions(strict=strict))
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(module, opt, state[f"optimizer_{i}"])
    return torch.load(path / METADATA_FILE, weights_only=bool(weights_only))
