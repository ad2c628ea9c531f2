"""Memory estimator and planner: will a configuration fit, and which is the fastest that does?

Three figures per configuration (ZeRO stage x offload x activation checkpointing):

* **model states per GPU** (parameters, gradients, optimizer states), in this project's FSDP2
  accounting (:func:`lightning_ampzero.memory.zero_formula`, checked against measured storages
  by the memory tests) plus the transient working set a rank holds while it computes: the
  gathered parameters of the unit in use and the one prefetched after it, and the unsharded
  gradients of a unit before its reduce-scatter (stages 2-3);
* **host memory per node** (CPU RAM) and **NVMe per node** for the offloaded states, and the
  whole-model copy each process builds on CPU before sharding when it is not built sharded;
* **activations per GPU** for a micro-batch and sequence length, measured by tracing one forward
  and backward on the meta device and counting the bytes of the tensors autograd saves for
  backward (:func:`trace_activations`).

Beside ours, :func:`deepspeed_estimate` gives DeepSpeed's own estimator figures
(``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs``, with its
GPUs-per-node, nodes, ``zero_init`` and ``additional_buffer_factor`` options), so users who know
those numbers can compare. DeepSpeed's figures assume fp16 mixed precision with Adam; ours follow
the precision and optimizer given.

:func:`lightning_ampzero.planner.plan` picks the fastest configuration that fits a GPU and CPU (and NVMe) budget, in the
order of :func:`_preference` (see its [Note: plan order]): fewest offloads, then lowest stage, then
least recompute, where stages 0-2 count as one stage because they communicate the same bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from lightning_ampzero._local import local_tensor
from lightning_ampzero.config import STAGES, OffloadConfig, ZeroConfig
from lightning_ampzero.memory import zero_formula

__all__ = [
    "CHECKPOINTING",
    "OFFLOADS",
    "OPTIMIZERS",
    "PRECISIONS",
    "ActivationTrace",
    "Estimate",
    "ModelSize",
    "deepspeed_estimate",
    "estimate",
    "estimate_all",
    "format_bytes",
    "gpt_activations",
    "gpt_size",
    "model_size",
    "nvme_buffer_bytes",
    "nvme_traffic",
    "parse_bytes",
    "parse_count",
    "trace_activations",
]

OFFLOADS = ("none", "optimizer=cpu", "optimizer=nvme", "params+optimizer=cpu", "params+optimizer=nvme")
CHECKPOINTING = ("none", "full")

# This project's layout (precision/policy.py, [Note: master weights]): in every precision the model
# holds fp32 parameters (the master, sharded at stages 1-3), gradients land in fp32 ``.grad`` and
# optimizer states are fp32. Precisions differ in the compute copy. Bytes per element of
# (the gathered / compute copy of the parameters, an unsharded gradient before its reduction):
PRECISIONS: dict[str, tuple[int, int]] = {
    "32-true": (4, 4),
    # autocast casts per op; parameters gather in fp32 (the Linear layers gather in 16 bits at
    # stage 3: counted as fp32, an upper bound) and reduce in fp32 (the Linear layers in 16 bits)
    "16-mixed": (4, 4),
    "bf16-mixed": (4, 4),
    # a 16-bit compute copy per forward (FSDP2 MixedPrecisionPolicy; stage 0: cast in forward)
    "16-true": (2, 2),
    "bf16-true": (2, 2),
}
FP32 = 4
# optimizer states per parameter
OPTIMIZERS = {"adam": 2, "adamw": 2, "sgd-momentum": 1, "sgd": 0}

GiB = 2**30


# ---------------------------------------------------------------------------------------
# Parsing what users type: "7e9", "1.3B", "80GB", "512GiB"
# ---------------------------------------------------------------------------------------

_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_BYTE_SUFFIX = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_NUMBER = r"([0-9][0-9_,]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?)"


def parse_count(value: Any, what: str = "count") -> int:
    """A whole number of elements from ``7e9``, ``1.3B``, ``350M``, ``125K``, ``7,000,000`` or a number."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a number, got {value!r}.")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        m = re.fullmatch(_NUMBER + r"\s*([A-Za-z]*)", str(value).strip())
        suffix = m.group(2).upper() if m else None
        if m is None or suffix not in _COUNT_SUFFIX:
            raise ValueError(
                f"{what}={value!r} is not a count. Write a number with an optional suffix K (10^3), M (10^6),"
                " B or G (10^9), T (10^12), e.g. 7e9, 1.3B, 350M, 125K."
            )
        number = float(m.group(1).replace("_", "").replace(",", "")) * _COUNT_SUFFIX[suffix]
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{what}={value!r} must be a finite number >= 0.")
    if abs(number - round(number)) > 1e-6 * max(1.0, number):
        raise ValueError(f"{what}={value!r} must be a whole number of elements, got {number}.")
    return int(round(number))


