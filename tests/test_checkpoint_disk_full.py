"""A checkpoint save that cannot complete (a full disk) says so on every rank, keeps the last good
checkpoint and leaves no half-written one behind ([Note: a save that cannot complete])."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _spawn import spawn  # noqa: E402

MiB = 1 << 20


def _state(mib: int, value: float) -> dict:
    return {"state_dict": {"w": torch.full((mib * MiB // 4,), value)}}


def _save(path: Path, state: dict) -> str:
    import torch.distributed as dist

    from lightning_ampzero.checkpoint.sharded import CheckpointSaveError, save_sharded

    try:
        save_sharded(path, state, {"step": 1}, is_global_zero=dist.get_rank() == 0, barrier=dist.barrier)
    except CheckpointSaveError as e:
        return str(e)
    return "saved"


def _check_previous(path: Path) -> float:
    import torch.distributed.checkpoint as dcp

    from lightning_ampzero.checkpoint.sharded import incomplete_path, is_sharded_checkpoint

    assert is_sharded_checkpoint(path) and not incomplete_path(path).exists()
    loaded = {"state_dict": {"w": torch.zeros(MiB // 4)}}
    dcp.load(loaded, checkpoint_id=path)
    return float(loaded["state_dict"]["w"][0])


def _refused_before_writing(rank: int, world: int, root: str) -> tuple[str, str, float]:
    from lightning_ampzero.checkpoint import sharded

    path = Path(root) / "last.ckpt"
    first = _save(path, _state(1, 1.0))
    if rank == 1:  # one rank's filesystem is short of space: every rank must refuse together
        sharded._free_bytes = lambda p: 3 * MiB
    second = _save(path, _state(4, 2.0))
    return first, second, _check_previous(path)


def test_a_save_without_room_is_refused_on_every_rank_and_keeps_the_last_checkpoint(tmp_path):
    results = spawn(_refused_before_writing, world_size=2, args=(str(tmp_path),), timeout=180)
    for first, second, kept in results:
        assert first == "saved"
        assert "Not enough disk space to save the checkpoint" in second and str(tmp_path / "last.ckpt") in second
        assert "it needs about 5.0 MiB" in second and "Nothing was written; the previous checkpoint" in second
        assert kept == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def _directory_not_creatable(rank: int, world: int, root: str) -> str:
    import errno

    if rank == 0:  # a read-only filesystem (mount -o ro) as rank 0 meets it
        def mkdir(self, *args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system", str(self))

        Path.mkdir = mkdir
    return _save(Path(root) / "ckpts" / "last.ckpt", _state(1, 1.0))


def test_a_directory_rank_0_cannot_create_is_said_on_every_rank_at_once(tmp_path):
    # Rank 0's failed mkdir skipped the barrier the other ranks waited in: the save hung until the
    # watchdog (300 s) named two collectives, never the read-only filesystem (a new-user trial).
    results = spawn(_directory_not_creatable, world_size=2, args=(str(tmp_path),), timeout=60)
    for rank, message in enumerate(results):
        assert message.startswith(f"Cannot create the checkpoint directory {tmp_path / 'ckpts'}"), message
        assert ("Read-only file system" if rank == 0 else "rank 0 could not") in message
        assert "ModelCheckpoint(dirpath=...)" in message
    assert list(tmp_path.iterdir()) == []


def _disk_fills_during_the_save(rank: int, world: int, root: str) -> tuple[str, str, float]:
    from lightning_ampzero.checkpoint import sharded

    path = Path(root) / "last.ckpt"
    first = _save(path, _state(1, 1.0))
    sharded._checkpoint_bytes = lambda state: 0  # the check passes: the disk fills up while writing
    if rank == 1:
        # Rank 1 sees only the pickled copy of rank 0's error (no ENOSPC in it) and plenty of room
        # (rank 0 may already have removed the partial save): the verdict must come from rank 0.
        sharded._free_bytes = lambda p: 1 << 40
    second = _save(path, _state(12, 2.0))
    return first, second, _check_previous(path)


@pytest.fixture
def small_disk(tmp_path):
    """A real 8 MiB filesystem (a tmpfs): writing past it fails with ENOSPC."""
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_disk_that_fills_during_the_save_fails_cleanly_on_every_rank(small_disk):
    results = spawn(_disk_fills_during_the_save, world_size=2, args=(str(small_disk),), timeout=180)
    for first, second, kept in results:
        assert first == "saved"
        assert f"Saving the checkpoint {small_disk / 'last.ckpt'} failed: no space left on the device" in second
        assert "The partial save was removed; the previous checkpoint" in second
        assert kept == 1.0
    assert sorted(p.name for p in small_disk.iterdir()) == ["last.ckpt"]


def _weights_only_resume(rank: int, world: int, root: str) -> str:
    from torch import nn

    from lightning_ampzero.checkpoint.sharded import load_sharded

    model = nn.Linear(4, 4)
    _save(Path(root), {"state_dict": model.state_dict()})  # as ModelCheckpoint(save_weights_only=True) saves
    opt = torch.optim.AdamW(model.parameters())
    try:
        load_sharded(Path(root), model, [opt])
        message = "loaded with the optimizer"
    except KeyError as e:
        message = str(e)
    load_sharded(Path(root), model, [])  # the weights alone load (trainer.validate(ckpt_path=...))
    return message


def test_resuming_a_weights_only_checkpoint_says_so_as_lightning_does(tmp_path):
    # It stopped with DCP's "Missing key in checkpoint state_dict: optimizer_0.state..." traceback.
    for message in spawn(_weights_only_resume, world_size=2, args=(str(tmp_path / "ckpt"),), timeout=180):
        assert "checkpoint contains only the model" not in message  # the path is named in between
        assert "contains only the model. This is probably due to `ModelCheckpoint.save_weights_only`" in message



class _Killed(BaseException):
    """The process ending at that point (not an Exception: nothing may catch it)."""


def _kill_at(monkeypatch, module, name: str, call: int) -> None:
    original, calls = getattr(module, name), []

    def patched(*args, **kwargs):
        calls.append(args)
        if len(calls) == call:
            raise _Killed(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, patched)


def _killed_while_replacing(tmp_path: Path, monkeypatch, can_swap: bool) -> Path:
    """last.ckpt holds 1.0, a complete save of 2.0 is staged; the process ends at the replace's second
    rename or first removal, whichever comes first."""
    from lightning_ampzero.checkpoint import sharded

    path = tmp_path / "last.ckpt"
    sharded.save_sharded(path, _state(1, 1.0), {"step": 1}, is_global_zero=True)
    replace = sharded._replace_dir
    monkeypatch.setattr(sharded, "_replace_dir", lambda src, dst: None)  # stop at the staged save
    sharded.save_sharded(path, _state(1, 2.0), {"step": 2}, is_global_zero=True)
    assert sharded.is_sharded_checkpoint(path) and (sharded.incomplete_path(path) / "meta.pt").is_file()
    if not can_swap:
        monkeypatch.setattr(sharded, "_exchange", lambda a, b: False)  # NFS, FUSE: two renames
    _kill_at(monkeypatch, os, "replace", 2)
    _kill_at(monkeypatch, shutil, "rmtree", 1)
    with pytest.raises(_Killed):
        replace(sharded.incomplete_path(path), path)
    monkeypatch.undo()
    return path


def test_a_process_killed_while_replacing_a_checkpoint_leaves_a_complete_one_under_its_name(tmp_path, monkeypatch):
    # [Note: replacing a checkpoint] Rank 0 killed between the two renames left no last.ckpt, and
    # fit(ckpt_path="last") started from step 0 (a new-user trial).
    import torch.distributed.checkpoint as dcp

    from lightning_ampzero.checkpoint.sharded import is_sharded_checkpoint

    from lightning_ampzero.checkpoint.sharded import _exchange

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    if not _exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("this filesystem cannot swap two paths in one step; the next test covers the fallback")
    path = _killed_while_replacing(tmp_path / "a", monkeypatch, can_swap=True)
    assert is_sharded_checkpoint(path), sorted(p.name for p in path.parent.iterdir())
    loaded = {"state_dict": {"w": torch.zeros(MiB // 4)}}
    dcp.load(loaded, checkpoint_id=path)
    assert float(loaded["state_dict"]["w"][0]) == 2.0


def test_where_paths_cannot_be_swapped_a_replace_killed_midway_names_the_complete_previous_checkpoint(
        tmp_path, monkeypatch):
    from lightning_ampzero.checkpoint.sharded import _check_loadable

    path = _killed_while_replacing(tmp_path, monkeypatch, can_swap=False)
    assert not path.exists()
    with pytest.raises(FileNotFoundError, match=r"complete in .*last\.ckpt\.old; rename that to last\.ckpt") as e:
        _check_loadable(path)
    assert "holds meta.pt" in str(e.value)  # the staged save is complete too


def test_resuming_beside_an_interrupted_save_says_it_is_there_and_what_to_do(tmp_path):
    # A killed save's .incomplete directory stayed unmentioned when the resumed run saved under other
    # names (a trial: 121 MB).
    from lightning_ampzero.checkpoint import sharded

    path = tmp_path / "epoch=0-step=5.ckpt"
    sharded.save_sharded(path, _state(1, 1.0), {"step": 5}, is_global_zero=True)
    assert sharded.interrupted_saves_note(tmp_path, beside=path.name) is None
    partial = tmp_path / "epoch=0-step=10.ckpt.incomplete"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"x" * 3 * MiB)
    (tmp_path / "last.ckpt.incomplete").mkdir()  # killed before writing anything
    note = sharded.interrupted_saves_note(tmp_path, beside=path.name)
    assert note is not None and "epoch=0-step=10.ckpt.incomplete (3.0 MiB)" in note and "delete them" in note, note
    assert "last.ckpt.incomplete (empty)" in note, note
    # A replace killed between its two renames (no swap): the complete previous checkpoint at .old,
    # where ckpt_path="last" does not look.
    os.replace(path, tmp_path / "last.ckpt.old")
    note = sharded.interrupted_saves_note(tmp_path)
    assert "last.ckpt.old is a complete checkpoint" in note and "rename it to last.ckpt" in note, note


def test_a_checkpoint_removal_killed_part_way_leaves_a_name_that_says_so(tmp_path, monkeypatch):
    # A trial's rank 0 killed inside ModelCheckpoint's removal of a displaced top-k checkpoint left a
    # half-deleted epoch=0-step=5.ckpt, under a checkpoint's name.
    from lightning_ampzero.checkpoint import sharded

    path = tmp_path / "epoch=0-step=5.ckpt"
    sharded.save_sharded(path, _state(1, 1.0), {"step": 5}, is_global_zero=True)
    _kill_at(monkeypatch, shutil, "rmtree", 1)
    with pytest.raises(_Killed):
        sharded.remove_checkpoint_dir(path)
    monkeypatch.undo()
    assert not path.exists() and sharded.incomplete_path(path).is_dir()
