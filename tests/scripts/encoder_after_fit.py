"""An encoder-decoder's ``generate()`` (and its encoder) called after ``trainer.fit()`` at stage 2.

``generate()`` runs ``get_encoder()(...)``, a part of the wrapped model, never the wrapped model's
own forward, so it stopped on torch's "got mixed torch.Tensor and DTensor" where ``model(...)``
gave the message saying where to call it ([Note: a child called outside a step method] in
lightning_ampzero/zero/apply.py; a new-user trial). Run as a user runs it (2 CPU ranks, nothing
exported): a tiny T5 trains 2 steps under Lightning's ddp and at stage 2; the JSON holds the
losses of each, and per call after the fit what stage 2 raised on each rank.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import T5Config, T5ForConditionalGeneration

import lightning.pytorch as pl

from lightning_ampzero.process import run_and_exit


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                         num_heads=4, decoder_start_token_id=0, pad_token_id=0,
                                                         eos_token_id=1, dropout_rate=0.0))
        self.losses: list[float] = []

    def training_step(self, batch, i):
        loss = self.model(input_ids=batch[:, :6], labels=batch[:, 6:].contiguous()).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(strategy: str) -> Module:
    pl.seed_everything(0, verbose=False)
    module = Module()
    data = DataLoader(torch.randint(2, 64, (16, 10), generator=torch.Generator().manual_seed(1)), batch_size=4)
    pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(module, data)
    return module


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    ddp, ours = _fit("ddp"), _fit("ampzero_stage_2")
    x = torch.randint(2, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    raised = {}
    for name, call in (("generate", lambda: ours.model.generate(input_ids=x, max_new_tokens=3)),
                       ("encoder", lambda: ours.model.get_encoder()(input_ids=x))):
        try:
            call()
            raised[name] = None
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            raised[name] = f"{type(e).__name__}: {e}"
    gathered = [None, None]
    dist.all_gather_object(gathered, raised)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"ddp": ddp.losses, "stage2": ours.losses, "raised": gathered}))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
