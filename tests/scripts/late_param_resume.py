"""A resume from a checkpoint saved before a trainable parameter ever had a gradient.

The parameter (``late``, a head the loss uses from step 3 on) has no optimizer state when the
checkpoint is saved at step 2. The resume stopped at stages 1-3 with DCP's "Missing key in
checkpoint state_dict: optimizer_0.state.late.weight.step" ([Note: parameters without a saved
optimizer state] in lightning_ampzero/checkpoint/sharded.py; a new-user trial). Run as a user runs
it (2 CPU ranks, nothing exported): the JSON holds, per system, the parameters' largest difference
from Lightning's ddp after the uninterrupted run and after the resumed one, how far ``late``
moved, and whether it had an optimizer state at the save and at the end.
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

from _common import full_tensors, quiet_trainer

from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy

LATE_FROM = 3  # the first step whose loss uses ``late``


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
        self.late = nn.Linear(8, 4)

    def training_step(self, batch, i):
        x, y = batch
        out = self.net(x)
        if self.global_step >= LATE_FROM:
            out = out + self.late(x)
        return F.cross_entropy(out, y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)),
                          batch_size=4)



def _late_has_state(trainer: pl.Trainer, model: Model) -> bool:
    return any(len(trainer.optimizers[0].state.get(p, {})) > 0 for p in model.late.parameters())



def _run(name: str, make, root: Path) -> dict:
    pl.seed_everything(0, verbose=False)
    whole = Model()
    start = full_tensors(whole)["late.weight"]
    quiet_trainer(make(), root / name, 6).fit(whole)
    pl.seed_everything(0, verbose=False)
    first, model = quiet_trainer(make(), root / name, 2), Model()
    first.fit(model)
    saved_with_state = _late_has_state(first, model)
    ckpt = str(root / name / "step2.ckpt")
    first.save_checkpoint(ckpt)
    resumed = Model()
    last = quiet_trainer(make(), root / name, 6)
    last.fit(resumed, ckpt_path=ckpt)
    return {"whole": full_tensors(whole), "resumed": full_tensors(resumed), "saved_with_state": saved_with_state,
            "end_with_state": _late_has_state(last, resumed), "start": start}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tmp", required=True)
    p.add_argument("--stages", default="0,1,3")
    args = p.parse_args()
    runs = {"ddp": _run("ddp", lambda: "ddp_find_unused_parameters_true", Path(args.tmp))}
    for stage in (int(s) for s in args.stages.split(",")):
        # stage 0 is DDP: a parameter unused in a step needs find_unused_parameters, as under ddp
        unused = {"find_unused_parameters": True} if stage == 0 else {}
        runs[f"stage{stage}"] = _run(f"stage{stage}", lambda: AmpZeroStrategy(stage=stage, **unused), Path(args.tmp))
    ref = runs["ddp"]["whole"]
    diff = lambda a, b: max((a[n] - b[n]).abs().max().item() for n in b)  # noqa: E731
    # Lightning's resume does not replay the uninterrupted run's batches (its loop restarts the
    # epoch's loader), so the resumed run is compared with ddp's resumed run.
    out = {name: {"resumed_vs_ddp": diff(r["resumed"], runs["ddp"]["resumed"]), "whole_vs_ddp": diff(r["whole"], ref),
                  "late_moved": (r["resumed"]["late.weight"] - r["start"]).abs().max().item(),
                  "saved_with_state": r["saved_with_state"], "end_with_state": r["end_with_state"]}
           for name, r in runs.items()}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
