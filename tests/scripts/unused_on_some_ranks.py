"""Parameters some ranks give no gradient ([Note: parameters unused on some ranks] in zero/unused.py).

A model whose layer ``a`` runs on rank 0 only and ``b`` (same shape) on rank 1 only, as a mixture
of experts routes tokens, plus a layer ``c`` no rank runs. Trained with AdamW (weight decay: a
zero gradient and None differ) under Lightning's ``ddp_find_unused_parameters_true`` and stages
1-3, with and without gradient accumulation (a layer used in one micro-batch only), from the
same initial weights and data. The JSON holds, per system, the final parameters.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl

from _common import full_params

from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)  # run by no rank

    def forward(self, x: torch.Tensor, branch: int) -> torch.Tensor:
        h = self.shared(x)
        return (self.a(h) if branch == 0 else self.b(h)).pow(2).mean()


class Module(pl.LightningModule):
    def __init__(self, accumulate: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Net()
        self.accumulate = accumulate

    def training_step(self, batch, i):
        # Without accumulation each rank keeps to its branch; with it, rank 0 also takes b in odd
        # micro-batches: a gradient from one micro-batch, none from the other.
        branch = self.trainer.global_rank if self.accumulate == 1 or i % 2 == 0 else 1
        return self.net(batch[0], branch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)


def _run(strategy, accumulate: int) -> dict[str, list[float]]:
    pl.seed_everything(0, verbose=False)
    module = Module(accumulate)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, logger=False,
                         accumulate_grad_batches=accumulate, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    data = TensorDataset(torch.randn(64, 8, generator=torch.Generator().manual_seed(1)))
    trainer.fit(module, DataLoader(data, batch_size=2))
    return full_params(module)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = {}
    for accumulate in (1, 2):
        out[f"ddp/{accumulate}"] = _run("ddp_find_unused_parameters_true", accumulate)
        for stage in (1, 2, 3):
            out[f"stage{stage}/{accumulate}"] = _run(AmpZeroStrategy(stage=stage), accumulate)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
