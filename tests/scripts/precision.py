"""Precision plugin on N ranks: train under each precision, skip injected overflows, resume the scaler.

Run as a script (never inside pytest: Lightning's launcher re-runs the command line for the
other ranks). Scenarios (``--scenario``), each a list of configurations run in one launch:

* ``train``: ``--configs stage:precision[:clip]`` (``precision`` may end in ``@flag`` to pass it as
  ``Trainer(precision=...)`` instead of the strategy's config). Per configuration: the per-step
  losses (mean over ranks), the dtypes seen inside the step, the FSDP2 unit policies.
* ``inject``: ``--configs stage``: 16-mixed with a small dynamic scaler; an inf is written into ONE
  rank's gradient shard at given steps. Per step and rank: skipped or not, parameters and
  optimizer state unchanged or not, the scheduler's step count, the scale, what the logger got.
* ``resume``: ``--configs stage``: 16-mixed, overflow injected before and after an epoch-end
  checkpoint; an uninterrupted run, the run that saves, and the run resumed from it.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers.logger import Logger

from lightning_ampzero.config import LossScalerConfig, PrecisionConfig
from lightning_ampzero.models.gpt import GPTConfig, GPTModule
from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy

from parity import PatternData

MODEL = GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32)


class MemoryLogger(Logger):
    """Keeps what the Trainer logs, per step."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> str:
        return "0"

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append({"step": step, **{k: float(v) for k, v in metrics.items()}})

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


class Recorder(GPTModule):
    def __init__(self, *, inject: dict[int, int] | None = None, scheduler: bool = False, **kw: Any) -> None:
        super().__init__(model=MODEL, lr=3e-3, **kw)
        self.losses: list[float] = []
        self.dtypes: dict[str, str] = {}
        self.inject = inject or {}  # global step -> rank whose gradient shard gets an inf
        self.use_scheduler = scheduler

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.losses.append(loss.detach().float().item())
        return loss

    def configure_model(self) -> None:
        super().configure_model()
        if not self.dtypes:
            # What each kind of op computes in, seen from inside the step.
            def record(key):
                def hook(module, args, output):
                    self.dtypes.setdefault(key, str(output.dtype))
                    self.dtypes.setdefault(key + "_weight", str(_local(module.weight).dtype))
                return hook

            self.model.blocks[0].mlp[0].register_forward_hook(record("linear"))
            self.model.blocks[0].ln_1.register_forward_hook(record("layernorm"))

    def on_after_backward(self) -> None:
        rank = self.inject.get(self.global_step)
        if rank is not None and self.global_rank == rank:
            # One element of this rank's own shard (stages 1-3) / replica (stage 0), after reduction.
            grad = self.model.blocks[1].mlp[0].weight.grad
            _local(grad).view(-1)[0] = float("inf")

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        if not self.use_scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


