"""A natural fp16 overflow on N CPU ranks: the skipped step changes nothing, and the run equals one without that update.

Run as a script (never inside pytest: Lightning's launcher re-runs the command line for the
other ranks). Each configuration trains the small GPT under ``16-mixed`` with DeepSpeed's default
loss scale (2**16). One global micro-batch (the first of optimizer step ``--outlier``) is
degenerate: every sequence is one token repeated. Its gradients add up coherently over all
positions, so a few elements of the gradients computed in fp16 under autocast exceed fp16's
range (measured on this model in one process: 13 of 135k elements, in ``head.weight`` and one
bias, above 65504 / 2**16, while the ordinary batches stay below a third of it). Nothing is
injected: the inf comes from fp16 itself. Under FP8 the GEMMs return fp32 weight gradients, so
the head is kept out of FP8 there (as FP8 recipes usually keep the output layer) and overflows.

Each configuration is trained twice from the same seed, on the same data:

* ``natural``: the plain module. The scaler must skip the outlier step (and only it);
* ``reference``: :class:`LeaveOut`, a LightningModule whose ``optimizer_step`` runs the closure
  (forward and backward on the outlier batch, so data and random streams are consumed as in the
  other run) but does not step the optimizer, and whose ``lr_scheduler_step`` does not step the
  scheduler, for that one step. Its scaler never sees the outlier step.

The scaler is configured so both runs keep the same scale throughout (hysteresis 2: the one
overflow is absorbed without halving; a window longer than the run: no doubling). Then the
only difference between the runs is who left the update out, and per-step losses and final
parameters must be equal bit for bit.

``--configs C1,C2,...``: each ``C`` is ``stage:clip:optim[:accumulate[:precision]]``; clip
``none`` or ``norm=<v>`` / ``value=<v>`` (Trainer gradient clipping); optim ``adamw`` (torch
AdamW), ``cpu`` / ``nvme`` (optimizer offload, small tiles), ``fp8o2`` (FP8 O2 optimizer states,
conf/fp8/msamp_o2.yaml with ``min_features=0``); precision ``16-mixed`` (default) or ``16-true``.
Writes ``{C: {"natural": {...}, "reference": {...}}}`` with, per rank and per optimizer step:
whether parameters / optimizer state / offload store changed (bitwise), the scaler's counters,
the LR and the scheduler's ``last_epoch``, the non-finite gradient elements; per rank and
micro-batch the losses; per rank a digest of the final parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import lightning.pytorch as pl

from lightning_ampzero._deepspeed.optim import WarmupDecayLR
from lightning_ampzero.config import LossScalerConfig, PrecisionConfig
from lightning_ampzero.fp8.optim import _local
from lightning_ampzero.models.gpt import GPTConfig, GPTModule
from lightning_ampzero.offload.optimizer import OffloadedAdam
from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy
from lightning_ampzero.zero.clip import global_grad_norm

from parity import PatternData

MODEL = GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32)
GLOBAL_BATCH = 8
OUTLIER_TOKEN = 7


def scaler_config(accumulate: int) -> LossScalerConfig:
    """DeepSpeed's default dynamic scaler (2**16, hysteresis 2), window longer than any run here.

    The scale is the same at every step of both runs (see the module docstring). Lightning divides
    each micro-batch's loss by ``accumulate``, so the scale is multiplied by it: each micro-batch's
    backward sees 2**16 times its gradient, as without accumulation.
    """
    assert accumulate & (accumulate - 1) == 0, "a power of two keeps the scale a power of two"
    return LossScalerConfig(initial_scale_power=16 + accumulate.bit_length() - 1, hysteresis=2,
                            loss_scale_window=1000)


class OutlierData(PatternData):
    """PatternData whose global (micro-)batch ``outlier`` is ``OUTLIER_TOKEN`` repeated (inputs and targets)."""

    def __init__(self, n: int, outlier: int) -> None:
        super().__init__(n, MODEL.block_size, MODEL.vocab_size)
        self.data[outlier * GLOBAL_BATCH:(outlier + 1) * GLOBAL_BATCH] = OUTLIER_TOKEN


class Natural(GPTModule):
    """The small GPT with AdamW and a step-interval LR schedule; records its losses."""

    def __init__(self) -> None:
        super().__init__(model=MODEL, lr=3e-3)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.losses.append(loss.detach().float().item())
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        # ampzero-train's default schedule (DeepSpeed's WarmupDecayLR), with a nonzero floor so that
        # every step that is not skipped moves the parameters.
        scheduler = WarmupDecayLR(optimizer, warmup_min_lr=3e-4, warmup_max_lr=3e-3, warmup_num_steps=3,
                                  warmup_type="linear", total_num_steps=20)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LeaveOut(Natural):
    """The reference: the optimizer step ending at batch ``leave_out`` is left out of the update.

    The closure still runs (forward and backward on that batch, through the same strategy and
    precision), so the data and random streams advance as in the run that skips the step; the
    optimizer and the step-interval scheduler are not stepped, and the loss scaler never sees
    that step (it neither unscales nor counts it).
    """

    def __init__(self, leave_out: int) -> None:
        super().__init__()
        self.leave_out = leave_out
        self._left_out = False

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        if batch_idx == self.leave_out:
            optimizer_closure()
            self._left_out = True
            return
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    def lr_scheduler_step(self, scheduler, metric) -> None:
        if self._left_out:
            self._left_out = False
            return
        super().lr_scheduler_step(scheduler, metric)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s local data as integers: equal means bit for bit (NaN, -0.0 and FP8 included)."""
    local = _local(t.detach()).contiguous()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[local.element_size()]
    return local.view(ints).clone()


