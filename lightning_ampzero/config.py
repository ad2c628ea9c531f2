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
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_ampzero._schema import FromDict, check_choice, check_class_names, check_number
from lightning_ampzero.host_memory import MAX_CACHE_MB as MAX_HOST_CACHE_MB

STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class ZeroConfig(FromDict, section="zero"):
    """ZeRO partitioning on FSDP2 (see DESIGN.md for the stage table).

    Attributes:
        stage: 0 = data parallel (DDP), 1 = optimizer state sharded, 2 = + gradients, 3 = + parameters.
        reduce_bucket_size: elements per gradient communication unit. Consecutive blocks are grouped
            into one FSDP2 unit (one reduce-scatter) until the unit would exceed this; for stage 0 it
            is DDP's bucket size, except at this default, where stage 0 keeps DDP's own (25 MiB:
            :func:`stage0_bucket_mb`).
        allgather_bucket_size: elements per parameter all-gather unit (stages 1-3). The unit size
            used for grouping is ``min(reduce_bucket_size, allgather_bucket_size)``.
        prefetch_bucket_size: stage 3: elements of the following units all-gathered ahead of use
            (forward and backward explicit prefetch). 0 keeps FSDP2's implicit one-unit prefetch.
        param_persistence_threshold: stage 3: units with fewer elements than this stay gathered from
            their forward to the end of their backward (DeepSpeed's persistent parameters): small
            units cost more in latency than they save in memory.
        max_reuse_distance: stage 3: a unit stays gathered from its forward to its backward, instead of
            being freed and gathered again, when the units gathered in between (the later units'
            forwards, and the backwards of those not kept) hold fewer elements than this
            (DeepSpeed's ``stage3_max_reuse_distance``). It saves the backward all-gather of the
            last units of the forward, for their memory. 0 (the default) frees every unit after its
            forward; DeepSpeed's default, 1e9, keeps every unit of a model under about 0.5B
            parameters gathered through the step, as stage 2 holds them.
        hpz_partition_size: stage 3, ZeRO++ hpZ: after forward, keep a secondary copy of the
            parameters sharded over groups of this many ranks, so backward all-gathers stay inside
            the group (a node). 1 disables it. Must divide the world size.
        wrap_modules: class names of the modules that become communication units before bucketing.
            Empty = automatic: the repeated blocks (classes occurring at least twice inside a
            ModuleList/Sequential), e.g. transformer blocks.
        overlap_comm: stages 1-3 on gloo (CPU), with a model of several groups: leave each group's
            gradient reduce-scatter in flight while backward goes on, and (stages 1-2) all-gather
            the next group's parameters while the current one computes its forward (DeepSpeed's
            key of the same name). Gradients are final when ``backward()`` returns either way; code
            that runs *during* backward and reads another group's ``.grad`` needs ``False`` ([Note:
            reduce-scatters in flight] in lightning_ampzero/zero/comm.py). Stage 0 (DDP's buckets)
            and CUDA (FSDP2's streams) always overlap: ``False`` there has no effect, with a warning.
        find_unused_parameters: stage 0 (DDP): look, after each backward, for parameters it gave no
            gradient, so that DDP does not wait for them. ``None`` = under manual optimization only
            (a GAN backpropagates through one network at a time), as stages 1-3 (FSDP2) allow
            without asking. ``False`` saves DDP's extra walk of the graph when every backward reaches
            every parameter (DDP's "find_unused_parameters=True was specified ... but did not find
            any unused parameters" warning asks for it); ``True`` for automatic optimization of a
            model whose loss leaves some parameters out. Set only with stage 0.
        timeout_s: process-group timeout in seconds.
        watchdog_s: seconds a rank may go without progress before the hang detector ends the run on
            every live rank, naming the ranks that are missing and where ([Note: hang detection] in
            lightning_ampzero/watchdog.py); 0 turns it off; ``None`` = 300, or half of ``timeout_s``
            when that is shorter. Must be below ``timeout_s``.
        process_group_backend: ``None`` picks ``nccl`` on CUDA and ``gloo`` on CPU.
        host_memory_cache_mb: Linux (glibc): each training process keeps the host memory it frees
            for reuse by the next step (up to this many MiB at the top of each heap, and no block
            mapped on its own), instead of handing it back to the kernel and taking a page fault
            for every 4 KiB of it again ([Note: page faults per step] in
            lightning_ampzero/host_memory.py; stages 1-2 on the CPU benchmark about 6% faster, a
            75M-parameter GPT's stage 2 about 1.3x). The price is resident memory kept after a
            peak. 0 leaves the C library's defaults.
    """

    stage: int = 2
    reduce_bucket_size: float = 5e8
    allgather_bucket_size: float = 5e8
    prefetch_bucket_size: float = 5e7
    param_persistence_threshold: float = 1e5
    max_reuse_distance: float = 0
    hpz_partition_size: int = 1
    wrap_modules: tuple[str, ...] = ()
    overlap_comm: bool = True
    find_unused_parameters: Optional[bool] = None
    timeout_s: float = 1800.0
    watchdog_s: Optional[float] = None
    process_group_backend: Optional[str] = None
    host_memory_cache_mb: int = 1024

    def __post_init__(self) -> None:
        owner = "zero"
        if isinstance(self.stage, float) and self.stage in STAGES:  # 3.0 (a JSON number) is stage 3, an int
            object.__setattr__(self, "stage", int(self.stage))
        if self.stage not in STAGES or isinstance(self.stage, bool):
            raise ValueError(
                f"zero.stage={self.stage!r} is not a ZeRO stage. Allowed values: 0 (DDP), 1 (optimizer"
                " states), 2 (+ gradients), 3 (+ parameters)."
            )
        for name in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size",
                     "param_persistence_threshold", "max_reuse_distance"):
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
        if not isinstance(self.overlap_comm, bool):
            raise ValueError(f"zero.overlap_comm must be true or false, got {self.overlap_comm!r}.")
        if self.find_unused_parameters is not None and not isinstance(self.find_unused_parameters, bool):
            raise ValueError(f"zero.find_unused_parameters must be true, false or null, got"
                             f" {self.find_unused_parameters!r}.")
        if self.find_unused_parameters is not None and self.stage != 0:
            raise ValueError(
                f"zero.find_unused_parameters={self.find_unused_parameters} is a stage-0 (DDP) setting, and"
                f" zero.stage={self.stage}: stages 1-3 (FSDP2) train parameters a backward leaves out without"
                " it. Remove find_unused_parameters or set stage=0."
            )
        check_number(owner, "timeout_s", self.timeout_s, minimum=1)
        if self.watchdog_s is not None:
            check_number(owner, "watchdog_s", self.watchdog_s, minimum=0)
        if self.watchdog_s is not None and self.watchdog_s >= self.timeout_s:
            raise ValueError(
                f"zero.watchdog_s={self.watchdog_s!r} must be below zero.timeout_s={self.timeout_s!r}: past the"
                " process-group timeout the collectives fail on their own, without naming the missing rank."
                " Lower watchdog_s (0 turns the hang detector off) or raise timeout_s."
            )
        if self.process_group_backend is not None:
            check_choice(owner, "process_group_backend", self.process_group_backend, ("nccl", "gloo", "mpi"))
        check_number(owner, "host_memory_cache_mb", self.host_memory_cache_mb, minimum=0, integral=True)
        if self.host_memory_cache_mb > MAX_HOST_CACHE_MB:
            raise ValueError(f"zero.host_memory_cache_mb must be at most {MAX_HOST_CACHE_MB} (glibc takes a C int of"
                             f" bytes), got {self.host_memory_cache_mb!r}.")
        object.__setattr__(self, "wrap_modules", check_class_names(owner, "wrap_modules", self.wrap_modules))

    @property
    def watchdog_seconds(self) -> float:
        """The hang detector's time (0: off); see ``watchdog_s``."""
        return min(300.0, self.timeout_s / 2) if self.watchdog_s is None else float(self.watchdog_s)

    @property
    def unit_size(self) -> int:
        """Largest number of elements grouped into one communication unit."""
        return int(min(self.reduce_bucket_size, self.allgather_bucket_size))


