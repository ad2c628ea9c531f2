"""ZeRO-Infinity at scale on this machine: a GPT whose fp32 model states exceed host memory, trained
at stage 3 on 2 CPU ranks with parameters and optimizer state on NVMe (issue 15, acceptance 2).

A benchmark, not a test: it takes minutes to hours and tens of GB of disk
(``tests/test_param_offload.py::test_infinity_benchmark_smoke``, marked slow, runs it on a tiny
model). It runs Lightning with ``AmpZeroStrategy(stage=3, offload_optimizer="nvme",
offload_param="nvme")`` on ``--devices`` CPU ranks (Lightning's launcher starts the other ranks)
and reports:

* seconds per optimizer step (each step timed on rank 0, from batch start to batch end);
* peak RSS per rank (``VmHWM`` over the whole run, and over the steps after the first) against
  the estimator's host figure (``lightning_ampzero.estimate.estimate`` with the run's buffers;
  on a CPU accelerator its "GPU" figures are host memory too and the gradient shard is counted
  once);
* bytes read and written per step and rank in the swap files (measured by the stores and the
  parameter swapper) against ``estimate.nvme_traffic``;
* the I/O lower bound: those bytes (all ranks: they share the drive) over the drive's bandwidth,
  measured in the same run on ``--nvme-dir`` before training (``bench_nvme_io``: page cache with
  fsync for writes, cold reads);
* the compute lower bound: 6 x parameters x tokens per rank over the fp32 matmul rate of one core
  (each rank has one), measured in the same run on the model's own Linear shape;
* the loss of every step (the same batch every step, so the loss must fall).

The script re-runs itself with ``MALLOC_MMAP_THRESHOLD_=65536`` (see ``main``) so that RSS shows
what is in use. A thread in each rank stops the run (exit code 3, with a message) if the machine's available
memory falls below ``--min-available`` (default 1.5 GiB): the machine is shared, and the kernel's
OOM killer would pick some other process.

Usage::

    python benchmarks/bench_infinity.py --nvme-dir /local_nvme [--n-layer 32 --n-embd 2560] [--steps 3]

Writes ``benchmarks/results/<--out>.json`` and ``.md`` (default ``infinity_cpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import lightning.pytorch as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_nvme_io import _drop_cache, _run  # noqa: E402  (the same measurement, same directory)

from lightning_ampzero.config import OffloadConfig, ZeroConfig  # noqa: E402
from lightning_ampzero.estimate import estimate, gpt_size  # noqa: E402
from lightning_ampzero.models.config import GPTConfig  # noqa: E402
from lightning_ampzero.models.gpt import GPTModule  # noqa: E402
from lightning_ampzero.offload.grads import grad_swapper  # noqa: E402
from lightning_ampzero.offload.optimizer import OffloadedAdam  # noqa: E402
from lightning_ampzero.process import run_and_exit  # noqa: E402
from lightning_ampzero.strategy import AmpZeroStrategy  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GiB = 2**30


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise KeyError("MemAvailable")


def _guard(minimum: int) -> None:
    """Stop this rank before the machine runs out of memory (see the module docstring)."""

    def watch() -> None:
        while True:
            if _available() < minimum:
                print(f"bench_infinity: available memory fell below {minimum / GiB:.1f} GiB: stopping the run"
                      " (lower --n-layer/--n-embd or the buffers)", file=sys.stderr, flush=True)
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="bench-memory-guard").start()


class _SameBatch(Dataset):
    """One fixed batch of token sequences, repeated: the loss must fall step after step."""

    def __init__(self, n: int, block: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        self.data = (start + torch.arange(block + 1)) % vocab

    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, i: int):
        row = self.data[i % len(self.data)]
        return row[:-1], row[1:]


class _Meter(pl.Callback):
    def __init__(self, profile_step: int = -1) -> None:
        self.profile_step = profile_step  # --profile: torch.profiler over this step on rank 0
        self._prof: Any = None
        self.steps: list[float] = []
        self.forward_backward: list[float] = []  # batch start to the optimizer step
        self.losses: list[float] = []
        self.cpu: list[tuple[float, float, int]] = []  # per step: user s, system s, minor page faults
        self._ru: Any = None
        self.io: list[tuple[int, int]] = []
        self.hwm_after_first = 0
        self.hwm_setup_and_first = 0
        self.first_start = 0.0
        self._t = 0.0

    @staticmethod
    def _io(trainer: pl.Trainer) -> tuple[int, int]:
        opt = trainer.strategy.optimizers[0]
        opt = getattr(opt, "_optimizer", opt)
        read = written = 0
        if isinstance(opt, OffloadedAdam) and opt.store.kind == "nvme":
            read, written = opt.store.bytes_read, opt.store.bytes_written
        swapper = trainer.strategy.param_swapper
        if swapper is not None:
            read, written = read + swapper.bytes_read, written + swapper.bytes_written
        grads = grad_swapper(trainer.strategy.model)
        if grads is not None:
            read, written = read + grads.bytes_read, written + grads.bytes_written
        return read, written

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 1:
            self.hwm_setup_and_first = _status_kib("VmHWM") * 1024
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: setup and the first step excluded
        self.io.append(self._io(trainer))
        if batch_idx == self.profile_step and trainer.global_rank == 0:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
            self._prof.__enter__()
        self._ru = resource.getrusage(resource.RUSAGE_SELF)
        self._t = time.perf_counter()
        if batch_idx == 0:
            self.first_start = self._t

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.forward_backward.append(time.perf_counter() - self._t)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append(time.perf_counter() - self._t)
        ru = resource.getrusage(resource.RUSAGE_SELF)  # all threads: the I/O pool's and gloo's too
        self.cpu.append((ru.ru_utime - self._ru.ru_utime, ru.ru_stime - self._ru.ru_stime,
                         ru.ru_minflt - self._ru.ru_minflt))
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            print(self._prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), flush=True)
            # by shape: which copies (all-gather copy-out, reduce-scatter copy-in, swap buffers) cost
            print(self._prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=30), flush=True)
            self._prof = None

    def on_train_end(self, trainer, pl_module) -> None:
        self.io.append(self._io(trainer))
        # anonymous memory vs pages of mapped files (the swap file's map) at the end
        self.rss_kinds = {k: _status_kib(k) * 1024 for k in ("RssAnon", "RssFile", "RssShmem")}
        self.hwm_after_first = _status_kib("VmHWM") * 1024
        swapper = trainer.strategy.param_swapper
        self.swapper = None if swapper is None else {
            "units": len(swapper.units), "segments": sum(len(u.segments) for u in swapper.units),
            "buffer_count": swapper.buffer_count, "buffer_bytes": swapper.buffer_bytes,
            "peak_buffers_in_use": swapper.peak_buffers_in_use, "file_bytes": swapper.file_bytes}


def _disk(path: Path, size: int) -> dict:
    """The drive's bandwidth in the same run, with fsync: a first write of ``size`` bytes into a new
    file, a rewrite of the same blocks (what the preallocated swap files see from the second step
    on; on this machine's virtual disk first writes are several times slower), and a cold read."""
    path.mkdir(parents=True, exist_ok=True)  # a new --nvme-dir, as the strategy's nvme_path may be
    f = path / f"bench-infinity-disk-{os.getpid()}.bin"
    try:
        first = _run(f, size, 8 << 20, 1, False, "write")
        rewrite = _run(f, size, 8 << 20, 1, False, "write")
        _drop_cache(f)
        read = _run(f, size, 8 << 20, 1, False, "read")
    finally:
        f.unlink(missing_ok=True)
    return {"first_write_GBps": size / first / 1e9, "write_GBps": size / rewrite / 1e9, "read_GBps": size / read / 1e9,
            "bytes": size}


def _matmul_rate(cfg: GPTConfig, tokens: int) -> float:
    """fp32 FLOP/s of one core on the MLP's Linear shape with this many tokens (best of 3)."""
    torch.set_num_threads(1)
    x, w = torch.randn(tokens, cfg.n_embd), torch.randn(4 * cfg.n_embd, cfg.n_embd)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - t)
    return 2 * tokens * cfg.n_embd * 4 * cfg.n_embd / best


