"""Measure per-rank model-state bytes (peak per category over a few steps) for ZeRO stages.

Samples are taken after forward (parameters held for backward), after every micro-batch's
backward (gradients, including accumulated ones) and after the optimizer step (optimizer
state). Writes, for rank 0, the peaks and the parameter count as JSON. Run as a script.
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import lightning.pytorch as pl

from lightning_ampzero.memory import PeakModelState
from lightning_ampzero.models.gpt import GPTConfig, GPTModule
from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy

from parity import PatternData


REDUCE_SCATTERS = {"n": 0}


def _count_reduce_scatters() -> None:
    """Count FSDP2's gradient reduce-scatters (torch 2.13 calls dist.reduce_scatter_single, 2.11
    dist.reduce_scatter_tensor)."""
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    original = getattr(dist, name)

    def counted(*a, **kw):
        REDUCE_SCATTERS["n"] += 1
        return original(*a, **kw)

    setattr(dist, name, counted)


class Measured(GPTModule):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.peak = PeakModelState()
        self.reduce_scatters: list[int] = []  # per micro-batch backward
        self._before = 0

    def on_before_backward(self, loss):
        self._sample()
        self._before = REDUCE_SCATTERS["n"]

    def _sample(self) -> None:
        self.peak.sample(self, self.trainer.optimizers)

    def on_after_backward(self):
        self._sample()
        self.reduce_scatters.append(REDUCE_SCATTERS["n"] - self._before)

    def on_train_batch_end(self, *args):
        self._sample()


def run(stage: int, args: argparse.Namespace) -> dict:
    pl.seed_everything(0, verbose=False)
    model = Measured(model=GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32))
    strategy = AmpZeroStrategy(stage=stage, param_persistence_threshold=0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=3, accumulate_grad_batches=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(PatternData(64, 32, 256), batch_size=2))
    numel = sum(p.numel() for p in model.parameters())  # DTensor numel is the global size
    peaks = torch.tensor([model.peak.peak[k] for k in sorted(model.peak.peak)], dtype=torch.float64)
    spread = peaks.clone()
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    dist.all_reduce(spread, op=dist.ReduceOp.MIN)
    keys = sorted(model.peak.peak)
    return {"numel": numel, "world_size": trainer.world_size, "max": dict(zip(keys, peaks.tolist())),
            "min": dict(zip(keys, spread.tolist())), "reduce_scatters": model.reduce_scatters}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    _count_reduce_scatters()
    results = {s: run(int(s), args) for s in args.stages.split(",")}
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
