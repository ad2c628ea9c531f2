"""Gradient swapping (offload_grad) under Lightning on CPU ranks: parity, one launch.

Run as a script (never inside pytest). Every configuration trains the small GPT of parity.py at
stage 3 on ``--devices`` ranks and records per-micro-batch losses (averaged over ranks); each rank
saves its final parameter shards to ``<out>.<config>.rank<r>.pt``.

``--configs C1,C2,...``: each ``C`` is ``offload:accumulate:clip`` with offload ``none`` (nothing
offloaded), ``infinity`` (parameters, optimizer and, by ``offload_grad='auto'``, gradients on
NVMe) or ``infinity-nograd`` (the same with ``offload_grad='none'``); clip ``none`` or
``norm=<v>`` / ``value=<v>``. Writes ``{C: {"losses": [...], "report": {...}}}``; the report says,
at every optimizer step, whether each gradient was the swapped one and how many bytes of
gradients were held in memory.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import lightning.pytorch as pl

from lightning_ampzero.models.gpt import GPTConfig
from lightning_ampzero.offload.grads import grad_swapper
from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy
from lightning_ampzero.zero.clip import global_grad_norm

from offload import _loader, _mean_losses, _trainer
from parity import Recorder


def strategy_for(offload: str, nvme_dir: str) -> AmpZeroStrategy:
    kw: dict = {"stage": 3}
    if offload.startswith("infinity"):
        # As tests/scripts/offload.py's "infinity": units spanning several parameter buffers, groups
        # spanning several optimizer tiles.
        kw.update(offload_optimizer="nvme", offload_param="nvme", sub_group_size=20000, nvme_path=nvme_dir,
                  buffer_count=6, param_buffer_count=4, param_buffer_size=20000)
        if offload == "infinity-nograd":
            kw["offload_grad"] = "none"
    return AmpZeroStrategy(**kw)


class _Watch(pl.Callback):
    """At each optimizer step (after clipping): are the gradients the swapped ones, how many bytes
    of them are held in memory; and the swapper's counters at the end of training."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.report: dict = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        params = [p for p in pl_module.parameters() if p.grad is not None]
        swapper = next((s for s in map(grad_swapper, params) if s is not None), None)
        # Before Lightning clips: the norm, read through p.grad (the file's memory map when swapped).
        self.steps.append({"swapped": sum(swapper.holds(p) for p in params) if swapper else 0,
                           "with_grad": len(params), "norm": global_grad_norm(params).item(),
                           "resident": swapper.resident_bytes() if swapper else None})

    def on_train_end(self, trainer, pl_module) -> None:
        swapper = grad_swapper(pl_module)
        self.report = {"steps": self.steps}
        if swapper is not None:
            self.report.update(bytes_written=swapper.bytes_written, bytes_read=swapper.bytes_read,
                               peak_pending_bytes=swapper.peak_pending_bytes, numel=swapper.numel,
                               file_bytes=swapper.file_bytes, file=str(swapper.path))


def run(cfg: str, args: argparse.Namespace) -> dict:
    offload, accumulate, clip = cfg.split(":")
    pl.seed_everything(0, verbose=False)
    model = Recorder(model=GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32), lr=3e-3)
    clip_kw = {}
    if clip != "none":
        algo, val = clip.split("=")
        clip_kw = {"gradient_clip_val": float(val), "gradient_clip_algorithm": algo}
    watch = _Watch()
    trainer = _trainer(strategy_for(offload, args.nvme_dir), args, max_steps=args.steps,
                       accumulate_grad_batches=int(accumulate), enable_checkpointing=False, callbacks=[watch],
                       **clip_kw)
    micro = args.global_batch // args.devices
    trainer.fit(model, _loader(trainer, args.global_batch * args.steps * int(accumulate), micro))
    shards = [p.to_local().detach().clone() for p in model.parameters()]
    torch.save(shards, f"{args.out}.{cfg.replace(':', '_')}.rank{dist.get_rank()}.pt")
    return {"losses": _mean_losses(model), "report": watch.report}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--nvme-dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.use_deterministic_algorithms(True)
    results = {cfg: run(cfg, args) for cfg in args.configs.split(",")}
    dist.barrier()  # every rank's teardown has run: its swap files must be gone
    results["_leftover_swap_dirs"] = sorted(p.name for p in Path(args.nvme_dir).glob("ampzero-*"))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