def _optimizer(trainer: pl.Trainer) -> Any:
    opt = trainer.optimizers[0]
    return getattr(opt, "_optimizer", opt)


def _state_snapshot(opt: Any) -> list[Any]:
    """Every optimizer state entry of every parameter (tensors as bits), in parameter order."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p] if p in opt.state else {}
            out.append({k: _bits(v) if torch.is_tensor(v) else v for k, v in state.items()})
    return out


def _store_snapshot(opt: Any) -> list[torch.Tensor]:
    """Offload: the store's flat vectors (master weights and both moments, host memory or NVMe files)."""
    if not isinstance(opt, OffloadedAdam):
        return []
    store = opt.store
    return [_bits(store.full(g, name)) for g in range(len(store.group_sizes))
            for name in ("master", "exp_avg", "exp_avg_sq")]


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class Probe(pl.Callback):
    """Per optimizer step on this rank: what it changed (parameters, optimizer state, offload store), scaler, LR.

    Snapshots are taken at the first micro-batch's start and the last micro-batch's end of each
    step (in between, stages 1-2 keep the parameters unsharded across micro-batches).
    """

    def __init__(self, accumulate: int) -> None:
        self.accumulate = accumulate
        self.rows: list[dict[str, Any]] = []
        self._before: Any = None
        self._grads: dict[str, Any] = {}

    @staticmethod
    def _snapshot(trainer: pl.Trainer, module: pl.LightningModule) -> tuple[Any, Any, Any]:
        opt = _optimizer(trainer)
        return [_bits(p) for p in module.parameters()], _state_snapshot(opt), _store_snapshot(opt)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx % self.accumulate:
            return
        self._before = self._snapshot(trainer, module)
        self._grads = {}

    def on_before_optimizer_step(self, trainer, module, optimizer):
        # After the scaler's unscale_ and overflow decision, before clipping and the step.
        bad, total, with_inf, finite_params = 0, 0, [], 0
        for name, p in module.named_parameters():
            if p.grad is None:
                continue
            g = _local(p.grad)
            n_bad = int((~torch.isfinite(g)).sum())
            bad += n_bad
            total += g.numel()
            if n_bad:
                with_inf.append(name)
            elif g.numel():
                finite_params += 1
        norm = float(global_grad_norm(list(module.parameters())))
        self._grads = {"nonfinite": bad, "grad_elements": total, "params_with_nonfinite": with_inf,
                       "params_all_finite": finite_params, "grad_norm": norm}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if (batch_idx + 1) % self.accumulate:
            return
        params, state, store = self._snapshot(trainer, module)
        b_params, b_state, b_store = self._before
        plugin = trainer.precision_plugin
        sched = trainer.lr_scheduler_configs[0].scheduler
        self.rows.append({
            "params_unchanged": _same(params, b_params),
            "opt_state_unchanged": _same(state, b_state),
            "store_unchanged": _same(store, b_store),
            "store_tensors": len(store),
            "state_keys": sorted({k for s in state for k in s}),
            "last_step_skipped": plugin.scaler.last_step_skipped,
            "skipped_steps": plugin.scaler.stats()["skipped_steps"],
            "overflows": plugin.scaler.stats()["overflows"],
            "scale": plugin.scaler.get_scale(),
            "lr": float(trainer.optimizers[0].param_groups[0]["lr"]),
            "scheduler_last_epoch": sched.last_epoch,
            **self._grads,
        })


