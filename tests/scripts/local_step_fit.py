"""A plain Trainer fit with ``torch.optim.AdamW`` at its defaults, ampzero at one stage against Lightning's ddp.

Writes (torch.save, rank 0) the final parameters, gathered, and how many optimizer steps ran on
local shards ([Note: the optimizer step on local shards] in zero/local_step.py), seen from inside
``AdamW.step`` on rank 0.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl

import lightning_ampzero  # noqa: F401  (registers the ampzero_* strategies)
from lightning_ampzero.process import run_and_exit

LOCAL_STEPS = []  # per AdamW step on rank 0: whether its param groups held plain tensors only
_step = torch.optim.AdamW.step


def _recording_step(self, *args, **kwargs):
    from torch.distributed.tensor import DTensor

    LOCAL_STEPS.append(all(not isinstance(p, DTensor) for g in self.param_groups for p in g["params"]))
    return _step(self, *args, **kwargs)


torch.optim.AdamW.step = _recording_step  # same class: the step stays eligible


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(37, 12)  # uneven shards
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(12, 12), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(12, 5)

    def training_step(self, batch, i):
        x, y = batch
        h = self.emb(x).mean(1)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)  # CPU default: the for-loop implementation


class Save(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, module) -> None:
        from torch.distributed.tensor import DTensor

        state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in module.state_dict().items()}
        if trainer.global_rank == 0:
            torch.save({"state": state, "local_steps": sum(LOCAL_STEPS)}, self.out)


def fit(strategy: str, out: Path) -> None:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randint(0, 37, (48, 6), generator=g), torch.randint(0, 5, (48,), generator=g))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=5, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Save(out)])
    trainer.fit(Net(), DataLoader(data, batch_size=4))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("strategy")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    fit(args.strategy, Path(args.out))


if __name__ == "__main__":
    run_and_exit(main)
