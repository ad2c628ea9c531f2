"""Parameters unfrozen and frozen during training ([Note: parameters unfrozen during training]).

Lightning's ``BackboneFinetuning`` unfreezes the backbone at epoch 1 and adds it to the
optimizer; a callback then freezes the head at epoch 2. Stage 0 (DDP) kept reducing only the
parameters that trained when it was built: the backbone trained on each rank's own gradient and
the ranks drifted apart; with the head frozen DDP would wait for its gradient. Each stage runs
as a user runs it (2 CPU ranks, nothing exported); the JSON holds, per stage, the largest
difference between the ranks' final parameters, and each stage's largest difference from stage 1
(FSDP2, which reduces whatever has a gradient).
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
from lightning.pytorch.callbacks import BackboneFinetuning, Callback

from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy


class FreezeHead(Callback):
    def on_train_epoch_start(self, trainer, module):
        if trainer.current_epoch == 2:
            module.head.requires_grad_(False)


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)

    def training_step(self, batch, i):
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(filter(lambda p: p.requires_grad, self.parameters()), lr=1e-2)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _fit(stage: int) -> dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g))
    model = Model()
    trainer = pl.Trainer(strategy=AmpZeroStrategy(stage=stage), accelerator="cpu", devices=2, max_epochs=3,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1), FreezeHead()])
    trainer.fit(model, DataLoader(data, batch_size=4))
    return {n: _full(p) for n, p in model.named_parameters()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    final = {stage: _fit(stage) for stage in (0, 1)}
    out = {}
    for stage, params in final.items():
        ranks = [None, None]
        dist.all_gather_object(ranks, params)
        out[f"ranks_{stage}"] = max((ranks[0][k] - ranks[1][k]).abs().max().item() for k in params)
        out[f"vs_stage_1_{stage}"] = max((params[k] - final[1][k]).abs().max().item() for k in params)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
