"""A branch chosen per rank, each branch a sharding unit of its own ([Note: units reduced in different orders]).

Four blocks of one shape (``inp``, ``a``, ``b``, ``out``) become units of their own under a
``reduce_bucket_size`` smaller than two of them. In step 2 rank 1 takes the other branch than rank 0,
so each rank reduces the unit it ran in its place in the backward and the other one at the end: in
different orders (both have run both branches before, so each rank has both units to reduce). Before
the check, stages 1 and 2 summed rank 0's gradient of one branch with rank 1's of the other, silently
(0.0023 from ``ddp_find_unused_parameters_true`` after 3 SGD steps). The JSON holds, per run, either
the final parameters or the error it stopped with: ``ddp`` / ``same/ddp`` (Lightning's ddp with
find_unused_parameters), ``same/stage{1,2}`` (every rank takes the same branch: trains, no error),
``split/stage{1,2}`` (the ranks differ in step 2).
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


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class Module(pl.LightningModule):
    def __init__(self, split: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.a, self.b, self.out = Block(), Block(), Block(), Block()  # four units of one size
        self.split = split

    def training_step(self, batch, i):
        x, y = batch
        # The data chooses the branch (a, b, b): every rank has run both once when, in step 2, rank 1
        # takes the other one if ``split`` (a unit no rank has gathered yet is not reduced at all: one
        # collective fewer on that rank, which gloo refuses in C++).
        take_a = bool(x[0, 0] > 0) != (self.split and self.global_rank == 1 and i == 2)
        h = self.inp(x)
        h = self.a(h) if take_a else self.b(h)
        return (self.out(h).mean(-1, keepdim=True) - y).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _run(strategy, split: bool) -> object:
    pl.seed_everything(0, verbose=False)
    module = Module(split)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, generator=g)
    x[:, 0] = torch.tensor([1.0, 1, -1, -1, -1, -1, -1, -1])  # the branches of steps 0-2: a, b, b
    data = TensorDataset(x, torch.randn(8, 1, generator=g))
    try:
        trainer.fit(module, DataLoader(data, batch_size=2))
    except RuntimeError as error:
        return {"error": str(error)}
    return full_params(module)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = {"ddp": _run("ddp_find_unused_parameters_true", split=True)}
    for stage in (1, 2):
        out[f"same/stage{stage}"] = _run(AmpZeroStrategy(stage=stage, reduce_bucket_size=300), split=False)
        out[f"split/stage{stage}"] = _run(AmpZeroStrategy(stage=stage, reduce_bucket_size=300), split=True)
    out["same/ddp"] = _run("ddp_find_unused_parameters_true", split=False)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    run_and_exit(main)
