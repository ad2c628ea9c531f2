"""Where a training step's time goes: ``ampzero-train run.profile_steps=N``.

:class:`StepProfile` runs ``torch.profiler`` (CPU activity, FLOPs counted) over N optimizer steps
after the first few, on every rank, and splits each rank's wall time into categories by the
self time of the operators that ran on its main thread:

* ``gemm``: matrix multiplications (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_scaled_mm``),
* ``attention``: the fused attention kernels and their backward,
* ``communication``: collectives and waits on them (c10d / gloo / NCCL operators),
* ``optimizer``: everything under ``Optimizer.step`` (torch labels it),
* ``other ops``: every other operator (norms, activations, copies, the loss),
* ``outside ops``: the rest of the wall time: Python, Lightning's per-step work, idle.

With the FLOPs the profiler counts for the GEMMs, MFU factors into three measured terms: the
share of the step spent in GEMMs, the GEMMs' rate against the GEMM peak (lightning_ampzero/flops.py),
and the model FLOPs over the GEMM FLOPs. That is the account of where the FLOP utilisation goes.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from lightning.pytorch.callbacks import Callback

CATEGORIES = ("gemm", "attention", "communication", "optimizer", "other ops", "outside ops")
_GEMM = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm"}
_COMM_MARKS = ("c10d", "gloo", "nccl", "record_param_comms", "allreduce", "all_reduce", "allgather",
               "all_gather", "reduce_scatter", "_wait_tensor", "wait_tensor")


def _update_windows(events: list) -> list[tuple[int, float, float]]:
    """(thread, start, end) of each optimizer update: inside ``Optimizer.step``, after the last backward op.

    Lightning runs the closure (forward and backward) inside ``optimizer.step``, so the step's label
    covers the whole training step; its update is what follows the closure's last autograd work.
    """
    windows = []
    for step in (e for e in events if e.name.startswith("Optimizer.step")):
        lo, hi = step.time_range.start, step.time_range.end
        grads = [e.time_range.end for e in events
                 if e.thread == step.thread and lo <= e.time_range.start and e.time_range.end <= hi
                 and ("backward" in e.name.lower() or e.name.startswith("autograd::"))]
        windows.append((step.thread, max(grads, default=lo), hi))
    return windows


def _category(event: Any, windows: list[tuple[int, float, float]]) -> Optional[str]:
    """The category of one profiler event; None for labels whose self time is Python around ops."""
    name = event.name
    low = name.lower()
    if any(mark in low for mark in _COMM_MARKS):
        return "communication"
    start = event.time_range.start
    if name.startswith("Optimizer.step") or any(t == event.thread and lo <= start <= hi for t, lo, hi in windows):
        return "optimizer" if name.startswith(("aten::", "Optimizer.")) else None
    if name in _GEMM:
        return "gemm"
    if "scaled_dot_product" in name:
        return "attention"
    if name.startswith("aten::") or name.startswith("autograd::") or "Backward" in name:
        return "other ops"
    return None


def breakdown(events: Any, wall_s: float, steps: int) -> dict[str, Any]:
    """Seconds per step by category, and the FLOPs the GEMMs did per step, from profiler events."""
    events = [e for e in events if e.device_type.name == "CPU"]
    windows = _update_windows(events)
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    gemm_flops = 0.0
    for event in events:
        cat = _category(event, windows)
        if cat is None:
            continue
        seconds[cat] += event.self_cpu_time_total / 1e6
        if cat == "gemm":
            gemm_flops += event.flops or 0
    inside = sum(seconds.values())
    seconds["outside ops"] = max(0.0, wall_s - inside)
    return {"step_s": wall_s / steps, "seconds_per_step": {k: v / steps for k, v in seconds.items()},
            "gemm_flops_per_step": gemm_flops / steps}


class StepProfile(Callback):
    """Profiles optimizer steps ``[start, start + steps)`` on every rank; ``result`` on rank 0."""

    def __init__(self, steps: int, start: int = 5) -> None:
        self.steps, self.start = steps, start
        self.result: Optional[dict[str, Any]] = None
        self._prof: Any = None
        self._t0 = 0.0
        self._done = False

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        start = min(self.start, max(0, (trainer.max_steps or 0) - self.steps - 1))
        if self._prof is None and not self._done and trainer.global_step == start:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], with_flops=True)
            self._prof.__enter__()
            self._first, self._t0 = trainer.global_step, time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._prof is not None and trainer.global_step >= self._first + self.steps:
            self._finish(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._prof is not None:
            self._finish(trainer)
        from lightning_ampzero.cli.summary import _all_gather_object

        local = getattr(self, "_local", None)
        ranks = _all_gather_object(local, trainer.world_size)
        if trainer.is_global_zero and all(r is not None for r in ranks):
            self.result = {"steps": ranks[0]["steps"], "ranks": ranks}

    def _finish(self, trainer: Any) -> None:
        wall = time.perf_counter() - self._t0
        steps = trainer.global_step - self._first
        self._prof.__exit__(None, None, None)
        events = self._prof.events()
        self._prof, self._done = None, True
        self._local = {**breakdown(events, wall, max(1, steps)), "steps": steps, "rank": trainer.global_rank}


def render_profile(profile: dict[str, Any], summary: dict[str, Any], console: Any) -> None:
    """The breakdown table (mean over ranks), and MFU as the product of its measured factors."""
    from rich.table import Table

    ranks = profile["ranks"]
    n = len(ranks)
    step = sum(r["step_s"] for r in ranks) / n
    table = Table(title=f"where the step time goes ({profile['steps']} profiled steps, mean of {n} ranks)",
                  title_justify="left")
    table.add_column("category")
    table.add_column("ms / step", justify="right")
    table.add_column("share", justify="right")
    for cat in CATEGORIES:
        ms = sum(r["seconds_per_step"][cat] for r in ranks) / n
        table.add_row(cat, f"{1e3 * ms:.1f}", f"{ms / step:.1%}")
    table.add_row("step", f"{1e3 * step:.1f}", "100%")
    console.print(table)
    gemm_s = sum(r["seconds_per_step"]["gemm"] for r in ranks) / n
    gemm_flops = sum(r["gemm_flops_per_step"] for r in ranks) / n
    peak_per_rank = (summary.get("gemm_peak_flops") or 0) / max(1, summary.get("world_size", n))
    if gemm_s and gemm_flops and peak_per_rank and summary.get("model_flops_per_token") and summary.get("steps"):
        tokens_per_rank_step = summary["tokens"] / summary["steps"] / summary["world_size"]
        model_flops = summary["model_flops_per_token"] * tokens_per_rank_step
        console.print(
            f"MFU during the profiled steps = {gemm_s / step:.1%} of the step in GEMMs x"
            f" {gemm_flops / gemm_s / peak_per_rank:.1%} of the GEMM peak while in them x"
            f" {model_flops / gemm_flops:.2f} model FLOPs per GEMM FLOP"
            f" = {gemm_s / step * gemm_flops / gemm_s / peak_per_rank * model_flops / gemm_flops:.1%}"
        )
