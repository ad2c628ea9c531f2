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
(a process killed) therefore never touches the previous checkpoint at ``<path>`` and leaves a
directory whose name says it is incomplete; loading it is refused with that reason. A save that
fails while the processes live (a full disk) removes its partial directory and says so on every
rank ([Note: a save that cannot complete]).
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_ampzero.estimate import format_bytes
from lightning_ampzero.process import collective_device

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


class CheckpointSaveError(OSError):
    """A save that could not complete; the previous checkpoint at the same path is untouched."""


def save_sharded(
    path: Path,
    state: Mapping[str, Any],
    metadata: dict[str, Any],
    *,
    is_global_zero: bool,
    barrier: Callable[[], None] = lambda: None,
) -> None:
    """Write ``state`` (``state_dict`` and ``optimizer_<i>`` entries from get_*_state_dict) and ``metadata`` atomically.

    [Note: a save that cannot complete] Before anything is written, every rank checks that its
    filesystem has room for the whole checkpoint (all ranks' shards plus the replicated tensors;
    conservative where ranks write to node-local disks). A save that fails anyway (the disk fills
    up, a write error on any rank) is a collective decision: every rank raises
    :class:`CheckpointSaveError` naming the path and the space needed and free, the partial
    ``.incomplete`` directory is removed, and the previous checkpoint at ``path`` is kept.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    staging = incomplete_path(path)
    need = _checkpoint_bytes(state) + _METADATA_ALLOWANCE
    # The directory first, decided together: a rank 0 that cannot create it (a read-only filesystem,
    # no permission) skipped the barrier below while the others waited in it, until the watchdog
    # ended the run 300 s later naming two collectives and not the cause (a new-user trial); and a
    # path nothing can be written to read as "not enough disk space" (0 free under /sys).
    failure: BaseException | None = None
    if is_global_zero:
        try:
            if staging.exists():
                shutil.rmtree(staging)  # left by an earlier interrupted save of the same name
            staging.mkdir(parents=True)
        except OSError as e:
            failure = e
    if _max_over_ranks(int(failure is not None)):
        said = (f"{type(failure).__name__}: {_first_line(failure)}" if failure is not None
                else "rank 0 could not; its own error says why")
        raise CheckpointSaveError(
            f"Cannot create the checkpoint directory {staging} ({said}). Nothing was written{_kept(path)}. Save"
            " where this process can write: ModelCheckpoint(dirpath=...) or Trainer(default_root_dir=...)."
        ) from failure
    free = _free_bytes(staging)
    if _max_over_ranks(int(free < need)):
        if is_global_zero:
            shutil.rmtree(staging, ignore_errors=True)
        barrier()  # no rank goes on (to look for the checkpoint, say) before the empty directory is gone
        raise CheckpointSaveError(
            f"Not enough disk space to save the checkpoint {path}: it needs about {format_bytes(need)} and"
            f" {format_bytes(free)} is free on this rank's filesystem (a rank's may be less). Nothing was written"
            f"{_kept(path)}. Free some space, or save elsewhere / less often (ModelCheckpoint(dirpath=...,"
            " every_n_train_steps=...), save_top_k)."
        )
    try:
        barrier()
        # [Note: replicated tensors saved from rank 0] A tensor every rank holds whole (a buffer, a
        # 0-dim parameter, every tensor at stage 0) is written once; DCP's default spreads these over
        # the ranks by bytes, so BatchNorm's running statistics, which each rank updates from its own
        # batches after the step's broadcast ([Note: buffer broadcast] in zero/buffers.py), were saved
        # from rank 1, and a resume or an export carried rank 1's (a new-user trial). DDP saves rank
        # 0's, and so does this.
        dcp.save(dict(state), checkpoint_id=staging,  # collective: returns once .metadata is written
                 planner=dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True))
        if is_global_zero:
            torch.save(metadata, staging / METADATA_FILE)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank must hear of it before anyone moves on
        failure = e  # (DCP raises CheckpointException, a BaseException, for a write that failed on any rank)
    # Each rank reads its own evidence before the collective (after it, rank 0's cleanup frees the
    # space again), and the verdict is shared: the exception DCP hands the other ranks was pickled,
    # which drops the OSError(ENOSPC) it was raised from. torch's writer reports a full disk as
    # "unexpected pos ..." rather than ENOSPC, so a failed write with less room left than the
    # checkpoint needs is read as the full disk it almost surely is.
    free_at_failure = _free_bytes(staging) if failure is not None else free
    no_space = failure is not None and (_no_space(failure) or free_at_failure < need)
    verdict = _max_over_ranks(2 if no_space else 1 if failure is not None else 0)
    if verdict:
        if is_global_zero and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
        barrier()
        cause = f"{type(failure).__name__}: {failure}" if failure is not None else "another rank failed to write"
        if verdict == 2:
            said = f"; the writer said: {_first_line(failure)}" if failure is not None else ""
            cause = (f"no space left on the device ({format_bytes(free_at_failure)} was free on this rank when it"
                     f" failed; the checkpoint needs about {format_bytes(need)}{said})")
        raise CheckpointSaveError(
            f"Saving the checkpoint {path} failed: {cause}. The partial save was removed{_kept(path)}."
        ) from failure
    if is_global_zero:
        _replace_dir(staging, path)
    barrier()


# meta.pt holds loop and callback states and hyper-parameters: small, but not nothing.
_METADATA_ALLOWANCE = 1 << 20


def _checkpoint_bytes(state: Any) -> int:
    """Bytes the whole checkpoint writes: every rank's shards (summed over ranks) plus replicated tensors once."""
    sharded, replicated = 0, 0
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, torch.Tensor):
            local = getattr(item, "_local_tensor", None)
            if local is not None:
                sharded += local.numel() * local.element_size()
            else:
                replicated += item.numel() * item.element_size()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        total = torch.tensor([sharded], dtype=torch.float64, device=collective_device())  # NCCL: CUDA only
        dist.all_reduce(total)
        sharded = int(total.item())
    return sharded + replicated


