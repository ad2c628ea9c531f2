"""A user's script: fits with the models kept alive, and a normal interpreter exit (no exit_process).

Records, per rank, the torch threads each fit computes with (``threads_stage<k>``) and the
``OMP_NUM_THREADS`` it sees: launched with nothing exported, each rank must get its share of the
cores, as Lightning's ddp gives it.

Records, per rank, the threads alive just before the strategy's exit hook runs and after it
(when finalization is about to start): the c10d threads (gloo's run loops, the TCPStore daemon)
must be gone by then, or a late GIL request from one of them can abort the exit. See
[Note: exit without finalization] in lightning_ampzero/process.py.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path


def _threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        except OSError:  # the thread ended while we listed
            pass
    return sorted(names)


def _record(key: str) -> None:
    path = Path(OUT.format(rank=os.environ.get("LOCAL_RANK", "0")))
    seen = json.loads(path.read_text()) if path.exists() else {}
    seen[key] = _threads()
    path.write_text(json.dumps(seen))


OUT = sys.argv[1]  # "<dir>/threads-{rank}.json"
# Registered before the strategy's hook, so it runs after it (atexit is last in, first out).
atexit.register(_record, "after_hook")

import lightning.pytorch as pl  # noqa: E402

from lightning_ampzero.models.gpt import GPTConfig, GPTModule  # noqa: E402

from parity import PatternData  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402


class _Threads(pl.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        import torch

        path = Path(OUT.format(rank=os.environ.get("LOCAL_RANK", "0")))
        seen = json.loads(path.read_text()) if path.exists() else {}
        seen[f"threads_stage{trainer.strategy.stage}"] = [torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")]
        path.write_text(json.dumps(seen))


pl.seed_everything(0)
data = DataLoader(PatternData(16, 16, 256, seed=1), batch_size=4)
models, trainers = [], []
for strategy, precision in (("ampzero_stage_0", "bf16-mixed"), ("ampzero_stage_3", "32-true")):
    model = GPTModule(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=256), lr=1e-3)
    trainer = pl.Trainer(strategy=strategy, precision=precision, accelerator="cpu", devices=2, max_steps=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, callbacks=[_Threads()])
    trainer.fit(model, train_dataloaders=data)
    models.append(model)  # kept: a script's globals hold the sharded model and its groups
    trainers.append(trainer)
# Registered after the strategy's hook, so it runs before it.
atexit.register(_record, "before_hook")
