"""Single-GPU suite: a GPT of about 1B parameters on one H100/H200, through Lightning's Trainer.

Written on a machine without a GPU; first run on one H100 (stages 0-3 and stage 3 with
activation checkpointing, benchmarks/README.md). ``--dry-run`` runs the same code path on the
CPU with a tiny model (what the CPU machine checks)::

    python benchmarks/run.py --gpu                      # every configuration, ~15-25 min on an H100
    python benchmarks/run.py --gpu --only 's[23]'       # a subset (regex on the names)
    python benchmarks/run.py --gpu --dry-run            # CPU, tiny model: checks the script only

Configurations (all bf16-mixed, strategy ampzero, 1 GPU): stages 0-3; stage 3 with full
activation checkpointing; stage 2 and 3 with the optimizer offloaded to the host; stage 2 with
FP8 (tensorwise and delayed recipes, Linear layers of the blocks); and, when DeepSpeed imports
on the machine (from wheels carried over), DeepSpeed ZeRO 2 and 3 with ``torch_autocast`` bf16
and with its bf16 mode, bare loop. On one GPU the ZeRO stages shard over a single rank: they
measure each stage's overhead, not a memory saving.

Per configuration, each in a fresh process (so peak memory is its own): median step time
after warm-up (``torch.cuda.synchronize`` at every step start), tokens/s, model FLOPs
utilization and peak memory (``torch.cuda.max_memory_allocated`` and ``_reserved``).

MFU = model FLOPs per second / peak dense bf16 FLOPs of the GPU (H100 SXM and H200: 989.5e12;
H100 PCIe: 756e12; from ``torch.cuda.get_device_name``). Model FLOPs per token (PaLM
appendix B): ``6 N + 12 L T d`` with N the parameters outside the embeddings, L layers, T the
sequence length and d the width; activation-checkpointing recomputation is not counted (it is
not model work).

Writes ``benchmarks/results/gpu_<device>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100": 989.5e12, "H200": 989.5e12, "A100": 312e12}

#: name -> AmpZeroStrategy keyword arguments (or a DeepSpeed precision for system "deepspeed")
CONFIGS: dict[str, dict[str, Any]] = {
    "ampzero/s0": {"stage": 0},
    "ampzero/s1": {"stage": 1},
    "ampzero/s2": {"stage": 2},
    "ampzero/s3": {"stage": 3},
    "ampzero/s3+ac": {"stage": 3, "activation_checkpointing": "full"},
    "ampzero/s2+offload": {"stage": 2, "offload_optimizer": "cpu"},
    "ampzero/s3+offload": {"stage": 3, "offload_optimizer": "cpu"},
    "ampzero/s2+fp8_tensorwise": {"stage": 2, "fp8": {"recipe": "tensorwise", "skip_fqns": ["*head*"]}},
    "ampzero/s2+fp8_delayed": {"stage": 2, "fp8": {"recipe": "delayed", "skip_fqns": ["*head*"]}},
    "deepspeed/s2/torch_autocast": {"stage": 2, "deepspeed": "bf16-mixed"},
    "deepspeed/s3/torch_autocast": {"stage": 3, "deepspeed": "bf16-mixed"},
    "deepspeed/s2/bf16": {"stage": 2, "deepspeed": "bf16-true"},
    "deepspeed/s3/bf16": {"stage": 3, "deepspeed": "bf16-true"},
}


def gpt_config(dry_run: bool) -> dict:
    if dry_run:
        return {"n_layer": 2, "n_embd": 64, "n_head": 4, "block_size": 32, "vocab_size": 256}
    # 18 x 2048: 12 L d^2 = 906M in the blocks + 2 x 32000 x 2048 = 131M embeddings/head: ~1.04B.
    return {"n_layer": 18, "n_embd": 2048, "n_head": 16, "block_size": 2048, "vocab_size": 32000}


def model_flops_per_token(cfg: dict, numel: int) -> float:
    embeddings = cfg["vocab_size"] * cfg["n_embd"] + cfg["block_size"] * cfg["n_embd"]
    return 6 * (numel - embeddings) + 12 * cfg["n_layer"] * cfg["block_size"] * cfg["n_embd"]


def peak_flops(device_name: str) -> Optional[float]:
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):  # "H100 PCIe" before "H100"
        if key in device_name:
            return PEAK_BF16_FLOPS[key]
    return None


# ---- one configuration (child process) ----------------------------------------------------------
def _child(name: str, args: argparse.Namespace) -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    from parity import PatternData
    from torch.utils.data import DataLoader

    spec = dict(CONFIGS[name])
    cfg = gpt_config(args.dry_run)
    device = "cpu" if args.dry_run else "cuda"
    total = args.warmup + args.steps
    data = PatternData(args.batch * total, cfg["block_size"], cfg["vocab_size"])
    loader = DataLoader(data, batch_size=args.batch, shuffle=False)
    starts: list[float] = []

    def mark() -> None:
        if device == "cuda":
            torch.cuda.synchronize()
        starts.append(time.perf_counter())

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if "deepspeed" in spec:
        numel = _run_deepspeed(spec, cfg, loader, device, mark)
    else:
        numel = _run_ampzero(spec, cfg, loader, device, mark, total)
    mark()
    times = [b - a for a, b in zip(starts[args.warmup:], starts[args.warmup + 1:])]
    step = statistics.median(times)
    tokens = args.batch * cfg["block_size"] / step
    out = {"config": name, "numel": numel, "step_ms": 1e3 * step, "step_ms_min": 1e3 * min(times),
           "step_ms_max": 1e3 * max(times), "tokens_per_s": tokens,
           "model_flops_per_token": model_flops_per_token(cfg, numel)}
    if device == "cuda":
        name_ = torch.cuda.get_device_name()
        peak = peak_flops(name_)
        out.update({"device": name_, "peak_allocated": torch.cuda.max_memory_allocated(),
                    "peak_reserved": torch.cuda.max_memory_reserved(),
                    "mfu": tokens * out["model_flops_per_token"] / peak if peak else None})
    return out


def _run_ampzero(spec: dict, cfg: dict, loader: Any, device: str, mark: Any, total: int) -> int:
    import lightning.pytorch as pl

    from lightning_ampzero.config import Fp8Config
    from lightning_ampzero.models.gpt import GPTConfig, GPTModule
    from lightning_ampzero.strategy import AmpZeroStrategy

    kw = dict(spec)
    if "fp8" in kw:
        kw["fp8"] = Fp8Config(**kw["fp8"], emulate=device == "cpu")

    class Timed(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            mark()

    module = GPTModule(model=GPTConfig(**cfg))
    trainer = pl.Trainer(accelerator="cpu" if device == "cpu" else "gpu", devices=1, precision="bf16-mixed",
                         strategy=AmpZeroStrategy(**kw), max_steps=total, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[Timed()])
    trainer.fit(module, loader)
    return sum(p.numel() for p in module.parameters())


def _run_deepspeed(spec: dict, cfg: dict, loader: Any, device: str, mark: Any) -> int:
    import deepspeed

    from lightning_ampzero.models.gpt import GPT, GPTConfig

    from .configs import BenchConfig, Workload
    from .systems import adamw, deepspeed_config, loss_fn

    deepspeed.init_distributed("nccl" if device == "cuda" else "gloo")
    model = GPT(GPTConfig(**cfg)).to(device)
    numel = sum(p.numel() for p in model.parameters())
    w = Workload(micro_batch=loader.batch_size, accumulate=1, world=1, seq=cfg["block_size"])
    ds = deepspeed_config(BenchConfig("deepspeed", spec["stage"], spec["deepspeed"]), w)
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = int(1e5)  # DeepSpeed's default
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=adamw(model, 3e-4), config=ds)
    for x, y in loader:
        mark()
        loss = loss_fn(engine(x.to(device)), y.to(device))
        engine.backward(loss)
        engine.step()
    return numel


# ---- driver -------------------------------------------------------------------------------------
def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description="single-GPU suite (see benchmarks/suite/gpu.py)")
    p.add_argument("--only", default="", help="regex on configuration names")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model: check the script without a GPU")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--timeout", type=float, default=900, help="seconds per configuration")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        Path(args.result).write_text(json.dumps(_child(args.child, args)))
        return
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("the GPU suite needs CUDA (use --dry-run to check the script on a CPU).")
    names = [n for n in CONFIGS if re.search(args.only, n)] if args.only else list(CONFIGS)
    try:
        import deepspeed  # noqa: F401
    except Exception:
        names = [n for n in names if not n.startswith("deepspeed")]
    results: list[dict] = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONWARNINGS": "ignore", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    for name in names:
        result_file = Path(args.out) / f".gpu_{re.sub(r'[^A-Za-z0-9]+', '_', name)}.json"
        Path(args.out).mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "benchmarks.suite.gpu", "--child", name, "--result", str(result_file),
               "--batch", str(args.batch), "--warmup", str(args.warmup), "--steps", str(args.steps)]
        if args.dry_run:
            cmd.append("--dry-run")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode == 0 and result_file.exists():
            results.append(json.loads(result_file.read_text()))
            result_file.unlink()
        else:
            results.append({"config": name, "error": (proc.stderr or proc.stdout)[-2000:]})
        r = results[-1]
        print(f"{name:32s} " + (r["error"].strip().splitlines()[-1] if "error" in r else
                                f"{r['step_ms']:.1f} ms/step, {r['tokens_per_s']:.0f} tok/s"
                                + (f", MFU {r['mfu']:.3f}" if r.get("mfu") else "")
                                + (f", peak {r['peak_allocated'] / 2**30:.1f} GiB" if "peak_allocated" in r else "")),
              flush=True)
    _write(results, args)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write(results: list[dict], args: argparse.Namespace) -> None:
    from .report import environment

    env = environment(sys.executable)
    device = next((r["device"] for r in results if "device" in r), "cpu-dry-run")
    stem = "gpu_dry_run" if args.dry_run else "gpu_" + re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_").lower()
    meta = {"environment": env, "model": gpt_config(args.dry_run), "batch": args.batch, "warmup": args.warmup,
            "steps": args.steps, "results": results}
    out = Path(args.out)
    (out / f"{stem}.json").write_text(json.dumps(meta, indent=1) + "\n")
    lines = [f"# GPU suite on {device} ({env['date']}, git {env['git_commit']})", "",
             f"torch {env['versions']['torch']}, lightning {env['versions']['lightning']}, deepspeed"
             f" {env['versions']['deepspeed'] or '-'}; GPT {meta['model']}; batch {args.batch} sequences;"
             f" {args.warmup} warm-up + {args.steps} timed steps; bf16-mixed.", "",
             "| config | ms/step [min-max] | tokens/s | MFU | peak allocated GiB | peak reserved GiB |",
             "|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['config']} | failed: {r['error'].strip().splitlines()[-1][:80]} | | | | |")
            continue
        mfu = f"{r['mfu']:.3f}" if r.get("mfu") else "-"
        mem = (f"{r['peak_allocated'] / 2**30:.1f} | {r['peak_reserved'] / 2**30:.1f}" if "peak_allocated" in r
               else "- | -")
        lines.append(f"| {r['config']} | {r['step_ms']:.1f} [{r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}] |"
                     f" {r['tokens_per_s']:.0f} | {mfu} | {mem} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / (stem + '.json')}, {out / (stem + '.md')}")


if __name__ == "__main__":
    main()