def main() -> None:
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ and "LOCAL_RANK" not in os.environ:
        # glibc keeps freed blocks in its heap once it has raised its mmap threshold, and RSS would
        # then show memory a step has freed (measured: 2.7 instead of 1.9 GiB per rank at 0.16B
        # parameters). A fixed threshold gives every large tensor its own mmap; glibc reads it at
        # start-up, hence the re-exec (Lightning's launcher passes it on to the other ranks).
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 16)
        os.execv(sys.executable, [sys.executable, *sys.argv])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme-dir", required=True)
    p.add_argument("--n-layer", type=int, default=32)
    p.add_argument("--n-embd", type=int, default=2560)
    p.add_argument("--n-head", type=int, default=20)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--sub-group-size", type=float, default=2.5e7)
    p.add_argument("--buffer-count", type=int, default=6)
    p.add_argument("--param-buffer-count", type=int, default=5)
    p.add_argument("--param-buffer-size", type=float, default=1e8)
    p.add_argument("--unit", type=int, default=0,
                   help="elements per FSDP2 unit (reduce/allgather/prefetch bucket); 0: one transformer block")
    p.add_argument("--disk-probe", type=float, default=2 * GiB, help="bytes written and read to measure the drive")
    p.add_argument("--min-available", type=float, default=1.5 * GiB)
    p.add_argument("--offload-grad", default="auto", choices=("auto", "none", "nvme"),
                   help="OffloadConfig.offload_grad: gradient shards to the swap file per unit (auto: yes here)")
    p.add_argument("--profile", type=int, default=-1, metavar="STEP",
                   help="print torch.profiler's operator table for this step (0-based) on rank 0")
    p.add_argument("--out", default="infinity_cpu")
    args = p.parse_args()
    torch.set_num_threads(1)  # one core per rank
    _guard(int(args.min_available))
    cfg = GPTConfig(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)
    # One block per unit (and one prefetched): the default 5e8-element buckets would gather six
    # 2.5B-model blocks at once, 5 GiB per rank, which with two ranks does not fit this machine.
    unit = args.unit or 12 * args.n_embd**2 + 13 * args.n_embd
    buckets = {"reduce_bucket_size": unit, "allgather_bucket_size": unit, "prefetch_bucket_size": unit}
    zero = ZeroConfig(stage=3, **buckets)
    offload = OffloadConfig(offload_optimizer="nvme", offload_param="nvme", nvme_path=args.nvme_dir,
                            sub_group_size=args.sub_group_size, buffer_count=args.buffer_count,
                            param_buffer_count=args.param_buffer_count, param_buffer_size=args.param_buffer_size,
                            offload_grad=args.offload_grad)
    strategy = AmpZeroStrategy(stage=3, **buckets, offload_optimizer="nvme", offload_param="nvme", nvme_path=args.nvme_dir,
                               sub_group_size=args.sub_group_size, buffer_count=args.buffer_count,
                               param_buffer_count=args.param_buffer_count, param_buffer_size=args.param_buffer_size,
                               offload_grad=args.offload_grad)
    meter = _Meter(args.profile)
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, precision="32-true",
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, callbacks=[meter])
    module = GPTModule(model=cfg, lr=args.lr, weight_decay=0.0)
    data = _SameBatch(args.micro_batch * args.devices, args.block_size, cfg.vocab_size)
    t0 = time.perf_counter()
    disk = rate = None
    started, baseline = 0.0, 0

    class _Probe(pl.Callback):
        """Drive and core measured once the ranks exist, before the model is built."""

        def setup(self, trainer, pl_module, stage) -> None:
            nonlocal disk, rate, started, baseline
            baseline = _status_kib("VmRSS") * 1024  # libraries and the process group, no model yet
            if trainer.global_rank == 0:
                disk = _disk(Path(args.nvme_dir), int(args.disk_probe))
            rate = _matmul_rate(cfg, args.micro_batch * args.block_size)
            trainer.strategy.barrier()
            started = time.perf_counter()

    trainer.callbacks.insert(0, _Probe())
    sampler = DistributedSampler(data, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False)
    loader = DataLoader(data, batch_size=args.micro_batch, sampler=sampler)
    trainer.fit(module, loader)
    total = time.perf_counter() - t0

    hwm = torch.tensor([max(meter.hwm_setup_and_first, meter.hwm_after_first), meter.hwm_after_first, baseline,
                        *meter.rss_kinds.values()], dtype=torch.float64)
    every = [torch.zeros_like(hwm) for _ in range(dist.get_world_size())]
    dist.all_gather(every, hwm)
    io = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(meter.io[1:-1], meter.io[2:])]  # steps 2..n
    if trainer.global_rank != 0:
        return
    size = gpt_size(cfg, zero)
    est = estimate(size, 3, "params+optimizer=nvme", gpus_per_node=args.devices, zero=zero, buffers=offload)
    host = est.gpu + est.cpu // args.devices - est.gpu_grads
    tokens = args.micro_batch * args.block_size
    world = args.devices
    io_bound = None
    if io:
        read = sum(r for r, _ in io) / len(io) * world
        written = sum(w for _, w in io) / len(io) * world
        io_bound = read / (disk["read_GBps"] * 1e9) + written / (disk["write_GBps"] * 1e9)
    # Each rank runs forward and backward of the whole model on its own micro-batch: 6·Ψ·tokens FLOPs
    # per rank, the ranks in parallel on their own cores.
    compute_bound = 6 * size.numel * tokens / rate
    result = {
        "model": {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_head": cfg.n_head, "block_size": cfg.block_size,
                  "parameters": size.numel, "fp32_model_states_GB": 16 * size.numel / 1e9},
        "run": {"ranks": world, "micro_batch": args.micro_batch, "tokens_per_rank_step": tokens, "steps": args.steps,
                "lr": args.lr, "unit": unit, "offload": {k: getattr(offload, k) for k in (
                    "sub_group_size", "buffer_count", "param_buffer_count", "param_buffer_size", "io_threads",
                    "offload_grad")},
                "nvme_dir": args.nvme_dir, "machine_memory_GiB": os.sysconf("SC_PAGE_SIZE") * os.sysconf(
                    "SC_PHYS_PAGES") / GiB, "cores": os.cpu_count(),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
        "losses": meter.losses,
        "step_seconds": meter.steps,
        "forward_backward_seconds": meter.forward_backward,
        "rank0_cpu_per_step": [{"user_s": u, "system_s": k, "minor_faults": f} for u, k, f in meter.cpu],
        "optimizer_step_seconds": [a - b for a, b in zip(meter.steps, meter.forward_backward)],
        "setup_seconds": meter.first_start - started,
        "total_seconds": total,
        "peak_rss_per_rank_GiB": [float(h[0]) / GiB for h in every],
        "peak_rss_after_first_step_GiB": [float(h[1]) / GiB for h in every],
        "rss_before_model_GiB": [float(h[2]) / GiB for h in every],
        "rss_at_end_GiB": [dict(zip(meter.rss_kinds, (float(x) / GiB for x in h[3:]))) for h in every],
        "estimate_host_per_rank_GiB": host / GiB,
        "io_per_step_rank0": [{"read": r, "written": w} for r, w in io],
        "estimate_io_per_rank": {"read": est.nvme_read, "written": est.nvme_written},
        "disk": disk,
        "matmul_GFLOPs_per_core": rate / 1e9,
        "io_lower_bound_s": io_bound,
        "compute_lower_bound_s": compute_bound,
        "swapper_rank0": meter.swapper,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=1))
    steady = meter.steps[1:] or meter.steps
    bound = max(io_bound or 0.0, compute_bound)
    lines = [
        f"# ZeRO-Infinity on CPU: GPT {cfg.n_layer} x {cfg.n_embd}, {size.numel / 1e9:.2f}B parameters"
        f" ({result['run']['date']})", "",
        f"{world} ranks x 1 core, stage 3, fp32, parameters and optimizer state on NVMe ({args.nvme_dir}),"
        f" gradients {'in memory' if not offload.swaps_gradients(stage=3, grads_on_host=True) else 'swapped per unit'};"
        f" {16 * size.numel / 1e9:.1f} GB of fp32 model states (params, grads, Adam master + moments) on a"
        f" {result['run']['machine_memory_GiB']:.0f} GiB machine; micro-batch {args.micro_batch} x {args.block_size}"
        " tokens per rank, the same batch every step.", "",
        "| figure | value |", "|---|---|",
        f"| losses | {', '.join(f'{x:.4f}' for x in meter.losses)} |",
        f"| seconds per step | {', '.join(f'{x:.1f}' for x in meter.steps)} |",
        f"| of which forward + backward (all-gathers, parameter reads, reduce-scatters) |"
        f" {', '.join(f'{x:.1f}' for x in meter.forward_backward)} |",
        f"| of which the optimizer step (host AdamW, optimizer and parameter swap files) |"
        f" {', '.join(f'{a - b:.1f}' for a, b in zip(meter.steps, meter.forward_backward))} |",
        f"| rank 0's CPU time per step, user / system (page faults) |"
        f" {', '.join(f'{u:.1f} / {k:.1f} ({f / 1e6:.2f}M)' for u, k, f in meter.cpu)} |",
        f"| setup (build, shard, swap files) | {result['setup_seconds']:.0f} s |",
        f"| peak RSS per rank (whole run, setup included) | {', '.join(f'{x:.2f}' for x in result['peak_rss_per_rank_GiB'])} GiB |",
        f"| peak RSS per rank (steps 2..n) | {', '.join(f'{x:.2f}' for x in result['peak_rss_after_first_step_GiB'])}"
        " GiB |",
        f"| RSS per rank before the model (libraries, process group) |"
        f" {', '.join(f'{x:.2f}' for x in result['rss_before_model_GiB'])} GiB |",
        f"| estimator, host per rank (model states, buffers, working set) | {host / GiB:.2f} GiB |",
        f"| swap-file bytes per step, rank 0 (read / written) | "
        + (f"{sum(r for r, _ in io) / len(io) / 1e9:.2f} / {sum(w for _, w in io) / len(io) / 1e9:.2f} GB" if io else "-")
        + f" (estimate {est.nvme_read / 1e9:.2f} / {est.nvme_written / 1e9:.2f} GB) |",
        f"| drive (same run, fsync) | first write {disk['first_write_GBps']:.2f} GB/s, rewrite"
        f" {disk['write_GBps']:.2f} GB/s, cold read {disk['read_GBps']:.2f} GB/s |",
        f"| I/O lower bound per step (all ranks' bytes / rewrite and cold-read bandwidth) | {io_bound:.1f} s |"
        if io_bound else "| I/O lower bound | - |",
        f"| compute lower bound per step (6 x params x tokens / {rate / 1e9:.1f} GFLOP/s) | {compute_bound:.1f} s |",
        f"| steady step / larger bound | {sum(steady) / len(steady) / bound:.2f}x |",
    ]
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
