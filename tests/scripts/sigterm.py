"""Rank 0 receives SIGTERM mid-fit: every rank stops, through the per-batch SIGTERM broadcast.

Rank 0 sets Lightning's received_sigterm flag (what its signal handler does on a real SIGTERM)
right after its own end-of-batch check of batch STOP_AT, so only the broadcast can stop the
other rank. Each rank records the batches it trained and how the fit ended into <out>.<rank>.json.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.utils.data import DataLoader

import lightning.pytorch as pl

from lightning_ampzero.models.gpt import GPTConfig, GPTModule
from lightning_ampzero.process import run_and_exit

from _common import fit_until_sigterm
from parity import PatternData

STOP_AT = 3


class Module(GPTModule):
    def __init__(self) -> None:
        super().__init__(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16, vocab_size=256), lr=1e-3)
        self.trained: list[int] = []

    def training_step(self, batch, batch_idx):
        self.trained.append(batch_idx)
        return super().training_step(batch, batch_idx)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="ampzero")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    module = Module()
    trainer = pl.Trainer(strategy=args.strategy, accelerator="cpu", devices=2, max_steps=20, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    loop = trainer.fit_loop.epoch_loop
    check_after_batch = loop.on_advance_end

    def on_advance_end(*args, **kwargs):  # type: ignore[no-untyped-def]
        check_after_batch(*args, **kwargs)  # Lightning's own check of this rank's flag
        if rank == 0 and module.trained[-1] == STOP_AT:
            trainer._signal_connector.received_sigterm = True  # SIGTERM arrives between batches

    loop.on_advance_end = on_advance_end
    fit_until_sigterm(trainer, module, DataLoader(PatternData(64, 16, 256, seed=1), batch_size=2), args.out, rank)


if __name__ == "__main__":
    run_and_exit(main)
