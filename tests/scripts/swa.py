"""Lightning's StochasticWeightAveraging with BatchNorm at stages 1-3, against ddp, and resumed
from sharded checkpoints at other stages ([Note: an averaged copy of a sharded model] and [Note:
the averaged copy in a sharded checkpoint] in lightning_ampzero/zero/averaged.py).

The model has a BatchNorm (SWA's extra epoch recomputes its statistics), two Linears sharing one
weight (the copy must stay tied) and a 0-dim parameter (kept whole, outside FSDP2). The JSON holds,
per run, the final state (parameters and buffers): ``ddp``, ``ddp/no_swa`` (must differ from
``ddp``, or the test could not fail), ``stage{1,2,3}``, ``stage{2,3}/saving`` (saving a
checkpoint per epoch), and ``resume/<saved>-><stage>``: fit again from the stage-<saved> run's
checkpoint after epoch 2. SWA's last epoch runs forward only and still steps the optimizer with
the gradients of the last real step, as under ddp ([Note: a step without a backward]).
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
from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging

from _common import full_state

from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.dec = nn.Linear(8, 8)
        self.dec.weight = self.enc.weight  # tied
        self.head = nn.Linear(8, 1)
        self.scale = nn.Parameter(torch.tensor(1.0))  # 0-dim

    def training_step(self, batch, i):
        x, y = batch
        h = torch.relu(self.norm(self.enc(x)))
        return nn.functional.mse_loss(self.scale * self.head(self.dec(h)), y)

    def validation_step(self, batch, i):
        x, y = batch
        h = torch.relu(self.norm(self.enc(x)))
        self.log("val", nn.functional.mse_loss(self.scale * self.head(self.dec(h)), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _run(strategy, *, swa: bool = True, save_to: Path | None = None, resume: Path | None = None,
         then: bool = False) -> dict:
    pl.seed_everything(0, verbose=False)
    module = Module()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    callbacks: list = [StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)] if swa else []
    if save_to is not None:
        callbacks.append(ModelCheckpoint(dirpath=save_to, save_top_k=-1))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=4, logger=False,
                         enable_checkpointing=save_to is not None, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)
    loader = DataLoader(data, batch_size=8)
    trainer.fit(module, loader, ckpt_path=resume)
    if not then:
        return full_state(module)
    # [Note: SWA's setup on a model already sharded]: the callback's setup runs again in each of these,
    # on the module the fit left sharded (stages 1-3 stopped with "FSDP does not support deepcopy").
    out = {"val": trainer.validate(module, loader, verbose=False)[0]["val"],
           "val_again": trainer.validate(module, loader, verbose=False)[0]["val"]}
    trainer.fit_loop.max_epochs += 2
    trainer.fit(module, loader)
    return {**out, **full_state(module)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--dir", required=True, help="checkpoints go here")
    args = p.parse_args()
    root = Path(args.dir)
    out = {"ddp": _run("ddp"), "ddp/no_swa": _run("ddp", swa=False)}
    for stage in (1, 2, 3):
        # Without a checkpoint callback: a save reshards, which hid [Note: a step without a backward].
        out[f"stage{stage}"] = _run(AmpZeroStrategy(stage=stage))
    out["ddp/then"] = _run("ddp", then=True)
    for stage in (1, 3):
        out[f"stage{stage}/then"] = _run(AmpZeroStrategy(stage=stage), then=True)
    for stage in (2, 3):
        out[f"stage{stage}/saving"] = _run(AmpZeroStrategy(stage=stage), save_to=root / f"stage{stage}")
    for saved, stage in ((2, 2), (2, 3), (3, 1)):
        ckpt = next((root / f"stage{saved}").glob("epoch=2-*.ckpt"))
        out[f"resume/{saved}->{stage}"] = _run(AmpZeroStrategy(stage=stage), resume=ckpt)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
