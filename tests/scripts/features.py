"""Everything a Lightning user expects, under strategy ampzero at a given stage, on N ranks.

Checks run inside the ranks and are collected as JSON (rank 0 writes it); the pytest side
asserts on them. Run as a script.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ampzero.models.gpt import GPTConfig, GPTModule
from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy

from parity import PatternData

TINY = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16)


class Indexed(Dataset):
    def __init__(self, n: int) -> None:
        self.data = PatternData(n, 16, 256, seed=1)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        x, y = self.data[i]
        return x, y, torch.tensor(i)


class Features(GPTModule):
    def __init__(self) -> None:
        super().__init__(model=TINY)
        self.seen: list[int] = []
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.seen.extend(idx.tolist())
        loss = self._loss((x, y))
        self.losses.append(loss.item())
        self.log("rank_value", float(self.global_rank), sync_dist=True, on_step=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch[:2])
        self.log("val_loss", loss, sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch[:2]), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return batch[2]


class TwoOptimizers(pl.LightningModule):
    """Manual optimization with two optimizers over two sub-models (GAN-style alternation)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a = self.b = None

    def configure_model(self):
        if self.a is None:
            torch.manual_seed(0)
            self.a = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
            self.b = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x, part):
        for layer in part:
            x = torch.tanh(layer(x))
        return x

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        x = batch[0]
        for opt, part in ((opt_a, self.a), (opt_b, self.b)):
            loss = F.mse_loss(self(x, part), torch.zeros_like(x))
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)


def _trainer(args, stage, **kw):
    defaults = dict(accelerator="cpu", devices=args.devices, strategy=AmpZeroStrategy(stage=stage),
                    logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    defaults.update(kw)
    return pl.Trainer(**defaults)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _gather_list(values: list[int]) -> list[int]:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, values)
    return [v for part in out for v in part]


def check_stage(stage: int, args, tmp: Path) -> dict:
    result: dict = {}
    n = 32
    # 1. sampler injection, sync_dist logging, validation, test, predict
    pl.seed_everything(0, verbose=False)
    model = Features()
    trainer = _trainer(args, stage, max_steps=4, limit_val_batches=2, val_check_interval=2)
    loader = DataLoader(Indexed(n), batch_size=2)
    trainer.fit(model, loader, DataLoader(Indexed(8), batch_size=2))
    seen = _gather_list(model.seen)
    result["sampler_disjoint"] = len(seen) == len(set(seen))
    result["sampler_count"] = len(seen)
    result["rank_value"] = float(trainer.callback_metrics["rank_value"])
    result["val_loss_finite"] = bool(torch.isfinite(trainer.callback_metrics["val_loss"]))
    test = trainer.test(model, DataLoader(Indexed(8), batch_size=2), verbose=False)
    result["test_loss"] = test[0]["test_loss"]
    preds = trainer.predict(model, DataLoader(Indexed(8), batch_size=2))
    result["predicted"] = sorted(_gather_list([int(i) for p in preds for i in p]))
    result["params_equal_across_ranks"] = _same_everywhere(model)

    # 2. ModelCheckpoint: save at the end of epoch 0, resume, same trajectory as the uninterrupted
    # run. (At an epoch boundary: a plain DataLoader restarts its epoch on a mid-epoch resume.)
    ckpt_dir = tmp / f"ckpt{stage}"
    per_epoch = 12  # samples: 3 steps per epoch on 2 ranks with batch 2
    pl.seed_everything(0, verbose=False)
    full = Features()
    _trainer(args, stage, max_epochs=2).fit(full, DataLoader(Indexed(per_epoch), batch_size=2))
    pl.seed_everything(0, verbose=False)
    first = Features()
    cb = ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True)
    _trainer(args, stage, max_epochs=1, callbacks=[cb], enable_checkpointing=True).fit(
        first, DataLoader(Indexed(per_epoch), batch_size=2))
    ckpt = sorted(ckpt_dir.glob("*.ckpt"))[-1]
    pl.seed_everything(0, verbose=False)
    resumed = Features()
    _trainer(args, stage, max_epochs=2).fit(resumed, DataLoader(Indexed(per_epoch), batch_size=2), ckpt_path=str(ckpt))
    result["checkpoint_is_dir"] = ckpt.is_dir()
    result["first_losses"] = first.losses
    result["resume_full_losses"] = full.losses
    result["resume_losses"] = resumed.losses

    # 3. manual optimization with two optimizers
    pl.seed_everything(0, verbose=False)
    two = TwoOptimizers()
    trainer = _trainer(args, stage, max_steps=3)
    x = torch.randn(16, 8)
    trainer.fit(two, DataLoader(torch.utils.data.TensorDataset(x), batch_size=4))
    result["manual_steps"] = trainer.global_step
    result["manual_equal_across_ranks"] = _same_everywhere(two)
    result["manual_a_finite"] = all(bool(torch.isfinite(_full(p)).all()) for p in two.parameters())
    return result


def _same_everywhere(module: nn.Module) -> bool:
    ok = True
    for p in module.parameters():
        full = _full(p.detach()).clone()
        ref = full.clone()
        dist.broadcast(ref, 0)
        ok &= bool(torch.equal(full, ref))
    return ok


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--tmp", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    results = {s: check_stage(int(s), args, Path(args.tmp)) for s in args.stages.split(",")}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