#: DDP's own default bucket (``DistributedDataParallel(bucket_cap_mb=25)``).
DDP_BUCKET_MB = 25


def stage0_bucket_mb(reduce_bucket_size: float) -> float:
    """Stage 0's DDP bucket in MiB: ``reduce_bucket_size`` fp32 gradients, or DDP's 25 MiB at its default.

    The default (5e8 elements, DeepSpeed's) is for grouping FSDP2 units at stages 1-2; as DDP's bucket
    it made one bucket of any model, all-reduced only once backward ends. DDP's 25 MiB buckets start
    while backward goes on: on a 75M-parameter GPT (6 x 1024, 2 CPU ranks, bf16-mixed, a plain Trainer
    script) stage 0 took 1.01-1.07x Lightning's ddp step with one bucket, 1.00-1.01x with 25 MiB (the
    benchmarks README). A value set apart from the default is taken as given.
    """
    if reduce_bucket_size == ZeroConfig.reduce_bucket_size:
        return DDP_BUCKET_MB
    return reduce_bucket_size * 4 / 2**20  # elements of fp32 gradients


PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
COMM_DTYPES = ("fp32", "bf16", "fp16")
AT_MIN_SCALE = ("raise", "skip", "warn")
#: ``lower_precision_safe_modules=None``'s classes (DeepSpeed's torch_autocast default).
DEFAULT_SAFE_MODULES = ("Linear", "Conv1d", "Conv2d", "Conv3d")


