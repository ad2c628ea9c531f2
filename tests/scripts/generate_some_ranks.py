"""transformers' ``generate()`` on some ranks only, and ranks generating different lengths
([Note: generate() on some ranks] in lightning_ampzero/zero/unused.py).

A GPT-2 built from a config in ``configure_model``. Each training step generates from the batch
with a different number of new tokens per rank (as ranks whose sequences reach EOS at different
steps), then trains on the result; at the end of each validation, rank 0 alone generates a
sample, the way sampling callbacks do (``--train-epoch-end-stage``: in ``on_train_epoch_end``, where
the model is sharded, which fails with a message). Lightning's ddp and stages 1-3, same seed and data. The
JSON holds, per system, the final parameters and rank 0's samples. A hang ends the run on the
watchdog (a short ``watchdog_s``), so the test fails instead of waiting.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

import lightning.pytorch as pl

from _common import full_params

from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy


class Module(pl.LightningModule):
    def __init__(self, sample_in: str = "on_validation_epoch_end") -> None:
        super().__init__()
        self.samples: list = []
        self.sample_in = sample_in
        self.epochs = torchmetrics.SumMetric()  # a child without parameters, called outside the steps

    def configure_model(self) -> None:
        torch.manual_seed(0)
        # No dropout: synced generation runs extra forwards (in train mode, from training_step) on the
        # rank that finished first, and dropout would draw other masks than ddp's unsynced run.
        config = GPT2Config(n_embd=32, n_layer=3, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0,
                            eos_token_id=0, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch, i):
        with torch.no_grad():
            ids = self.model.generate(batch[0], max_new_tokens=2 + 5 * self.global_rank, do_sample=False)
        return self.model(ids, labels=ids).loss

    def validation_step(self, batch, i):
        return self.model(batch[0], labels=batch[0]).loss

    def _sample(self) -> None:
        if self.trainer.is_global_zero:
            self.samples.append(self.model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5,
                                                    do_sample=False).tolist())

    def on_validation_epoch_end(self) -> None:
        if self.sample_in == "on_validation_epoch_end":
            self._sample()

    def on_train_epoch_end(self) -> None:
        self.epochs(1.0)
        if self.sample_in == "on_train_epoch_end":
            self._sample()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _run(strategy, sample_in: str = "on_validation_epoch_end") -> dict:
    pl.seed_everything(0, verbose=False)
    module = Module(sample_in)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, logger=False,
                         num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    data = DataLoader(TensorDataset(torch.randint(1, 100, (8, 5), generator=torch.Generator().manual_seed(1))),
                      batch_size=2)
    trainer.fit(module, data, data)
    params = full_params(module)
    return {"params": params, "samples": module.samples}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--train-epoch-end-stage", type=int, help="sample in on_train_epoch_end at this stage only")
    args = p.parse_args()
    if args.train_epoch_end_stage is not None:  # fails: [Note: a child called outside a step method]
        # a short watchdog: at stage 3 the run ends only when it fires (the test waits for it)
        _run(AmpZeroStrategy(stage=args.train_epoch_end_stage, watchdog_s=20), sample_in="on_train_epoch_end")
        return
    out = {"ddp": _run("ddp")}
    for stage in (1, 2, 3):
        out[f"stage{stage}"] = _run(AmpZeroStrategy(stage=stage, watchdog_s=60))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
