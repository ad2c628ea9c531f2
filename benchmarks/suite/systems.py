"""The training loops compared, each driven the way its users drive it.

* ``ampzero``: ``Trainer(strategy=AmpZeroStrategy(stage=...), precision=...)`` with a
  ``GPTModule``: Lightning's loop, hooks and optimizer closure included.
* ``ampzero_nosigterm`` (diagnostic): ``ampzero`` with Lightning's per-batch SIGTERM broadcast
  disabled. Lightning 2.6's training loop broadcasts a one-element tensor from rank 0 and reads
  it with ``.item()`` before every batch (``_TrainingEpochLoop._broadcast_sigterm_tensor``):
  a blocking collective per micro-batch that no bare loop has. This run measures its cost.
* ``ampzero_fp32reduce`` (diagnostic, bf16-mixed): ``ampzero`` with
  ``lower_precision_safe_modules=[]``: no safe modules, so every gradient is reduced and (stage
  3) every parameter gathered in fp32; the units are those of 32-true. Measures what stage 3's
  bf16 gather of the Linears saves (on gloo the default already reduces every gradient in fp32).
* ``ampzero_lowwire`` (diagnostic, bf16-mixed): ``ampzero`` with the safe modules listed
  (``lower_precision_safe_modules=["Linear", "Conv1d", "Conv2d", "Conv3d"]``): their gradients
  reduced in bf16 on gloo too, where the default (``None``) sends them in fp32 on gloo ([Note:
  the safe modules' gradients on gloo] in lightning_ampzero/precision/policy.py). Measures
  what the bf16 wire costs or saves here.
* ``ampzero_reuse`` (diagnostic, stage 3): ``ampzero`` with ``max_reuse_distance=1e9``,
  DeepSpeed's default ``stage3_max_reuse_distance``, which the ``deepspeed`` runs use: both keep
  this model's units gathered from forward to backward instead of gathering them again (the same
  traffic), where ampzero's default (0) frees each unit after its forward.
* ``lightning_ddp``: the same Trainer with Lightning's own ``strategy="ddp"``: Lightning's
  per-step cost with a strategy we did not write (the evidence for what Lightning costs).
* ``fsdp2``: a bare loop over the model sharded by ``apply_zero`` with the policies
  ampzero's precision plugin computes: the same FSDP2 units, reshard settings, prefetch and
  mixed-precision policies as ``ampzero`` at that stage and precision, without Lightning
  (bf16-mixed: the Linears of each unit in one bf16-reducing group, as ``ampzero``).
* ``ddp``: a bare loop over ``DistributedDataParallel`` (defaults), autocast for bf16-mixed.
* ``deepspeed``: a bare loop over ``deepspeed.initialize(model, optimizer=AdamW(...),
  config=...)``: ``engine(x)``, ``engine.backward(loss)``, ``engine.step()``, as DeepSpeed
  documents it. Precisions: fp32; bf16-mixed = DeepSpeed's ``torch_autocast`` (bf16 autocast,
  fp32 parameters, Linear gradients reduced in bf16: the same numerics as ``ampzero_lowwire``;
  ampzero's default reduces them in fp32 on gloo); bf16-true = DeepSpeed's ``bf16`` mode (bf16 parameters and gradients, fp32
  master in the optimizer).

All use the same AdamW and parameter groups (``GPTModule.configure_optimizers``), the same
loss (``GPTModule._loss``), the same data loader, and call the same :class:`~meter.Meter`
hooks at the same points.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from .configs import BenchConfig, Workload
from .meter import Meter

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

from parity import PatternData  # noqa: E402  (the parity tests' deterministic data)


def make_loader(w: Workload, rank: int) -> DataLoader:
    """Rank r reads the samples r, r+N, ... of each global batch, in order."""
    data = PatternData(w.global_batch * w.total_steps, w.seq, w.vocab)
    sampler = DistributedSampler(data, num_replicas=w.world, rank=rank, shuffle=False)
    return DataLoader(data, batch_size=w.micro_batch, sampler=sampler, shuffle=False)


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))  # as GPTModule._loss


def adamw(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW with GPTModule.configure_optimizers' groups and hyper-parameters (its defaults)."""
    from lightning_ampzero.models.gpt import gpt_adamw

    return gpt_adamw(model, lr)


def _autocast(precision: str) -> Callable[[], Any]:
    if precision == "bf16-mixed":
        return lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext


