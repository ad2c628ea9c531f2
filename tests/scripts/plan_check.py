"""Measure, per rank, the memory the planner budgets for: model states (with the working set) + activations.

Run as a script (Lightning multi-process, never inside pytest). For each ZeRO stage, trains the
small GPT for a few optimizer steps with gradient accumulation and measures on every rank:

* model states with :func:`lightning_ampzero.memory.measure_model_state` (storages of parameters,
  gathered parameters, gradients and optimizer states), sampled at the moments FSDP2 holds the
  most: after each unit's pre-forward (the unit and its prefetched successor gathered), after
  each pre-backward, just before each post-backward (unsharded gradients not yet
  reduce-scattered), after every micro-batch's backward and after every optimizer step. The
  peak of the per-sample total is kept;
* activations: bytes of the tensors one micro-batch's forward saved for backward (parameters
  excluded, storages counted once), like the estimator's meta-device trace but on real tensors.

Writes JSON for rank 0 with, per stage, the maximum over ranks of each figure, and the report of
the :class:`lightning_ampzero.callbacks.MemoryReport` callback that ran alongside (its metrics go
to a CSVLogger under ``--log-dir``).
"""

from __future__ import annotations

import argparse
import functools
import json
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

from lightning_ampzero.callbacks import MemoryReport
from lightning_ampzero.config import AmpZeroConfig, ZeroConfig
from lightning_ampzero.memory import device_bytes, measure_model_state
from lightning_ampzero.models.gpt import GPTConfig, GPTModule
from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy

from parity import PatternData


class _Peak:
    def __init__(self) -> None:
        self.total = 0
        self.at_peak: dict[str, int] = {}
        self.module: nn.Module | None = None
        self.optimizers: list = []

    def sample(self) -> None:
        if self.module is None:
            return
        m = measure_model_state(self.module, self.optimizers)
        total = device_bytes(m)  # as MemoryReport's peak: the offload's host memory is not the device's
        if total > self.total:
            self.total, self.at_peak = total, m


PEAK = _Peak()


def _patch_fsdp() -> None:
    """Sample inside FSDP2's own hooks, where the gathered parameters / unsharded gradients peak."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    def after(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            out = fn(*args, **kwargs)
            PEAK.sample()
            return out
        return inner

    def before(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            PEAK.sample()
            return fn(*args, **kwargs)
        return inner

    FSDPParamGroup.pre_forward = after(FSDPParamGroup.pre_forward)
    FSDPParamGroup.pre_backward = after(FSDPParamGroup.pre_backward)
    FSDPParamGroup.post_backward = before(FSDPParamGroup.post_backward)


class Measured(GPTModule):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.activations = 0
        self._saved: dict[int, int] = {}
        self._hooks = None

    def on_train_start(self) -> None:
        PEAK.module, PEAK.optimizers = self, list(self.trainer.optimizers)

    def training_step(self, batch, batch_idx):
        # the third micro-batch (MemoryReport counts the second: saved-tensor hooks do not nest)
        if batch_idx != 2:
            return super().training_step(batch, batch_idx)

        def pack(t: torch.Tensor) -> torch.Tensor:
            base = getattr(t, "_base", None)
            if not isinstance(t, nn.Parameter) and not isinstance(base, nn.Parameter):
                s = t.untyped_storage()
                self._saved[s._cdata] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = super().training_step(batch, batch_idx)
        self.activations = sum(self._saved.values())
        return loss

    def on_before_backward(self, loss):
        PEAK.sample()

    def on_after_backward(self):
        PEAK.sample()

    def on_train_batch_end(self, *args):
        PEAK.sample()


def run(stage: int, args: argparse.Namespace) -> dict:
    global PEAK
    PEAK = _Peak()
    pl.seed_everything(0, verbose=False)
    gpt = GPTConfig(**json.loads(args.model))
    zero = ZeroConfig(**{**json.loads(args.zero), "stage": stage})
    model = Measured(model=gpt)
    report = MemoryReport(log_every_n_steps=1, print_table=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=AmpZeroStrategy(AmpZeroConfig(zero=zero)),
        max_steps=args.steps, accumulate_grad_batches=args.accumulate, enable_checkpointing=False,
        logger=CSVLogger(args.log_dir, name=f"stage{stage}", version=0), callbacks=[report],
        enable_progress_bar=False, enable_model_summary=False,
    )
    data = PatternData(64, args.seq_len, gpt.vocab_size)
    trainer.fit(model, DataLoader(data, batch_size=args.micro_batch))
    local = torch.tensor([PEAK.total, model.activations] + [PEAK.at_peak.get(k, 0) for k in _KEYS], dtype=torch.float64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    values = [int(v) for v in local.tolist()]
    return {"world_size": trainer.world_size, "model_states": values[0], "activations": values[1],
            "at_peak": dict(zip(_KEYS, values[2:])), "need": values[0] + values[1], "report": report.report}


_KEYS = ("params_sharded", "params_gathered", "grads", "optimizer")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--model", required=True, help="GPTConfig fields as JSON")
    p.add_argument("--zero", default="{}", help="ZeroConfig fields as JSON (stage is set per run)")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--log-dir", required=True, help="CSVLogger root (MemoryReport logs there)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    _patch_fsdp()
    results = {s: run(int(s), args) for s in args.stages.split(",")}
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