class StepProbe(Callback):
    """Per step: was it skipped, did parameters / optimizer state move, where is the scheduler."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._before: Any = None

    @staticmethod
    def _snapshot(trainer, module):
        params = [_local(p.detach()).clone() for p in module.parameters()]
        opt = trainer.optimizers[0]
        state = [[_local(v).clone() if torch.is_tensor(v) else v for v in opt.state[p].values()]
                 for g in opt.param_groups for p in g["params"] if p in opt.state]
        return params, state

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._before = self._snapshot(trainer, module)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        params, state = self._snapshot(trainer, module)
        b_params, b_state = self._before
        same_params = all(torch.equal(a, b) for a, b in zip(params, b_params))
        same_state = len(state) == len(b_state) and all(
            all(torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(s, t)) for s, t in zip(state, b_state)
        )
        plugin = trainer.precision_plugin
        sched = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
        self.rows.append({
            "skipped": plugin.scaler.last_step_skipped,
            "params_unchanged": same_params,
            "opt_state_unchanged": same_state,
            "scale": plugin.scaler.get_scale(),
            "skipped_steps": plugin.scaler.stats()["skipped_steps"],
            "scheduler_steps": sched.last_epoch if sched is not None else None,
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "loss": float(outputs["loss"]),
        })


def _strategy(stage: int, precision: str | None, scaler: LossScalerConfig | None = None) -> AmpZeroStrategy:
    cfg = PrecisionConfig(precision=precision, loss_scaler=scaler or LossScalerConfig())
    return AmpZeroStrategy(stage=stage, precision=cfg)


def _trainer(args, strategy, **kw) -> pl.Trainer:
    defaults = dict(accelerator="cpu", devices=args.devices, strategy=strategy, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    use_distributed_sampler=False)
    defaults.update(kw)
    return pl.Trainer(**defaults)


def _loader(trainer, steps: int, global_batch: int = 8, seed: int = 0) -> DataLoader:
    world = trainer.world_size
    dataset = PatternData(global_batch * steps, 32, 256, seed=seed)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=trainer.global_rank, shuffle=False)
    return DataLoader(dataset, batch_size=global_batch // world, sampler=sampler)


def _mean_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _unit_policies(module) -> list[list[str]]:
    from torch.distributed.fsdp import FSDPModule

    names = {id(m): n for n, m in module.named_modules()}
    rows = []
    for m in module.modules():
        if isinstance(m, FSDPModule):
            pol = m._get_fsdp_state()._mp_policy
            rows.append([names[id(m)], type(m).__name__, str(pol.param_dtype), str(pol.reduce_dtype)])
    return rows


def _gathered_dtypes(module) -> dict[str, str]:
    """Module name -> the dtype FSDP2 all-gathers its parameters in (after the first step)."""
    from lightning_ampzero.memory import fsdp_param_groups

    names = {id(m): n for n, m in module.named_modules()}
    return {names[id(fp._module_info.module)]: str(fp.param_dtype or fp.orig_dtype)
            for group in fsdp_param_groups(module) for fp in group.fsdp_params}


def run_train(cfg: str, args) -> dict[str, Any]:
    stage, precision, *rest = cfg.split(":")
    clip = rest[0] if rest else "none"
    flag = precision.endswith("@flag")
    precision = precision.removesuffix("@flag")
    pl.seed_everything(0, verbose=False)
    model = Recorder()
    kw: dict[str, Any] = {}
    if clip != "none":
        algo, val = clip.split("=")
        kw = {"gradient_clip_val": float(val), "gradient_clip_algorithm": algo}
    if flag:
        trainer = _trainer(args, f"ampzero_stage_{stage}", precision=precision, max_steps=args.steps, **kw)
    else:
        trainer = _trainer(args, _strategy(int(stage), precision), max_steps=args.steps, **kw)
    trainer.fit(model, _loader(trainer, args.steps))
    plugin = trainer.precision_plugin
    master = {str(_local(p).dtype) for p in model.parameters()}
    grads = {str(_local(p.grad).dtype) for p in model.parameters() if p.grad is not None}
    return {
        "losses": _mean_over_ranks(model.losses),
        "trainer_precision": trainer.precision,
        "dtypes": model.dtypes,
        "master_dtypes": sorted(master),
        "opt_state_dtypes": sorted({str(_local(v).dtype) for s in trainer.optimizers[0].state.values()
                                    for k, v in s.items() if k != "step" and torch.is_tensor(v)}),
        "grad_dtypes": sorted(grads),
        "units": _unit_policies(model) if int(stage) > 0 else [],
        "gathered": _gathered_dtypes(model) if int(stage) > 0 else {},
        "skipped_steps": plugin.scaler.stats()["skipped_steps"],
        "scale": plugin.scaler.get_scale(),
        "precision_state": plugin.state_dict(),
    }


INJECT_SCALER = LossScalerConfig(initial_scale_power=8, loss_scale_window=5, hysteresis=2)


def run_inject(cfg: str, args) -> dict[str, Any]:
    stage = int(cfg)
    pl.seed_everything(0, verbose=False)
    # An inf in rank 1's shard at step 3, in rank 0's at step 4 (hysteresis 2: the first one is
    # absorbed, the second halves the scale).
    model = Recorder(inject={3: 1, 4: 0}, scheduler=True)
    probe, logger = StepProbe(), MemoryLogger()
    trainer = _trainer(args, _strategy(stage, "16-mixed", INJECT_SCALER), max_steps=args.steps, callbacks=[probe],
                       logger=logger, log_every_n_steps=1, gradient_clip_val=1.0)
    trainer.fit(model, _loader(trainer, args.steps))
    return {"rows": _gather(probe.rows), "logged": logger.rows if trainer.is_global_zero else None,
            "global_step": trainer.global_step}


RESUME_SCALER = LossScalerConfig(initial_scale_power=10, loss_scale_window=3, hysteresis=2)


def run_resume(cfg: str, args, tmp: Path) -> dict[str, Any]:
    stage = int(cfg)
    per_epoch = 6
    # Two overflows before the checkpoint (after step 6 it holds scale 512, hysteresis 1, last
    # overflow at iteration 2); the first step after it overflows again, so the resumed run takes
    # the uninterrupted run's path only if all of that was restored (hysteresis 2 would absorb it).
    inject = {1: 1, 2: 0, 6: 1}

    def fit(epochs: int, callbacks=(), ckpt=None):
        pl.seed_everything(0, verbose=False)
        model = Recorder(inject=inject, scheduler=True)
        probe = StepProbe()
        trainer = _trainer(args, _strategy(stage, "16-mixed", RESUME_SCALER), max_epochs=epochs,
                           callbacks=[probe, *callbacks], enable_checkpointing=bool(callbacks))
        trainer.fit(model, _loader(trainer, per_epoch), ckpt_path=ckpt)
        return trainer, probe

    full, full_probe = fit(2)
    ckpt_dir = tmp / f"resume{stage}"
    cb = ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True)
    first, first_probe = fit(1, [cb])
    ckpt = sorted(ckpt_dir.glob("*.ckpt"))[-1]
    meta = torch.load(ckpt / "meta.pt", weights_only=False) if dist.get_rank() == 0 else {}
    resumed, resumed_probe = fit(2, ckpt=str(ckpt))
    return {
        "full": full_probe.rows,
        "first": first_probe.rows,
        "first_state": first.precision_plugin.state_dict(),
        "saved_state": meta.get("AmpZeroPrecision"),
        "resumed": resumed_probe.rows,
        "resumed_state_end": resumed.precision_plugin.state_dict(),
        "full_state_end": full.precision_plugin.state_dict(),
        "resumed_scheduler": resumed.lr_scheduler_configs[0].scheduler.state_dict()["last_epoch"],
        "full_scheduler": full.lr_scheduler_configs[0].scheduler.state_dict()["last_epoch"],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", choices=("train", "inject", "resume"), required=True)
    p.add_argument("--configs", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--tmp", default=".")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    results = {}
    for cfg in args.configs.split(","):
        if args.scenario == "train":
            results[cfg] = run_train(cfg, args)
        elif args.scenario == "inject":
            results[cfg] = run_inject(cfg, args)
        else:
            results[cfg] = run_resume(cfg, args, Path(args.tmp))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
