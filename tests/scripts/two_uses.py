"""A module used twice in one backward under "bf16-mixed" ([Note: a module used twice in one backward]).

Two users' patterns, each trained by Lightning's DDP (the reference) and by ampzero at each stage
given, 2 CPU ranks, the same seed and data:

* ``siamese``: automatic optimization; one encoder applied to two views of the batch, one loss.
* ``gan``: manual optimization in Lightning's order (G step, then D on real and on the detached
  fake in one loss), so the discriminator is used twice in the D step's backward.

The JSON holds, per pattern and stage, the largest difference of the final parameters from the
reference's.
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


class Siamese(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))

    def training_step(self, batch, i):
        (x,) = batch
        return F.mse_loss(self.enc(x).float(), self.enc(x.flip(0) * 0.5).float())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=2e-3)


class Gan(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.disc = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def training_step(self, batch, i):
        (x,) = batch
        g_opt, d_opt = self.optimizers()
        z = torch.randn(x.shape[0], 8, generator=torch.Generator().manual_seed(1000 * self.global_rank + i))
        ones, zeros = torch.ones(x.shape[0], 1), torch.zeros(x.shape[0], 1)
        self.toggle_optimizer(g_opt)
        g_loss = F.binary_cross_entropy_with_logits(self.disc(self.gen(z)).float(), ones)
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        self.untoggle_optimizer(g_opt)
        self.toggle_optimizer(d_opt)
        d_loss = (F.binary_cross_entropy_with_logits(self.disc(x).float(), ones)
                  + F.binary_cross_entropy_with_logits(self.disc(self.gen(z).detach()).float(), zeros)) / 2
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        self.untoggle_optimizer(d_opt)

    def configure_optimizers(self):
        return torch.optim.Adam(self.gen.parameters(), lr=2e-3), torch.optim.Adam(self.disc.parameters(), lr=2e-3)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _fit(cls: type, strategy) -> dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(64, 16, generator=torch.Generator().manual_seed(5)))
    model = cls()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=8, precision="bf16-mixed",
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=8))
    return {n: _full(p) for n, p in model.named_parameters()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--stages", default="3")
    args = p.parse_args()
    out: dict[str, float] = {}
    for name, cls, reference in (("siamese", Siamese, "ddp"), ("gan", Gan, "ddp_find_unused_parameters_true")):
        ref = _fit(cls, reference)
        for stage in map(int, args.stages.split(",")):
            params = _fit(cls, AmpZeroStrategy(stage=stage))
            out[f"{name}_vs_ddp_{stage}"] = max((params[k] - ref[k]).abs().max().item() for k in params)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
