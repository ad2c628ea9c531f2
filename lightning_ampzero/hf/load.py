"""Pretrained weights in: build a transformers model from its config, stream its weights in after sharding.

``from_pretrained`` only builds the model (inside ``configure_model`` at stage 3 that build is
partitioned as it happens, so no rank ever holds the whole model) and records where its weights
are. Once the strategy has partitioned and materialised the model it calls
``load_pending_pretrained``, which copies into every parameter and persistent buffer only this
rank's part of it, read straight from the checkpoint files: a parameter that is a DTensor
(stages 1-3, FSDP2's ``Shard(0)``) reads the rows of its local shard with
``safe_open(...).get_slice(key)[start:stop]``; a plain tensor (stage 0, and modules left
unsharded) reads the whole tensor. No rank reads more than its shards, and no more than one
tensor's slice is in flight at a time ([Note: one mapping per read] in files.py).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from lightning_ampzero.fp8.convert import FP8_STATE_SUFFIXES
from lightning_ampzero.hf.files import CheckpointFiles, weight_files
from lightning_ampzero.hf.keys import checkpoint_to_model, group_by_tensor, matches_any, state_tensors, tied_targets

# Attribute of a model built by from_pretrained, removed once its weights are loaded (so a
# second setup, e.g. trainer.test after trainer.fit, never overwrites trained weights).
_PENDING = "_ampzero_pretrained"
_PENDING_HOOK = "_ampzero_pretrained_hook"


def _refuse_unloaded(module: nn.Module, args: Any) -> None:
    """Forward pre-hook of a model whose pretrained weights were never copied in.

    With Lightning's own strategies nothing calls :func:`load_pending_pretrained`, and a model built
    by :func:`from_pretrained` trained silently from its random initial weights (a new-user trial:
    0.13 from the file under ``ddp``); strategy ``ampzero`` loads them in setup, before any forward.
    """
    source = module.__dict__.get(_PENDING)
    if source is not None:
        raise RuntimeError(
            f"The weights of {str(source.path)!r} were never loaded into this {type(module).__name__}, built by"
            " lightning_ampzero.hf.from_pretrained, which copies them in at setup under strategy 'ampzero'. With"
            " another strategy, or no Trainer, call lightning_ampzero.hf.load_pending_pretrained(model) once the"
            " model is built: in configure_model() right after building it there, or in setup() for a model built"
            " in __init__ or setup() (Lightning calls setup() before configure_model())."
        )


@dataclass(frozen=True)
class PretrainedSource:
    """Where a model's weights are, and whether every weight must be found there."""

    path: Path
    strict: bool = True


@dataclass(frozen=True)
class LoadStats:
    """What one rank read for one model (figures in bytes)."""

    model: str  # name of the model inside the module given to load_pending_pretrained ("" for itself)
    path: str
    tensors: int  # tensors loaded
    bytes_read: int  # sum of the slices read from the files
    largest_read: int  # largest single slice
    local_bytes: int  # bytes of this rank's part of the loaded tensors, in their own dtype
    largest_tensor: int  # largest whole tensor in the checkpoint
    seconds: float


def from_pretrained(
    model_cls: Any, path: str | Path, *, config: Any = None, strict: bool = True, **kwargs: Any
) -> nn.Module:
    """Build ``model_cls`` from the config of the ``save_pretrained`` directory ``path``; its weights load at setup.

    Call it where the model is built (``configure_model`` at stage 3)::

        def configure_model(self):
            self.model = lightning_ampzero.hf.from_pretrained(AutoModelForCausalLM, "path/to/model")

    ``model_cls`` is an ``AutoModel*`` class or a model class (``LlamaForCausalLM``). ``config``
    replaces the directory's config (e.g. with overrides); other keyword arguments go to the
    model's constructor (``attn_implementation="eager"``, ``dtype=torch.float32``, ...).
    Tensors missing from the checkpoint or left over in it are an error naming them; with
    ``strict=False`` they are a warning (parameters missing from the checkpoint, e.g. a new
    head, keep their initial values). Shapes that differ are always an error.

    The weights are copied in by :func:`load_pending_pretrained`, which strategy ``ampzero``
    calls in setup after partitioning; with any other setup call it yourself once the model is
    in place (on a plain model it loads every tensor whole).
    """
    path = Path(path)
    weight_files(path)  # a wrong path fails here, not after the model is built and sharded
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(path))
    if hasattr(model_cls, "from_config"):  # AutoModelForCausalLM and the other Auto classes
        model = model_cls.from_config(config, **kwargs)
    elif hasattr(model_cls, "_from_config"):  # a PreTrainedModel subclass: the same path as from_config
        model = model_cls._from_config(config, **kwargs)
    else:
        model = model_cls(config, **kwargs)
    setattr(model, _PENDING, PretrainedSource(path, strict))
    model.__dict__[_PENDING_HOOK] = model.register_forward_pre_hook(_refuse_unloaded)
    # transformers' from_pretrained returns the model in eval mode (dropout off), and Lightning
    # does not switch modules to train mode: as a drop-in for it, the same mode, or the run trained
    # with dropout where the user's ddp run had none (a new-user trial, issue 16's note).
    model.eval()
    return model


def pending_pretrained(module: nn.Module) -> list[tuple[str, nn.Module, PretrainedSource]]:
    """The models inside ``module`` (at any depth, itself included) whose weights are still to be loaded."""
    return [(name, m, m.__dict__[_PENDING]) for name, m in module.named_modules() if _PENDING in m.__dict__]


