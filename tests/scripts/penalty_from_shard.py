"""A weight penalty computed in ``training_step`` from a parameter read outside its module's forward
([Note: a loss computed from a shard] in lightning_ampzero/strategy.py).

A tiny Hugging Face Llama trains 3 steps (``--precision``, fp32 by default) with ``loss + 1e-2 * ||up_proj.weight||^2``, the
weight read before the forward. ``--mode whole`` takes the term's whole value the way the error
message says (``full_tensor()`` where it is a DTensor) and writes, for Lightning's ddp and for
ampzero stage 3 with its reduce-scatters left in flight (the default) and blocking
(``overlap_comm=False``), and stage 2 with a model of several units, the parameters after the
steps and the penalty's values. ``--mode raw`` adds the
term as it is at stage 3: the run must stop with the strategy's message.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from _common import full_params
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

import lightning.pytorch as pl

from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy


class Module(pl.LightningModule):
    def __init__(self, whole: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.whole = whole
        self.penalties: list[float] = []
        self.model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))

    def training_step(self, batch, i):
        weight = self.model.model.layers[0].mlp.up_proj.weight
        self.log("weight_is_dtensor", float(isinstance(weight, DTensor)))
        term = 1e-2 * weight.pow(2).sum()
        if self.whole and isinstance(term, DTensor):
            term = term.full_tensor()
        self.penalties.append(float(term.detach()) if not isinstance(term, DTensor) else float("nan"))
        return self.model(input_ids=batch[0], labels=batch[0]).loss + term

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.0)


def _run(strategy, whole: bool, precision: str = "32-true") -> dict:
    pl.seed_everything(0, verbose=False)
    module = Module(whole)
    tokens = torch.randint(1, 64, (12, 12), generator=torch.Generator().manual_seed(1))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision=precision, max_steps=3,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=2))
    return {"params": full_params(module), "penalties": module.penalties,
            "weight_is_dtensor": float(trainer.callback_metrics["weight_is_dtensor"])}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["whole", "raw"], required=True)
    p.add_argument("--precision", default="32-true")
    args = p.parse_args()
    if args.mode == "raw":
        _run(AmpZeroStrategy(stage=3), whole=False, precision=args.precision)
        return
    out = {"ddp": _run("ddp", True, args.precision), "stage3": _run(AmpZeroStrategy(stage=3), True, args.precision),
           "stage3_blocking": _run(AmpZeroStrategy(stage=3, overlap_comm=False), True, args.precision),
           # below stage 3 a model of several units (a bucket under its size) is sharded in the step too
           "stage2_units": _run(AmpZeroStrategy(stage=2, reduce_bucket_size=3000), True, args.precision)}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
