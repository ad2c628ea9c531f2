"""``Trainer(sync_batchnorm=True)`` on CPU at stages 0-3: the JSON maps each stage to the error fit stopped with
("" if it trained). Before, the flag was ignored at every stage, silently."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl

from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(1))

    def training_step(self, batch, i):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = {}
    for stage in (0, 1, 2, 3):
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=AmpZeroStrategy(stage=stage), sync_batchnorm=True,
                             max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        data = TensorDataset(torch.randn(8, 3, 6, 6))
        try:
            trainer.fit(Net(), DataLoader(data, batch_size=4))
            out[str(stage)] = ""
        except ValueError as error:
            out[str(stage)] = str(error)
    Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    run_and_exit(main)
