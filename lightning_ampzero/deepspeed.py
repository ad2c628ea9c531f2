"""Import a DeepSpeed JSON config into the one schema.

``convert_deepspeed_config("ds_config.json")`` (or a dict) returns an
:class:`ImportedDeepSpeedConfig`: the :class:`~lightning_ampzero.config.AmpZeroConfig` it stands
for, the Trainer settings DeepSpeed keeps in its JSON (gradient clipping, accumulation,
precision), its ``optimizer`` / ``scheduler`` sections, and the keys that have no effect here.
``AmpZeroStrategy(config="ds_config.json")`` uses it, and ``ampzero-config from-deepspeed``
prints it as Hydra overrides or an experiment YAML.

Rules (DeepSpeed silently ignores a misspelt key; we do not):

* A key DeepSpeed does not know is an error naming its path, with a "did you mean".
* A key DeepSpeed knows but that changes nothing here is listed, with the reason, in one
  :class:`DeepSpeedConfigWarning` per conversion (on global rank 0 only).
* ``"auto"`` (the Hugging Face integration's placeholder) takes our default, or what the
  Trainer / LightningModule already says; :attr:`ImportedDeepSpeedConfig.auto` lists those keys.
* Values are validated by the typed configs, so a bad value names the allowed ones.

Features: ``zero_optimization.offload_optimizer`` / ``offload_param`` / ``sub_group_size`` and
``aio`` become :class:`~lightning_ampzero.config.OffloadConfig`, ``activation_checkpointing``
turns on full checkpointing of the repeated blocks
(:class:`~lightning_ampzero.config.ActivationCheckpointingConfig`), and ``msamp`` becomes
:class:`~lightning_ampzero.config.Fp8Config` (``_deepspeed_features.py``). Keys whose meaning
here differs from DeepSpeed's are listed as notes (:attr:`ImportedDeepSpeedConfig.notes`).

Precision: ``fp16`` maps to ``"16-mixed"`` and ``bf16`` to ``"bf16-mixed"``, as Lightning's
own DeepSpeed integration maps them; DeepSpeed's fp16 loss-scaler keys keep their names and
semantics (:class:`~lightning_ampzero.config.LossScalerConfig`). ``torch_autocast`` picks the
"-mixed" precision of its dtype and its ``lower_precision_safe_modules``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Union

from lightning_ampzero import _deepspeed_features as features
from lightning_ampzero._schema import check_choice, check_number, config_from_dict, suggest
from lightning_ampzero.config import (
    ActivationCheckpointingConfig,
    AmpZeroConfig,
    Fp8Config,
    LossScalerConfig,
    OffloadConfig,
    PrecisionConfig,
    ZeroConfig,
)

__all__ = [
    "DeepSpeedConfigError",
    "DeepSpeedConfigWarning",
    "ImportedDeepSpeedConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "WarmupDecayLR",
    "build_optimizer",
    "build_scheduler",
    "convert_deepspeed_config",
]

AUTO = "auto"


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config that cannot be converted: unknown keys, bad values, contradictions."""


class DeepSpeedConfigWarning(UserWarning):
    """DeepSpeed config keys that have no effect with lightning_ampzero."""


# ---------------------------------------------------------------------------------------
# The optimizer and scheduler sections (also the `optim` / `scheduler` nodes of ampzero-train)
# ---------------------------------------------------------------------------------------

OPTIMIZERS = ("AdamW", "Adam")
SCHEDULERS = ("WarmupLR", "WarmupDecayLR")
WARMUP_TYPES = ("log", "linear")


@dataclass(frozen=True)
class OptimizerConfig:
    """A torch optimizer, as DeepSpeed's ``optimizer`` section describes it.

    Attributes:
        type: ``AdamW`` (decoupled weight decay) or ``Adam`` (L2 penalty added to the gradient).
            DeepSpeed's ``"Adam"`` is AdamW unless its ``adam_w_mode`` is false; the importer
            resolves that, so here the names mean the torch classes.
        lr, betas, eps, weight_decay: the torch optimizer's arguments.
    """

    type: str = "AdamW"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        check_choice("optim", "type", self.type, OPTIMIZERS)
        check_number("optim", "lr", self.lr, minimum=0)
        check_number("optim", "eps", self.eps, minimum=0)
        check_number("optim", "weight_decay", self.weight_decay, minimum=0)
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), got {self.betas!r}.")
        object.__setattr__(self, "betas", tuple(float(b) for b in betas))

    @classmethod
    def from_dict(cls, data: Any) -> "OptimizerConfig":
        return config_from_dict(cls, data, path="optim")


@dataclass(frozen=True)
class SchedulerConfig:
    """DeepSpeed's ``WarmupLR`` / ``WarmupDecayLR`` (stepped after every optimizer step).

    Attributes:
        type: ``None`` (constant learning rate), ``WarmupLR`` or ``WarmupDecayLR``.
        warmup_min_lr: learning rate at the first step.
        warmup_max_lr: learning rate reached after warmup; ``None`` = the optimizer's ``lr``.
        warmup_num_steps: optimizer steps of warmup.
        warmup_type: ``log`` (DeepSpeed's default) or ``linear`` growth during warmup.
        total_num_steps: ``WarmupDecayLR``: the step at which the rate has decayed linearly to
            ``warmup_min_lr``; ``None`` = the Trainer's estimated number of optimizer steps.
    """

    type: Optional[str] = None
    warmup_min_lr: float = 0.0
    warmup_max_lr: Optional[float] = None
    warmup_num_steps: int = 1000
    warmup_type: str = "log"
    total_num_steps: Optional[int] = None

    def __post_init__(self) -> None:
        if self.type is not None:
            check_choice("scheduler", "type", self.type, SCHEDULERS)
        check_number("scheduler", "warmup_min_lr", self.warmup_min_lr, minimum=0)
        if self.warmup_max_lr is not None:
            check_number("scheduler", "warmup_max_lr", self.warmup_max_lr, minimum=0)
        check_number("scheduler", "warmup_num_steps", self.warmup_num_steps, minimum=0, integral=True)
        check_choice("scheduler", "warmup_type", self.warmup_type, WARMUP_TYPES)
        if self.total_num_steps is not None:
            check_number("scheduler", "total_num_steps", self.total_num_steps, minimum=1, integral=True)

    @classmethod
    def from_dict(cls, data: Any) -> "SchedulerConfig":
        return config_from_dict(cls, data, path="scheduler")