#: The largest ``initial_scale_power`` whose scale (2**p) is a finite float32.
MAX_SCALE_POWER = 127
FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class LossScalerConfig(FromDict, section="loss_scaler"):
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
        if self.initial_scale_power > MAX_SCALE_POWER:
            # 2**128 is not a finite float32: the scaled loss would be inf on the first step, and
            # Python's float overflows past 2**1023 (a bare OverflowError in every worker).
            raise ValueError(
                f"loss_scaler.initial_scale_power={self.initial_scale_power} makes a scale of 2**"
                f"{self.initial_scale_power}, beyond float32's range: it must be <= {MAX_SCALE_POWER}"
                " (DeepSpeed's default is 16; 32 is already far above what fp16 gradients need)."
            )
        if self.loss_scale > FLOAT32_MAX:
            raise ValueError(
                f"loss_scaler.loss_scale={self.loss_scale!r} is beyond float32's range (max {FLOAT32_MAX:.4g}):"
                " use a static scale such as 2**16, or 0 for dynamic scaling."
            )
        check_number(owner, "loss_scale_window", self.loss_scale_window, minimum=1, integral=True)
        check_number(owner, "hysteresis", self.hysteresis, minimum=1, integral=True)
        check_number(owner, "min_loss_scale", self.min_loss_scale, minimum=0)
        if self.min_loss_scale <= 0:
            raise ValueError(f"loss_scaler.min_loss_scale must be > 0, got {self.min_loss_scale!r}.")
        check_choice(owner, "at_min_scale", self.at_min_scale, AT_MIN_SCALE)

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0

    def non_default(self) -> dict[str, object]:
        """The fields whose value is not the default, by name (for messages that say what was set)."""
        default = LossScalerConfig()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