def bare_loop(model: torch.nn.Module, opt: torch.optim.Optimizer, w: Workload, meter: Meter, rank: int,
              autocast: Callable[[], Any], no_sync: Callable[[], Any]) -> None:
    """forward / backward per micro-batch (no_sync on non-final ones), then the optimizer step."""
    batches: Iterator = iter(make_loader(w, rank))
    a = w.accumulate
    for i in range(w.total_steps):
        meter.step_start(i)
        opt.zero_grad(set_to_none=True)
        for j in range(a):
            x, y = next(batches)
            with (contextlib.nullcontext() if j == a - 1 else no_sync()):
                with autocast():
                    loss = loss_fn(model(x), y)
                meter.sample()
                (loss / a).backward()
            meter.sample()
            meter.record_loss(loss)
        opt.step()
        meter.sample()
        meter.step_end(i)


# ---- systems -------------------------------------------------------------------------------
def run_ddp(cfg: BenchConfig, w: Workload, meter: Meter, rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from lightning_ampzero.memory import measure_model_state
    from lightning_ampzero.models.gpt import GPT

    model = DistributedDataParallel(GPT(w.gpt_config()))
    opt = adamw(model.module, w.lr)
    meter.sampler = lambda: measure_model_state(model.module, [opt])
    bare_loop(model, opt, w, meter, rank, _autocast(cfg.precision), model.no_sync)
    return {"numel": sum(p.numel() for p in model.module.parameters())}


def run_fsdp2(cfg: BenchConfig, w: Workload, meter: Meter, rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ampzero.config import PrecisionConfig, ZeroConfig
    from lightning_ampzero.memory import measure_model_state
    from lightning_ampzero.models.gpt import GPT
    from lightning_ampzero.precision.policy import dtype_plan, fsdp_policies
    from lightning_ampzero.zero.apply import apply_zero, no_sync

    model = GPT(w.gpt_config())
    numel = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh("cpu", (w.world,), mesh_dim_names=("dp",))
    zero = ZeroConfig(stage=cfg.stage, reduce_bucket_size=w.reduce_bucket_size,
                      allgather_bucket_size=w.allgather_bucket_size, prefetch_bucket_size=w.prefetch_bucket_size,
                      param_persistence_threshold=w.param_persistence_threshold)
    mp_policy, module_policies = fsdp_policies(dtype_plan(cfg.precision, PrecisionConfig()), model, cfg.stage)
    apply_zero(model, mesh, zero, mp_policy, module_policies=module_policies)
    opt = adamw(model, w.lr)
    meter.sampler = lambda: measure_model_state(model, [opt])
    bare_loop(model, opt, w, meter, rank, _autocast(cfg.precision), lambda: no_sync(model, cfg.stage))
    return {"numel": numel}


def _meter_callback(meter: Meter, accumulate: int) -> Any:
    """The Meter's hooks from Lightning's: a step starts at its first micro-batch."""
    import lightning.pytorch as pl

    class MeterCallback(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx % accumulate == 0:
                meter.step_start(batch_idx // accumulate)

        def on_before_backward(self, trainer, pl_module, loss):
            meter.sample()

        def on_after_backward(self, trainer, pl_module):
            meter.sample()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if (batch_idx + 1) % accumulate == 0:
                meter.sample()
                meter.step_end(batch_idx // accumulate)

    return MeterCallback()


def _lightning_module(w: Workload, meter: Meter):
    from lightning_ampzero.models.gpt import GPTModule

    class BenchGPT(GPTModule):
        """GPTModule recording its loss for the parity check, without ``self.log``: logging
        with ``sync_dist=True`` would add an all-reduce per step that the other loops don't do."""

        def training_step(self, batch, batch_idx):
            loss = self._loss(batch)
            meter.record_loss(loss)
            return loss

    return BenchGPT(model=w.gpt_config(), lr=w.lr)


@contextlib.contextmanager
def _sigterm_broadcast(enabled: bool) -> Iterator[None]:
    if enabled:
        yield
        return
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    from lightning_ampzero.sigterm import AsyncSigtermBroadcast

    # Lightning's broadcast, and ampzero's asynchronous one that replaces it (sigterm.py)
    originals = (_TrainingEpochLoop._broadcast_sigterm_tensor, AsyncSigtermBroadcast.__call__)
    _TrainingEpochLoop._broadcast_sigterm_tensor = lambda self: None
    AsyncSigtermBroadcast.__call__ = lambda self: None
    try:
        yield
    finally:
        _TrainingEpochLoop._broadcast_sigterm_tensor, AsyncSigtermBroadcast.__call__ = originals


def run_lightning(cfg: BenchConfig, w: Workload, meter: Meter, rank: int) -> dict:
    import lightning.pytorch as pl

    from lightning_ampzero.memory import measure_model_state

    module = _lightning_module(w, meter)
    if cfg.system.startswith("ampzero"):
        from lightning_ampzero.strategy import AmpZeroStrategy

        kw: dict[str, Any] = {}
        if cfg.offload:
            kw["offload_optimizer"] = cfg.offload
        if cfg.system == "ampzero_fp32reduce":
            kw["precision"] = {"lower_precision_safe_modules": []}
        if cfg.system == "ampzero_lowwire":
            kw["precision"] = {"lower_precision_safe_modules": ["Linear", "Conv1d", "Conv2d", "Conv3d"]}
        if cfg.system == "ampzero_reuse":
            kw["max_reuse_distance"] = 1e9  # DeepSpeed's default stage3_max_reuse_distance
        strategy: Any = AmpZeroStrategy(
            stage=cfg.stage, reduce_bucket_size=w.reduce_bucket_size, allgather_bucket_size=w.allgather_bucket_size,
            prefetch_bucket_size=w.prefetch_bucket_size, param_persistence_threshold=w.param_persistence_threshold,
            host_memory_cache_mb=w.host_memory_cache_mb, **kw)
    else:
        strategy = "ddp"
    holder: dict[str, Any] = {}

    def sample() -> dict:
        trainer = holder["trainer"]
        return measure_model_state(trainer.lightning_module, trainer.optimizers)

    meter.sampler = sample
    trainer = pl.Trainer(
        accelerator="cpu", devices=w.world, strategy=strategy, precision=cfg.precision,
        max_steps=w.total_steps, accumulate_grad_batches=w.accumulate, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        num_sanity_val_steps=0, callbacks=[_meter_callback(meter, w.accumulate)],
    )
    holder["trainer"] = trainer
    with _sigterm_broadcast(enabled=cfg.system != "ampzero_nosigterm"):
        trainer.fit(module, make_loader(w, rank))
    numel = sum(p.numel() for p in module.parameters())  # DTensor numel is the global size
    info = {"numel": numel}
    if cfg.offload:
        from lightning_ampzero.offload.optimizer import is_offloaded

        info["offloaded"] = any(is_offloaded(o) for o in trainer.strategy.optimizers)
    holder.clear()
    return info


def deepspeed_config(cfg: BenchConfig, w: Workload) -> dict:
    zero: dict[str, Any] = {
        "stage": cfg.stage,
        "reduce_bucket_size": int(w.reduce_bucket_size),
        "allgather_bucket_size": int(w.allgather_bucket_size),
        "stage3_prefetch_bucket_size": int(w.prefetch_bucket_size),
        "stage3_param_persistence_threshold": int(w.param_persistence_threshold),
    }
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": w.micro_batch,
        "gradient_accumulation_steps": w.accumulate,
        "train_batch_size": w.global_batch,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        # DeepSpeed 0.19.8 clips the global gradient norm to 1.0 unless told otherwise; every
        # other system here runs without clipping (Lightning's default).
        "gradient_clipping": 0.0,
    }
    if cfg.offload:
        zero["offload_optimizer"] = {"device": cfg.offload, "pin_memory": False}
        # our client AdamW (the same optimizer as every other system), not DeepSpeedCPUAdam
        ds["zero_force_ds_cpu_optimizer"] = False
    if cfg.precision == "bf16-true":
        ds["bf16"] = {"enabled": True}
    elif cfg.precision == "bf16-mixed":
        ds["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    return ds


def run_deepspeed(cfg: BenchConfig, w: Workload, meter: Meter, rank: int) -> dict:
    import deepspeed

    from lightning_ampzero.models.gpt import GPT

    from .deepspeed_state import measure_deepspeed

    model = GPT(w.gpt_config())
    numel = sum(p.numel() for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=adamw(model, w.lr), config=deepspeed_config(cfg, w))
    paths: dict[str, int] = {}

    def sample() -> dict:
        cats, by_path = measure_deepspeed(engine)
        for k, v in by_path.items():
            paths[k] = max(paths.get(k, 0), v)
        return cats

    meter.sampler = sample
    batches: Iterator = iter(make_loader(w, rank))
    for i in range(w.total_steps):
        meter.step_start(i)
        for _ in range(w.accumulate):
            x, y = next(batches)
            loss = loss_fn(engine(x), y)
            meter.sample()
            engine.backward(loss)
            meter.sample()
            meter.record_loss(loss)
            engine.step()  # the optimizer steps at the accumulation boundary
        meter.sample()
        meter.step_end(i)
    try:
        engine.destroy()
    except Exception:  # older engines have no destroy()
        pass
    return {"numel": numel, "deepspeed_paths": paths}


RUNNERS: dict[str, Callable[[BenchConfig, Workload, Meter, int], dict]] = {
    "ampzero": run_lightning,
    "lightning_ddp": run_lightning,
    "ampzero_nosigterm": run_lightning,
    "ampzero_fp32reduce": run_lightning,
    "ampzero_reuse": run_lightning,
    "ampzero_lowwire": run_lightning,
    "fsdp2": run_fsdp2,
    "ddp": run_ddp,
    "deepspeed": run_deepspeed,
}


def deepspeed_available() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:
        return False
    return True
