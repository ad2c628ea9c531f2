"""A user's Trainer script with ``OnExceptionCheckpoint``, in which one rank or every rank raises at step 3.

    python tests/scripts/exception_checkpoint.py <stage> <who: last|all|none> <checkpoint dir> [resume]

No environment set, the hang detector at its default: as a user runs it. An epoch is 3 steps, so
step 3 is the first of epoch 1 (a plain DataLoader resumes at an epoch's start). ``none`` raises
nowhere and ends at step 6; with ``resume`` the run resumes from
``<checkpoint dir>/on_exception.ckpt`` and ends at step 6. Both print the step they started at and
a digest of the whole model's weights at the end.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.utils.data import DataLoader

import lightning.pytorch as pl
from lightning.pytorch.callbacks import OnExceptionCheckpoint

from lightning_ampzero.models.gpt import GPTConfig, GPTModule
from lightning_ampzero.strategy import AmpZeroStrategy

from parity import PatternData

STAGE, WHO, DIRPATH = int(sys.argv[1]), sys.argv[2], sys.argv[3]
RESUME = len(sys.argv) > 4
STEPS = 6 if RESUME or WHO == "none" else 20


class Module(GPTModule):
    def on_train_start(self) -> None:
        print(f"rank {self.global_rank}: started at step {self.global_step}", flush=True)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        last = self.global_rank == self.trainer.world_size - 1
        if not RESUME and self.global_step == 3 and (WHO == "all" or (WHO == "last" and last)):
            print(f"rank {self.global_rank}: raise at {time.time():.3f}", flush=True)
            raise ValueError(f"a bad batch on rank {self.global_rank}")
        return super().training_step(batch, batch_idx)


if __name__ == "__main__":
    pl.seed_everything(0)
    torch.set_num_threads(1)
    model = Module(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=256), lr=1e-3)
    trainer = pl.Trainer(strategy=AmpZeroStrategy(stage=STAGE), accelerator="cpu", devices=2,
                         max_steps=STEPS, logger=False, default_root_dir=DIRPATH,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[OnExceptionCheckpoint(dirpath=DIRPATH)])
    data = DataLoader(PatternData(12, 16, 256, seed=1), batch_size=2)
    trainer.fit(model, data, ckpt_path=f"{DIRPATH}/on_exception.ckpt" if RESUME else None)
    # the whole model (a DTensor gathered: collective, on every rank), as exact as float64 sums go
    digest = sum(float((p.full_tensor() if hasattr(p, "full_tensor") else p).double().sum()) for p in model.parameters())
    print(f"rank {trainer.global_rank}: weights digest {digest!r} at step {trainer.global_step}", flush=True)