def _max_over_ranks(value: int) -> int:
    """The largest ``value`` over ranks (every rank must call it; no process group: this rank's)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([float(value)], device=collective_device())  # NCCL: CUDA only
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _free_bytes(path: Path) -> int:
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return shutil.disk_usage(existing).free


def _no_space(error: BaseException) -> bool:
    import errno

    seen: list[BaseException] = []
    todo: list[Any] = [error]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or e in seen:
            continue
        seen.append(e)
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e):
            return True
        todo.extend([e.__cause__, e.__context__])
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, Mapping):
            todo.extend(v[0] if isinstance(v, tuple) else v for v in failures.values())
    return False


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def _kept(path: Path) -> str:
    return f"; the previous checkpoint {path} is kept" if is_sharded_checkpoint(path) else ""


def _exchange(a: Path, b: Path) -> bool:
    """Swap the two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where that is not offered."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):  # a filesystem without it (NFS, FUSE)
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _replace_dir(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst``; an existing ``dst`` is removed only once ``src`` is in place.

    [Note: replacing a checkpoint] A directory cannot be renamed over a non-empty one, and two
    renames (``dst`` aside, then ``src`` in) leave a moment with no ``dst``: a rank 0 killed there
    left no ``last.ckpt``, and ``fit(ckpt_path="last")`` trained from step 0 with only Lightning's
    warning (a new-user trial). Where the filesystem can swap two paths in one step (Linux: ext4,
    xfs, btrfs, tmpfs), ``dst`` always names a complete checkpoint, the old one or the new; the
    two renames remain for the others, and the old one is then at ``<dst>.old`` (_check_loadable says so).
    """
    if dst.is_file():
        dst.unlink()
    if dst.exists() and _exchange(src, dst):
        shutil.rmtree(src)  # now the previous checkpoint
        return
    old = None
    if dst.exists():
        old = _previous(dst)
        if old.exists():
            shutil.rmtree(old)
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old)


def _previous(path: Path) -> Path:
    return path.with_name(path.name + ".old")


def _readable_weights_file(path: Path) -> bool:
    """Whether ``path`` starts as a file of saved tensors does: torch.save's zip archive or legacy pickle,
    or safetensors' header (8-byte length, then a JSON object)."""
    import zipfile

    if zipfile.is_zipfile(path):
        return True
    with open(path, "rb") as f:
        head = f.read(9)
    return head[:1] == b"\x80" or (len(head) == 9 and head[8:9] == b"{")


def interrupted_saves_note(directory: Path, beside: str = "") -> Optional[str]:
    """The interrupted saves in ``directory``, or None.

    A killed save's ``.incomplete`` directory is removed only by a later save to the same name;
    resumed under other names (another ``every_n_train_steps``), it stayed, unmentioned (a trial:
    121 MB). A replace killed between its two renames leaves the previous checkpoint, complete, at
    ``<name>.old`` ([Note: replacing a checkpoint]), where ``ckpt_path="last"`` does not look.
    """
    try:  # a note: nothing here may stop the run (a directory another process is changing)
        left = sorted(p for p in directory.glob("*" + INCOMPLETE_SUFFIX) if p.is_dir())
        sizes = [sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for p in left]
        kept = sorted(p for p in directory.glob("*.old") if is_sharded_checkpoint(p)
                      and not p.with_name(p.name[:-len(".old")]).exists())
    except OSError:
        return None
    if not left and not kept:
        return None
    where = f" beside {beside}" if beside else ""
    parts = []
    if left:
        listed = ", ".join(f"{p.name} ({format_bytes(n) if n else 'empty'})" for p, n in zip(left, sizes))
        parts.append(f"{len(left)} interrupted save(s){where}: {listed}, in {directory}. They are not checkpoints"
                     " (loading one is refused) and only a later save to the same name replaces one: delete them"
                     " once no run is writing there.")
    for old in kept:
        parts.append(f"{old} is a complete checkpoint that a killed save was replacing: rename it to"
                     f" {old.name[:-len('.old')]} to resume from it.")
    return " ".join(parts)


def remove_checkpoint_dir(path: Path) -> None:
    """Delete a checkpoint directory, first renamed so that a kill part-way leaves a name that says so
    (a trial's rank 0 killed inside the removal left a half-deleted ``epoch=0-step=5.ckpt``)."""
    doomed = incomplete_path(path)
    if doomed.exists():
        shutil.rmtree(doomed)
    os.replace(path, doomed)
    shutil.rmtree(doomed)


def _check_loadable(path: Path) -> None:
    if path.name.endswith(INCOMPLETE_SUFFIX):
        raise ValueError(
            f"{path} is an interrupted save (its name ends in {INCOMPLETE_SUFFIX!r}: the process stopped"
            " before the save completed). Resume from the previous complete checkpoint."
        )
    if not path.exists() and is_sharded_checkpoint(_previous(path)):  # [Note: replacing a checkpoint]
        raise FileNotFoundError(
            f"{path} does not exist: the process stopped while replacing it. The checkpoint it held is complete"
            f" in {_previous(path)}; rename that to {path.name} to resume from it"
            + (f" (the new save, in {incomplete_path(path)}, may be complete too: it is if it holds"
               f" {METADATA_FILE})." if incomplete_path(path).exists() else ".")
        )
    if not path.exists() and incomplete_path(path).exists():
        raise FileNotFoundError(
            f"{path} does not exist: its save was interrupted (the partial data is in"
            f" {incomplete_path(path)}). Resume from the previous complete checkpoint."
        )
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist.")
    if not is_sharded_checkpoint(path):
        hint = ""
        if path.is_file() and not _readable_weights_file(path):
            # (a trial's file of random bytes was told how to load it with torch.load, which then failed)
            hint = (" It is not a checkpoint of any kind either: neither a torch.save file nor a safetensors file"
                    " (a truncated or corrupt copy, or another file given by mistake). Pass a checkpoint"
                    " directory this strategy wrote, or a complete copy of the file.")
        elif path.is_file():  # a checkpoint of another strategy (ddp, deepspeed's single file, ...)
            hint = (" It is a single file, as Lightning's other strategies write: trainer.validate / test / predict read"
                    " its weights with this strategy, trainer.fit does not resume from it. To train on from its"
                    " weights, build the model in __init__, load them before trainer.fit"
                    " (module.load_state_dict(torch.load(path, weights_only=False)['state_dict']); a plain state"
                    " dict, such as save_consolidated's output, loads as it is, without ['state_dict']) and fit"
                    " without ckpt_path: the optimizer and loop states do not carry over.")
        raise ValueError(
            f"{path} is not a sharded checkpoint directory written by strategy 'ampzero': it needs"
            f" {METADATA_FILE} and torch.distributed.checkpoint's .metadata.{hint}"
        )


def load_sharded(
    path: Path, module: nn.Module, optimizers: Sequence[Optimizer], *, strict: bool = True,
    weights_only: bool | None = None, extra: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load model (and optimizer, where given) states in place into the partitioned ``module``.

    ``extra``: other states saved beside them (``{key: state_dict}``), loaded in place into those
    tensors where the checkpoint has the key. Returns the metadata and the ``extra`` entries loaded.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    _check_loadable(path)
    saved = set(_saved_keys(path))  # read once: the metadata of a large checkpoint is not small
    if optimizers and not any(key.startswith("optimizer_") for key in saved):
        # Lightning's own words for a weights-only file (its checks never see a sharded directory's
        # contents): DCP's "Missing key in checkpoint state_dict: optimizer_0.state..." said nothing useful.
        raise KeyError(
            f"Trying to restore optimizer state but checkpoint {path} contains only the model. This is probably due"
            " to `ModelCheckpoint.save_weights_only` being set to `True`. To start training from these weights,"
            " load them without ckpt_path (trainer.validate(model, ckpt_path=...) first, then trainer.fit(model)),"
            " or save with save_weights_only=False to resume."
        )
    state: dict[str, Any] = {"state_dict": get_model_state_dict(module)}
    stateless: list[bool] = []  # per optimizer: parameters without a saved state were left out
    for i, opt in enumerate(optimizers):
        optim_state, dropped = _without_unsaved_keys(get_optimizer_state_dict(module, opt), f"optimizer_{i}", saved)
        state[f"optimizer_{i}"] = optim_state
        stateless.append(dropped)
    present = {key: value for key, value in (extra or {}).items() if any(k.startswith(key + ".") for k in saved)}
    state.update(present)
    dcp.load(state, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=not strict))
    set_model_state_dict(module, state["state_dict"], options=StateDictOptions(strict=strict))
    for i, opt in enumerate(optimizers):
        # [Note: parameters without a saved optimizer state]: torch refuses a trainable parameter
        # without a state unless told not to be strict; only then, and only for those parameters.
        set_optimizer_state_dict(module, opt, state[f"optimizer_{i}"],
                                 options=StateDictOptions(strict=not stateless[i]))
    return torch.load(path / METADATA_FILE, weights_only=bool(weights_only)), present


def load_full_file(path: Path, module: nn.Module, *, strict: bool = True,
                   weights_only: bool | None = None) -> dict[str, Any]:
    """Load the weights of a single-file Lightning checkpoint (``state_dict``: full tensors) into the partitioned ``module``.

    Every rank reads the file and keeps its own shard of each tensor (memory: the whole file per
    rank while loading, as Lightning's FSDP strategy reads one). Returns the checkpoint, for
    Lightning's restore of callbacks and hyper-parameters.
    """
    from lightning.fabric.utilities.cloud_io import _load as pl_load
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    checkpoint = pl_load(path, map_location="cpu", weights_only=weights_only)
    state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise ValueError(
            f"{path} is a single file without a Lightning 'state_dict': not a checkpoint Lightning wrote. For a plain"
            " state dict (ampzero-consolidate's safetensors or pt output), load it into the model yourself before"
            " the call: module.load_state_dict(...) for a model built in __init__."
        )
    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=strict))
    return checkpoint


