"""``requires_grad`` changed inside a step method ([Note: requires_grad changed inside a step]).

Two users' patterns, each trained by Lightning's ``ddp_find_unused_parameters_true`` (the
reference) and by ampzero at each stage given, 2 CPU ranks, the same seed and data:

* ``toggle``: a GAN under manual optimization. ``toggle_optimizer(g_opt)`` freezes the
  discriminator (the parameters of the other optimizer) for the generator's backward; the
  discriminator must get no gradient from it.
* ``freeze``: automatic optimization; ``training_step`` freezes the first layer with
  ``requires_grad_(False)`` at batch 2 and unfreezes it at batch 5 (the module's parameters, as
  the user sees them inside the step). The layer must stay frozen in between.
* ``freeze_acc``: the same with ``accumulate_grad_batches=2``, frozen at batch 3 (the last
  micro-batch of a window, after the layer's gradient of batch 2) and unfrozen at batch 6 (the
  first of a window).

The JSON holds, per pattern and strategy, the largest difference of the final parameters from
the reference's, and of the ranks' final parameters from each other.
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


class Gan(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.disc = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, i):
        x, _ = batch
        g_opt, d_opt = self.optimizers()
        self.toggle_optimizer(g_opt)
        g_loss = -self.disc(self.gen(x)).mean()
        self.manual_backward(g_loss)
        g_opt.step()
        g_opt.zero_grad()
        self.untoggle_optimizer(g_opt)
        self.toggle_optimizer(d_opt)
        d_loss = self.disc(self.gen(x).detach()).mean() - self.disc(x).mean()
        self.manual_backward(d_loss)
        d_opt.step()
        d_opt.zero_grad()
        self.untoggle_optimizer(d_opt)

    def configure_optimizers(self):
        return torch.optim.Adam(self.gen.parameters(), lr=1e-2), torch.optim.Adam(self.disc.parameters(), lr=1e-2)


class FreezeInStep(pl.LightningModule):
    freeze_at, unfreeze_at = 2, 5

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.rest = nn.Sequential(nn.Tanh(), nn.Linear(16, 4))

    def training_step(self, batch, i):
        if i == self.freeze_at:
            self.first.requires_grad_(False)
        if i == self.unfreeze_at:
            self.first.requires_grad_(True)
        x, y = batch
        return F.cross_entropy(self.rest(self.first(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class FreezeInWindow(FreezeInStep):
    freeze_at, unfreeze_at = 3, 6


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _fit(cls: type, strategy, accumulate: int) -> dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g))
    model = cls()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, logger=False,
                         accumulate_grad_batches=accumulate,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=4))
    return {n: _full(p) for n, p in model.named_parameters()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--stages", default="1,2,3")
    args = p.parse_args()
    out: dict[str, float] = {}
    for name, cls, accumulate in (("toggle", Gan, 1), ("freeze", FreezeInStep, 1), ("freeze_acc", FreezeInWindow, 2)):
        ref = _fit(cls, "ddp_find_unused_parameters_true", accumulate)
        for stage in map(int, args.stages.split(",")):
            params = _fit(cls, AmpZeroStrategy(stage=stage), accumulate)
            ranks = [None, None]
            dist.all_gather_object(ranks, params)
            out[f"{name}_ranks_{stage}"] = max((ranks[0][k] - ranks[1][k]).abs().max().item() for k in params)
            out[f"{name}_vs_ddp_{stage}"] = max((params[k] - ref[k]).abs().max().item() for k in params)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
