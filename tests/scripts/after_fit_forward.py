"""A stage-3 model under bf16-mixed called after ``trainer.fit()`` on every rank ([Note: a stage-3
model called after fit] in lightning_ampzero/zero/apply.py).

A tiny Hugging Face Llama trains 2 steps; then every rank runs ``model(input_ids)`` under
``no_grad``, outside the step methods. Before, it stopped in attention ("query, key, and value to
have the same dtype"). The JSON holds the logits and their dtype, for ampzero stage 3 and for
Lightning's ddp, whose call runs under ``torch.autocast`` by hand (what the strategy now does).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

import lightning.pytorch as pl

from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))

    def training_step(self, batch, i):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _run(strategy, autocast_by_hand: bool) -> dict:
    pl.seed_everything(0, verbose=False)
    module = Module()
    tokens = torch.randint(1, 64, (8, 12), generator=torch.Generator().manual_seed(1))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="bf16-mixed", max_steps=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=2))
    module.model.eval()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast_by_hand):
        logits = module.model(input_ids=tokens[:2]).logits
    return {"dtype": str(logits.dtype), "logits": logits.float().flatten().tolist()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = {"ddp": _run("ddp", autocast_by_hand=True), "stage3": _run(AmpZeroStrategy(stage=3), autocast_by_hand=False)}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
