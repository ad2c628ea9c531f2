"""Lightning's EMAWeightAveraging at stages 1-3, against ddp, and resumed from sharded checkpoints
at other stages ([Note: EMAWeightAveraging at stages 1-3] in lightning_ampzero/zero/averaged.py).

The model of swa.py (a BatchNorm, two Linears sharing one weight, a 0-dim parameter), validated
every epoch (the callback swaps the averaged weights in for validation and back after it). The
JSON holds, per run, the final state (parameters and buffers) and the validation losses per epoch
(measured with the averaged weights): ``ddp``, ``ddp/no_ema`` (must differ from ``ddp``, or the
test could not fail), ``stage{1,2,3}``, ``stage{2,3}/saving`` (a checkpoint per epoch), and
``resume/<saved>-><stage>``: fit again from the stage-<saved> run's checkpoint after epoch 2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint

from _common import full_state
from swa import Module

from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.val: list[float] = []

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.val.append(float(trainer.callback_metrics["val"]))


def _run(strategy, *, ema: bool = True, save_to: Path | None = None, resume: Path | None = None) -> dict:
    pl.seed_everything(0, verbose=False)
    module = Module()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    losses = Losses()
    callbacks: list = [losses] + ([EMAWeightAveraging(decay=0.8)] if ema else [])
    if save_to is not None:
        callbacks.append(ModelCheckpoint(dirpath=save_to, save_top_k=-1))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=4, logger=False,
                         enable_checkpointing=save_to is not None, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, num_sanity_val_steps=0)
    loader = DataLoader(data, batch_size=8)
    trainer.fit(module, loader, loader, ckpt_path=resume)
    return {**full_state(module), "val": losses.val}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--dir", required=True, help="checkpoints go here")
    args = p.parse_args()
    root = Path(args.dir)
    # (name, ddp or a stage, keywords of _run); "resume" names the run whose checkpoint after epoch 2 is resumed
    plan = [("ddp", "ddp", {}), ("ddp/no_ema", "ddp", {"ema": False}), ("ddp/saving", "ddp", {"save_to": "ddp"}),
            ("stage2/saving", 2, {"save_to": "stage2"}), ("stage3/saving", 3, {"save_to": "stage3"}),
            ("stage1", 1, {}), ("stage3", 3, {}), ("resume/ddp->ddp", "ddp", {"resume": "ddp"}),
            ("resume/2->2", 2, {"resume": "stage2"}), ("resume/2->3", 3, {"resume": "stage2"}),
            ("resume/3->1", 1, {"resume": "stage3"})]
    results = {}
    for name, stage, kw in plan:
        if "save_to" in kw:
            kw = {**kw, "save_to": root / kw["save_to"]}
        if "resume" in kw:
            kw = {**kw, "resume": next((root / kw["resume"]).glob("epoch=1-*.ckpt"))}
        results[name] = _run("ddp" if stage == "ddp" else AmpZeroStrategy(stage=stage), **kw)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))

if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