@dataclass(frozen=True)
class PrecisionConfig(FromDict, section="precision"):
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
            subclasses; a name ``torch.nn`` defines names torch's class only, not peft's LoRA
            ``Linear``) whose gradients are reduced (and under stage 3 parameters all-gathered) in
            the low dtype; everything else communicates in fp32. Only valid with "-mixed".
            ``None`` (the default) is Linear and Conv1d-3d, with their gradients reduced in the low
            dtype where they cross a network (NCCL) and in fp32 on gloo, where the wire is the
            host's memory and the casts to and from the low dtype cost as much as the halved bytes
            save, or more ([Note: the safe modules' gradients on gloo] in precision/policy.py); stage 3
            still gathers their weights in the low dtype there. A list (the default's four
            included) reduces them in the low dtype on every backend; ``[]`` names none.
        communication_data_type: dtype of every gradient reduction; ``None`` = fp32 for "-mixed"
            (except the safe modules above), the compute dtype for "-true", fp32 for "32-true".
            "fp16" needs an fp16 precision (loss-scaled gradients).
    """

    precision: Optional[str] = None
    loss_scaler: LossScalerConfig = field(default_factory=LossScalerConfig)
    check_grad_overflow: bool = False
    lower_precision_safe_modules: Optional[tuple[str, ...]] = None
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
        if self.lower_precision_safe_modules is not None:
            object.__setattr__(self, "lower_precision_safe_modules", tuple(self.lower_precision_safe_modules))
        for name in self.lower_precision_safe_modules or ():
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
            changed = [f"{name}={value!r}" for name, value in self.loss_scaler.non_default().items()]
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
        if not precision.endswith("-mixed") and self.lower_precision_safe_modules:
            raise ValueError(
                f"precision.lower_precision_safe_modules={list(self.lower_precision_safe_modules)} only applies to"
                f" autocast ('16-mixed', 'bf16-mixed'), not to precision={precision!r}: under '-true' every module"
                " computes and communicates in the low dtype, under '32-true' none does. Remove the setting or choose"
                " a '-mixed' precision."
            )


FP8_RECIPES = ("tensorwise", "delayed", "rowwise")
FP8_FORMATS = ("hybrid", "e4m3")
MSAMP_LEVELS = ("none", "O1", "O2")


@dataclass(frozen=True)
class Fp8Config(FromDict, section="fp8"):
    """FP8 training of the ``nn.Linear`` layers (lightning_ampzero.fp8; user guide: docs/fp8.md).

    Creating one turns FP8 on (``AmpZeroStrategy(fp8=Fp8Config(recipe="delayed"))``);
    :meth:`off` is the disabled config that :class:`AmpZeroConfig` holds by default. FP8 runs on
    top of the Trainer's precision ("bf16-mixed" or "bf16-true" in practice): only the GEMMs of
    the converted layers change.

    Attributes:
        enabled: False = FP8 is off; nothing is converted.
        recipe: how scales are chosen. ``tensorwise``: one scale per tensor from its current amax
            (dynamic). ``delayed``: per-tensor scales from an amax history of earlier steps
            (Transformer Engine's recipe: the cast needs no extra pass over the tensor).
            ``rowwise``: one scale per row of each GEMM operand (dynamic; robust to outliers).
        format: ``hybrid`` = E4M3 for activations and weights, E5M2 for gradients (more range);
            ``e4m3`` = E4M3 everywhere. ``None`` picks ``hybrid``, or ``e4m3`` for ``rowwise``
            (CUDA's row-wise FP8 GEMM takes E4M3 operands only).
        amax_history_len: ``delayed``: number of steps whose amax the scale is taken from (max).
        margin: ``delayed``: scales are divided by ``2**margin`` (headroom for growing amax).
        reduce_amax: ``delayed``: all-reduce (MAX) the amaxes over data-parallel ranks before the
            scales are updated, so every rank uses the same scales (one collective per step).
        min_features: layers with ``min(in_features, out_features) < min_features`` stay in high
            precision: the casts around a small GEMM cost more than FP8 saves. 0 converts all.
        pad_dims: FP8 GEMMs need ``in_features`` and ``out_features`` to be multiples of 16. False
            skips other layers; True converts them, zero-padding the operands (exact, but
            the padded part is wasted work).
        skip_fqns: ``fnmatch`` patterns of module names never converted (e.g. ``"*head"``). For
            a callable, call ``convert_to_fp8(model, cfg, module_filter_fn=...)`` in
            ``configure_model``; the strategy leaves converted layers as they are.
        msamp: MS-AMP-style level. ``none``: FP8 GEMMs only. ``O1``: + weights all-gathered in FP8
            under ZeRO stages 1-3 (FSDP2 all-gather extension; half the bytes of bf16; not with
            ``zero.hpz_partition_size > 1``, which FSDP2 does not support for that extension).
            ``O2``: O1 + Adam's first moment stored in FP8 (E4M3) and second moment in fp16,
            each with a per-tensor scale (3 bytes per parameter instead of 8).
        emulate: compute the GEMMs on dequantized operands instead of ``torch._scaled_mm`` (same
            quantization, no FP8 GEMM); chosen automatically on GPUs without FP8 support.
    """

    enabled: bool = True
    recipe: str = "tensorwise"
    format: Optional[str] = None
    amax_history_len: int = 16
    margin: int = 0
    reduce_amax: bool = True
    min_features: int = 1024
    pad_dims: bool = False
    skip_fqns: tuple[str, ...] = ()
    msamp: str = "none"
    emulate: bool = False

    def __post_init__(self) -> None:
        owner = "fp8"
        for name in ("enabled", "reduce_amax", "pad_dims", "emulate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"fp8.{name} must be true or false, got {getattr(self, name)!r}.")
        check_choice(owner, "recipe", self.recipe, FP8_RECIPES)
        if self.format is not None:
            check_choice(owner, "format", self.format, FP8_FORMATS)
        check_choice(owner, "msamp", self.msamp, MSAMP_LEVELS)
        check_number(owner, "amax_history_len", self.amax_history_len, minimum=1, integral=True)
        check_number(owner, "margin", self.margin, minimum=0, integral=True)
        check_number(owner, "min_features", self.min_features, minimum=0, integral=True)
        if isinstance(self.skip_fqns, str):
            raise ValueError(f"fp8.skip_fqns must be a list of module-name patterns, got the string {self.skip_fqns!r}.")
        object.__setattr__(self, "skip_fqns", tuple(self.skip_fqns))
        for pattern in self.skip_fqns:
            if not isinstance(pattern, str) or not pattern:
                raise ValueError(f"fp8.skip_fqns must hold module-name patterns such as '*head', got {pattern!r}.")
        if self.recipe == "rowwise" and self.format == "hybrid":
            raise ValueError(
                "fp8.recipe='rowwise' with fp8.format='hybrid': CUDA's row-wise scaled GEMM takes E4M3 operands"
                " only, so gradients cannot be E5M2. Use format='e4m3' (or leave it unset), or recipe='tensorwise'"
                " / 'delayed' for E5M2 gradients."
            )
        if self.recipe == "rowwise" and self.msamp != "none":
            raise ValueError(
                f"fp8.msamp={self.msamp!r} all-gathers weights in FP8 with one scale per tensor, which"
                " recipe='rowwise' does not have (its backward needs the weight scaled along the other axis)."
                " Use recipe='tensorwise' or 'delayed' with msamp, or msamp='none' with rowwise."
            )
        if self.recipe != "delayed":
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            changed = [n for n in ("amax_history_len", "margin") if getattr(self, n) != defaults[n]]
            if changed:
                raise ValueError(
                    f"fp8.{changed[0]}={getattr(self, changed[0])!r} only applies to recipe='delayed' (an amax"
                    f" history), not to recipe={self.recipe!r}. Remove the setting or set recipe='delayed'."
                )

    @classmethod
    def off(cls) -> "Fp8Config":
        """The disabled config (AmpZeroConfig's default): no layer is converted."""
        return cls(enabled=False)

    @property
    def resolved_format(self) -> str:
        return self.format or ("e4m3" if self.recipe == "rowwise" else "hybrid")


AC_MODES = ("none", "full", "selective")


@dataclass(frozen=True)
class ActivationCheckpointingConfig(FromDict, section="activation_checkpointing"):
    """Activation checkpointing (ZeRO-R), DeepSpeed's keys where they exist (docs/activation_checkpointing.md).

    Attributes:
        mode: ``none`` (off), ``full`` (a checkpointed block keeps only its inputs; backward re-runs
            its forward) or ``selective`` (also keeps the outputs of matmuls and attention, recomputes
            the cheap ops: norms, activations, adds).
        modules: class names of the blocks to checkpoint; empty = the repeated blocks (as
            ``zero.wrap_modules``), e.g. the transformer blocks.
        every_n: checkpoint every n-th block, from the first (1 = all).
        number_checkpoints: checkpoint this many blocks, spread evenly (the first included); ``None``
            = decided by ``every_n``. Also the capacity of the contiguous buffer (as in DeepSpeed).
        cpu_checkpointing: keep the checkpoints (block inputs) in host memory until backward; on CUDA
            copied asynchronously on a side stream into pinned memory.
        contiguous_memory_optimization: copy the checkpoints into a preallocated arena that is reused
            every step instead of fresh allocations (less fragmentation).
        synchronize_checkpoint_boundary: synchronize the accelerator before and after every
            checkpointed block (debugging, timing). Host compute is synchronous: no-op on CPU.
        profile: time the forward and the recomputation of every checkpointed block
            (``strategy.activation_checkpointing.profile_summary()``; logged at teardown).
        partition_activations: DeepSpeed splits checkpoints across a tensor-parallel group. This
            strategy's mesh is pure data parallel, where it saves nothing: accepted for DeepSpeed
            configs, with a warning that says so.
    """

    mode: str = "none"
    modules: tuple[str, ...] = ()
    every_n: int = 1
    number_checkpoints: Optional[int] = None
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    partition_activations: bool = False

    def __post_init__(self) -> None:
        owner = "activation_checkpointing"
        check_choice(owner, "mode", self.mode, AC_MODES)
        flags = ("cpu_checkpointing", "contiguous_memory_optimization", "synchronize_checkpoint_boundary", "profile",
                 "partition_activations")
        for name in flags:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{owner}.{name} must be true or false, got {getattr(self, name)!r}.")
        check_number(owner, "every_n", self.every_n, minimum=1, integral=True)
        if self.number_checkpoints is not None:
            check_number(owner, "number_checkpoints", self.number_checkpoints, minimum=1, integral=True)
            if self.every_n != 1:
                raise ValueError(
                    f"{owner}.number_checkpoints={self.number_checkpoints} and {owner}.every_n={self.every_n} both"
                    " choose which blocks are checkpointed: set one of them."
                )
        object.__setattr__(self, "modules", check_class_names(owner, "modules", self.modules))
        if self.mode == "none":
            default = ActivationCheckpointingConfig.__dataclass_fields__
            changed = [n for n in (*flags, "modules", "every_n", "number_checkpoints")
                       if getattr(self, n) != default[n].default and not (n == "modules" and not self.modules)]
            if changed:
                raise ValueError(
                    f"{owner}.{changed[0]}={getattr(self, changed[0])!r} has no effect with {owner}.mode='none'"
                    " (checkpointing is off). Set mode='full' or 'selective', or remove the setting."
                )

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class CompileConfig(FromDict, section="compile"):
    """``torch.compile`` of each block, in place, before partitioning (docs/compile.md).

    Attributes:
        enabled: compile the blocks. ``AmpZeroStrategy(compile=True)`` is the shorthand.
        modules: class names of the blocks to compile; empty = the repeated blocks (as
            ``zero.wrap_modules`` and activation checkpointing find them), e.g. the transformer blocks.
        backend: ``torch.compile``'s backend (``inductor``: C++ on CPU, Triton on GPU).
        mode: ``torch.compile``'s mode (``None`` = its default).
        fullgraph: fail on a graph break instead of running the rest of the block eagerly.
        dynamic: ``torch.compile``'s ``dynamic`` (``None``: static shapes first, dynamic after a
            shape change).
    """

    enabled: bool = False
    modules: tuple[str, ...] = ()
    backend: str = "inductor"
    mode: Optional[str] = None
    fullgraph: bool = False
    dynamic: Optional[bool] = None

    def __post_init__(self) -> None:
        owner = "compile"
        for name in ("enabled", "fullgraph"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{owner}.{name} must be true or false, got {getattr(self, name)!r}.")
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise ValueError(f"{owner}.dynamic must be true, false or null, got {self.dynamic!r}.")
        check_choice(owner, "mode", self.mode, COMPILE_MODES)
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"{owner}.backend must name a torch.compile backend such as 'inductor', got"
                             f" {self.backend!r}.")
        object.__setattr__(self, "modules", check_class_names(owner, "modules", self.modules))
        if not self.enabled:
            default = CompileConfig.__dataclass_fields__
            changed = [n for n in ("modules", "backend", "mode", "fullgraph", "dynamic")
                       if getattr(self, n) != default[n].default and not (n == "modules" and not self.modules)]
            if changed:
                raise ValueError(
                    f"{owner}.{changed[0]}={getattr(self, changed[0])!r} has no effect with {owner}.enabled=false."
                    f" Set {owner}.enabled=true (AmpZeroStrategy(compile=True)), or remove the setting."
                )


OFFLOAD_DEVICES = ("none", "cpu", "nvme")
# ``cpu`` is no choice for gradients: FSDP2 already puts them in host memory with offload_param.
GRAD_OFFLOADS = ("auto", "none", "nvme")


@dataclass(frozen=True)
class OffloadConfig(FromDict, section="offload"):
    """ZeRO-Offload / ZeRO-Infinity: optimizer state and parameters off the accelerator (docs/offload.md).

    DeepSpeed's keys (``zero_optimization.offload_optimizer.*`` / ``offload_param.*`` and
    ``sub_group_size``), flattened into one object.

    Attributes:
        offload_optimizer: ``none``, ``cpu`` or ``nvme``: where the fp32 master weights and the Adam
            moments live (stages 1-3). The optimizer step runs on the host (vectorized AdamW),
            ``sub_group_size`` elements at a time.
        offload_param: ``none``, ``cpu`` or ``nvme`` (stage 3). ``cpu``: parameter shards live in host
            memory and are copied to the accelerator for each all-gather (FSDP2's CPUOffloadPolicy);
            with ``accelerator="cpu"``, where they live in host memory already, it swaps them to
            tmpfs (``/dev/shm``) as ``nvme`` does to a drive. ``nvme`` (ZeRO-Infinity): each rank's
            shards live in a swap file under ``nvme_path`` and are read back into
            ``param_buffer_count`` buffers just before their unit's all-gather
            (lightning_ampzero/offload/params.py). Both swapping forms need ``offload_optimizer``
            ``cpu`` or ``nvme``: the host step writes the updated parameters into the file.
        nvme_path: directory for ``nvme`` swap files (on a fast local drive), optimizer and
            parameters alike. ``None`` = a directory under the Trainer's ``default_root_dir`` (with a
            warning).
        pin_memory: page-locked host buffers, so host-device copies are asynchronous. Applied only
            where an accelerator exists (pinning fails on a CPU-only machine).
        buffer_count: ``nvme``: host buffers for optimizer state, each one state tensor of one tile
            (``sub_group_size`` fp32 elements). Adam needs 3 per tile (master, two moments), so
            ``buffer_count // 3`` tiles are in flight: the resident state is at most
            ``buffer_count * sub_group_size * 4`` bytes.
        sub_group_size: elements per optimizer tile: the unit of the host step and of NVMe I/O.
        io_threads: ``nvme``: background threads reading and writing tiles (each store its own).
        param_buffer_count: swapped parameters: host buffers for the shards being all-gathered or read
            ahead (DeepSpeed's ``offload_param.buffer_count``). A unit takes one buffer per
            ``param_buffer_size`` elements of its shards; parameter memory is at most
            ``param_buffer_count * param_buffer_size`` elements (each buffer no larger than the
            largest unit needs).
        param_buffer_size: swapped parameters: elements per buffer (DeepSpeed's
            ``offload_param.buffer_size``); at least the largest parameter shard of a rank.
        offload_grad: ``auto``, ``none`` or ``nvme`` (stage 3): whether each unit's reduced gradient
            shard goes to a per-rank swap file under ``nvme_path`` right after its reduce-scatter,
            instead of staying in host memory until the optimizer step (4 bytes per parameter of
            the rank's partition; lightning_ampzero/offload/grads.py). ``auto`` (the default) swaps
            them when ``offload_optimizer='nvme'`` at stage 3 and the shards are in host memory
            (``offload_param`` set, or ``accelerator="cpu"``), because that is what DeepSpeed does:
            its ZeRO-3 with ``offload_optimizer.device: nvme`` writes the fp32 gradient partitions
            into the NVMe optimizer swap files and has no key to turn that off, so a converted
            DeepSpeed config behaves alike. ``nvme`` also swaps them with ``offload_optimizer='cpu'``;
            ``none`` keeps them in memory (fewer bytes of I/O per step when memory is not the limit).
    """

    offload_optimizer: str = "none"
    offload_param: str = "none"
    nvme_path: Optional[str] = None
    pin_memory: bool = True
    buffer_count: int = 6
    sub_group_size: float = 1e8
    io_threads: int = 2
    param_buffer_count: int = 5
    param_buffer_size: float = 1e8
    offload_grad: str = "auto"

    def __post_init__(self) -> None:
        owner = "offload"
        check_choice(owner, "offload_optimizer", self.offload_optimizer, OFFLOAD_DEVICES)
        check_choice(owner, "offload_param", self.offload_param, OFFLOAD_DEVICES)
        check_choice(owner, "offload_grad", self.offload_grad, GRAD_OFFLOADS)
        if self.offload_grad == "nvme" and self.offload_optimizer == "none":
            raise ValueError(
                "offload.offload_grad='nvme' needs offload_optimizer='cpu' or 'nvme': the host optimizer step reads"
                " the swapped gradients tile by tile from their file, where a torch optimizer would read every"
                " gradient through the file's memory map at once (all of it resident again). Set offload_optimizer,"
                " or offload_grad='none'."
            )
        if self.offload_param == "nvme" and self.offload_optimizer == "none":
            raise ValueError(
                "offload.offload_param='nvme' needs offload_optimizer='cpu' or 'nvme': the host optimizer step"
                " updates the swapped parameters tile by tile, straight into their swap file, where a torch"
                " optimizer would step every parameter at once and need the whole shard in memory. Set"
                " offload_optimizer='nvme' (ZeRO-Infinity) or 'cpu'."
            )
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"offload.pin_memory must be true or false, got {self.pin_memory!r}.")
        check_number(owner, "buffer_count", self.buffer_count, minimum=3, integral=True)
        check_number(owner, "sub_group_size", self.sub_group_size, minimum=1, integral=True)
        check_number(owner, "io_threads", self.io_threads, minimum=1, integral=True)
        check_number(owner, "param_buffer_count", self.param_buffer_count, minimum=1, integral=True)
        check_number(owner, "param_buffer_size", self.param_buffer_size, minimum=1, integral=True)
        if self.offload_param == "none":
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            changed = [n for n in ("param_buffer_count", "param_buffer_size") if getattr(self, n) != defaults[n]]
            if changed:
                raise ValueError(
                    f"offload.{changed[0]}={getattr(self, changed[0])!r} is set but offload.offload_param='none':"
                    " only swapped parameters use it. Set offload_param='nvme' or remove the setting."
                )
        if self.nvme_path is not None:
            if not isinstance(self.nvme_path, (str, os.PathLike)) or not str(self.nvme_path):
                raise ValueError(f"offload.nvme_path must be a directory path, got {self.nvme_path!r}.")
            if "nvme" not in (self.offload_optimizer, self.offload_param, self.offload_grad):
                raise ValueError(
                    f"offload.nvme_path={str(self.nvme_path)!r} is set but neither offload.offload_optimizer="
                    f"{self.offload_optimizer!r} nor offload.offload_param={self.offload_param!r} (nor"
                    f" offload_grad={self.offload_grad!r}) is 'nvme': only 'nvme' uses it. Set one of them to 'nvme'"
                    " or remove nvme_path."
                )
            object.__setattr__(self, "nvme_path", str(self.nvme_path))

    @property
    def enabled(self) -> bool:
        return self.offload_optimizer != "none" or self.offload_param != "none"

    def swaps_gradients(self, *, stage: int, grads_on_host: bool) -> bool:
        """Whether stage-3 gradient shards go to a swap file (``offload_grad``, ``auto`` resolved).

        ``grads_on_host``: the reduced shards land in host memory (``offload_param`` set, or a CPU
        accelerator); on an accelerator without parameter offload they stay there, unswapped.
        """
        if stage != 3 or not grads_on_host or self.offload_optimizer == "none":
            return False
        return self.offload_grad == "nvme" or (self.offload_grad == "auto" and self.offload_optimizer == "nvme")


# DeepSpeed's top-level config sections and the AmpZeroConfig field each is read into
# (lightning_ampzero/_deepspeed maps the keys inside them).
_DEEPSPEED_SECTIONS = {
    "zero_optimization": "zero", "fp16": "precision", "bf16": "precision", "torch_autocast": "precision",
    "communication_data_type": "precision.communication_data_type", "msamp": "fp8",
    "activation_checkpointing": "activation_checkpointing", "compile": "compile", "aio": "offload",
}


@dataclass(frozen=True)
class AmpZeroConfig(FromDict):
    """Everything the strategy is configured by. Features add their own field here."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config.off)
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)

    def __getitem__(self, key: Any) -> Any:
        # Lightning's DeepSpeedStrategy.config is DeepSpeed's dict, and its users index it
        # (``config["zero_optimization"]["stage"]``); here that was a bare "not subscriptable"
        # (a new-user trial). Say where the setting lives instead.
        where = _DEEPSPEED_SECTIONS.get(key)
        hint = f" DeepSpeed's {key!r} section is read as strategy.config.{where}." if where else ""
        raise TypeError(
            f"strategy.config is an AmpZeroConfig (a dataclass), not DeepSpeed's dict: read its fields as attributes,"
            f" e.g. strategy.config.zero.stage.{hint} dataclasses.asdict(strategy.config) gives a plain dict.")

    def __post_init__(self) -> None:
        stage = self.zero.stage
        if self.offload.offload_optimizer != "none" and stage == 0:
            raise ValueError(
                f"offload.offload_optimizer={self.offload.offload_optimizer!r} needs zero.stage 1, 2 or 3 (ZeRO-Offload"
                " moves each rank's optimizer-state partition off the accelerator); stage 0 has no partition. Use"
                " stage=1 or higher."
            )
        if self.offload.offload_grad == "nvme" and stage != 3:
            raise ValueError(
                f"offload.offload_grad='nvme' needs zero.stage=3 (the gradient shards are swapped per unit after"
                f" their reduce-scatter, which stage 3 runs every micro-batch), got stage={stage}. Set stage=3, or"
                " offload_grad='auto'."
            )
        if self.offload.offload_param != "none" and stage != 3:
            raise ValueError(
                f"offload.offload_param={self.offload.offload_param!r} needs zero.stage=3 (only stage 3 partitions the"
                f" parameters), got stage={stage}. Set stage=3, or use offload_optimizer for stages 1-2."
            )
        ac = self.activation_checkpointing
        hooked = [n for n in ("cpu_checkpointing", "contiguous_memory_optimization", "profile",
                              "synchronize_checkpoint_boundary") if getattr(ac, n)]
        if self.compile.enabled and ac.enabled and hooked:
            # Measured (torch 2.13): torch.compile cannot trace the per-block Python these run (the
            # saved-tensor hooks, the clocks), so every checkpointed block would run eagerly.
            raise ValueError(
                f"compile.enabled with activation_checkpointing.{hooked[0]}=True: that option runs Python hooks around"
                " each checkpointed block that torch.compile cannot trace, so the blocks would silently stay"
                f" uncompiled. Choose one: turn off activation_checkpointing.{hooked[0]}, or compile.enabled=false."
            )
        if self.compile.enabled and self.compile.fullgraph and self.fp8.enabled and self.fp8.recipe == "delayed":
            # New-user trial: dynamo stopped at the first step ("torch.* op returned non-Tensor" in
            # fp8/scaling.py). The delayed recipe counts each Fp8Linear's forward and backward in
            # Python to run its once-per-step amax all-reduce, which a graph cannot hold.
            raise ValueError(
                "compile.fullgraph=True with fp8.recipe='delayed': the delayed recipe's per-step amax bookkeeping"
                " runs in Python at each Fp8Linear, which torch.compile cannot put in one graph, so the first step"
                " would fail. Choose one: fp8.recipe='tensorwise' or 'rowwise' (one graph per block), or"
                " compile.fullgraph=false (each block is compiled in pieces between its Fp8Linears)."
            )
        if self.fp8.enabled and self.fp8.msamp != "none" and self.zero.hpz_partition_size > 1:
            # FSDP2 (torch 2.13) cannot keep the hpZ secondary shard of a parameter that defines its
            # own all-gather (fsdp_pre_all_gather): the post-forward reshard fails on the FP8 bytes,
            # and the backward all-gather from that shard raises NotImplementedError
            # (_fsdp_param.py, all_gather_inputs). tests/test_fp8_hpz.py reproduces it on 4 ranks.
            raise ValueError(
                f"fp8.msamp={self.fp8.msamp!r} (weights all-gathered in FP8) cannot be combined with"
                f" zero.hpz_partition_size={self.zero.hpz_partition_size}: PyTorch's FSDP2 does not support its"
                " all-gather extension on the hpZ secondary partition. Choose one: hpz_partition_size=1 to keep"
                " the FP8 all-gather, or fp8.msamp='none' to keep hpZ (FP8 GEMMs stay; weights are gathered in"
                " the parameter dtype)."
            )
