"""``trainer.validate`` before ``trainer.fit`` ([Note: units left gathered by evaluation] in strategy.py).

At stage 3 a standalone validation left the root and persistent units gathered, and the fit that
followed built its optimizer over the gathered copies: the model's weights came out of the fit as
they went in. Each system runs validate, then fit, then validate again, as a user evaluating a
baseline before fine-tuning does (2 CPU ranks, nothing exported); the JSON holds, per system,
the largest difference of the final parameters from Lightning's ddp, how far the fit moved them,
and the two validation losses.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl

from lightning_ampzero.models.gpt import GPTConfig, GPTModule
from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy

MODEL = GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=64)


class Module(GPTModule):
    def validation_step(self, batch, i):
        self.log("val_loss", self._loss(batch), sync_dist=True)


def _loader(seed: int) -> DataLoader:
    tokens = torch.randint(0, 64, (32, 17), generator=torch.Generator().manual_seed(seed))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)


def _full(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in module.named_parameters()}


def _run(strategy) -> dict:
    pl.seed_everything(0, verbose=False)
    module = Module(model=MODEL, lr=1e-2)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                         num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    before = trainer.validate(module, _loader(5), verbose=False)[0]["val_loss"]
    start = _full(module)
    trainer.fit(module, _loader(1))
    final = _full(module)
    after = trainer.validate(module, _loader(5), verbose=False)[0]["val_loss"]
    moved = max((final[k] - start[k]).abs().max().item() for k in final)
    return {"final": final, "moved": moved, "val": [before, after]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    runs = {"ddp": _run("ddp")}
    for stage in (1, 2, 3):
        runs[f"stage{stage}"] = _run(AmpZeroStrategy(stage=stage))
    ref = runs["ddp"]["final"]
    out = {name: {"vs_ddp": max((r["final"][k] - ref[k]).abs().max().item() for k in ref), "moved": r["moved"],
                  "val": r["val"]} for name, r in runs.items()}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
