"""Where a step's time goes: rank 0 of the suite's systems under cProfile, side by side.

Runs the CPU suite's workload (``benchmarks/suite``) for each ``system:stage`` given, in the same
two processes one after the other, with Python's profiler on rank 0 over the timed steps, and
prints each one's median step and the functions whose own time differs most between the first
system and each other one (ms a step). cProfile adds its own cost to every Python call, so read
the differences, not the absolute times::

    torchrun --standalone --nproc_per_node=2 benchmarks/profile_step.py \\
        --systems fsdp2:1,ampzero:1,ddp:0,lightning_ddp:0 --precision bf16-mixed --out /tmp/prof

Each system's full statistics are kept as ``<out>/<system>_s<stage>.pstats`` (``python -m pstats``).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the suite, run from anywhere

from benchmarks.suite.configs import BenchConfig, Workload  # noqa: E402
from benchmarks.suite.meter import Meter  # noqa: E402
from benchmarks.suite.systems import RUNNERS  # noqa: E402
from benchmarks.suite.worker import _quiet  # noqa: E402


def own_times(path: Path, steps: int) -> dict[tuple[str, int, str], tuple[int, float]]:
    """(file, line, function) -> (calls, own ms a step) of one saved profile."""
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    return {(f.split("site-packages/")[-1], line, fn): (calls, own * 1000 / steps)
            for (f, line, fn), (_, calls, own, _, _) in stats.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", default="fsdp2:1,ampzero:1,ddp:0,lightning_ddp:0",
                   help="comma-separated system:stage (the first is the reference of the differences)")
    p.add_argument("--precision", default="bf16-mixed", choices=("32-true", "bf16-mixed", "bf16-true"))
    p.add_argument("--steps", type=int, default=40, help="timed steps per system")
    p.add_argument("--top", type=int, default=20, help="functions listed per comparison")
    p.add_argument("--out", default="profile_out", help="folder for the .pstats files")
    args = p.parse_args()

    torch.set_num_threads(1)  # as the suite: one thread per rank on this 2-core machine
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    rank = dist.get_rank()
    _quiet()
    workload = Workload(steps=args.steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for item in args.systems.split(","):
        system, stage = item.split(":")
        cfg = BenchConfig(system, int(stage), args.precision)
        meter = Meter(workload.total_steps, workload.accumulate)
        meter.profile_enabled = False  # torch.profiler's step would be inside cProfile's
        profiler = cProfile.Profile()
        start = meter.step_start

        def step_start(i: int, start=start, profiler=profiler) -> None:
            if i == workload.warmup:
                profiler.enable()
            start(i)

        meter.step_start = step_start  # type: ignore[method-assign]
        RUNNERS[system](cfg, workload, meter, rank)
        profiler.disable()
        path = out / f"{system}_s{stage}.pstats"
        if rank == 0:
            profiler.dump_stats(str(path))
            runs.append((f"{system} s{stage}", statistics.median(meter.step_times(workload.warmup)) * 1000, path))
        dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return
    for name, ms, _ in runs:
        print(f"{name}: median step {ms:.1f} ms over {args.steps} steps (under cProfile)")
    ref_name, _, ref_path = runs[0]
    ref = own_times(ref_path, args.steps)
    for name, _, path in runs[1:]:
        other = own_times(path, args.steps)
        print(f"\nown time, ms a step: {name} - {ref_name} (calls in brackets)")
        keys = sorted(set(ref) | set(other), key=lambda k: -abs(other.get(k, (0, 0.0))[1] - ref.get(k, (0, 0.0))[1]))
        for key in keys[:args.top]:
            (nb, b), (na, a) = ref.get(key, (0, 0.0)), other.get(key, (0, 0.0))
            print(f"{a - b:+8.3f}  {a:7.3f} ({na:5d})  {b:7.3f} ({nb:5d})  {key[2]}  {key[0][-60:]}:{key[1]}")


if __name__ == "__main__":
    main()
