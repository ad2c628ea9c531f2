"""Which rank's BatchNorm running statistics a checkpoint holds, and what every rank resumes with.

Each rank updates its running statistics from its own batches; DDP (and ampzero, [Note: buffer
broadcast] in lightning_ampzero/zero/buffers.py) broadcasts rank 0's at the next training forward,
and saves rank 0's. ampzero's checkpoints held rank 1's ([Note: replicated tensors saved from rank
0] in lightning_ampzero/checkpoint/sharded.py; a new-user trial). Run as a user runs it (2 CPU
ranks, nothing exported): per system and rank, the running mean at the end of the fit that saves,
and at the start of the fit that resumes from it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl

from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        self.seen: dict[str, list[float]] = {}

    def training_step(self, batch, i):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def on_train_start(self) -> None:
        self.seen["start"] = self.net[1].running_mean.tolist()

    def on_train_end(self) -> None:
        self.seen["end"] = self.net[1].running_mean.tolist()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)  # the rows drift, so each rank's batches have their own mean
        x = torch.randn(32, 4, generator=g) + torch.arange(32.0)[:, None] / 8
        return DataLoader(TensorDataset(x, torch.randn(32, 1, generator=g)), batch_size=4)


def _trainer(strategy, steps: int) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _run(make, root: Path) -> dict:
    pl.seed_everything(0, verbose=False)
    first, saved = _trainer(make(), 3), Model()
    first.fit(saved)
    ckpt = str(root / "step3.ckpt")
    first.save_checkpoint(ckpt)
    resumed = Model()
    _trainer(make(), 4).fit(resumed, ckpt_path=ckpt)
    mine = {"end": saved.seen["end"], "resumed": resumed.seen["start"]}
    both = [None, None]
    dist.all_gather_object(both, mine)
    return {str(rank): seen for rank, seen in enumerate(both)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tmp", required=True)
    args = p.parse_args()
    out = {"ddp": _run(lambda: "ddp", Path(args.tmp) / "ddp")}
    for stage in (0, 1, 3):
        out[f"stage{stage}"] = _run(lambda: AmpZeroStrategy(stage=stage), Path(args.tmp) / f"stage{stage}")
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
