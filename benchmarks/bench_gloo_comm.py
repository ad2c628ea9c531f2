"""Gloo's reduce-scatter and all-gather against the same collectives done by a ring of send/recv.

    python benchmarks/bench_gloo_comm.py             # 2 ranks, 0.25M-32M fp32 elements, about a minute

Per size (elements of the full, unsharded buffer) and repetition, in one launch and alternating:
gloo's ``reduce_scatter_tensor`` against lightning_ampzero's :class:`GlooReduceScatter` forced
onto its ring, ``all_gather_into_tensor`` against :class:`GlooAllGather` likewise (copies
included), and for scale gloo's all-reduce of the same buffer (what DDP runs; a ZeRO step's
reduce-scatter plus all-gather should cost about one). Median of 9 calls each, rank 0's clock
after a barrier. The crossovers set ``GLOO_REDUCE_SCATTER_MIN_NUMEL`` and
``GLOO_ALL_GATHER_MIN_NUMEL`` in lightning_ampzero/zero/comm.py. Writes
``benchmarks/results/gloo_comm.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _worker(rank: int, world: int, port: int, sizes: list[int], out: str) -> None:
    from lightning_ampzero.zero.comm import GlooAllGather, GlooReduceScatter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.group.WORLD
    forced_rs, forced_ag = GlooReduceScatter(min_numel=0), GlooAllGather(min_numel=0)
    native_rs, native_ag = GlooReduceScatter(min_numel=2**62), GlooAllGather(min_numel=2**62)
    rows = []
    for n in sizes:
        full, shard = torch.randn(n), torch.empty(n // world)
        times: dict[str, list[float]] = {"rs_native": [], "rs_ring": [], "ag_native": [], "ag_ring": [],
                                         "all_reduce": []}
        work = torch.empty_like(full)
        for _ in range(9):
            for name, call in (("rs_native", lambda: native_rs(shard, work, group, dist.ReduceOp.SUM)),
                               ("rs_ring", lambda: forced_rs(shard, work, group, dist.ReduceOp.SUM)),
                               ("ag_native", lambda: native_ag(full, full.view(world, -1)[rank], group)),
                               ("ag_ring", lambda: forced_ag(full, full.view(world, -1)[rank], group)),
                               ("all_reduce", lambda: dist.all_reduce(work, group=group))):
                work.copy_(full)  # outside the clock: the reduce-scatter may overwrite its input
                dist.barrier()
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
        rows.append({"numel": n, **{k: 1e3 * statistics.median(v) for k, v in times.items()}})
        if rank == 0:
            r = rows[-1]
            print(f"{n:>11,d}  reduce-scatter {r['rs_native']:7.1f} -> {r['rs_ring']:7.1f} ms   all-gather"
                  f" {r['ag_native']:7.1f} -> {r['ag_ring']:7.1f} ms   all-reduce {r['all_reduce']:7.1f} ms", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="250000,500000,800000,1000000,2000000,4900000,8000000,16000000,32000000")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "gloo_comm.json"
    mp.spawn(_worker, args=(2, 29000 + os.getpid() % 1000, sizes, str(raw)), nprocs=2)
    rows = json.loads(raw.read_text())
    from lightning_ampzero.zero.comm import GLOO_ALL_GATHER_MIN_NUMEL, GLOO_REDUCE_SCATTER_MIN_NUMEL

    thresholds = {"reduce_scatter": GLOO_REDUCE_SCATTER_MIN_NUMEL, "all_gather": GLOO_ALL_GATHER_MIN_NUMEL}
    raw.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
                               "thresholds": thresholds, "rows": rows}, indent=1))
    lines = [f"# gloo collectives, native against a ring of send/recv ({time.strftime('%Y-%m-%d')}, torch"
             f" {torch.__version__}, 2 ranks, fp32)", "",
             f"`python benchmarks/bench_gloo_comm.py`; ms, median of 9, the machine shared with other jobs."
             f" Thresholds in use: reduce-scatter from {GLOO_REDUCE_SCATTER_MIN_NUMEL:,}, all-gather from"
             f" {GLOO_ALL_GATHER_MIN_NUMEL:,} elements.", "",
             "| elements | reduce-scatter | ring | all-gather | ring | all-reduce (DDP) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['numel']:,} | {r['rs_native']:.1f} | {r['rs_ring']:.1f} | {r['ag_native']:.1f} |"
                     f" {r['ag_ring']:.1f} | {r['all_reduce']:.1f} |")
    (out / "gloo_comm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