def _digest(module: pl.LightningModule) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(_bits(p).numpy().tobytes())
    return h.hexdigest()


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _strategy(stage: int, optim: str, accumulate: int, precision_name: str, nvme_dir: str) -> AmpZeroStrategy:
    precision = PrecisionConfig(precision=precision_name, loss_scaler=scaler_config(accumulate))
    kw: dict[str, Any] = {"stage": stage, "precision": precision}
    if optim in ("cpu", "nvme"):
        # Small tiles: every parameter group spans several tiles (the tiled host step is exercised).
        kw.update(offload_optimizer=optim, sub_group_size=20000)
        if optim == "nvme":
            kw.update(nvme_path=nvme_dir, buffer_count=6)
    elif optim == "fp8o2":
        # conf/fp8/msamp_o2.yaml; the small GPT's layers need min_features=0 to be converted. The
        # head stays an fp16 (autocast) Linear, as FP8 recipes usually keep the output layer: FP8
        # GEMMs return fp32 weight gradients, so the outlier's natural overflow is the head's.
        kw["fp8"] = {"recipe": "tensorwise", "msamp": "O2", "min_features": 0, "skip_fqns": ["*head"]}
    elif optim != "adamw":
        raise ValueError(f"unknown optim {optim!r}")
    return AmpZeroStrategy(**kw)


def fit(cfg: str, reference: bool, args: argparse.Namespace) -> dict[str, Any]:
    stage, clip, optim, *rest = cfg.split(":")
    accumulate = int(rest[0]) if rest else 1
    precision = rest[1] if len(rest) > 1 else "16-mixed"
    batches = args.steps * accumulate
    # The outlier is the first micro-batch of optimizer step --outlier (under accumulation its
    # inf sits in the accumulated gradients while the window's other micro-batches add to them);
    # that step ends at the last micro-batch of its window.
    outlier = args.outlier * accumulate
    leave_out = outlier + accumulate - 1
    pl.seed_everything(0, verbose=False)
    model = LeaveOut(leave_out) if reference else Natural()
    clip_kw: dict[str, Any] = {}
    if clip != "none":
        algo, val = clip.split("=")
        clip_kw = {"gradient_clip_val": float(val), "gradient_clip_algorithm": algo}
    probe = Probe(accumulate)
    strategy = _strategy(int(stage), optim, accumulate, precision, args.tmp)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, callbacks=[probe], **clip_kw,
    )
    dataset = OutlierData(GLOBAL_BATCH * batches, outlier)
    sampler = DistributedSampler(dataset, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False)
    trainer.fit(model, DataLoader(dataset, batch_size=GLOBAL_BATCH // trainer.world_size, sampler=sampler))
    opt = _optimizer(trainer)
    return {
        "losses": _gather(model.losses),
        "rows": _gather(probe.rows),
        "digest": _gather(_digest(model)),
        "optimizer": type(opt).__name__,
        "global_step": trainer.global_step,
        "outlier": outlier,
        "leave_out": leave_out,
        "accumulate": accumulate,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=7, help="optimizer steps")
    p.add_argument("--outlier", type=int, default=3, help="the optimizer step whose first micro-batch is degenerate")
    p.add_argument("--tmp", default=".")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    results = {}
    for cfg in args.configs.split(","):
        results[cfg] = {"natural": fit(cfg, False, args), "reference": fit(cfg, True, args)}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