def load_pending_pretrained(module: nn.Module) -> list[LoadStats]:
    """Copy their checkpoint's weights into every model built by :func:`from_pretrained` inside ``module``.

    Run it after the module is partitioned and materialised; every rank calls it (it does no
    collective: each rank reads its own shards). Returns what this rank read, per model.
    """
    stats = []
    for name, model, source in pending_pretrained(module):
        stats.append(load_pretrained_(model, source.path, strict=source.strict, name=name))
        del model.__dict__[_PENDING]
        hook = model.__dict__.pop(_PENDING_HOOK, None)
        if hook is not None:
            hook.remove()
    return stats


def _region(t: torch.Tensor) -> tuple[torch.Tensor, Optional[list[slice]], tuple[int, ...]]:
    """(local tensor to fill, region of the global tensor it holds or None for all of it, global shape)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t.data if isinstance(t, nn.Parameter) else t, None, tuple(t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = t.to_local()
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"local shard {tuple(local.shape)} differs from the layout of {t.placements}:"
                           f" {tuple(shape)}.")
    # Only dimensions that are split need a slice; FSDP2's Shard(0) gives rows [offset, offset + n).
    last = max((d for d in range(t.dim()) if shape[d] != t.shape[d]), default=-1)
    region = [slice(offset[d], offset[d] + shape[d]) for d in range(last + 1)]
    return local, region or None, tuple(t.shape)


@torch.no_grad()
def load_pretrained_(model: nn.Module, path: str | Path, *, strict: bool = True, name: str = "") -> LoadStats:
    """Copy the weights of the ``save_pretrained`` directory ``path`` into ``model`` (sharded or not), in place."""
    start = time.perf_counter()
    files = CheckpointFiles(path)
    adapters: set[str] = set()  # peft adapters: new parameters, never in a pretrained checkpoint
    named = list(state_tensors(model, adapters))
    one_to_one, fused = checkpoint_to_model(model, files.tensors, [n for n, _ in named])
    if fused:
        first = next(iter(fused))
        raise NotImplementedError(
            f"{path}: {len(fused)} parameters of {type(model).__name__} are fused from several checkpoint tensors"
            f" by a transformers weight converter (e.g. {first!r} from {fused[first][:3]}), which cannot be read"
            " shard by shard. Load this model with transformers' own from_pretrained at stage 0-2."
        )
    key_of: dict[str, str] = {}
    for ckpt_key, model_name in one_to_one.items():
        key_of.setdefault(model_name, ckpt_key)
    tied = tied_targets(model)
    ignore_missing = getattr(model, "_keys_to_ignore_on_load_missing", None)
    ignore_unexpected = getattr(model, "_keys_to_ignore_on_load_unexpected", None)

    plan: list[tuple[str, torch.Tensor, str]] = []
    used: set[str] = set()
    missing: list[str] = []
    mismatched: list[str] = []
    for tensor, names in group_by_tensor(named):
        keys = [key_of[n] for n in names if n in key_of]
        if not keys:  # a tied weight absent from the file (save_pretrained drops it): load its source
            keys = [key_of[tied[n]] for n in names if n in tied and tied[n] in key_of]
        if not keys:
            # FP8's delayed-recipe buffers (amax history, scale) are the recipe's own state, converted in
            # before the weights load (a trial: "26 parameters/buffers are not in the checkpoint").
            if not all(matches_any(n, ignore_missing) or n in adapters or n.endswith(FP8_STATE_SUFFIXES)
                       for n in names):
                missing.append(names[0])
            continue
        used.update(keys)
        if tuple(tensor.shape) != files.tensors[keys[0]].shape:
            mismatched.append(f"{names[0]}: model {tuple(tensor.shape)}, checkpoint {files.tensors[keys[0]].shape}")
            continue
        plan.append((names[0], tensor, keys[0]))
    unexpected = [k for k in files.tensors if k not in used and not matches_any(k, ignore_unexpected)]
    where = f"Loading {path} into {type(model).__name__}"
    if mismatched:
        raise RuntimeError(f"{where}: {len(mismatched)} shapes differ ({'; '.join(mismatched[:5])}). Check that the"
                           " config used to build the model is the checkpoint's.")
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} parameters/buffers are not in the checkpoint: {missing[:8]}")
        if unexpected:
            parts.append(f"{len(unexpected)} checkpoint tensors match no parameter or buffer: {unexpected[:8]}")
        if strict:
            raise RuntimeError(
                f"{where}: {'; '.join(parts)}. Check the model class and config against the checkpoint's"
                " config.json; if the model differs on purpose (a new head), pass strict=False to"
                " from_pretrained: parameters not in the checkpoint then keep their initial values."
            )
        warnings.warn(f"{where} (strict=False): {'; '.join(parts)}. Those parameters keep their initial values.")

    local_bytes = 0
    for _, tensor, key in plan:
        local, region, _ = _region(tensor)
        files.copy_into(key, local, region)
        local_bytes += local.numel() * local.element_size()
    return LoadStats(
        model=name, path=str(path), tensors=len(plan), bytes_read=files.bytes_read, largest_read=files.largest_read,
        local_bytes=local_bytes, largest_tensor=max((i.nbytes for i in files.tensors.values()), default=0),
        seconds=time.perf_counter() - start,
    )
