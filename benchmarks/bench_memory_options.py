"""Step time and peak memory with and without each memory option (a benchmark, not a test).

Options: activation checkpointing (full, selective, CPU checkpoints, CPU checkpoints in the
contiguous pool) and optimizer offload (cpu, nvme), each against the same baseline: the GPT of
``lightning_ampzero.models.gpt`` trained with AdamW in one process, the transforms applied
directly (``apply_activation_checkpointing``, ``OffloadedAdam``), exactly as the strategy
applies them before/after partitioning. Every option runs in a fresh subprocess so its peak
memory is its own.

Measured per option:

* ``step_ms`` / ``step_ms_min``: median and fastest wall time of a training step (forward,
  backward, optimizer) after warm-up, with ``--threads`` intra-op threads (default 1: on a shared
  machine the fastest step is the least disturbed estimate);
* ``saved_activation_bytes``: bytes kept for backward after the forward (by device);
* ``peak_host_growth``: how far the process's RSS rises above its level between steps during the
  measured steps (CPU): the transient memory of a step (activations, gradients, temporaries).
  The peak is reset through /proc/self/clear_refs after warm-up, and the subprocess runs with
  ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors go back to the OS (glibc would otherwise
  keep them, and RSS would not show what a step frees);
* ``persistent_host_bytes``: RSS between steps less RSS once the model was built, before the
  optimizer (CPU): optimizer state (wherever it lives), gradients and anything else kept across steps;
* ``peak_device_bytes``: ``torch.cuda.max_memory_allocated`` over a step (CUDA);
* ``optimizer_resident_bytes``: optimizer state resident in host memory (offload).

Usage::

    python benchmarks/bench_memory_options.py [--device cpu|cuda] [--steps 5] [--layers 4] [--width 256]

Writes ``benchmarks/results/memory_options_<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

OPTIONS = {
    "baseline": {},
    "ac_full": {"ac": {"mode": "full"}},
    "ac_selective": {"ac": {"mode": "selective"}},
    "ac_full_every_2": {"ac": {"mode": "full", "every_n": 2}},
    "ac_cpu_checkpointing": {"ac": {"mode": "full", "cpu_checkpointing": True}},
    "ac_cpu_contiguous": {"ac": {"mode": "full", "cpu_checkpointing": True, "contiguous_memory_optimization": True}},
    "offload_cpu": {"offload": "cpu"},
    "offload_nvme": {"offload": "nvme"},
}


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def run_option(name: str, args: argparse.Namespace) -> dict:
    import torch

    from lightning_ampzero.activation import apply_activation_checkpointing, saved_activations
    from lightning_ampzero.config import ActivationCheckpointingConfig, OffloadConfig
    from lightning_ampzero.models.gpt import GPT, GPTConfig
    from lightning_ampzero.offload import OffloadedAdam

    option = OPTIONS[name]
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64), block_size=args.seq)
    model = GPT(cfg).to(device)
    handle = None
    if "ac" in option:
        handle = apply_activation_checkpointing(model, ActivationCheckpointingConfig(**option["ac"]))
    rss_built = _status_kib("VmRSS")  # model built, no optimizer yet
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tmp = None
    if "offload" in option:
        tmp = tempfile.TemporaryDirectory(dir=args.nvme_dir)
        kind = option["offload"]
        extra = {"nvme_path": tmp.name} if kind == "nvme" else {}
        opt = OffloadedAdam(opt, OffloadConfig(offload_optimizer=kind, sub_group_size=args.tile, **extra),
                            nvme_dir=Path(tmp.name))
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)

    def loss_fn():
        logits = model(x)
        return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), x.view(-1))

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn().backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(2):
        step()
    packed_before = dict(handle.hooks.stats.bytes_by_device) if handle is not None and handle.hooks else {}
    loss, saved = saved_activations(loss_fn)
    packed = {k: v - packed_before.get(k, 0) for k, v in handle.hooks.stats.bytes_by_device.items()} \
        if handle is not None and handle.hooks else {}
    loss.backward()
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_alloc = torch.cuda.memory_allocated()
    Path("/proc/self/clear_refs").write_text("5")
    rss = _status_kib("VmRSS")
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    out = {
        "option": name,
        "step_ms": 1e3 * statistics.median(times),
        "step_ms_min": 1e3 * min(times),
        "persistent_host_bytes": (rss - rss_built) * 1024,
        "saved_activation_bytes": saved.bytes,
        "saved_activation_bytes_by_device": saved.bytes_by_device,
        "peak_host_growth": (_status_kib("VmHWM") - rss) * 1024,
        "params": sum(p.numel() for p in model.parameters()),
    }
    if device.type == "cuda":
        out["peak_device_bytes"] = torch.cuda.max_memory_allocated()
        out["device_bytes_between_steps"] = base_alloc
    if isinstance(opt, OffloadedAdam):
        out["optimizer_resident_bytes"] = opt.store.resident_bytes()
        opt.close()
    else:
        out["optimizer_resident_bytes"] = sum(v.numel() * v.element_size() for s in opt.state.values()
                                              for v in s.values() if torch.is_tensor(v))
    out["checkpoint_copies_by_device"] = packed  # per forward: where cpu_checkpointing put the checkpoints
    if tmp is not None:
        tmp.cleanup()
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def markdown(results: list[dict], args: argparse.Namespace) -> str:
    base = next(r for r in results if r["option"] == "baseline")
    device_col = args.device == "cuda"
    head = ["option", "step ms (median / min)", "min vs base", "saved act. MiB", "of which CPU checkpoints MiB",
            "optimizer resident MiB", "peak device MiB" if device_col else "step peak host MiB",
            "persistent host MiB"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        host_act = r["checkpoint_copies_by_device"].get("cpu", 0)
        peak = r.get("peak_device_bytes", 0) if device_col else r["peak_host_growth"]
        rows.append("| " + " | ".join([
            r["option"], f"{r['step_ms']:.0f} / {r['step_ms_min']:.0f}", f"{r['step_ms_min'] / base['step_ms_min']:.2f}x",
            _mib(r["saved_activation_bytes"]), _mib(host_act), _mib(r["optimizer_resident_bytes"]), _mib(peak),
            _mib(r["persistent_host_bytes"]),
        ]) + " |")
    note = (f"GPT {args.layers} layers x {args.width} wide, batch {args.batch} x {args.seq} tokens,"
            f" {base['params'] / 1e6:.1f}M parameters, AdamW; device {args.device}, {args.threads} thread(s);"
            f" {args.steps} measured steps.")
    return note + "\n\n" + "\n".join(rows) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per run")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tile", type=int, default=1 << 18, help="offload sub_group_size (elements)")
    p.add_argument("--nvme-dir", default=None, help="directory for the nvme option's swap files")
    p.add_argument("--options", default=",".join(OPTIONS))
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one option, print JSON
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_option(args.one, args)))
        return
    results = []
    for name in args.options.split(","):
        cmd = [sys.executable, __file__, "--one", name, "--device", args.device, "--steps", str(args.steps),
               "--layers", str(args.layers), "--width", str(args.width), "--seq", str(args.seq),
               "--batch", str(args.batch), "--tile", str(args.tile), "--threads", str(args.threads)]
        if args.nvme_dir:
            cmd += ["--nvme-dir", args.nvme_dir]
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "MALLOC_MMAP_THRESHOLD_": "65536"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            raise SystemExit(f"option {name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        results.append(json.loads(line[len("RESULT "):]))
        print(f"{name:<24} {results[-1]['step_ms']:8.1f} ms", flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"memory_options_{args.device}"
    stem.with_suffix(".json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    stem.with_suffix(".md").write_text(markdown(results, args))
    print(markdown(results, args))


if __name__ == "__main__":
    main()
