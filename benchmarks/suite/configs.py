"""The workload and the configurations of the CPU suite.

Every configuration trains the same GPT (``lightning_ampzero.models.gpt``, identical init on
every rank and in every system), on the same data (``PatternData`` of tests/scripts/parity.py,
rank r reading the samples r, r+N, ... of each global batch), with the same AdamW (two
parameter groups, as ``GPTModule.configure_optimizers``), seed and global batch. Only the
system and its ZeRO stage / precision change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

SYSTEMS = ("ampzero", "fsdp2", "deepspeed", "ddp", "lightning_ddp", "ampzero_nosigterm", "ampzero_fp32reduce",
           "ampzero_reuse", "ampzero_lowwire")
#: Diagnostic variants of ampzero (systems.py): not targets, evidence for what a ratio is made of.
DIAGNOSTIC = ("ampzero_nosigterm", "ampzero_fp32reduce", "ampzero_reuse", "ampzero_lowwire")
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")

#: What each system runs for a precision (its own name for it).
PRECISION_LABELS = {
    "deepspeed": {"32-true": "fp32", "bf16-mixed": "torch_autocast bf16", "bf16-true": "bf16 mode"},
}


@dataclass(frozen=True)
class Workload:
    """Model, data and step schedule shared by every configuration of a suite.

    A step is one optimizer step: ``accumulate`` micro-batches of ``micro_batch`` sequences of
    ``seq`` tokens on each of ``world`` ranks. ``warmup`` steps are discarded, ``steps`` are
    timed, and one more step (not timed) is profiled for communication and sampled for model
    states.
    """

    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    seq: int = 128
    vocab: int = 256
    # Issue 16's targets are for stage 2 without accumulation: one micro-batch of 4 per step
    # (the global batch of 8 sequences the suite used with 2 x 2 before).
    micro_batch: int = 4
    accumulate: int = 1
    warmup: int = 2
    steps: int = 10
    world: int = 2
    lr: float = 3e-3
    # Both ZeRO implementations get the same bucket settings (their defaults, except the
    # persistence threshold: 0 keeps no stage-3 parameter gathered, so model states and
    # traffic are comparable with the ZeRO formula; DeepSpeed's and ampzero's default, 1e5,
    # would keep every unit of this small model gathered).
    reduce_bucket_size: float = 5e8
    allgather_bucket_size: float = 5e8
    prefetch_bucket_size: float = 5e7
    param_persistence_threshold: float = 0
    # ampzero's default; set in every worker for every system, since they share the processes
    # (benchmarks/suite/worker.py). 0 runs all of them with glibc's defaults.
    host_memory_cache_mb: int = 1024

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulate * self.world

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps + 1

    def gpt_config(self):  # -> GPTConfig (import kept out of the launcher process)
        from lightning_ampzero.models.gpt import GPTConfig

        return GPTConfig(vocab_size=self.vocab, block_size=self.seq, n_layer=self.n_layer, n_head=self.n_head,
                         n_embd=self.n_embd)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BenchConfig:
    """One system at one ZeRO stage and precision.

    ``offload``: "cpu" moves the optimizer step and state to host memory (ampzero
    ``offload_optimizer='cpu'``, DeepSpeed ``offload_optimizer.device='cpu'``); on a CPU-only
    machine it measures the offload code path, not a memory saving.
    """

    system: str
    stage: int
    precision: str
    offload: Optional[str] = None

    def __post_init__(self) -> None:
        if self.system not in SYSTEMS:
            raise ValueError(f"unknown system {self.system!r}; one of {', '.join(SYSTEMS)}.")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; one of {', '.join(PRECISIONS)}.")
        if self.system in ("ddp", "lightning_ddp") and self.stage != 0:
            raise ValueError(f"{self.system} is data parallel: stage 0 only, got {self.stage}.")
        if self.system == "fsdp2" and self.stage == 0:
            raise ValueError("fsdp2 covers stages 1-3 (stage 0 is DDP).")

    @property
    def name(self) -> str:
        extra = f"+offload_{self.offload}" if self.offload else ""
        return f"{self.system}/s{self.stage}/{self.precision}{extra}"

    @property
    def precision_label(self) -> str:
        return PRECISION_LABELS.get(self.system, {}).get(self.precision, self.precision)

    @classmethod
    def from_name(cls, name: str) -> "BenchConfig":
        system, stage, rest = name.split("/")
        precision, _, offload = rest.partition("+offload_")
        return cls(system, int(stage[1:]), precision, offload or None)


@dataclass(frozen=True)
class Suite:
    name: str
    workload: Workload
    configs: tuple[BenchConfig, ...]
    repetitions: int
    notes: tuple[str, ...] = field(default=())


def _core(precisions: tuple[str, ...], deepspeed_stage0: bool) -> list[BenchConfig]:
    out: list[BenchConfig] = []
    for p in precisions:
        out += [BenchConfig("ddp", 0, p), BenchConfig("ampzero", 0, p)]
        if deepspeed_stage0:
            out.append(BenchConfig("deepspeed", 0, p))
        for s in (1, 2, 3):
            out += [BenchConfig("ampzero", s, p), BenchConfig("fsdp2", s, p), BenchConfig("deepspeed", s, p)]
    return out


def full_suite() -> Suite:
    configs = _core(("32-true", "bf16-mixed"), deepspeed_stage0=False)
    # Lightning's cost, measured apart: its own ddp strategy against bare DDP, and ampzero with
    # Lightning's per-batch SIGTERM broadcast disabled (a diagnostic, see systems.py).
    configs += [BenchConfig("lightning_ddp", 0, p) for p in ("32-true", "bf16-mixed")]
    configs += [BenchConfig("ampzero_nosigterm", 2, "32-true")]
    # bf16-mixed without the lower-precision-safe modules (every gradient reduced in fp32, no
    # low-precision FSDP2 groups / DDP comm hook): what the bf16 reduction of Linear gradients costs.
    configs += [BenchConfig("ampzero_fp32reduce", s, "bf16-mixed") for s in (0, 1, 2, 3)]
    # Stage 3 with DeepSpeed's default reuse distance (1e9), which DeepSpeed runs with here: both
    # then keep this model's units gathered from forward to backward (ampzero's default frees them).
    configs += [BenchConfig("ampzero_reuse", 3, p) for p in ("32-true", "bf16-mixed")]
    # bf16-mixed with the safe modules listed: their gradients in bf16 on gloo too (DeepSpeed's
    # torch_autocast wire), where the default sends them in fp32 on gloo.
    configs += [BenchConfig("ampzero_lowwire", s, "bf16-mixed") for s in (0, 1, 2, 3)]
    # DeepSpeed's bf16 mode (bf16 parameters and gradients, fp32 master) beside ampzero's
    # equivalent, bf16-true (FSDP2 param_dtype=bf16, fp32 shards as master).
    configs += [BenchConfig("ampzero", 0, "bf16-true")]
    configs += [BenchConfig(sys_, s, "bf16-true") for s in (1, 2, 3) for sys_ in ("ampzero", "deepspeed")]
    configs += [BenchConfig(sys_, s, "32-true", "cpu") for s in (2, 3) for sys_ in ("ampzero", "deepspeed")]
    return Suite("full", Workload(), tuple(configs), repetitions=3)


def quick_suite() -> Suite:
    configs = [c for c in _core(("32-true", "bf16-mixed"), deepspeed_stage0=False)]
    configs += [BenchConfig("deepspeed", s, "bf16-true") for s in (1, 2, 3)]
    # 10 timed steps x 3 repetitions: with 5 x 2 the medians of 20-50 ms steps moved by up to 29%
    # between two launches of the same code, past the guard's 15% (benchmarks/README.md).
    workload = Workload(n_layer=2, n_embd=128, seq=64, micro_batch=4, warmup=2, steps=10)
    return Suite("quick", workload, tuple(configs), repetitions=3)


def smoke_suite() -> Suite:
    """The test's suite (tests/test_benchmarks_smoke.py): tiny, seconds per configuration."""
    configs = (BenchConfig("ddp", 0, "32-true"), BenchConfig("ampzero", 2, "32-true"),
               BenchConfig("fsdp2", 2, "32-true"), BenchConfig("deepspeed", 2, "32-true"))
    workload = Workload(n_layer=2, n_embd=64, seq=32, micro_batch=2, warmup=1, steps=3)
    return Suite("smoke", workload, configs, repetitions=1)


SUITES = {"full": full_suite, "quick": quick_suite, "smoke": smoke_suite}
