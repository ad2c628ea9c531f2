"""A BatchNorm CNN through Lightning at several stages; every rank's losses and buffers as JSON.

Run as a script (never inside pytest: Lightning's launcher re-runs the command line for the
other rank). Each configuration is ``stage:reduce_bucket_size`` (0: the default bucket). Each rank
reads its own slice of a dataset whose statistics differ between the slices (so the ranks'
running statistics drift apart unless broadcast), with gradient accumulation 2 (Lightning's
``block_backward_sync`` on the first micro-batch), a sanity-check validation before training and
a validation every 2 optimizer steps (running statistics in use).
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import lightning.pytorch as pl

from lightning_ampzero.process import run_and_exit


class Images(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        parity = (torch.arange(n) % 2).float().view(n, 1, 1, 1)  # rank r reads the samples i = r mod 2
        self.x = torch.randn(n, 3, 6, 6, generator=g) * (1 + parity) + parity
        self.y = torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def conv_bn(cin: int, cout: int, momentum: "float | None" = 0.1) -> nn.Module:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout, momentum=momentum), nn.ReLU())


class BNModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(conv_bn(3, 8), conv_bn(8, 8), conv_bn(8, 8, momentum=None))
        self.head = nn.Linear(8, 4)
        self.losses: dict[str, list[float]] = {"train": [], "val": []}

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))

    def training_step(self, batch, batch_idx):
        loss = nn.functional.cross_entropy(self(batch[0]), batch[1])
        self.losses["train"].append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.losses["val"].append(nn.functional.cross_entropy(self(batch[0]), batch[1]).item())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run(cfg: str, args: argparse.Namespace) -> list[dict]:
    from lightning_ampzero.strategy import AmpZeroStrategy

    stage, bucket = (int(v) for v in cfg.split(":"))
    pl.seed_everything(0, verbose=False)
    model = BNModule()
    strategy = AmpZeroStrategy(stage=stage, **({"reduce_bucket_size": bucket} if bucket else {}))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, accumulate_grad_batches=2,
        val_check_interval=4, check_val_every_n_epoch=None, num_sanity_val_steps=2, limit_val_batches=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )

    def loader(seed: int, n: int) -> DataLoader:
        data = Images(n, seed)
        sampler = DistributedSampler(data, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False)
        return DataLoader(data, batch_size=4, sampler=sampler)

    trainer.fit(model, loader(0, 8 * 2 * args.steps), loader(1, 16))
    mine = {**model.losses, "buffers": {n: b.tolist() for n, b in model.named_buffers()},
            "broadcasts": getattr(model.__dict__.get("_ampzero_buffer_broadcast"), "broadcasts", None)}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", required=True, help="comma list of stage:reduce_bucket_size")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    results = {cfg: run(cfg, args) for cfg in args.configs.split(",")}
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