def _saved_keys(path: Path) -> Iterable[str]:
    """The flattened keys (``optimizer_0.param_groups.0.lr``, ...) the checkpoint at ``path`` holds."""
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.keys()


def _without_unsaved_keys(optim_state: dict[str, Any], prefix: str, saved: set[str]) -> tuple[dict[str, Any], bool]:
    """``optim_state`` without what the checkpoint does not hold, and whether a parameter's state was left out.

    [Note: param-group settings added since the save] A learning-rate scheduler adds
    ``initial_lr`` to its optimizer's groups. Lightning's ``Tuner.lr_find`` attaches one after
    saving the checkpoint it restores at the end, and a resume may configure a scheduler the saved
    run had not: DCP, loading into the live optimizer's layout, stopped on the key the checkpoint
    lacks (``Missing key in checkpoint state_dict: optimizer_0.param_groups.0.initial_lr``, at every
    stage; a new-user trial, issue 16's note). torch's ``Optimizer.load_state_dict`` takes the saved
    groups as they are, so the live-only settings are left out of what is loaded, as there.

    [Note: parameters without a saved optimizer state] A trainable parameter that never had a
    gradient (a head used only in validation, a branch not taken yet) has no optimizer state when
    the checkpoint is saved, since torch's optimizers create it at the first step that sees a
    gradient. Loading into a fresh optimizer, torch's ``get_optimizer_state_dict`` creates a state
    for every parameter (a step at lr 0), so DCP asked for keys the checkpoint never had and the
    resume stopped (``Missing key in checkpoint state_dict: optimizer_0.state.head.weight.step``, at
    stages 1-3; a new-user trial). Such a parameter is left out of what is loaded, and the load then
    leaves it without a state, as the run that saved it had (``Optimizer.load_state_dict`` keeps
    only the states it is given): its first gradient starts its moments and step count at zero, as
    in the uninterrupted run. A parameter with part of its state saved is still a mismatch for DCP
    to report.
    """
    for g, group in enumerate(optim_state.get("param_groups", [])):
        for key in [k for k in group if k != "params" and f"{prefix}.param_groups.{g}.{k}" not in saved]:
            del group[key]
    states = optim_state.get("state", {})
    # A state key is the parameter's FQN, then the state's name (``exp_avg``), then any nesting: a
    # parameter has a saved state where its FQN is a dotted prefix of one (a parameter's FQN is
    # never a prefix of another's, which goes through a module).
    head = f"{prefix}.state."
    with_state = {".".join(parts[:n]) for parts in (key[len(head):].split(".") for key in saved
                                                    if key.startswith(head)) for n in range(1, len(parts))}
    unsaved = [fqn for fqn in states if fqn not in with_state]
    for fqn in unsaved:
        del states[fqn]
    return optim_state, bool(unsaved)
