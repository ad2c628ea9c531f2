"""The planner: the fastest ZeRO configuration whose memory fits (``ampzero-estimate plan``).

:func:`plan` weighs every (stage, offload, activation checkpointing) with the figures of
:mod:`lightning_ampzero.estimate`, in the order of :func:`_preference` (see its [Note: plan
order]): fewest offloads, then lowest stage, then least recompute, where stages 0-2 count as one
stage because they communicate the same bytes. On a CPU accelerator every figure is host memory
(:func:`host_on_cpu`); NVMe candidates carry the swap-file bytes per step and, given a drive
bandwidth, the seconds of I/O they cost at least.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Optional

from lightning_ampzero.config import STAGES, OffloadConfig
from lightning_ampzero.estimate import (
    CHECKPOINTING,
    OFFLOADS,
    ActivationTrace,
    Estimate,
    ModelSize,
    estimate,
    format_bytes,
    nvme_traffic,
    valid_combinations,
)

__all__ = ["ACCELERATORS", "PLAN_ORDER", "Candidate", "Plan", "host_on_cpu", "plan"]


PLAN_ORDER = ("fewest offloads (none < optimizer < params+optimizer; cpu before nvme), then lowest stage, then least"
              " recompute; stages 0-2 count as one stage there, since they move the same bytes")
_OFFLOAD_RANK = {o: i for i, o in enumerate(OFFLOADS)}


def _preference(stage: int, offload: str, checkpointing: str) -> tuple[int, int, int, int]:
    """Sort key of a candidate: smaller is faster.

    [Note: plan order] Offloads first: each one moves state over PCIe (or to disk) every step,
    which costs more than anything else here. Then communication: stages 0, 1 and 2 all move
    2Ψ elements per rank per step (all-reduce = reduce-scatter + all-gather), stage 3 moves 3Ψ
    (FACTS.md, ZeRO paper), so among stages 0-2 recompute is avoided first (a recomputed
    forward costs about a third more compute, and hides nothing) and the stage breaks ties;
    stage 3 comes after every stage 0-2 option, recompute included.
    """
    return (_OFFLOAD_RANK[offload], int(stage == 3), CHECKPOINTING.index(checkpointing), stage)


ACCELERATORS = ("gpu", "cpu")


def host_on_cpu(states: Estimate, *, gpus_per_node: int = 1, activations: int = 0) -> tuple[int, int]:
    """Host bytes (per rank, per node) of one configuration trained on ``accelerator="cpu"``.

    [Note: CPU accelerator] Without a GPU the "GPU" figures are host memory too: a rank's
    parameters, gradients, optimizer states, working set and ``activations`` share the node's RAM
    with what the offload keeps on the host. ``states`` must come from
    ``estimate(..., accelerator="cpu")``, which counts each tensor once: the gradient shard a host
    optimizer steps with is the rank's own fp32 ``.grad`` there (offload/optimizer.py ``_host_grad``
    copies nothing on CPU). Offloading to ``cpu`` frees nothing on such a machine (parameters
    "offloaded to cpu" are swapped to tmpfs, RAM as well); only NVMe does.
    benchmarks/bench_infinity.py reports this figure against the peak RSS it measures
    (results/infinity_cpu.md).
    """
    if states.accelerator != "cpu":
        raise ValueError("host_on_cpu needs an estimate made for a CPU accelerator: estimate(..., accelerator='cpu').")
    per_rank = states.gpu + activations
    node = gpus_per_node * per_rank + states.cpu
    return node // gpus_per_node, node


def _bandwidth(value: Any) -> Optional[tuple[float, float]]:
    """``None``, one bandwidth (bytes/s, read and write) or ``(read, write)``."""
    if value is None:
        return None
    pair = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(pair) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                                 and v > 0 for v in pair):
        raise ValueError(f"nvme_bandwidth must be bytes per second > 0, one figure or (read, write); got {value!r}.")
    return float(pair[0]), float(pair[1])


@dataclass(frozen=True)
class Candidate:
    """One (stage, offload, checkpointing) the planner weighed, and what it needs.

    ``gpu`` is the need per GPU (model states + activations); ``cpu`` and ``nvme`` per node. With
    ``accelerator="cpu"``, ``cpu`` is everything the node's ranks hold in host memory and
    ``host_per_rank`` one rank's share (:func:`host_on_cpu`). ``nvme_read`` / ``nvme_written``: bytes one
    rank reads from / writes to its swap files per optimizer step with one micro-batch
    (:func:`nvme_traffic`); ``*_node``: all ranks of a node, which share its drive. ``io_seconds``:
    the node's bytes over the drive's read and write bandwidth, a lower bound on the step time
    (``None`` without NVMe or without a bandwidth).
    """

    stage: int
    offload: str
    checkpointing: str
    model_states: Estimate
    activations: Optional[int]
    gpu: int
    cpu: int
    nvme: int
    fits: bool
    reasons: tuple[str, ...] = ()
    host_per_rank: Optional[int] = None
    nvme_read: int = 0
    nvme_written: int = 0
    nvme_read_node: int = 0
    nvme_written_node: int = 0
    io_seconds: Optional[float] = None

    @property
    def name(self) -> str:
        return f"stage {self.stage}, offload {self.offload}, checkpointing {self.checkpointing}"

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "model_states"}
        d["model_states"] = self.model_states.as_dict()
        d["reasons"] = list(self.reasons)
        return d


@dataclass(frozen=True)
class Plan:
    """Candidates in preference order; ``choice`` is the first that fits (``None`` if none does).

    ``gpu_budget`` is ``None`` on ``accelerator="cpu"``, where ``cpu_budget`` bounds everything.
    ``nvme_bandwidth``: (read, write) bytes per second of a node's drive, when given.
    """

    candidates: tuple[Candidate, ...]
    gpu_budget: Optional[int]
    cpu_budget: int
    nvme_budget: Optional[int]
    activations_known: bool
    accelerator: str = "gpu"
    nvme_bandwidth: Optional[tuple[float, float]] = None

    @property
    def choice(self) -> Optional[Candidate]:
        return next((c for c in self.candidates if c.fits), None)

    @property
    def rejected(self) -> list[Candidate]:
        """The faster candidates that did not fit (the ones before the choice)."""
        out = []
        for c in self.candidates:
            if c.fits:
                break
            out.append(c)
        return out

    def as_dict(self) -> dict[str, Any]:
        choice = self.choice
        return {"choice": choice.as_dict() if choice else None, "accelerator": self.accelerator,
                "gpu_budget": self.gpu_budget, "cpu_budget": self.cpu_budget, "nvme_budget": self.nvme_budget,
                "nvme_bandwidth": list(self.nvme_bandwidth) if self.nvme_bandwidth else None,
                "activations_known": self.activations_known, "order": PLAN_ORDER,
                "candidates": [c.as_dict() for c in self.candidates]}


def plan(
    size: ModelSize,
    gpu_memory: Optional[int],
    cpu_memory: int,
    *,
    nvme_memory: Optional[int] = None,
    nvme_bandwidth: Optional[Any] = None,
    accelerator: str = "gpu",
    activations: Optional[ActivationTrace] = None,
    stages: Iterable[int] = STAGES,
    offloads: Iterable[str] = OFFLOADS,
    checkpointing: Iterable[str] = CHECKPOINTING,
    gpu_headroom: float = 0.0,
    cpu_headroom: float = 0.0,
    **estimate_kwargs: Any,
) -> Plan:
    """The fastest configuration whose memory fits, with every faster one and why it was rejected.

    Budgets are bytes: ``gpu_memory`` per GPU, ``cpu_memory`` and ``nvme_memory`` per node
    (``None``: no NVMe, NVMe offload is ruled out). ``gpu_headroom`` / ``cpu_headroom`` are the
    fractions kept free (allocator fragmentation, communication buffers, the CUDA context).
    The GPU need is model states plus ``activations`` for the checkpointing setting; without an
    activation trace activations count as 0 and checkpointing choices collapse to ``none``.
    ``accelerator="cpu"`` (no GPU; ``gpu_memory`` must be ``None``): every figure is host memory
    and the node's total (:func:`host_on_cpu`) must fit ``cpu_memory``. ``nvme_bandwidth`` (bytes
    per second of a node's drive, one figure or ``(read, write)``) gives each NVMe candidate's
    ``io_seconds``: its bytes per step over it. Pass ``buffers=OffloadConfig(...)`` (to
    :func:`estimate`) to count the NVMe swap buffers in host memory.
    """
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator={accelerator!r} is not valid. Allowed values: {', '.join(ACCELERATORS)}.")
    on_cpu = accelerator == "cpu"
    if on_cpu and gpu_memory is not None:
        raise ValueError("gpu_memory does not apply with accelerator='cpu': the ranks hold everything in host memory,"
                         " which cpu_memory budgets. Pass gpu_memory=None.")
    budgets = (("cpu_memory", cpu_memory),) if on_cpu else (("gpu_memory", gpu_memory), ("cpu_memory", cpu_memory))
    for name, value in budgets:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive number of bytes, got {value!r}.")
    for name, value in (("gpu_headroom", gpu_headroom), ("cpu_headroom", cpu_headroom)):
        if not 0 <= value < 1:
            raise ValueError(f"{name} is the fraction of memory kept free, in [0, 1); got {value!r}.")
    bandwidth = _bandwidth(nvme_bandwidth)
    stages, offloads, checkpointing = tuple(stages), tuple(offloads), tuple(checkpointing)
    for c in checkpointing:
        if c not in CHECKPOINTING:
            raise ValueError(f"activation checkpointing {c!r} is not valid. Allowed values: {', '.join(CHECKPOINTING)}.")
    if activations is None:
        checkpointing = ("none",)
    gpu_budget = None if on_cpu else int(gpu_memory * (1 - gpu_headroom))
    cpu_budget = int(cpu_memory * (1 - cpu_headroom))
    per_node = estimate_kwargs.get("gpus_per_node", 1)
    combos = valid_combinations(stages, offloads)
    if not combos:
        raise ValueError(f"no valid (stage, offload) combination among stages {stages} and offloads {offloads}:"
                         " offload needs stage >= 1, parameter offload stage 3.")
    candidates = []
    states_of = {(stage, offload): estimate(size, stage, offload, accelerator=accelerator, **estimate_kwargs)
                 for stage, offload in combos}
    order = sorted(((s, o, c) for s, o in combos for c in checkpointing), key=lambda soc: _preference(*soc))
    for stage, offload, ckpt in order:
        states = states_of[(stage, offload)]
        act = activations.bytes(ckpt) if activations is not None else None
        gpu = states.gpu + (act or 0)
        cpu, host_rank = states.cpu, None
        reasons = []
        if on_cpu:
            host_rank, cpu = host_on_cpu(states, gpus_per_node=per_node, activations=act or 0)
            if cpu > cpu_budget:
                reasons.append(f"host needs {format_bytes(cpu)} per node > {format_bytes(cpu_budget)}")
        else:
            if gpu > gpu_budget:
                reasons.append(f"GPU needs {format_bytes(gpu)} > {format_bytes(gpu_budget)}")
            if cpu > cpu_budget:
                reasons.append(f"CPU needs {format_bytes(cpu)} per node > {format_bytes(cpu_budget)}")
        if states.nvme:
            if nvme_memory is None:
                reasons.append("NVMe offload needs --nvme-memory")
            elif states.nvme > nvme_memory:
                reasons.append(f"NVMe needs {format_bytes(states.nvme)} per node > {format_bytes(nvme_memory)}")
        read_node, written_node = per_node * states.nvme_read, per_node * states.nvme_written
        io_seconds = None
        if bandwidth is not None and (read_node or written_node):
            io_seconds = read_node / bandwidth[0] + written_node / bandwidth[1]
        candidates.append(Candidate(stage, offload, ckpt, states, act, gpu, cpu, states.nvme, not reasons,
                                    tuple(reasons), host_rank, states.nvme_read, states.nvme_written, read_node,
                                    written_node, io_seconds))
    return Plan(tuple(candidates), gpu_budget, cpu_budget, nvme_memory, activations is not None, accelerator, bandwidth)
