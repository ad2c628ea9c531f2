"""Lightning's ``Tuner.lr_find``, and a resume into a run with a scheduler the saved run had not.

Both loaded a checkpoint into an optimizer whose groups hold ``initial_lr`` (a scheduler's), which
the checkpoint lacks, and stopped with DCP's "Missing key ... param_groups.0.initial_lr" at every
stage ([Note: param-group settings added since the save] in lightning_ampzero/checkpoint/sharded.py).
Run as a user runs them (2 CPU ranks, nothing exported), against Lightning's ddp: the JSON holds
per system the suggested learning rate, the parameters' largest difference from ddp after a fit
that follows lr_find, and after the resume.
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
from lightning.pytorch.tuner import Tuner

from _common import full_tensors, quiet_trainer

from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy


class Model(pl.LightningModule):
    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))

    def training_step(self, batch, i):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(256, 8, generator=g), torch.randint(0, 4, (256,), generator=g)),
                          batch_size=4)


class WithScheduler(Model):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)}




def _run(name: str, make, root: Path) -> dict:
    pl.seed_everything(0, verbose=False)
    model = Model()
    trainer = quiet_trainer(make(), root / name, 4)
    found = Tuner(trainer).lr_find(model, num_training=30, early_stop_threshold=None)
    trainer.fit(model)
    after_lr_find = full_tensors(model)
    pl.seed_everything(0, verbose=False)
    first = quiet_trainer(make(), root / name, 2)
    first.fit(Model())
    ckpt = str(root / name / "no_scheduler.ckpt")
    first.save_checkpoint(ckpt)
    resumed = WithScheduler()
    quiet_trainer(make(), root / name, 4).fit(resumed, ckpt_path=ckpt)
    return {"suggestion": found.suggestion(), "after_lr_find": after_lr_find, "resumed": full_tensors(resumed)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tmp", required=True)
    args = p.parse_args()
    runs = {"ddp": _run("ddp", lambda: "ddp", Path(args.tmp))}
    for stage in (0, 3):
        runs[f"stage{stage}"] = _run(f"stage{stage}", lambda: AmpZeroStrategy(stage=stage), Path(args.tmp))
    ref = runs["ddp"]
    out = {name: {"suggestion": r["suggestion"],
                  **{k: max((r[k][n] - ref[k][n]).abs().max().item() for n in ref[k]) for k in ("after_lr_find",
                                                                                                "resumed")}}
           for name, r in runs.items()}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
