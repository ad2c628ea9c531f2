"""The one schema: typed, frozen, validated config dataclasses.

Python users (``AmpZeroStrategy(stage=3, ...)``), Hydra config groups (registered in
Hydra's ConfigStore from these classes) and the DeepSpeed JSON importer all build
these same objects, so a value is validated in exactly one place.

Sizes are counted in elements (parameters), as in DeepSpeed's config, and typed
``float`` so that ``5e8`` (how DeepSpeed users write them, and how Hydra parses a
``strategy.reduce_bucket_size=5e8`` override) is accepted; they must be whole numbers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from lightning_ampzero._schema import check_choice, check_number, config_from_dict

STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO partitioning on FSDP2 (see DESIGN.md for the stage table).

    Attributes:
        stage: 0 = data parallel (DDP), 1 = optimizer state sharded, 2 = + gradients, 3 = + parameters.
        reduce_bucket_size: elements per gradient communication unit. Consecutive blocks are grouped
            into one FSDP2 unit (one reduce-scatter) until the unit would exceed this; for stage 0 it
            is DDP's bucket size.
        allgather_bucket_size: elements per parameter all-gather unit (stages 1-3). The unit size
            used for grouping is ``min(reduce_bucket_size, allgather_bucket_size)``.
        prefetch_bucket_size: stage 3: elements of the following units all-gathered ahead of use
            (forward and backward explicit prefetch). 0 keeps FSDP2's implicit one-unit prefetch.
        param_persistence_threshold: stage 3: units with fewer elements than this stay gathered from
            their forward to the end of their backward (DeepSpeed's persistent parameters): small
            units cost more in latency than they save in memory.
        hpz_partition_size: stage 3, ZeRO++ hpZ: after forward, keep a secondary copy of the
            parameters sharded over groups of this many ranks, so backward all-gathers stay inside
            the group (a node). 1 disables it. Must divide the world size.
        wrap_modules: class names of the modules that become communication units before bucketing.
            Empty = automatic: the repeated blocks (classes occurring at least twice inside a
            ModuleList/Sequential), e.g. transformer blocks.
        timeout_s: process-group timeout in seconds.
        process_group_backend: ``None`` picks ``nccl`` on CUDA and ``gloo`` on CPU.
    """

    stage: int = 2
    reduce_bucket_size: float = 5e8
    allgather_bucket_size: float = 5e8
    prefetch_bucket_size: float = 5e7
    param_persistence_threshold: float = 1e5
    hpz_partition_size: int = 1
    wrap_modules: tuple[str, ...] = ()
    timeout_s: float = 1800.0
    process_group_backend: Optional[str] = None

    def __post_init__(self) -> None:
        owner = "zero"
        if self.stage not in STAGES or isinstance(self.stage, bool):
            raise ValueError(
                f"zero.stage={self.stage!r} is not a ZeRO stage. Allowed values: 0 (DDP), 1 (optimizer"
                " states), 2 (+ gradients), 3 (+ parameters)."
            )
        for name in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size",
                     "param_persistence_threshold"):
            check_number(owner, name, getattr(self, name), minimum=0, integral=True)
        for name in ("reduce_bucket_size", "allgather_bucket_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"zero.{name} must be at least 1 element, got {getattr(self, name)!r}.")
        check_number(owner, "hpz_partition_size", self.hpz_partition_size, minimum=1, integral=True)
        if self.hpz_partition_size > 1 and self.stage != 3:
            raise ValueError(
                f"zero.hpz_partition_size={self.hpz_partition_size} needs zero.stage=3 (it shards the"
                f" gathered parameters kept for backward), got stage={self.stage}. Set stage=3 or"
                " hpz_partition_size=1."
            )
        check_number(owner, "timeout_s", self.timeout_s, minimum=1)
        if self.process_group_backend is not None:
            check_choice(owner, "process_group_backend", self.process_group_backend, ("nccl", "gloo", "mpi"))
        # Hydra hands lists; keep the frozen config hashable.
        object.__setattr__(self, "wrap_modules", tuple(self.wrap_modules))
        for name in self.wrap_modules:
            if not isinstance(name, str) or not name:
                raise ValueError(f"zero.wrap_modules must hold class names, got {name!r}.")

    @property
    def unit_size(self) -> int:
        """Largest number of elements grouped into one communication unit."""
        return int(min(self.reduce_bucket_size, self.allgather_bucket_size))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "ZeroConfig":
        return config_from_dict(cls, data, path="zero")


PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
COMM_DTYPES = ("fp32", "bf16", "fp16")
AT_MIN_SCALE = ("raise", "skip", "warn")
_DEFAULT_SAFE_MODULES = ("Linear", "Conv1d", "Conv2d", "Conv3d")


@dataclass(frozen=True)
class LossScalerConfig:
    """DeepSpeed's fp16 loss-scaler parameters (same names, same semantics; see FACTS.md).

    Attributes:
        loss_scale: 0 = dynamic scaling; a positive value = static scale.
        initial_scale_power: the dynamic scale starts at ``2**initial_scale_power``.
        loss_scale_window: clean steps since the last overflow before the scale doubles.
        hysteresis: overflows tolerated before the scale is halved.
        consecutive_hysteresis: refill the hysteresis on every clean step, not only at growth.
        min_loss_scale: the scale never halves below this.
        at_min_scale: what an overflow at the minimum scale does: ``raise`` (DeepSpeed's behaviour,
            with a diagnosis), ``skip`` (skip the step, keep going) or ``warn`` (skip and warn).
    """

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    at_min_scale: str = "raise"

    def __post_init__(self) -> None:
        owner = "loss_scaler"
        check_number(owner, "loss_scale", self.loss_scale, minimum=0)
        check_number(owner, "initial_scale_power", self.initial_scale_power, minimum=0, integral=True)
        check_number(owner, "loss_scale_window", self.loss_scale_window, minimum=1, integral=True)
        check_number(owner, "hysteresis", self.hysteresis, minimum=1, integral=True)
        check_number(owner, "min_loss_scale", self.min_loss_scale, minimum=0)
        if self.min_loss_scale <= 0:
            raise ValueError(f"loss_scaler.min_loss_scale must be > 0, got {self.min_loss_scale!r}.")
        check_choice(owner, "at_min_scale", self.at_min_scale, AT_MIN_SCALE)

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "LossScalerConfig":
        return config_from_dict(cls, data, path="loss_scaler")


@dataclass(frozen=True)
class PrecisionConfig:
    """Numerics of the step: autocast or low-precision parameters, loss scaling, comm dtype.

    Which op runs in which dtype for each precision: docs/precision.md.

    Attributes:
        precision: a Lightning precision string, or ``None`` to take the Trainer's ``precision=``.
            When set it wins over the Trainer's: the way to get "16-mixed" on CPU, where Lightning
            rewrites the Trainer's "16-mixed" to "bf16-mixed" before any strategy sees it.
        loss_scaler: used by fp16 precisions ("16-mixed", "16-true"); configuring it for another
            precision is an error.
        check_grad_overflow: bf16 / fp32: still skip steps whose gradients are non-finite on any
            rank (one fused check, one collective). fp16 always checks.
        lower_precision_safe_modules: "-mixed": exact class names (``type(m).__name__``, no
            subclasses) whose gradients are reduced (and under stage 3 parameters all-gathered) in
            the low dtype; everything else communicates in fp32. Only valid with "-mixed".
        communication_data_type: dtype of every gradient reduction; ``None`` = fp32 for "-mixed"
            (except the safe modules above), the compute dtype for "-true", fp32 for "32-true".
            "fp16" needs an fp16 precision (loss-scaled gradients).
    """

    precision: Optional[str] = None
    loss_scaler: LossScalerConfig = field(default_factory=LossScalerConfig)
    check_grad_overflow: bool = False
    lower_precision_safe_modules: tuple[str, ...] = _DEFAULT_SAFE_MODULES
    communication_data_type: Optional[str] = None

    def __post_init__(self) -> None:
        if self.precision is not None:
            check_choice("precision", "precision", self.precision, PRECISIONS)
        if self.communication_data_type is not None:
            check_choice("precision", "communication_data_type", self.communication_data_type, COMM_DTYPES)
        if not isinstance(self.check_grad_overflow, bool):
            raise ValueError(f"precision.check_grad_overflow must be true or false, got {self.check_grad_overflow!r}.")
        if isinstance(self.lower_precision_safe_modules, str):
            raise ValueError(
                "precision.lower_precision_safe_modules must be a list of class names, got the string"
                f" {self.lower_precision_safe_modules!r}."
            )
        object.__setattr__(self, "lower_precision_safe_modules", tuple(self.lower_precision_safe_modules))
        for name in self.lower_precision_safe_modules:
            if not isinstance(name, str) or not name or "." in name:
                raise ValueError(
                    f"precision.lower_precision_safe_modules must hold class names such as 'Linear' (no module"
                    f" path), got {name!r}."
                )
        if self.precision is not None:
            self.check_combination(self.precision)

    def check_combination(self, precision: str) -> None:
        """Reject settings that contradict ``precision`` (the resolved one), naming both.

        Called here when ``precision`` is set, and by the precision plugin once the Trainer's
        precision is known.
        """
        fp16 = precision in ("16-mixed", "16-true")
        if not fp16 and self.loss_scaler != LossScalerConfig():
            changed = [f"{f.name}={getattr(self.loss_scaler, f.name)!r}" for f in dataclasses.fields(LossScalerConfig)
                       if getattr(self.loss_scaler, f.name) != getattr(LossScalerConfig(), f.name)]
            raise ValueError(
                f"precision.loss_scaler is configured ({', '.join(changed)}) but precision={precision!r} does not"
                " scale the loss: only '16-mixed' and '16-true' (float16) do. bf16 has fp32's range and needs no"
                " scaling; to still skip steps whose gradients are inf/NaN set precision.check_grad_overflow=true"
                " and remove the loss_scaler settings, or choose an fp16 precision."
            )
        if self.communication_data_type == "fp16" and not fp16:
            raise ValueError(
                f"precision.communication_data_type='fp16' with precision={precision!r}: gradients are not loss-"
                "scaled in this precision, so reducing them in float16 under- and overflows. Use 'bf16' or 'fp32',"
                " or an fp16 precision ('16-mixed', '16-true')."
            )
        if not precision.endswith("-mixed") and self.lower_precision_safe_modules != _DEFAULT_SAFE_MODULES:
            raise ValueError(
                f"precision.lower_precision_safe_modules={list(self.lower_precision_safe_modules)} only applies to"
                f" autocast ('16-mixed', 'bf16-mixed'), not to precision={precision!r}: under '-true' every module"
                " computes and communicates in the low dtype, under '32-true' none does. Remove the setting or choose"
                " a '-mixed' precision."
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "PrecisionConfig":
        return config_from_dict(cls, data, path="precision")


@dataclass(frozen=True)
class AmpZeroConfig:
    """Everything the strategy is configured by. Features add their own field here."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "AmpZeroConfig":
        return config_from_dict(cls, data)
