"""A real SIGTERM to rank 0 in the middle of a backward, launched by torchrun (no launcher to forward it).

Lightning's handler broadcast from inside the backward while rank 1 was in its reduce-scatters, and
every rank hung ([Note: a SIGTERM in the middle of a step] in lightning_ampzero/sigterm.py; a
new-user trial). Rank 0 signals itself from a gradient hook on the first layer's output in batch
STOP_AT, after the later units' reductions have started. Each rank records the batches it trained
and how the fit ended into <out>.<rank>.json.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl

from _common import fit_until_sigterm

from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy

STOP_AT = 3


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 64)
        self.rest = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)], nn.Linear(64, 1))
        self.trained: list[int] = []

    def training_step(self, batch, batch_idx):
        self.trained.append(batch_idx)
        x, y = batch
        h = self.first(x)
        if self.global_rank == 0 and batch_idx == STOP_AT:
            h.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGTERM))
        return F.mse_loss(self.rest(h), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    module = Module()
    # a unit per 64x64 layer: reduce-scatters are in flight while the backward goes on
    strategy = AmpZeroStrategy(stage=args.stage, reduce_bucket_size=5000, allgather_bucket_size=5000)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=20, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    data = TensorDataset(torch.randn(128, 16), torch.randn(128, 1))
    fit_until_sigterm(trainer, module, DataLoader(data, batch_size=4), args.out, trainer.global_rank)


if __name__ == "__main__":
    run_and_exit(main)
