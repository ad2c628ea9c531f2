"""A user's Trainer script in which one rank stops or gets stuck mid-run (for the hang detector).

    python tests/scripts/hang.py <devices> <mode: stop|stuck|kill|raise> <watchdog_s> <pid file>

Rank ``devices - 1`` stops itself (SIGSTOP), sleeps, is killed (SIGKILL) or raises an error
before its forward at step 3; the others go on into the step's collectives and wait there. Each
rank writes its pid to ``<pid file>.<rank>`` so the test can clean up a stopped process.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader

import lightning.pytorch as pl

from lightning_ampzero.models.gpt import GPTConfig, GPTModule
from lightning_ampzero.strategy import AmpZeroStrategy

from parity import PatternData

DEVICES, MODE, WATCHDOG_S, PIDS = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4]


class Module(GPTModule):
    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        if self.global_step == 3 and self.global_rank == DEVICES - 1:
            print(f"rank {self.global_rank}: {MODE} at {time.time():.3f}", flush=True)
            if MODE == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif MODE == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif MODE == "raise":
                raise ValueError(f"a bad batch on rank {self.global_rank}")
            else:
                time.sleep(3600)
        return super().training_step(batch, batch_idx)


if __name__ == "__main__":
    pl.seed_everything(0)
    torch.set_num_threads(1)
    model = Module(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=256), lr=1e-3)
    trainer = pl.Trainer(strategy=AmpZeroStrategy(stage=2, watchdog_s=WATCHDOG_S), accelerator="cpu",
                         devices=DEVICES, max_steps=20, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with open(f"{PIDS}.{os.environ.get('LOCAL_RANK', '0')}", "w") as f:
        f.write(str(os.getpid()))
    trainer.fit(model, DataLoader(PatternData(160, 16, 256, seed=1), batch_size=2))
