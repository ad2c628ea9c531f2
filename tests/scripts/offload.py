"""Offload and activation checkpointing under Lightning on CPU ranks: parity and resume, one launch.

Run as a script (never inside pytest). Every configuration trains the small GPT of parity.py
with strategy ampzero on ``--devices`` ranks and records per-step losses (averaged over ranks).

``--mode parity --configs C1,C2,...``: each ``C`` is ``stage:offload:ac[:precision]`` with
offload in ``none|cpu|nvme``, ac in ``none|full|selective|cpu`` (cpu = full + cpu_checkpointing +
contiguous buffers) and an optional Trainer precision (default 32-true). ``infinity`` is ZeRO-Infinity:
optimizer state and parameters (stage 3) on NVMe; ``tmpfs`` is ``offload_param='cpu'`` with optimizer
offload ``cpu`` on this CPU accelerator (parameters swapped to /dev/shm). Writes
``{C: {"losses": [...], "report": {...}}}``.

``--mode resume --configs C1,...``: for each ``C`` (``stage:offload_save:offload_resume``), trains
2 epochs with a checkpoint after epoch 0, then resumes from it in a new Trainer (the resume may
use another offload setting) and trains epoch 1 again. Writes the uninterrupted losses and the
resumed ones. The resumed run swaps to another directory (``<nvme-dir>/resume``): swap files are
scratch, never part of a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ampzero.models.gpt import GPTConfig
from lightning_ampzero.offload.optimizer import OffloadedAdam
from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy

from parity import PatternData, Recorder

AC = {
    "none": None,
    "full": {"mode": "full"},
    "selective": {"mode": "selective"},
    "cpu": {"mode": "full", "cpu_checkpointing": True, "contiguous_memory_optimization": True},
}


def strategy_for(stage: int, offload: str, ac: str, nvme_dir: str) -> AmpZeroStrategy:
    kw: dict = {"stage": stage}
    if offload == "infinity":
        # Parameter buffers of 20000 elements: the unit of the two GPT blocks (about 50k elements per
        # rank) takes three, the embeddings' and the head's one each.
        kw.update(offload_optimizer="nvme", offload_param="nvme", sub_group_size=20000, nvme_path=nvme_dir,
                  buffer_count=6, param_buffer_count=4, param_buffer_size=20000)
    elif offload == "tmpfs":
        # The same buffer size (units spanning several buffers), the default buffer count (5).
        kw.update(offload_optimizer="cpu", offload_param="cpu", sub_group_size=20000, param_buffer_size=20000)
    elif offload != "none":
        # Small tiles so that every parameter group spans several tiles (the tiled path is exercised).
        kw.update(offload_optimizer=offload, sub_group_size=20000)
        if offload == "nvme":
            kw.update(nvme_path=nvme_dir, buffer_count=6)
    if AC[ac] is not None:
        kw["activation_checkpointing"] = AC[ac]
    return AmpZeroStrategy(**kw)


def _trainer(strategy: AmpZeroStrategy, args: argparse.Namespace, **kw) -> pl.Trainer:
    kw.setdefault("precision", "32-true")
    return pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False, **kw)


def _loader(trainer: pl.Trainer, n: int, micro: int) -> DataLoader:
    dataset = PatternData(n, 32, 256)
    sampler = DistributedSampler(dataset, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False)
    return DataLoader(dataset, batch_size=micro, sampler=sampler)


def _mean_losses(model: Recorder) -> list[float]:
    losses = torch.tensor(model.losses, dtype=torch.float64)
    dist.all_reduce(losses)
    return (losses / dist.get_world_size()).tolist()


def _nvme_report(trainer: pl.Trainer) -> dict:
    opt = trainer.strategy.optimizers[0]
    opt = getattr(opt, "_optimizer", opt)
    if not isinstance(opt, OffloadedAdam):
        return {"offloaded": False, "optimizer_state_on_param_device": _state_bytes(opt)}
    store = opt.store
    out = {"offloaded": True, "kind": store.kind, "resident_bytes": store.resident_bytes(),
           "state_bytes": 12 * sum(store.group_sizes), "tile": store.tile, "optimizer_state_on_param_device": 0}
    if store.kind == "nvme":
        out.update(slots=store.slots, bytes_read=store.bytes_read, bytes_written=store.bytes_written,
                   files=sorted(p.name for p in store.dir.iterdir()))
    swapper = trainer.strategy.param_swapper
    if swapper is not None:
        out["params"] = {"bytes_read": swapper.bytes_read, "bytes_written": swapper.bytes_written,
                         "numel": swapper.numel, "file": str(swapper.path), "file_bytes": swapper.file_bytes,
                         "units": len(swapper.units), "segments": sum(len(u.segments) for u in swapper.units),
                         "peak_buffers_in_use": swapper.peak_buffers_in_use, "buffer_count": swapper.buffer_count,
                         "buffer_bytes": swapper.buffer_bytes, "steps": trainer.global_step}
    return out


class _Capture(pl.Callback):
    """The offload report at the end of training, before teardown deletes the swap files."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.report = _nvme_report(trainer)