def parse_bytes(value: Any, what: str = "memory") -> int:
    """Bytes from ``80GB`` (10^9), ``80GiB`` (2^30), ``512 MiB``, ``1.5TB`` or a plain number of bytes."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a size, got {value!r}.")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        text = str(value).strip()
        m = re.fullmatch(_NUMBER + r"\s*([A-Za-z]*)", text)
        suffix = m.group(2).upper() if m else None
        if m is None or suffix not in _BYTE_SUFFIX:
            hint = ""
            if suffix in ("K", "M", "G", "T"):
                n = "KMGT".index(suffix) + 1
                hint = (f" ({text!r} is ambiguous: write {m.group(1)}{suffix}B for 10^{3 * n} bytes or"
                        f" {m.group(1)}{suffix}iB for 2^{10 * n}.)")
            raise ValueError(
                f"{what}={value!r} is not a size. Write a number with a unit: B, KB, MB, GB, TB (powers of 1000)"
                f" or KiB, MiB, GiB, TiB (powers of 1024), e.g. 80GB, 79.6GiB, 512GiB.{hint}"
            )
        number = float(m.group(1).replace("_", "").replace(",", "")) * _BYTE_SUFFIX[suffix]
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{what}={value!r} must be a finite size >= 0.")
    return int(number)


def format_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    if n == 0:
        return "0"
    if n >= 0.1 * GiB:
        return f"{n / GiB:,.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:,.1f} MiB"
    return f"{n / 2**10:,.1f} KiB"


def format_count(n: int) -> str:
    for div, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= div:
            return f"{n / div:.3g}{suffix}"
    return str(n)


# ---------------------------------------------------------------------------------------
# Model size: parameter count, largest layer, FSDP2 communication units
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSize:
    """What the model-state formulas need to know about a model.

    Attributes:
        numel: parameters Ψ (shared parameters counted once).
        largest_layer: parameters owned directly by the largest module (DeepSpeed's definition,
            ``sum(p.numel() for p in m.parameters(recurse=False))``): what DeepSpeed's ZeRO-3 gathers at once.
        units: elements of each FSDP2 communication unit in execution order (what our stage 3
            gathers at once), when known from a model; empty when only counts were given.
        unit: without ``units``: elements of the largest unit (e.g. a transformer block), every
            unit taken to be that large; 0 = ``largest_layer``.
        root: elements left to the root unit (gathered for the whole forward and backward).
        reduce_group: elements of the largest gradient reduction below stage 3, when known from
            a model: all of it when it fits one bucket ([Note: units below stage 3] in
            zero/units.py); 0 = the largest unit.
        description: where the numbers come from, for tables.
    """

    numel: int
    largest_layer: int
    units: tuple[int, ...] = ()
    unit: int = 0
    root: int = 0
    reduce_group: int = 0
    description: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.numel, bool) or not isinstance(self.numel, int) or self.numel < 1:
            raise ValueError(f"the parameter count must be a whole number >= 1, got {self.numel!r}.")
        if isinstance(self.largest_layer, bool) or not isinstance(self.largest_layer, int) or self.largest_layer < 1:
            raise ValueError(f"the largest layer must be a whole number of parameters >= 1, got {self.largest_layer!r}.")
        if self.largest_layer > self.numel:
            raise ValueError(
                f"the largest layer ({self.largest_layer:,} parameters) cannot exceed the whole model"
                f" ({self.numel:,} parameters)."
            )
        if self.unit < 0 or self.unit > self.numel:
            raise ValueError(f"the largest unit must be between 1 and the whole model ({self.numel:,}), got {self.unit!r}.")
        object.__setattr__(self, "units", tuple(int(u) for u in self.units))

    @property
    def largest_unit(self) -> int:
        return max(self.units) if self.units else (self.unit or self.largest_layer)


def model_size(module: nn.Module, zero: Optional[ZeroConfig] = None, description: str = "") -> ModelSize:
    """Count a model's parameters (it may live on the meta device) and find its largest layer and units.

    Units are grouped exactly as :func:`lightning_ampzero.zero.apply_zero` groups them for ``zero``
    (its ``wrap_modules`` and bucket sizes), so the stage-3 working set follows the real wrapping.
    """
    from lightning_ampzero.zero.units import one_unit_below_stage3, plan_units

    zero = zero or ZeroConfig()
    seen: dict[int, int] = {}
    for p in module.parameters():
        # meta tensors share no data pointer; the Parameter object identifies a shared weight
        seen.setdefault(id(p), p.numel())
    numel = sum(seen.values())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()), default=0)
    units = plan_units(module, zero.wrap_modules, zero.unit_size, stage=3)  # the stage-3 working set uses them
    order = {id(m): i for i, m in enumerate(module.modules())}
    units.sort(key=lambda u: order[id(u.modules[0])])
    root = numel - sum(u.numel for u in units)
    return ModelSize(numel=numel, largest_layer=max(1, largest), units=tuple(u.numel for u in units),
                     root=max(0, root), reduce_group=numel if one_unit_below_stage3(numel, zero.unit_size) else 0,
                     description=description or type(module).__name__)


def gpt_size(cfg: Any, zero: Optional[ZeroConfig] = None) -> ModelSize:
    """:func:`model_size` of :class:`lightning_ampzero.models.gpt.GPT` built on the meta device."""
    from lightning_ampzero.models.gpt import GPT, GPTConfig

    cfg = cfg if isinstance(cfg, GPTConfig) else GPTConfig.from_dict(cfg)
    with torch.device("meta"):
        model = GPT(cfg)
    desc = f"GPT(n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, n_head={cfg.n_head}, vocab={cfg.vocab_size})"
    return model_size(model, zero, desc)


# ---------------------------------------------------------------------------------------
# Model states: our FSDP2 accounting, and DeepSpeed's estimator
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """Model-state memory of one configuration (bytes).

    ``gpu_*`` are per GPU (rank); ``cpu`` and ``nvme`` per node. ``gpu_working`` is the transient
    part: gathered parameters and unsharded gradients of the units in use (stages 2-3), or DDP's
    gradient bucket copies (stage 0). ``deepspeed_gpu`` / ``deepspeed_cpu`` are DeepSpeed's
    estimator figures for the same stage and offload, ``None`` where it has none (stages 0-1, NVMe).
    ``nvme_read`` / ``nvme_written``: bytes each rank reads from / writes to its NVMe swap files per
    optimizer step with one micro-batch (:func:`nvme_traffic`). ``accelerator``: what :func:`estimate`
    was told the ranks run on ("cpu": the "GPU" figures are the ranks' host memory).
    """

    stage: int
    offload: str
    gpu_params: int
    gpu_grads: int
    gpu_optimizer: int
    gpu_working: int
    cpu: int
    nvme: int
    deepspeed_gpu: Optional[int] = None
    deepspeed_cpu: Optional[int] = None
    nvme_read: int = 0
    nvme_written: int = 0
    accelerator: str = "gpu"

    @property
    def gpu(self) -> int:
        return self.gpu_params + self.gpu_grads + self.gpu_optimizer + self.gpu_working

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gpu": self.gpu}


def _check_options(stage: int, offload: str) -> None:
    if stage not in STAGES or isinstance(stage, bool):
        raise ValueError(f"stage={stage!r} is not a ZeRO stage. Allowed values: 0, 1, 2, 3.")
    if offload not in OFFLOADS:
        raise ValueError(f"offload={offload!r} is not valid. Allowed values: {', '.join(OFFLOADS)}.")
    if offload != "none" and stage == 0:
        raise ValueError(f"offload={offload!r} needs a ZeRO stage >= 1 (stage 0 is plain DDP): the offloaded"
                         " optimizer works on a shard.")
    if offload.startswith("params") and stage != 3:
        raise ValueError(f"offload={offload!r} needs stage 3: only stage 3 shards the parameters it would offload.")


def valid_combinations(stages: Iterable[int] = STAGES, offloads: Iterable[str] = OFFLOADS) -> list[tuple[int, str]]:
    out = []
    for offload in offloads:
        for stage in stages:
            try:
                _check_options(stage, offload)
            except ValueError:
                continue
            out.append((stage, offload))
    return out


def _unit_sizes(size: ModelSize) -> tuple[int, ...]:
    """The units' elements in execution order: known from a model, or every unit ``largest_unit`` large."""
    return tuple(size.units) or (size.largest_unit,) * max(1, size.numel // max(1, size.largest_unit))


def _stage3_gathered(size: ModelSize, zero: ZeroConfig) -> int:
    """Elements of parameters a stage-3 rank holds gathered at its peak.

    The unit in use plus the units prefetched after it (FSDP2 prefetches at least one; with
    ``prefetch_bucket_size`` as many following units as fit in it, see zero/apply.py), plus the
    units kept gathered below ``param_persistence_threshold`` or for reuse (``max_reuse_distance``)
    and the root unit's own parameters.
    """
    from lightning_ampzero.zero.units import kept_for_reuse

    budget = int(zero.prefetch_bucket_size)
    units = size.units
    if not units:
        unit = size.largest_unit
        if zero.max_reuse_distance <= 0:
            ahead = max(unit, (budget // unit) * unit)
            return min(size.numel, unit + ahead)
        units = _unit_sizes(size)  # every unit that large, as above
    threshold = zero.param_persistence_threshold
    # [Note: reuse distance] in zero/units.py: the kept units are all gathered when backward starts
    # (an upper bound: the first of them to run backward is freed before the rest is gathered again)
    kept = kept_for_reuse(units, zero.max_reuse_distance, threshold)
    persistent = sum(u for u, k in zip(units, kept) if u < threshold or k) + size.root
    sharded = [u if u >= threshold and not k else 0 for u, k in zip(units, kept)]
    peak = 0
    for order in (sharded, sharded[::-1]):  # forward prefetch, then backward prefetch
        for i, u in enumerate(order):
            ahead, used = 0, 0
            for nxt in order[i + 1:]:  # as zero/apply.py's _prefetch_targets: at least one unit
                if ahead and used + nxt > budget:
                    break
                ahead, used = ahead + 1, used + nxt
            peak = max(peak, u + used)
    return min(size.numel, persistent + peak)


def offload_option(config: OffloadConfig) -> str:
    """The :data:`OFFLOADS` option a run's :class:`~lightning_ampzero.config.OffloadConfig` is (the
    inverse of what ``ampzero-estimate --plan`` prints). Parameters offloaded with the optimizer on
    another device have no option of their own: the drive, if either uses it, is the one estimated."""
    param, opt = config.offload_param, config.offload_optimizer
    if param != "none":
        return f"params+optimizer={'nvme' if 'nvme' in (param, opt) else 'cpu'}"
    return "none" if opt == "none" else f"optimizer={opt}"


def estimate(
    size: ModelSize,
    stage: int,
    offload: str = "none",
    *,
    gpus_per_node: int = 1,
    nodes: int = 1,
    precision: str = "32-true",
    optimizer: str = "adam",
    zero: Optional[ZeroConfig] = None,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
    buffers: Optional[OffloadConfig] = None,
    accelerator: str = "gpu",
) -> Estimate:
    """Model-state bytes per GPU and per node for one stage and offload option.

    Ours (``gpu_*``, ``cpu``, ``nvme``), per rank with Ψ parameters and N ranks, from
    :func:`lightning_ampzero.memory.zero_formula` in this project's layout (see :data:`PRECISIONS`:
    fp32 master parameters, fp32 gradients and states; c = bytes of the compute copy, u = of an
    unsharded gradient, S = optimizer states, 8 for Adam):

    * stage 0: 4Ψ + 4Ψ + SΨ, plus DDP's gradient buckets (4Ψ: DDP copies gradients into flat
      buckets) and, for "-true", the 16-bit copy cast in forward (cΨ);
    * stages 1-2: the gathered copy cΨ, gradients uΨ (stage 1, accumulated) or 4Ψ/N (stage 2,
      plus one unit's unsharded gradient u·U before its reduce-scatter), (S + 4)Ψ/N optimizer
      states and the fp32 shard;
    * stage 3: (4 + 4 + S)Ψ/N, plus the gathered working set c·(unit in use + prefetched units +
      persistent units) and u·U.
    * ``optimizer=cpu``: the optimizer states leave the GPU; the host holds per rank the states,
      an fp32 master copy and the fp32 gradient shard the CPU optimizer steps with
      ((S + 8)·Ψ/N: 16Ψ/N for Adam, DeepSpeed's 16). At stages 1-2 the GPU keeps the fp32
      parameter shard (4Ψ/N, the optimizer column): FSDP2 gathers from it, and the host step
      writes the updated master back into it.
    * ``params+optimizer=cpu`` (stage 3): the GPU keeps only the working set; the fp32 shard on
      the host is the master itself (DeepSpeed keeps a 16-bit shard there too: its 18).
    * ``nvme``: what ``cpu`` puts in host memory goes to NVMe, except the gradient shard;
      ``params+optimizer=nvme`` (ZeRO-Infinity) adds the parameter shard's own swap file (4Ψ/N:
      the optimizer's master copy is a separate file). ``buffers`` (the run's
      :class:`~lightning_ampzero.config.OffloadConfig`) adds the host buffers the swapping holds
      (:func:`nvme_buffer_bytes`); without it they are not counted.
    * gradients swapped (stage 3, ``params+optimizer``, ``buffers.offload_grad`` resolving to
      ``nvme``: ``auto`` with ``=nvme``, offload/grads.py): the host gradient shard (4Ψ/N) moves to
      its own swap file; the host keeps one unit's reduced shard until it is written (4·U/N) and the
      gradient tile the step reads into. Without ``buffers`` gradients are counted in host memory.
      With parameters resident on an accelerator (``optimizer=...``) the shards stay on it, unswapped.
    * ``zero_init=False``: the model is built whole on the CPU of every process before sharding
      (built in ``__init__`` rather than ``configure_model()``, where Lightning builds it on the
      device, and our stage 3 partitioned as it is built): an fp32 copy (4Ψ) per process at start-up.
      The CPU figure is the larger of that and the steady state, times GPUs per node.

    * ``accelerator="cpu"`` (no GPU; the "GPU" columns are the rank's own memory, on the host):
      the host step reads the rank's own fp32 ``.grad`` (offload/optimizer.py ``_host_grad`` copies
      nothing), so the host figure has no gradient copy ((S + 4)·Ψ/N) and the gradient shard stays
      in ``gpu_grads``, where the rank holds it. ``params+optimizer=cpu`` swaps the parameter shards to
      a file on tmpfs (offload/setup.py): host memory, counted in ``cpu`` (4Ψ/N) with the pool the
      shards are read into (``buffers``), as the run's memory report measures them.

    ``additional_buffer_factor`` only affects DeepSpeed's figures (ours are not padded).
    """
    _check_options(stage, offload)
    if accelerator not in ("gpu", "cpu"):
        raise ValueError(f"accelerator={accelerator!r} is not valid. Allowed values: gpu, cpu.")
    on_cpu = accelerator == "cpu"
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not valid. Allowed values: {', '.join(PRECISIONS)}.")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not valid. Allowed values: {', '.join(OPTIMIZERS)}.")
    for name, value in (("gpus_per_node", gpus_per_node), ("nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}.")
    zero = zero or ZeroConfig()
    copy, unsharded = PRECISIONS[precision]
    states = OPTIMIZERS[optimizer] * FP32
    psi, n_ranks = size.numel, gpus_per_node * nodes
    unit = size.largest_unit
    if stage == 0:
        base = zero_formula(psi, n_ranks, 0, state_bytes=states)
        working = FP32 * psi + (copy * psi if copy != FP32 else 0)
    elif stage in (1, 2):
        base = zero_formula(psi, n_ranks, stage, param_bytes=copy, grad_bytes=unsharded if stage == 1 else FP32,
                            state_bytes=states)
        # stage 2: the unsharded gradients of the largest reduction group, until its reduce-scatter
        working = unsharded * (size.reduce_group or unit) if stage == 2 else 0
    else:
        base = zero_formula(psi, n_ranks, 3, state_bytes=states)
        working = copy * _stage3_gathered(size, zero) + unsharded * unit

    shard = psi // n_ranks
    gpu_params, gpu_grads, gpu_opt = base.params, base.grads, base.optimizer
    # states + fp32 master (+ the fp32 gradient shard staged for the CPU step, on an accelerator)
    host = (states + (1 if on_cpu else 2) * FP32) * shard
    cpu_rank = nvme_rank = 0
    kind, _, device = offload.partition("=")
    grads = _grads_swapped(stage, offload, buffers)
    if kind != "none":
        # Stages 1-2 keep the fp32 shard FSDP2 shards the parameters into on the device (the host
        # step copies the updated master back into it); stage 3 counts it with the parameters.
        gpu_opt = FP32 * shard if stage in (1, 2) else 0
        if kind == "params+optimizer":
            # On a CPU accelerator FSDP2 has no host to move the gradient shards to: they stay the rank's.
            gpu_params, gpu_grads = 0, (base.grads if on_cpu and not grads else 0)
        if device == "cpu":
            cpu_rank = host
            if on_cpu and kind == "params+optimizer":
                # offload/setup.py: the shards' swap file on tmpfs, and the pool they are read into
                pool = nvme_buffer_bytes(size, n_ranks, buffers)[0] if buffers is not None else 0
                cpu_rank += FP32 * shard + pool
        else:
            # the gradient shard the host step reads: staged on the host from an accelerator; a CPU
            # accelerator's own (gpu_grads)
            cpu_rank, nvme_rank = (0 if on_cpu else FP32 * shard), (states + FP32) * shard
            if kind == "params+optimizer":
                nvme_rank += FP32 * shard  # offload/params.py: the fp32 shards' swap file
            if buffers is not None:
                cpu_rank += sum(nvme_buffer_bytes(size, n_ranks, buffers, params=kind == "params+optimizer",
                                                  grads=grads))
        if grads:
            # offload/grads.py: the shard to its file; one unit's reduced shard held until written
            cpu_rank += FP32 * (max(_unit_shards(size, n_ranks)) - (0 if on_cpu else shard))
            nvme_rank += FP32 * shard
            if device == "cpu" and buffers is not None:
                cpu_rank += FP32 * min(int(buffers.sub_group_size), shard)  # the step's gradient tile
    # A model built outside configure_model() (no zero_init) exists whole, in fp32, on the CPU of
    # every process before it is moved and sharded, at stage 3 too (sharded after the fact, with a
    # note: zero/materialize.py); inside configure_model() stage 3 builds it partitioned (zero/init.py).
    init_rank = 0 if zero_init else 4 * psi
    cpu = gpus_per_node * max(cpu_rank, init_rank)
    nvme = gpus_per_node * nvme_rank

    ds = deepspeed_estimate(psi, size.largest_layer, stage, offload, gpus_per_node=gpus_per_node, nodes=nodes,
                            zero_init=zero_init, additional_buffer_factor=additional_buffer_factor)
    read, written = nvme_traffic(size, offload, n_ranks, zero, grads=grads)
    return Estimate(stage, offload, gpu_params, gpu_grads, gpu_opt, working, cpu, nvme,
                    deepspeed_gpu=ds[1] if ds else None, deepspeed_cpu=ds[0] if ds else None,
                    nvme_read=read, nvme_written=written, accelerator=accelerator)


def _unit_shards(size: ModelSize, n_ranks: int) -> list[int]:
    """Elements of each stage-3 group's shard on a rank (units, then the root), ceil-divided as FSDP2 pads."""
    units = list(size.units) or [size.largest_unit] * max(1, size.numel // max(1, size.largest_unit))
    if size.units:
        units.append(size.root)
    return [-(-u // n_ranks) for u in units if u]


def nvme_buffer_bytes(size: ModelSize, n_ranks: int, offload: OffloadConfig, *, params: bool = True,
                      grads: bool = False) -> tuple[int, int]:
    """Host bytes a rank's NVMe offload holds in buffers: (parameter pool, optimizer tiles).

    Parameters (offload/params.py): ``param_buffer_count`` buffers, each as large as the largest
    group shard needs up to ``param_buffer_size`` elements, fp32. Optimizer (offload/store.py):
    ``buffer_count // 3`` slots of three fp32 tiles of ``sub_group_size`` elements, a tile no
    larger than the rank's partition; with ``grads`` (gradients swapped, offload/grads.py) one
    more fp32 tile, which the step reads each tile's gradients into.
    """
    shard = -(-size.numel // n_ranks)
    pool = 0
    if params:
        pool = offload.param_buffer_count * FP32 * min(int(offload.param_buffer_size), max(_unit_shards(size, n_ranks)))
    tiles = ((offload.buffer_count // 3) * 3 + (1 if grads else 0)) * FP32 * min(int(offload.sub_group_size), shard)
    return pool, tiles


def _grads_swapped(stage: int, offload: str, buffers: Optional[OffloadConfig]) -> bool:
    """Whether ``estimate`` counts gradient shards in a swap file ([Note: gradient swapping on FSDP2]).

    Only with parameters offloaded: ``optimizer=...`` keeps the parameters, and so the reduced
    gradient shards, on the accelerator, where they are not swapped (``offload_grad`` resolves to
    ``none`` there, or is refused when set to ``nvme``).
    """
    kind, _, device = offload.partition("=")
    if buffers is None or stage != 3 or kind != "params+optimizer":
        return False
    return buffers.offload_grad == "nvme" or (buffers.offload_grad == "auto" and device == "nvme")


def nvme_traffic(size: ModelSize, offload: str, n_ranks: int, zero: Optional[ZeroConfig] = None, *,
                 grads: bool = False) -> tuple[int, int]:
    """(bytes read, bytes written) per rank and optimizer step (one micro-batch) in NVMe swap files.

    Optimizer on NVMe: every tile's master and moments are read and written once, 12Ψ/N each way.
    Parameters on NVMe (stage 3): each group's shard is read for each all-gather, twice per step
    (forward, and the re-gather of backward) or once for groups kept gathered below
    ``param_persistence_threshold`` or for reuse (``max_reuse_distance``); the root is resharded after forward at stage 3 (zero/apply.py),
    so it is read twice. The optimizer writes the updated shard once: 4Ψ/N. With k micro-batches
    the parameter reads repeat k times. ``grads`` (gradient shards swapped, offload/grads.py): each
    unit writes its reduced shard after its reduce-scatter and the step reads it, 4Ψ/N each way
    (with k micro-batches written k times and read k - 1 more times, to accumulate); this applies
    with ``params+optimizer=cpu`` too (``offload_grad='nvme'``).
    """
    kind, _, device = offload.partition("=")
    shard = -(-size.numel // n_ranks)
    if device != "nvme":
        return (FP32 * shard, FP32 * shard) if grads else (0, 0)
    zero = zero or ZeroConfig()
    read = written = (12 + (FP32 if grads else 0)) * shard
    if kind == "params+optimizer":
        from lightning_ampzero.zero.units import kept_for_reuse

        units = _unit_sizes(size)
        kept = kept_for_reuse(units, zero.max_reuse_distance, zero.param_persistence_threshold)
        gathers = sum((1 if u < zero.param_persistence_threshold or k else 2) * -(-u // n_ranks)
                      for u, k in zip(units, kept) if u)
        if size.units and size.root:
            gathers += 2 * -(-size.root // n_ranks)
        read += FP32 * gathers
        written += FP32 * shard
    return read, written


def deepspeed_estimate(
    total_params: int,
    largest_layer_params: int,
    stage: int,
    offload: str = "none",
    *,
    gpus_per_node: int = 1,
    nodes: int = 1,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> Optional[tuple[int, int]]:
    """DeepSpeed's estimator: ``(cpu bytes per node, gpu bytes per GPU)``, or ``None`` where it has none.

    The formulas of ``deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs``
    and ``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs`` (fp16 params,
    Adam), with Ψ total parameters, L the largest layer, N GPUs in all, n GPUs per node:

    ======================  =================  ===========================================
    stage 2                 GPU                CPU
    ======================  =================  ===========================================
    none                    2Ψ + 18Ψ/N         4Ψ·n·f
    optimizer=cpu           2Ψ                 Ψ·max(4N, 16)·f
    ======================  =================  ===========================================

    ======================  =================  ==========================  ==========================
    stage 3                 GPU                CPU, zero_init              CPU, no zero_init
    ======================  =================  ==========================  ==========================
    none                    4L + 18Ψ/N         4L·n·f                      4Ψ·n·f
    optimizer=cpu           4L + 2Ψ/N          16Ψ/nodes·f                 Ψ·max(4n, 16/nodes)·f
    params+optimizer=cpu    4L                 18Ψ/nodes·f                 Ψ·max(4n, 18/nodes)·f
    ======================  =================  ==========================  ==========================

    f is ``additional_buffer_factor`` (1.5). DeepSpeed has no estimator for stages 0 and 1 or for
    NVMe offload. Its documentation still shows the older stage-2 GPU figure 4Ψ + 16Ψ/N.
    """
    _check_options(stage, offload)
    n_gpus = gpus_per_node * nodes
    psi, big, f = total_params, largest_layer_params, additional_buffer_factor
    if stage == 2 and offload in ("none", "optimizer=cpu"):
        if offload == "optimizer=cpu":
            return int(psi * max(4 * n_gpus, 16) * f), int(2 * psi)
        return int(psi * 4 * gpus_per_node * f), int(2 * psi + int(18 * psi / n_gpus))
    if stage == 3 and offload in ("none", "optimizer=cpu", "params+optimizer=cpu"):
        gpus_factor = 1 / nodes
        largest = 4 * big
        if offload == "params+optimizer=cpu":
            gpu = largest
            cpu = psi * 18 * gpus_factor * f if zero_init else psi * max(4 * gpus_per_node, 18 * gpus_factor) * f
        elif offload == "optimizer=cpu":
            gpu = largest + int(2 * psi / n_gpus)
            cpu = psi * 16 * gpus_factor * f if zero_init else psi * max(4 * gpus_per_node, 16 * gpus_factor) * f
        else:
            gpu = largest + int(18 * psi / n_gpus)
            cpu = big * 4 * gpus_per_node * f if zero_init else psi * 4 * gpus_per_node * f
        return int(cpu), int(gpu)
    return None


def estimate_all(size: ModelSize, *, stages: Iterable[int] = STAGES, offloads: Iterable[str] = OFFLOADS,
                 **kwargs: Any) -> list[Estimate]:
    """:func:`estimate` for every valid (stage, offload) combination, offloads outermost."""
    return [estimate(size, stage, offload, **kwargs) for stage, offload in valid_combinations(stages, offloads)]


# ---------------------------------------------------------------------------------------
# Activations: traced on the meta device
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ActivationTrace:
    """Bytes autograd saved for backward in one forward (parameters excluded, storages counted once).

    Attributes:
        saved: everything saved (no activation checkpointing).
        outside: saved outside the checkpointed blocks (embeddings, final norm, head, loss).
        block_inputs: the blocks' inputs, which full checkpointing keeps.
        blocks: per block, what its forward saved (recomputed, one block at a time, in backward).
    """

    saved: int
    outside: int
    block_inputs: int
    blocks: tuple[int, ...]

    def bytes(self, checkpointing: str = "none") -> int:
        """Peak saved-activation bytes per micro-batch under ``checkpointing`` (``none`` or ``full``).

        ``full`` keeps only each block's input and what lies outside the blocks, and rebuilds one
        block's saved tensors at a time in backward: outside + inputs + the largest block.
        """
        if checkpointing not in CHECKPOINTING:
            raise ValueError(f"activation checkpointing {checkpointing!r} is not valid. Allowed values:"
                             f" {', '.join(CHECKPOINTING)}.")
        if checkpointing == "none":
            return self.saved
        return self.outside + self.block_inputs + max(self.blocks, default=0)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), **{f"checkpointing={c}": self.bytes(c) for c in CHECKPOINTING}}


class _FusedAttention(torch.overrides.TorchFunctionMode):
    """Route ``F.scaled_dot_product_attention`` to a fused kernel's autograd formula.

    On the meta device SDPA falls back to the math path, which saves the (T x T) attention
    matrix; on GPUs (flash / memory-efficient) and CPUs (flash for CPU) the fused kernels save
    only q, k, v, the output and the log-sum-exp. Checked: with this the meta trace of the
    GPT equals the bytes a real CPU forward saves.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and len(args) == 3 and set(kwargs) <= {
            "attn_mask", "dropout_p", "is_causal", "scale"} and kwargs.get("attn_mask") is None:
            out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                *args, dropout_p=float(kwargs.get("dropout_p", 0.0)), is_causal=bool(kwargs.get("is_causal", False)),
                scale=kwargs.get("scale"))
            return out[0]
        return func(*args, **kwargs)


def _storage_key(t: torch.Tensor) -> int:
    return local_tensor(t).untyped_storage()._cdata  # the StorageImpl: unique per storage, meta included


def _storage_bytes(t: torch.Tensor) -> int:
    return local_tensor(t).untyped_storage().nbytes()


def trace_activations(
    model: nn.Module,
    run: Callable[[nn.Module], torch.Tensor],
    blocks: Optional[Sequence[nn.Module]] = None,
    *,
    backward: bool = True,
    fused_attention: bool = True,
) -> ActivationTrace:
    """Trace ``run(model)`` (a forward returning a scalar loss) and count what autograd saves.

    Meant for a model on the meta device (shapes and dtypes, no data, no compute), but any
    device works. ``blocks`` are the modules activation checkpointing would wrap (default: the
    repeated blocks, as the ZeRO wrap policy finds them). The backward is run too (on meta it is
    free), which checks that the traced graph is the one training differentiates.
    """
    if blocks is None:
        from lightning_ampzero.zero.units import find_blocks

        blocks = [m for _, m in find_blocks(model, ())]
    param_keys = {_storage_key(p) for p in model.parameters()} | {_storage_key(b) for b in model.buffers()}
    sizes: dict[int, int] = {}
    region_of: dict[int, set[Optional[int]]] = {}
    inputs: dict[int, int] = {}
    inputs_of: list[set[int]] = [set() for _ in blocks]
    held: list[torch.Tensor] = []  # keep storages alive so their keys are never reused
    current: list[Optional[int]] = [None]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in param_keys:
            sizes[key] = _storage_bytes(t)
            region_of.setdefault(key, set()).add(current[-1])
            held.append(t)
        return t

    def pre(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple) -> None:
            current.append(i)
            for a in args:
                if isinstance(a, torch.Tensor):
                    key = _storage_key(a)
                    inputs[key] = _storage_bytes(a)
                    inputs_of[i].add(key)
                    held.append(a)
        return hook

    def post(module: nn.Module, args: tuple, out: Any) -> None:
        current.pop()

    handles = []
    for i, b in enumerate(blocks):
        handles.append(b.register_forward_pre_hook(pre(i)))
        handles.append(b.register_forward_hook(post))
    mode = _FusedAttention() if fused_attention else None
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if mode is not None:
                with mode:
                    loss = run(model)
            else:
                loss = run(model)
        if backward:
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    outside = {k for k, regions in region_of.items() if None in regions}
    kept = outside | (set(inputs) - param_keys)
    # Recomputing block i rebuilds everything it saved except its input, which it is handed
    # (even a tensor also kept elsewhere, e.g. its output saved by the next block, is rebuilt).
    per_block = tuple(
        sum(sizes[k] for k, regions in region_of.items() if i in regions and k not in inputs_of[i])
        for i in range(len(blocks))
    )
    return ActivationTrace(
        saved=sum(sizes.values()),
        outside=sum(sizes[k] for k in outside),
        block_inputs=sum(inputs[k] for k in kept - outside),
        blocks=per_block,
    )


ACTIVATION_DTYPES = {"32-true": torch.float32, "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16,
           "16-true": torch.float16, "bf16-true": torch.bfloat16}


def gpt_activations(cfg: Any, micro_batch: int, seq_len: Optional[int] = None,
                    precision: str = "32-true") -> ActivationTrace:
    """:func:`trace_activations` of the GPT's training step (``GPTModule._loss``) on the meta device.

    Low precisions trace the model cast to the 16-bit dtype: that is exact for "-true"; under
    autocast ("-mixed") norms and softmax keep fp32 inputs, so the real figure is a little higher.
    """
    import torch.nn.functional as F

    from lightning_ampzero.models.gpt import GPT, GPTConfig

    cfg = cfg if isinstance(cfg, GPTConfig) else GPTConfig.from_dict(cfg)
    seq_len = cfg.block_size if seq_len is None else seq_len
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(f"micro_batch must be a whole number >= 1, got {micro_batch!r}.")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 1 <= seq_len <= cfg.block_size:
        raise ValueError(f"seq_len must be a whole number between 1 and the model's block_size {cfg.block_size},"
                         f" got {seq_len!r}.")
    if precision not in ACTIVATION_DTYPES:
        raise ValueError(f"precision={precision!r} is not valid. Allowed values: {', '.join(ACTIVATION_DTYPES)}.")
    with torch.device("meta"):
        model = GPT(cfg).to(ACTIVATION_DTYPES[precision])
    idx = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")
    targets = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")

    def run(m: nn.Module) -> torch.Tensor:
        logits = m(idx)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))

    return trace_activations(model, run, list(model.blocks))


_PLANNER = ("ACCELERATORS", "PLAN_ORDER", "Candidate", "Plan", "host_on_cpu", "plan")


def __getattr__(name: str) -> Any:
    # The planner lives in planner.py (this module stays under a thousand lines); its names are
    # still importable from here, lazily, because planner.py imports this module.
    if name in _PLANNER:
        from lightning_ampzero import planner

        return getattr(planner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