def build_optimizer(cfg: OptimizerConfig, params: Iterable[Any]) -> Any:
    """The torch optimizer of ``cfg`` over ``params`` (tensors or param-group dicts)."""
    import torch

    cls = torch.optim.AdamW if cfg.type == "AdamW" else torch.optim.Adam
    return cls(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=True)


def _lr_scheduler_base() -> type:
    import torch

    return torch.optim.lr_scheduler.LRScheduler


class WarmupDecayLR(_lr_scheduler_base()):  # type: ignore[misc]
    """DeepSpeed's ``WarmupLR`` (``total_num_steps=None``) and ``WarmupDecayLR`` as a torch scheduler.

    DeepSpeed sets absolute rates: ``min + (max - min) * gamma`` with, during warmup,
    ``gamma = log(i + 1) / log(warmup)`` (or ``i / warmup`` for ``linear``), then 1 (WarmupLR) or
    ``max(0, (total - i) / max(1, total - warmup))`` (WarmupDecayLR), where ``i`` counts the
    scheduler's ``step()`` calls minus one; DeepSpeed clamps ``warmup`` to at least 2 (log of 1).
    Its engine steps the scheduler after each optimizer step, so the k-th optimizer step
    (k = 0, 1, ...) runs at ``i = k - 1``, and at ``min`` for k = 0. Torch's ``last_epoch`` is
    ``k`` here, hence ``i = max(k - 1, 0)`` (both give ``min`` for k = 0 and 1).
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float,
        warmup_max_lr: Union[float, list[float]],
        warmup_num_steps: int,
        warmup_type: str = "log",
        total_num_steps: Optional[int] = None,
        last_epoch: int = -1,
    ) -> None:
        n = len(optimizer.param_groups)
        max_lrs = list(warmup_max_lr) if isinstance(warmup_max_lr, (list, tuple)) else [warmup_max_lr] * n
        self.min_lr = float(warmup_min_lr)
        self.max_lrs = [float(v) for v in max_lrs]
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, last_epoch)

    def gamma(self, k: int) -> float:
        i = max(k - 1, 0)
        if i < self.warmup_num_steps:
            if self.warmup_type == "log":
                return math.log(i + 1) / math.log(self.warmup_num_steps)
            return i / self.warmup_num_steps
        if self.total_num_steps is None:
            return 1.0
        return max(0.0, (self.total_num_steps - i) / max(1.0, self.total_num_steps - self.warmup_num_steps))

    def get_lr(self) -> list[float]:
        g = self.gamma(self.last_epoch)
        return [self.min_lr + (hi - self.min_lr) * g for hi in self.max_lrs]


def build_scheduler(cfg: SchedulerConfig, optimizer: Any, *, lr: float, total_steps: Optional[int] = None) -> Any:
    """The scheduler of ``cfg`` (or None), ``lr`` standing for ``warmup_max_lr=None``."""
    if cfg.type is None:
        return None
    total = None
    if cfg.type == "WarmupDecayLR":
        total = cfg.total_num_steps or total_steps
        if not total or total < 0 or total == math.inf:
            raise ValueError(
                "scheduler WarmupDecayLR needs total_num_steps: set it, or give the Trainer max_steps"
                " (or max_epochs with a sized DataLoader) so it can be estimated."
            )
    max_lr = lr if cfg.warmup_max_lr is None else cfg.warmup_max_lr
    return WarmupDecayLR(optimizer, cfg.warmup_min_lr, max_lr, cfg.warmup_num_steps, cfg.warmup_type, total)


# ---------------------------------------------------------------------------------------
# The keys DeepSpeed knows, and what each one becomes here
# ---------------------------------------------------------------------------------------
# Each table maps a key to a target path in the converted result (a str), or to the reason
# it has no effect here (a _NoEffect). Targets: "zero.<f>" / "precision.<f>" /
# "precision.loss_scaler.<f>" (AmpZeroConfig), "trainer.<kwarg>", "batch.<name>"; keys
# handled by code are marked _HANDLED.


@dataclass(frozen=True)
class _NoEffect:
    reason: str


_HANDLED = "<handled>"
_FSDP = "FSDP2 schedules its own communication"
_NOT_YET = "not available in this version of lightning_ampzero yet"
_MONITOR = "monitoring/profiling: use Lightning loggers and profilers"

_TOP: dict[str, Any] = {
    "train_batch_size": "batch.train_batch_size",
    "train_micro_batch_size_per_gpu": "batch.micro_batch_size",
    "gradient_accumulation_steps": "trainer.accumulate_grad_batches",
    "gradient_clipping": "trainer.gradient_clip_val",
    "communication_data_type": _HANDLED,
    "zero_optimization": _HANDLED,
    "fp16": _HANDLED,
    "bf16": _HANDLED,
    "bfloat16": _HANDLED,
    "torch_autocast": _HANDLED,
    "amp": _HANDLED,
    "optimizer": _HANDLED,
    "scheduler": _HANDLED,
    "activation_checkpointing": _HANDLED,
    "aio": _HANDLED,
    "msamp": _HANDLED,
    "zero_allow_untested_optimizer": _NoEffect("any torch optimizer works with FSDP2-sharded parameters"),
    "zero_force_ds_cpu_optimizer": _NoEffect("there is no DeepSpeed CPU optimizer here"),
    "prescale_gradients": _NoEffect("gradients are averaged by the reduce-scatter / all-reduce"),
    "gradient_predivide_factor": _NoEffect("gradients are averaged by the reduce-scatter / all-reduce"),
    "sparse_gradients": _NoEffect("sparse gradients are not supported by FSDP2"),
    "steps_per_print": _NoEffect("Lightning's progress bar and loggers report progress"),
    "wall_clock_breakdown": _NoEffect(_MONITOR),
    "memory_breakdown": _NoEffect(_MONITOR),
    "dump_state": _NoEffect(_MONITOR),
    "flops_profiler": _NoEffect(_MONITOR),
    "tensorboard": _NoEffect(_MONITOR),
    "wandb": _NoEffect(_MONITOR),
    "csv_monitor": _NoEffect(_MONITOR),
    "comet": _NoEffect(_MONITOR),
    "comms_logger": _NoEffect(_MONITOR),
    "timers": _NoEffect(_MONITOR),
    "disable_allgather": _NoEffect(_FSDP),
    "seq_parallel_communication_data_type": _NoEffect("sequence parallelism is not part of lightning_ampzero"),
    "sequence_parallel_size": _NoEffect("sequence parallelism is not part of lightning_ampzero"),
    "tensor_parallel": _NoEffect("tensor parallelism is not part of lightning_ampzero"),
    "pipeline": _NoEffect("pipeline parallelism is not part of lightning_ampzero"),
    "elasticity": _NoEffect("elastic training is Lightning's/TorchElastic's job"),
    "autotuning": _NoEffect("there is no autotuner here; see the memory estimator"),
    "checkpoint": _NoEffect("checkpoints are sharded torch.distributed.checkpoint directories"),
    "nebula": _NoEffect("checkpoints are sharded torch.distributed.checkpoint directories"),
    "data_types": _NoEffect("gradients accumulate in the parameters' dtype"),
    "dataloader_drop_last": _NoEffect("the DataLoader is yours (drop_last=...)"),
    "data_efficiency": _NoEffect("data efficiency / curriculum learning is not part of lightning_ampzero"),
    "curriculum_learning": _NoEffect("data efficiency / curriculum learning is not part of lightning_ampzero"),
    "eigenvalue": _NoEffect("not part of lightning_ampzero"),
    "progressive_layer_drop": _NoEffect("not part of lightning_ampzero"),
    "sparse_attention": _NoEffect("not part of lightning_ampzero"),
    "compression_training": _NoEffect("not part of lightning_ampzero"),
    "quantize_training": _NoEffect("not part of lightning_ampzero"),
    "weight_quantization": _NoEffect("not part of lightning_ampzero"),
    "hybrid_engine": _NoEffect("not part of lightning_ampzero"),
    "graph_harvesting": _NoEffect("not part of lightning_ampzero"),
    "use_data_before_expert_parallelism": _NoEffect("expert parallelism is not part of lightning_ampzero"),
    "compile": _NoEffect("call torch.compile in your LightningModule"),
    "zero_allow_comm_data_type_fp32": _NoEffect("communication_data_type is honoured as given"),
}

_ZERO: dict[str, Any] = {
    "stage": "zero.stage",
    "reduce_bucket_size": "zero.reduce_bucket_size",
    "allgather_bucket_size": "zero.allgather_bucket_size",
    "stage3_prefetch_bucket_size": "zero.prefetch_bucket_size",
    "prefetch_bucket_size": "zero.prefetch_bucket_size",
    "stage3_param_persistence_threshold": "zero.param_persistence_threshold",
    "param_persistence_threshold": "zero.param_persistence_threshold",
    "zero_hpz_partition_size": "zero.hpz_partition_size",
    "offload_optimizer": _HANDLED,
    "offload_param": _HANDLED,
    "cpu_offload": _HANDLED,
    "cpu_offload_params": _HANDLED,
    "cpu_offload_use_pin_memory": _HANDLED,
    "overlap_comm": _NoEffect(_FSDP + " and always overlaps it with compute"),
    "contiguous_gradients": _NoEffect("FSDP2 reduces gradients from contiguous buffers already"),
    "reduce_scatter": _NoEffect("stages 2-3 always reduce-scatter gradients"),
    "allgather_partitions": _NoEffect("parameters are always all-gathered per communication unit"),
    "use_multi_rank_bucket_allreduce": _NoEffect(_FSDP),
    "round_robin_gradients": _NoEffect(_FSDP),
    "sub_group_size": _HANDLED,
    "stage3_max_live_parameters": _NoEffect("live parameters are bounded by the units in flight (prefetch_bucket_size)"),
    "max_live_parameters": _NoEffect("live parameters are bounded by the units in flight (prefetch_bucket_size)"),
    "stage3_max_reuse_distance": _NoEffect("stage 3 re-gathers every unit for backward (reshard_after_forward)"),
    "max_reuse_distance": _NoEffect("stage 3 re-gathers every unit for backward (reshard_after_forward)"),
    "stage3_model_persistence_threshold": _NoEffect("use param_persistence_threshold"),
    "model_persistence_threshold": _NoEffect("use param_persistence_threshold"),
    "stage3_gather_16bit_weights_on_model_save": _NoEffect(
        "checkpoints are sharded directories; consolidate one into a single file when you need it"
    ),
    "stage3_gather_fp16_weights_on_model_save": _NoEffect(
        "checkpoints are sharded directories; consolidate one into a single file when you need it"
    ),
    "gather_16bit_weights_on_model_save": _NoEffect(
        "checkpoints are sharded directories; consolidate one into a single file when you need it"
    ),
    "stage3_module_granularity_threshold": _NoEffect("units are built from reduce/allgather bucket sizes"),
    "module_granularity_threshold": _NoEffect("units are built from reduce/allgather bucket sizes"),
    "stage3_use_all_reduce_for_fetch_params": _NoEffect(_FSDP),
    "use_all_reduce_for_fetch_params": _NoEffect(_FSDP),
    "elastic_checkpoint": _NoEffect("checkpoints reshard through torch.distributed.checkpoint"),
    "load_from_fp32_weights": _NoEffect("checkpoints hold the fp32 shards"),
    "ignore_unused_parameters": _NoEffect("FSDP2 tolerates unused parameters"),
    "legacy_stage1": _NoEffect("there is one stage-1 implementation"),
    "memory_efficient_linear": _NoEffect("linear layers are torch's"),
    "override_module_apply": _NoEffect("modules are built in configure_model under the sharded context"),
    "pipeline_loading_checkpoint": _NoEffect("not part of lightning_ampzero"),
    "log_trace_cache_warnings": _NoEffect(_MONITOR),
    "zero_quantized_weights": _NoEffect("ZeRO++ quantized communication is " + _NOT_YET),
    "zero_quantized_nontrainable_weights": _NoEffect("ZeRO++ quantized communication is " + _NOT_YET),
    "zero_quantized_gradients": _NoEffect("ZeRO++ quantized communication is " + _NOT_YET),
    "zeropp_loco_param": _NoEffect("ZeRO++ quantized communication is " + _NOT_YET),
    "mics_shard_size": _NoEffect("MiCS is not part of lightning_ampzero (see hpz_partition_size)"),
    "mics_hierarchical_params_gather": _NoEffect("MiCS is not part of lightning_ampzero"),
    "cpuadam_cores_perc": _NoEffect("there is no DeepSpeed CPU Adam here"),
}

_FP16: dict[str, Any] = {
    "enabled": _HANDLED,
    "auto_cast": _HANDLED,
    "loss_scale": "precision.loss_scaler.loss_scale",
    "initial_scale_power": "precision.loss_scaler.initial_scale_power",
    "loss_scale_window": "precision.loss_scaler.loss_scale_window",
    "hysteresis": "precision.loss_scaler.hysteresis",
    "consecutive_hysteresis": "precision.loss_scaler.consecutive_hysteresis",
    "min_loss_scale": "precision.loss_scaler.min_loss_scale",
    "fp16_master_weights_and_grads": _NoEffect("parameters stay fp32 under 16-mixed (autocast)"),
    "fp16_optimizer_states": _NoEffect("optimizer states follow the parameters' dtype"),
}

_BF16: dict[str, Any] = {
    "enabled": _HANDLED,
    "check_grad_overflow": "precision.check_grad_overflow",
    "immediate_grad_update": _NoEffect("gradients are reduced in the dtype set by communication_data_type"),
    "bf16_master_weights_and_grads": _NoEffect("parameters stay fp32 under bf16-mixed (autocast)"),
    "bf16_optimizer_states": _NoEffect("optimizer states follow the parameters' dtype"),
}

_AUTOCAST = ("enabled", "dtype", "lower_precision_safe_modules")
_AMP = _NoEffect("Apex AMP is not supported: use fp16 / bf16 / torch_autocast (or Trainer precision=...)")

_OPTIMIZER_NAMES = {"adam": "Adam", "adamw": "AdamW"}
_DS_OTHER_OPTIMIZERS = ("adagrad", "lamb", "onebitadam", "zerooneadam", "onebitlamb", "muadam", "muadamw",
                        "musgd", "lion", "muon", "sgd", "cpuadam", "fusedadam")
_OPTIMIZER_PARAMS = ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction",
                     "amsgrad", "fused")
_SCHEDULER_PARAMS = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps",
                     "last_batch_iteration")
_DS_OTHER_SCHEDULERS = ("LRRangeTest", "OneCycle", "WarmupCosineLR")

_COMM_DTYPES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "bf16": "bf16", "bfp16": "bf16", "bfloat16": "bf16",
}
_AUTOCAST_DTYPES = {
    "torch.bfloat16": "bf16-mixed", "bfloat16": "bf16-mixed", "bf16": "bf16-mixed",
    "torch.float16": "16-mixed", "float16": "16-mixed", "fp16": "16-mixed", "torch.half": "16-mixed", "half": "16-mixed",
}


# ---------------------------------------------------------------------------------------
# The result
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportedDeepSpeedConfig:
    """What a DeepSpeed config converts to.

    Attributes:
        config: the strategy's typed config.
        trainer: Trainer settings the JSON carries (``gradient_clip_val``, ``gradient_clip_algorithm``,
            ``accumulate_grad_batches``); applied by :meth:`apply_to_trainer`. The precision is in
            ``config.precision.precision``.
        micro_batch_size, train_batch_size: DeepSpeed's batch sizes (the DataLoader's batch size
            is the micro-batch; checked against the world size in :meth:`apply_to_trainer`).
        optimizer, scheduler: used when the LightningModule configures no optimizer.
        no_effect: ``(key path, reason)`` for every key that changes nothing here.
        notes: ``(key path, how it is read)`` for keys whose meaning here differs from DeepSpeed's
            (the ``activation_checkpointing`` section, ``offload_param.device="nvme"``, ``msamp``).
        auto: key paths whose value was ``"auto"``.
        source: the file it came from, or ``"<dict>"``.
    """

    config: AmpZeroConfig
    trainer: Mapping[str, Any] = field(default_factory=dict)
    micro_batch_size: Optional[int] = None
    train_batch_size: Optional[int] = None
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    no_effect: tuple[tuple[str, str], ...] = ()
    auto: tuple[str, ...] = ()
    source: str = "<dict>"
    #: ``"auto"`` optimizer parameters, resolved when the optimizer is built (``lr``: the module's).
    optimizer_auto: tuple[str, ...] = ()
    notes: tuple[tuple[str, str], ...] = ()

    # ---- Lightning -----------------------------------------------------------------------
    def apply_to_trainer(self, trainer: Any) -> None:
        """Apply the Trainer-level settings (called by ``AmpZeroStrategy.setup`` before optimizers exist).

        A setting the Trainer was explicitly given differently wins, with a warning. The
        ``optimizer`` / ``scheduler`` sections are installed when the LightningModule's
        ``configure_optimizers`` is not overridden or returns None.
        """
        clip = self.trainer.get("gradient_clip_val")
        if clip is not None:
            current = getattr(trainer, "gradient_clip_val", None)
            if current is None:
                trainer.gradient_clip_val = clip
                trainer.gradient_clip_algorithm = "norm"
            elif float(current) != float(clip) or str(getattr(trainer, "gradient_clip_algorithm", "norm")) != "norm":
                _warn(f"Trainer(gradient_clip_val={current}, gradient_clip_algorithm="
                      f"{getattr(trainer, 'gradient_clip_algorithm', None)!r}) is used; the DeepSpeed config's"
                      f" gradient_clipping={clip} (by norm) is ignored.")
        accumulate = self.trainer.get("accumulate_grad_batches")
        if accumulate is not None:
            current = int(getattr(trainer, "accumulate_grad_batches", 1))
            if current == 1:
                trainer.accumulate_grad_batches = int(accumulate)
            elif current != accumulate:
                _warn(f"Trainer(accumulate_grad_batches={current}) is used; the DeepSpeed config's"
                      f" gradient_accumulation_steps={accumulate} is ignored.")
        precision = self.config.precision.precision
        trainer_precision = str(getattr(trainer, "precision", "32-true"))
        if precision is not None and trainer_precision not in ("32-true", precision):
            _warn(f"Trainer(precision={trainer_precision!r}) differs from the DeepSpeed config's precision"
                  f" ({precision!r}); the DeepSpeed config's is used.")
        self._check_batch(trainer)
        module = getattr(trainer, "lightning_module", None)
        if module is not None:
            self.install_optimizers(module)

    def _check_batch(self, trainer: Any) -> None:
        world = int(getattr(trainer, "world_size", 1) or 1)
        accumulate = int(getattr(trainer, "accumulate_grad_batches", 1))
        micro, total = self.micro_batch_size, self.train_batch_size
        if micro is not None and total is not None and micro * accumulate * world != total:
            raise DeepSpeedConfigError(
                f"DeepSpeed config {self.source}: train_batch_size={total} must equal"
                f" train_micro_batch_size_per_gpu ({micro}) x gradient accumulation ({accumulate}) x world size"
                f" ({world}) = {micro * accumulate * world}."
            )

    def install_optimizers(self, module: Any) -> None:
        """Let ``module`` fall back to the ``optimizer`` / ``scheduler`` sections (idempotent).

        Its ``configure_optimizers`` is wrapped on the instance: when the class does not override
        it, or its result is None, the sections are built (DeepSpeed's behaviour); otherwise the
        module's own optimizer wins, with a warning that the sections are ignored. Called by
        ``AmpZeroStrategy.connect`` (Lightning rejects a module without configure_optimizers
        before the strategy's setup runs).
        """
        if self.optimizer is None and self.scheduler is None:
            return
        original = module.configure_optimizers
        if getattr(original, "_ampzero_deepspeed", False):
            return
        from lightning.pytorch.utilities.model_helpers import is_overridden

        overridden = is_overridden("configure_optimizers", module)
        imported = self

        def configure_optimizers(this: Any) -> Any:
            result = original() if overridden else None
            if result is not None:
                _warn("The LightningModule configures its own optimizer; the DeepSpeed config's optimizer/scheduler"
                      " sections are ignored.")
                return result
            return imported.configure_optimizers(this, this.trainer)

        configure_optimizers._ampzero_deepspeed = True  # type: ignore[attr-defined]
        module.configure_optimizers = types.MethodType(configure_optimizers, module)

    def configure_optimizers(self, module: Any, trainer: Any = None) -> Any:
        """Build the ``optimizer`` and ``scheduler`` sections for ``module`` (Lightning's return format)."""
        opt_cfg = self.optimizer or OptimizerConfig()
        if "lr" in self.optimizer_auto:
            lr = _module_lr(module)
            if lr is None:
                raise DeepSpeedConfigError(
                    f"DeepSpeed config {self.source}: optimizer.params.lr is \"auto\", and the LightningModule has"
                    " no `lr` / `learning_rate` attribute or hyperparameter to take it from. Set a number."
                )
            opt_cfg = dataclasses.replace(opt_cfg, lr=lr)
        optimizer = build_optimizer(opt_cfg, [p for p in module.parameters() if p.requires_grad])
        if self.scheduler is None or self.scheduler.type is None:
            return optimizer
        total = None
        if trainer is not None:
            total = getattr(trainer, "estimated_stepping_batches", None)
        scheduler = build_scheduler(self.scheduler, optimizer, lr=opt_cfg.lr, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- Hydra ---------------------------------------------------------------------------
    def micro_batch(self, world_size: Optional[int]) -> Optional[int]:
        """The per-process batch size: given, or derived from train_batch_size and ``world_size``."""
        if self.micro_batch_size is not None or self.train_batch_size is None or world_size is None:
            return self.micro_batch_size
        per_step = int(self.trainer.get("accumulate_grad_batches", 1)) * world_size
        if self.train_batch_size % per_step:
            raise DeepSpeedConfigError(
                f"DeepSpeed config {self.source}: train_batch_size={self.train_batch_size} is not divisible by"
                f" gradient accumulation x world size = {per_step}."
            )
        return self.train_batch_size // per_step

    def hydra_values(self, world_size: Optional[int] = None) -> dict[str, Any]:
        """Nested values for ``ampzero-train``'s config: only what differs from the option files' defaults.

        ``world_size`` lets a config that gives only ``train_batch_size`` set ``data.batch_size``.
        """
        out: dict[str, Any] = {}
        zero = _diff(self.config.zero, ZeroConfig(stage=self.config.zero.stage))
        if zero:
            out["strategy"] = zero
        prec = _diff(self.config.precision, PrecisionConfig(precision=self.config.precision.precision))
        if prec:
            out["precision"] = prec
        # Each against what its group option (hydra_groups) sets: conf/<group>/<option>.yaml.
        cfg = self.config
        for node, value, default in (
            ("offload", cfg.offload, OffloadConfig()),
            ("activation_checkpointing", cfg.activation_checkpointing,
             ActivationCheckpointingConfig(mode=cfg.activation_checkpointing.mode)),
            ("fp8", cfg.fp8, Fp8Config(recipe=cfg.fp8.recipe) if cfg.fp8.enabled else Fp8Config.off()),
        ):
            diff = _diff(value, default)
            if diff:
                out[node] = diff
        if self.trainer:
            out["trainer"] = dict(self.trainer)
        micro = self.micro_batch(world_size)
        if micro is not None:
            out["data"] = {"batch_size": micro}
        if self.optimizer is not None:
            out["optim"] = dataclasses.asdict(self.optimizer)
            for key in self.optimizer_auto:
                out["optim"].pop(key, None)
        if self.scheduler is not None:
            out["scheduler"] = dataclasses.asdict(self.scheduler)
        return _lists(out)

    def hydra_groups(self) -> dict[str, str]:
        """Config-group choices: ``{"strategy": "zero3", "precision": "16-mixed", "activation_checkpointing": "full"}``.

        Offload is written as ``offload.*`` values over ``strategy=zero<stage>`` (explicit, rather than
        the strategy group's *_offload presets, whose other values would have to be diffed too).
        """
        cfg = self.config
        groups = {"strategy": f"zero{cfg.zero.stage}"}
        if cfg.precision.precision is not None:
            groups["precision"] = cfg.precision.precision
        if cfg.activation_checkpointing.enabled:
            groups["activation_checkpointing"] = cfg.activation_checkpointing.mode
        if cfg.fp8.enabled:
            groups["fp8"] = cfg.fp8.recipe
        return groups

    def hydra_overrides(self, world_size: Optional[int] = None) -> list[str]:
        """Command-line overrides for ``ampzero-train`` equivalent to this config."""
        out = [f"{g}={v}" for g, v in self.hydra_groups().items()]
        for path, value in _flatten(self.hydra_values(world_size)):
            out.append(f"{path}={_override_value(value)}")
        return out

    def hydra_yaml(self, name: str = "deepspeed", world_size: Optional[int] = None) -> str:
        """An ``experiment/<name>.yaml`` equivalent to this config (``ampzero-train experiment=<name>``)."""
        from omegaconf import OmegaConf

        lines = [
            "# @package _global_",
            f"# Converted from the DeepSpeed config {self.source} by `ampzero-config from-deepspeed`.",
            f"# Use: save as <config dir>/experiment/{name}.yaml and run",
            f"#   ampzero-train --config-dir <config dir> experiment={name}",
        ]
        for key, reason in self.no_effect:
            lines.append(f"# no effect: {key} ({reason})")
        for key, reason in self.notes:
            lines.append(f"# note: {key}: {reason}")
        for key in self.auto:
            lines.append(f"# \"auto\": {key} (takes the default)")
        if self.micro_batch_size is None and self.train_batch_size is not None and world_size is None:
            lines.append(f"# train_batch_size={self.train_batch_size}: set data.batch_size to it divided by"
                         " (trainer.accumulate_grad_batches x world size)")
        body: dict[str, Any] = {"defaults": [{f"override /{g}": v} for g, v in self.hydra_groups().items()]}
        body.update(self.hydra_values(world_size))
        return "\n".join(lines) + "\n" + OmegaConf.to_yaml(OmegaConf.create(body))


def _module_lr(module: Any) -> Optional[float]:
    for name in ("lr", "learning_rate"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        hparams = getattr(module, "hparams", None)
        if hparams is not None and isinstance(hparams.get(name) if hasattr(hparams, "get") else None, (int, float)):
            return float(hparams.get(name))
    return None


def _diff(cfg: Any, default: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        a, b = getattr(cfg, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(a):
            sub = _diff(a, b)
            if sub:
                out[f.name] = sub
        elif a != b:
            out[f.name] = a
    return out


def _lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    return value


def _flatten(values: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in values.items():
        path = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.extend(_flatten(v, path + "."))
        else:
            out.append((path, v))
    return out


def _override_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _env_rank() -> int:
    for key in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if key in os.environ:
            try:
                return int(os.environ[key])
            except ValueError:
                pass
    return 0


def _warn(message: str) -> None:
    if _env_rank() == 0:
        warnings.warn(message, DeepSpeedConfigWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------
# Conversion
# ---------------------------------------------------------------------------------------


def _load(config: Union[str, os.PathLike, Mapping[str, Any]]) -> tuple[dict[str, Any], str]:
    if isinstance(config, Mapping):
        return dict(config), "<dict>"
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config file {str(path)!r} does not exist.")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise DeepSpeedConfigError(f"DeepSpeed config {path}: key {k!r} appears twice.")
            out[k] = v
        return out

    try:
        data = json.loads(path.read_text(), object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        raise DeepSpeedConfigError(f"DeepSpeed config {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise DeepSpeedConfigError(f"DeepSpeed config {path} must hold a JSON object, got {type(data).__name__}.")
    return data, str(path)


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == AUTO


class _Converter:
    def __init__(self, source: str) -> None:
        self.source = source
        self.values: dict[str, Any] = {}
        self.no_effect: list[tuple[str, str]] = []
        self.auto: list[str] = []
        self.unknown: list[str] = []
        self.errors: list[str] = []
        self.optimizer: Optional[OptimizerConfig] = None
        self.optimizer_auto: list[str] = []
        self.scheduler: Optional[SchedulerConfig] = None
        self.notes: list[tuple[str, str]] = []
        self.offload_optimizer = "none"  # the offload_optimizer device (aio needs it)

    # -- helpers ---------------------------------------------------------------------------
    def section(self, data: Any, path: str) -> dict[str, Any]:
        if data is None:
            return {}
        if not isinstance(data, Mapping):
            self.errors.append(f"{path} must be a JSON object, got {data!r}.")
            return {}
        return dict(data)

    def check_keys(self, data: Mapping[str, Any], known: Iterable[str], path: str) -> None:
        known = tuple(known)
        prefix = f"{path}." if path else ""
        for key in data:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                self.unknown.append(f"{prefix}{key}{hint}")

    def walk(self, data: Mapping[str, Any], table: Mapping[str, Any], path: str) -> None:
        """Apply a key table: map targets, record no-effect keys, flag unknown ones."""
        prefix = f"{path}." if path else ""
        self.check_keys(data, table, path)
        for key, value in data.items():
            rule = table.get(key)
            if rule is None or rule == _HANDLED:
                continue
            if isinstance(rule, _NoEffect):
                if value not in (None, False, {}) and not _is_auto(value):
                    self.no_effect.append((prefix + key, rule.reason))
                continue
            self.set(rule, value, prefix + key)

    def set(self, target: str, value: Any, key: str) -> None:
        if _is_auto(value):
            self.auto.append(key)
            return
        if target in self.values and self.values[target][0] != value:
            self.errors.append(f"{key}={value!r} contradicts {self.values[target][1]}={self.values[target][0]!r}.")
            return
        self.values[target] = (value, key)

    def flag(self, section: Mapping[str, Any], path: str) -> Optional[bool]:
        """The ``enabled`` flag of a section: True, False, or None for "auto"."""
        value = section.get("enabled", False)
        if _is_auto(value):
            self.auto.append(f"{path}.enabled")
            return None
        if not isinstance(value, bool):
            self.errors.append(f"{path}.enabled must be true, false or \"auto\", got {value!r}.")
            return False
        return value

    # -- sections --------------------------------------------------------------------------
    def convert(self, data: Mapping[str, Any]) -> None:
        data = dict(data)
        if "bfloat16" in data and "bf16" in data:
            self.errors.append("bf16 and bfloat16 are the same section: give one.")
        self.walk(data, _TOP, "")
        self.zero(self.section(data.get("zero_optimization"), "zero_optimization"))
        self.precision(data)
        self.sections(data)
        self.optimizer_section(self.section(data.get("optimizer"), "optimizer"))
        self.scheduler_section(self.section(data.get("scheduler"), "scheduler"))

    def zero(self, z: dict[str, Any]) -> None:
        if not z:
            return
        self.walk(z, _ZERO, "zero_optimization")
        features.convert_offload(self, z)

    def precision(self, data: Mapping[str, Any]) -> None:
        fp16 = self.section(data.get("fp16"), "fp16")
        bf16_key = "bfloat16" if "bfloat16" in data else "bf16"
        bf16 = self.section(data.get(bf16_key), bf16_key)
        autocast = self.section(data.get("torch_autocast"), "torch_autocast")
        chosen: list[tuple[str, str]] = []
        fp16_on = self.flag(fp16, "fp16") if fp16 else False
        if fp16_on:
            self.walk(fp16, _FP16, "fp16")
            chosen.append(("16-mixed", "fp16.enabled"))
            if fp16.get("auto_cast") not in (None, False, True) and not _is_auto(fp16.get("auto_cast")):
                self.errors.append(f"fp16.auto_cast must be true or false, got {fp16['auto_cast']!r}.")
        elif fp16:
            # Like DeepSpeed, the scaler keys only count when fp16 is on. With "auto" the Trainer's
            # precision decides; non-default scaler values would then be lost: say so.
            self.check_keys(fp16, _FP16, "fp16")
            default = LossScalerConfig()
            changed = [k for k, target in _FP16.items() if isinstance(target, str) and target != _HANDLED
                       and k in fp16 and not _is_auto(fp16[k]) and fp16[k] != getattr(default, target.rsplit(".", 1)[-1])]
            if fp16_on is None and changed:
                self.no_effect.append((
                    "fp16." + "/".join(changed),
                    "fp16.enabled is \"auto\": for these loss-scaler values use precision=\"16-mixed\" and"
                    " PrecisionConfig(loss_scaler=...)",
                ))
        if bf16:
            self.walk(bf16, _BF16, bf16_key)
        self.check_keys(autocast, _AUTOCAST, "torch_autocast")
        if bf16 and self.flag(bf16, bf16_key):
            chosen.append(("bf16-mixed", f"{bf16_key}.enabled"))
        if autocast and self.flag(autocast, "torch_autocast"):
            dtype = str(autocast.get("dtype", "torch.bfloat16"))
            mapped = _AUTOCAST_DTYPES.get(dtype.lower())
            if mapped is None:
                self.errors.append(f"torch_autocast.dtype={dtype!r} is not valid. Allowed values: torch.bfloat16,"
                                   " torch.float16.")
            else:
                chosen.append((mapped, "torch_autocast.enabled"))
            modules = autocast.get("lower_precision_safe_modules")
            if modules is not None:
                if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
                    self.errors.append("torch_autocast.lower_precision_safe_modules must be a list of class names.")
                else:
                    # DeepSpeed takes import paths ("torch.nn.Linear"); the schema holds class names.
                    self.set("precision.lower_precision_safe_modules", [m.rsplit(".", 1)[-1] for m in modules],
                             "torch_autocast.lower_precision_safe_modules")
        distinct = sorted({p for p, _ in chosen})
        if len(distinct) > 1:
            self.errors.append(" and ".join(k for _, k in chosen) + " are all set: enable one precision.")
        elif distinct:
            # In the strategy's config, so it holds whatever the Trainer's precision= says.
            self.values["precision.precision"] = (distinct[0], chosen[0][1])
        comm = data.get("communication_data_type")
        if comm is not None:
            mapped = _COMM_DTYPES.get(str(comm).lower())
            if mapped is None:
                self.errors.append(f"communication_data_type={comm!r} is not valid. Allowed values: fp32, fp16, bf16.")
            else:
                self.set("precision.communication_data_type", mapped, "communication_data_type")
        amp = self.section(data.get("amp"), "amp")
        if amp.get("enabled"):
            self.no_effect.append(("amp", _AMP.reason))

    def sections(self, data: Mapping[str, Any]) -> None:
        """The feature sections (after ``zero``: ``aio`` depends on the offload device)."""
        features.convert_aio(self, self.section(data.get("aio"), "aio"))
        features.convert_activation_checkpointing(
            self, self.section(data.get("activation_checkpointing"), "activation_checkpointing"))
        features.convert_msamp(self, self.section(data.get("msamp"), "msamp"))

    def optimizer_section(self, opt: dict[str, Any]) -> None:
        if not opt:
            return
        self.check_keys(opt, ("type", "params"), "optimizer")
        name = str(opt.get("type", ""))
        params = self.section(opt.get("params"), "optimizer.params")
        self.check_keys(params, _OPTIMIZER_PARAMS, "optimizer.params")
        kind = _OPTIMIZER_NAMES.get(name.lower())
        if kind is None:
            hint = suggest(name, _OPTIMIZER_NAMES.values())
            extra = " (a DeepSpeed optimizer: configure it in your LightningModule)" if name.lower() in _DS_OTHER_OPTIMIZERS else ""
            self.errors.append(f"optimizer.type={name!r} is not supported{extra}. Allowed values: 'Adam', 'AdamW'.{hint}")
            return
        if kind == "Adam" and params.get("adam_w_mode", True) is not False:
            kind = "AdamW"  # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false.
        for key in ("torch_adam", "fused"):
            if key in params:
                self.no_effect.append((f"optimizer.params.{key}", "torch's foreach Adam(W) implementation is used"))
        if params.get("amsgrad"):
            self.errors.append("optimizer.params.amsgrad=true is not supported.")
        if params.get("bias_correction") is False:
            self.errors.append("optimizer.params.bias_correction=false is not supported (torch Adam(W) always corrects).")
        kwargs: dict[str, Any] = {"type": kind}
        for key in ("lr", "betas", "eps", "weight_decay"):
            if key not in params:
                continue
            if _is_auto(params[key]):
                self.auto.append(f"optimizer.params.{key}")
                self.optimizer_auto.append(key)
            else:
                kwargs[key] = params[key]
        try:
            self.optimizer = OptimizerConfig(**kwargs)
        except ValueError as e:
            self.errors.append(f"optimizer: {e}")

    def scheduler_section(self, sched: dict[str, Any]) -> None:
        if not sched:
            return
        self.check_keys(sched, ("type", "params"), "scheduler")
        name = str(sched.get("type", ""))
        params = self.section(sched.get("params"), "scheduler.params")
        self.check_keys(params, _SCHEDULER_PARAMS, "scheduler.params")
        if name not in SCHEDULERS:
            hint = suggest(name, SCHEDULERS)
            extra = " (a DeepSpeed scheduler: configure it in your LightningModule)" if name in _DS_OTHER_SCHEDULERS else ""
            self.errors.append(f"scheduler.type={name!r} is not supported{extra}. Allowed values: 'WarmupLR',"
                               f" 'WarmupDecayLR'.{hint}")
            return
        kwargs: dict[str, Any] = {"type": name}
        for key in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"):
            if key not in params:
                continue
            if _is_auto(params[key]):
                self.auto.append(f"scheduler.params.{key}")
                if key == "warmup_num_steps":
                    kwargs[key] = 0  # the Hugging Face meaning of "auto" here: no warmup unless configured
            else:
                kwargs[key] = params[key]
        if params.get("last_batch_iteration", -1) not in (-1, None):
            self.no_effect.append(("scheduler.params.last_batch_iteration", "resume from a checkpoint instead"))
        if name == "WarmupLR":
            kwargs.pop("total_num_steps", None)
        if "scheduler.params.warmup_max_lr" in self.auto:
            kwargs["warmup_max_lr"] = None  # "auto": the optimizer's lr
        else:
            kwargs.setdefault("warmup_max_lr", 0.001)  # DeepSpeed's default, not the optimizer's lr
        try:
            self.scheduler = SchedulerConfig(**kwargs)
        except ValueError as e:
            self.errors.append(f"scheduler: {e}")

    # -- result ----------------------------------------------------------------------------
    def result(self) -> ImportedDeepSpeedConfig:
        if self.unknown:
            raise DeepSpeedConfigError(
                f"Unknown DeepSpeed config keys in {self.source}: " + "; ".join(self.unknown)
                + ". DeepSpeed would ignore them silently; fix or remove them."
            )
        nested: dict[str, Any] = {}
        trainer: dict[str, Any] = {}
        batch: dict[str, Any] = {}
        for target, (value, key) in self.values.items():
            head, _, rest = target.partition(".")
            if head == "trainer":
                trainer[rest] = (value, key)
            elif head == "batch":
                batch[rest] = (value, key)
            else:
                node = nested
                parts = target.split(".")
                for p in parts[:-1]:
                    node = node.setdefault(p, {})
                node[parts[-1]] = value
        trainer_kwargs = self._trainer(trainer)
        sizes = {}
        for name, (value, key) in batch.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                self.errors.append(f"{key} must be a positive whole number, got {value!r}.")
            else:
                sizes[name] = value
        config = None
        try:
            config = config_from_dict(AmpZeroConfig, nested)
        except (ValueError, TypeError) as e:
            self.errors.append(f"{e} (from the DeepSpeed keys {_keys_for(self.values, e)})")
        if self.errors:
            raise DeepSpeedConfigError(f"DeepSpeed config {self.source} cannot be converted: " + " ".join(self.errors))
        assert config is not None
        return ImportedDeepSpeedConfig(
            config=config, trainer=trainer_kwargs, micro_batch_size=sizes.get("micro_batch_size"),
            train_batch_size=sizes.get("train_batch_size"), optimizer=self.optimizer, scheduler=self.scheduler,
            no_effect=tuple(self.no_effect), auto=tuple(self.auto), source=self.source,
            optimizer_auto=tuple(self.optimizer_auto), notes=tuple(self.notes),
        )

    def _trainer(self, trainer: dict[str, tuple[Any, str]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if "gradient_clip_val" in trainer:
            value, key = trainer["gradient_clip_val"]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                self.errors.append(f"{key} must be a number >= 0, got {value!r}.")
            elif value > 0:
                out["gradient_clip_val"] = float(value)
                out["gradient_clip_algorithm"] = "norm"
        if "accumulate_grad_batches" in trainer:
            value, key = trainer["accumulate_grad_batches"]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                self.errors.append(f"{key} must be a whole number >= 1, got {value!r}.")
            else:
                out["accumulate_grad_batches"] = value
        return out


def _keys_for(values: Mapping[str, tuple[Any, str]], error: Exception) -> str:
    text = str(error)
    keys = [key for target, (_, key) in values.items() if target.rsplit(".", 1)[-1] in text]
    return ", ".join(keys) or "above"


def convert_deepspeed_config(
    config: Union[str, os.PathLike, Mapping[str, Any]], *, warn: bool = True
) -> ImportedDeepSpeedConfig:
    """Convert a DeepSpeed config (path to its JSON file, or a dict) to :class:`ImportedDeepSpeedConfig`.

    Raises :class:`DeepSpeedConfigError` for unknown keys (with suggestions), bad values and
    contradictions. With ``warn``, keys that have no effect here are listed in one
    :class:`DeepSpeedConfigWarning`.
    """
    data, source = _load(config)
    converter = _Converter(source)
    converter.convert(data)
    result = converter.result()
    parts = []
    if result.no_effect:
        parts.append(f"{len(result.no_effect)} key(s) have no effect with lightning_ampzero: "
                     + "; ".join(f"{k} ({r})" for k, r in result.no_effect) + ".")
    if result.notes:
        parts.append("Read differently from DeepSpeed: " + "; ".join(f"{k}: {r}" for k, r in result.notes) + ".")
    if warn and parts:
        _warn(f"DeepSpeed config {source}: " + " ".join(parts))
    return result