def _state_bytes(opt) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))


def parity(cfg: str, args: argparse.Namespace) -> dict:
    stage, offload, ac, *precision = cfg.split(":")
    pl.seed_everything(0, verbose=False)
    model = Recorder(model=GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32), lr=3e-3)
    strategy = strategy_for(int(stage), offload, ac, args.nvme_dir)
    capture = _Capture()
    trainer = _trainer(strategy, args, max_steps=args.steps, enable_checkpointing=False, callbacks=[capture],
                       precision=precision[0] if precision else "32-true")
    micro = args.global_batch // args.devices
    trainer.fit(model, _loader(trainer, args.global_batch * args.steps, micro))
    report = capture.report
    if strategy.activation_checkpointing is not None and strategy.activation_checkpointing.hooks is not None:
        stats = strategy.activation_checkpointing.hooks.stats
        report["ac_packed_bytes_by_device"] = dict(stats.bytes_by_device)
        report["ac_blocks"] = strategy.activation_checkpointing.blocks
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    report["skipped_steps"] = scaler.stats()["skipped_steps"] if hasattr(scaler, "stats") else None
    return {"losses": _mean_losses(model), "report": report}


def resume(cfg: str, args: argparse.Namespace) -> dict:
    stage, save_offload, resume_offload = cfg.split(":")
    global_batch, steps_per_epoch = 8, 4
    ckpt_dir = Path(args.nvme_dir) / f"ckpt-{cfg.replace(':', '_')}"

    pl.seed_everything(0, verbose=False)
    model = Recorder(model=GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32), lr=3e-3)
    trainer = _trainer(strategy_for(int(stage), save_offload, "none", args.nvme_dir), args, max_epochs=2,
                       callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1,
                                                  save_on_train_epoch_end=True)])
    trainer.fit(model, _loader(trainer, global_batch * steps_per_epoch, global_batch // args.devices))
    full = _mean_losses(model)
    ckpt = str(sorted(ckpt_dir.glob("epoch=0*.ckpt"))[0])

    pl.seed_everything(0, verbose=False)
    model = Recorder(model=GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32), lr=3e-3)
    other = Path(args.nvme_dir) / "resume"
    other.mkdir(exist_ok=True)
    trainer = _trainer(strategy_for(int(stage), resume_offload, "none", str(other)), args, max_epochs=2,
                       enable_checkpointing=False)
    trainer.fit(model, _loader(trainer, global_batch * steps_per_epoch, global_batch // args.devices), ckpt_path=ckpt)
    return {"full": full, "resumed": _mean_losses(model), "steps_per_epoch": steps_per_epoch}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["parity", "resume"], required=True)
    p.add_argument("--configs", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--nvme-dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.use_deterministic_algorithms(True)
    fn = parity if args.mode == "parity" else resume
    results = {cfg: fn(cfg, args) for cfg in args.configs.split(",")}
    dist.barrier()  # every rank's teardown has run: its swap files must be gone
    results["_leftover_swap_dirs"] = sorted(p.name for pattern in ("ampzero-offload-*", "ampzero-params-*",
                                                                    "ampzero-grads-*", "resume/ampzero-*")
                                            for p in Path(args.nvme_dir).glob(pattern))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
