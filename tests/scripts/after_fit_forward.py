"""A stage-3 model under bf16-mixed called after ``trainer.fit()`` on every rank ([Note: a stage-3
model called after fit] in lightning_ampzero/zero/apply.py), and a stage-2 one called in
``on_validation_epoch_end`` (stage 2 on gloo gathers its Linears in bf16 too: [Note: safe modules
gathered in the low dtype below stage 3] in zero/comm.py).

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
    def __init__(self, probe: "torch.Tensor | None" = None, autocast_by_hand: bool = False) -> None:
        super().__init__()
        self.probe, self.autocast_by_hand, self.at_validation_end = probe, autocast_by_hand, None
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))

    def training_step(self, batch, i):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def validation_step(self, batch, i):
        return None

    def on_validation_epoch_end(self):
        # outside the step methods, on every rank, as samples are generated
        if self.probe is not None:
            with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=self.autocast_by_hand):
                self.at_validation_end = self.model(input_ids=self.probe).logits

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _run(strategy, autocast_by_hand: bool, at_validation_end: bool = False) -> dict:
    pl.seed_everything(0, verbose=False)
    tokens = torch.randint(1, 64, (8, 12), generator=torch.Generator().manual_seed(1))
    module = Module(tokens[:2] if at_validation_end else None, autocast_by_hand)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="bf16-mixed", max_steps=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=1 if at_validation_end else 0,
                         num_sanity_val_steps=0)
    loader = DataLoader(TensorDataset(tokens), batch_size=2)
    trainer.fit(module, loader, loader if at_validation_end else None)
    if at_validation_end:
        logits = module.at_validation_end
        return {"dtype": str(logits.dtype), "logits": logits.float().flatten().tolist()}
    module.model.eval()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast_by_hand):
        logits = module.model(input_ids=tokens[:2]).logits
    return {"dtype": str(logits.dtype), "logits": logits.float().flatten().tolist()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = {"ddp": _run("ddp", autocast_by_hand=True), "stage3": _run(AmpZeroStrategy(stage=3), autocast_by_hand=False),
           # stages 1-2 refuse a child called after fit (sharded), so in on_validation_epoch_end
           "ddp_validation_end": _run("ddp", autocast_by_hand=True, at_validation_end=True),
           "stage2_validation_end": _run(AmpZeroStrategy(stage=2), autocast_by_hand=False, at_validation_end=True)}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
