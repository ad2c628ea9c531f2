"""One repetition of a suite, in the processes ``torchrun`` starts (one per rank).

Every configuration runs in these same processes, one after the other, in the order given,
so systems compared with each other run minutes (not hours) apart under the same machine
load, and the launch cost (interpreter, imports, rendezvous: about 10 s) is paid once per
repetition, not once per configuration. Between configurations: a barrier, garbage
collection, ``malloc_trim`` and a reset of the peak-RSS counter (meter.py), and a check that
no system left a global patch behind (DeepSpeed's ZeRO-3 replaces
``torch.nn.functional.linear`` "until manually reset"; we reset it).

Usage (run.py does this)::

    torchrun --standalone --nproc_per_node=2 -m benchmarks.suite.worker --suite quick --rep 0 \
        --configs 'ampzero/s2/32-true,deepspeed/s2/32-true' --out rep0.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import shutil
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_ampzero.host_memory import keep_freed_host_memory

from .comm import parse_trace
from .configs import SUITES, BenchConfig, Workload
from .meter import Meter, release_free_memory, status_kib
from .systems import RUNNERS, deepspeed_available

_F_LINEAR = F.linear


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "DeepSpeed", "deepspeed",
                 "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)


def run_one(cfg: BenchConfig, w: Workload, rank: int, have_deepspeed: bool) -> dict:
    if cfg.system == "deepspeed" and not have_deepspeed:
        return {"skipped": "deepspeed is not installed in this interpreter (pip install '.[bench]')"}
    gc.collect()
    release_free_memory()
    F.linear = _F_LINEAR
    meter = Meter(w.total_steps, w.accumulate)
    t0 = time.perf_counter()
    info = RUNNERS[cfg.system](cfg, w, meter, rank)
    wall = time.perf_counter() - t0
    if F.linear is not _F_LINEAR:
        info["restored_patched_f_linear"] = True
        F.linear = _F_LINEAR
    comm = parse_trace(meter.trace_path) if meter.trace_path else None
    if meter.trace_path:
        keep = os.environ.get("AMPZERO_BENCH_TRACE_DIR")  # the profiled step's chrome trace, for a look
        if keep:
            os.makedirs(keep, exist_ok=True)
            shutil.move(meter.trace_path, os.path.join(keep, f"{cfg.name.replace('/', '_')}-rank{rank}.json"))
        else:
            os.unlink(meter.trace_path)
    return {
        **info,
        "step_s": meter.step_times(w.warmup),
        "cpu_s": meter.step_cpu_times(w.warmup),
        "losses": meter.step_losses(),
        "rss_start": meter.rss_start_kib * 1024,
        "peak_rss": meter.peak_rss_kib * 1024,
        "model_state": meter.peaks,
        "model_state_samples": meter.samples,
        "comm": comm,
        "wall_s": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--suite", required=True, choices=sorted(SUITES))
    p.add_argument("--workload", default="", help="JSON overrides of the suite's Workload fields")
    p.add_argument("--configs", required=True, help="comma-separated configuration names, in run order")
    p.add_argument("--rep", type=int, default=0)
    p.add_argument("--prime", default="", help="a configuration to run first and discard (warms the processes)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    _quiet()
    # Every system of a repetition runs in these processes, and ampzero's strategy sets glibc's
    # malloc to keep freed memory ([Note: page faults per step] in lightning_ampzero/host_memory.py),
    # a setting that outlives it and cannot be undone: set it for all systems from the start, so
    # that each one runs with the same allocator and the ratios measure the systems.
    overrides = json.loads(args.workload) if args.workload else {}
    w = Workload(**{**SUITES[args.suite]().workload.as_dict(), **overrides})
    host_memory = keep_freed_host_memory(w.host_memory_cache_mb)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    w = dataclasses.replace(w, world=world)
    have_deepspeed = deepspeed_available()  # imported by every config's process alike (RSS baseline)
    _quiet()
    records = []
    threads = torch.get_num_threads()
    # The MFU bar: every rank's GEMM peak, measured at once with the threads the systems run with.
    from lightning_ampzero.flops import precision_peak_flops

    dist.barrier()
    local_peaks = {p: precision_peak_flops(p) for p in ("32-true", "bf16")}
    all_peaks: list = [None] * world
    dist.all_gather_object(all_peaks, local_peaks)
    gemm_peak = {p: sum(r[p] for r in all_peaks) for p in local_peaks}
    names = ([args.prime] if args.prime else []) + args.configs.split(",")
    for k, name in enumerate(names):
        cfg = BenchConfig.from_name(name)
        dist.barrier()
        try:
            local = run_one(cfg, w, rank, have_deepspeed)
        except Exception as e:  # record and go on: one failing system must not cost the others
            local = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        if torch.get_num_threads() != threads:  # no system may change what the next one runs with
            local["changed_num_threads"] = torch.get_num_threads()
            torch.set_num_threads(threads)
        ranks = [None] * world
        dist.all_gather_object(ranks, local)
        if args.prime and k == 0:
            continue
        if rank == 0:
            records.append({"config": cfg.name, "system": cfg.system, "stage": cfg.stage, "precision": cfg.precision,
                            "offload": cfg.offload, "rep": args.rep, "ranks": ranks})
            status = ranks[0].get("error") or ranks[0].get("skipped") or \
                f"{1e3 * sorted(ranks[0]['step_s'])[len(ranks[0]['step_s']) // 2]:.0f} ms/step"
            print(f"[rep {args.rep}] {cfg.name:32s} {status}", flush=True)
    if rank == 0:
        meta = {"suite": args.suite, "workload": w.as_dict(), "rep": args.rep, "world": world,
                "threads": torch.get_num_threads(), "rss_after_imports": status_kib("VmRSS") * 1024,
                "gemm_peak_flops": gemm_peak, "host_memory_set": host_memory}
        Path(args.out).write_text(json.dumps({"meta": meta, "records": records}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
