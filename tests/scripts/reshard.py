"""Checkpoint on one world size / stage, resume on another, compare with the uninterrupted run.

``--phase save``: train 2 epochs with a checkpoint at the end of epoch 0; writes all losses.
``--phase resume --ckpt C``: resume from C (any world size / stage) to the end of epoch 1;
writes the losses of the resumed steps. The global batch (12) is the same for every world
size, each rank getting samples r, r+world, ... of it, so the trajectory does not depend on
the world size (the parity tests show that).
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ampzero.models.gpt import GPTConfig
from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy

from parity import PatternData, Recorder

GLOBAL_BATCH = 12
STEPS_PER_EPOCH = 4


def _kill_during_save(n: int) -> None:
    """Simulate a crash: in the n-th save, each rank dies right after writing its shard files."""
    import os
    import signal

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    original = FileSystemWriter.write_data
    count = {"saves": 0}

    def write_data(self, plan, planner):
        count["saves"] += 1
        result = original(self, plan, planner)
        if count["saves"] == n:
            result.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    FileSystemWriter.write_data = write_data


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=["save", "resume"], required=True)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--ckpt-dir", default="")
    p.add_argument("--ckpt", default="")
    p.add_argument("--kill-at-save", type=int, default=0, help="SIGKILL every rank mid-way through save N")
    p.add_argument("--export", default="", help="after training: outputs on a fixed input + live consolidated export")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.kill_at_save:
        _kill_during_save(args.kill_at_save)
    warnings.filterwarnings("ignore")
    torch.use_deterministic_algorithms(True)

    pl.seed_everything(0, verbose=False)
    model = Recorder(model=GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32), lr=3e-3)
    callbacks = []
    if args.phase == "save":
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True))
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=AmpZeroStrategy(stage=args.stage), precision=args.precision,
        max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=args.phase == "save", callbacks=callbacks, use_distributed_sampler=False,
    )
    dataset = PatternData(GLOBAL_BATCH * STEPS_PER_EPOCH, 32, 256)
    sampler = DistributedSampler(dataset, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // trainer.world_size, sampler=sampler)
    trainer.fit(model, loader, ckpt_path=args.ckpt or None)
    losses = torch.tensor(model.losses, dtype=torch.float64)
    dist.all_reduce(losses)
    losses /= dist.get_world_size()
    outputs = None
    if args.export:
        # The trained sharded model's outputs on a fixed input, for comparison with the
        # consolidated weights loaded into a plain model; and a live 16-bit export.
        x = torch.arange(2 * 32).reshape(2, 32) % 256
        with torch.no_grad():
            outputs = model(x).float()[:, -1, :8].tolist()
        trainer.strategy.save_consolidated(Path(args.export) / "live_bf16.safetensors", dtype="bf16")
        trainer.strategy.save_consolidated(Path(args.export) / "live_fp32", dtype=None, max_shard_size="200KB")
        # the defaults with a torch.save name: the format follows the name (it wrote safetensors: a trial)
        trainer.strategy.save_consolidated(Path(args.export) / "live_default.pt")
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    scale = float(scaler.get_scale()) if scaler is not None and hasattr(scaler, "get_scale") else None
    if dist.get_rank() == 0:
        ckpts = sorted(str(c) for c in Path(args.ckpt_dir).glob("*.ckpt")) if args.ckpt_dir else []
        Path(args.out).write_text(json.dumps({"losses": losses.tolist(), "ckpts": ckpts, "final_scale": scale,
                                               "outputs": outputs}))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
