"""Step time as a user launches it: a plain ``Trainer`` script, nothing exported (issue 16).

    python benchmarks/bench_user_launch.py            # 5 repetitions, about 6 minutes on 2 cores
    python benchmarks/bench_user_launch.py --reps 2   # quicker, noisier
    python benchmarks/bench_user_launch.py --precision bf16-mixed   # -> user_launch_bf16-mixed.{json,md}
    python benchmarks/bench_user_launch.py --width 1024 --reps 2     # -> user_launch_w1024.{json,md}
    python benchmarks/bench_user_launch.py --adamw default           # torch.optim.AdamW(self.parameters())

Each repetition runs the same script once per strategy (Lightning's ``ddp``, then
``ampzero_stage_0`` ... ``ampzero_stage_3``, in an order rotated per repetition) as its own
command, with ``OMP_NUM_THREADS`` removed from the environment: whatever threads each rank
computes with is what the strategy gives it. Workload (the issue's): a GPT of 6 blocks x 256
wide, 4 heads, vocab 256, micro-batch 4 x 64 tokens per rank, 2 CPU ranks, fp32 (or
``--precision``), AdamW (GPTModule's, ``fused=True``; ``--adamw default``: torch's default, as
users write it, which on CPU is the for-loop implementation), no
accumulation; 5 warm-up steps, then 20 timed (wall time between the starts of consecutive steps,
rank 0). Ratios are against ``ddp`` in the same repetition; median [min-max] over repetitions.
Writes ``benchmarks/results/user_launch.{json,md}`` (``user_launch_<precision>.*`` for another
precision; ``..._adamw_default`` with ``--adamw default``; ``..._w<width>`` for another ``--width``, the blocks' ``n_embd``: 1024 makes 75M parameters,
whose gather and gradient buffers are larger than the 32 MiB below which glibc serves a block
from its heap: [Note: page faults per step] in lightning_ampzero/host_memory.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.suite.user_launch import run_as_user  # noqa: E402

STRATEGIES = ("ddp", "ampzero_stage_0", "ampzero_stage_1", "ampzero_stage_2", "ampzero_stage_3")
WARMUP, TIMED = 5, 20


def _user_script(strategy: str, out: str, precision: str, width: str = "256", adamw: str = "fused") -> None:
    """What a user writes: a LightningModule, a DataLoader, a Trainer (the launched command)."""
    import torch
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_ampzero  # noqa: F401  (registers the ampzero_* strategies)
    from lightning_ampzero.models.gpt import GPTConfig, GPTModule

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.starts.append(time.perf_counter())

        def on_train_end(self, trainer, pl_module) -> None:
            if trainer.global_rank == 0:
                steps = [b - a for a, b in zip(self.starts, self.starts[1:])][WARMUP:]
                Path(out).write_text(json.dumps({"step_s": steps, "threads": torch.get_num_threads(),
                                                 "omp": os.environ.get("OMP_NUM_THREADS")}))

    pl.seed_everything(0, verbose=False)
    tokens = torch.randint(0, 256, (4 * 2 * (WARMUP + TIMED + 1), 65))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    class Module(GPTModule):
        def configure_optimizers(self):
            if adamw == "default":  # what a user writes, torch's CPU default (the for-loop implementation)
                return torch.optim.AdamW(self.parameters(), lr=1e-3)
            return super().configure_optimizers()  # GPTModule's: weight-decay groups, fused=True

    model = Module(model=GPTConfig(n_layer=6, n_embd=int(width), n_head=4, block_size=64, vocab_size=256), lr=1e-3)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=WARMUP + TIMED + 1, precision=precision,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Clock()])
    trainer.fit(model, data)


def _run(strategy: str, out: Path, precision: str, width: int, adamw: str) -> dict:
    proc = run_as_user(__file__, ["--worker", strategy, str(out), precision, str(width), adamw], timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{strategy} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed"))
    p.add_argument("--width", type=int, default=256, help="n_embd of the GPT's 6 blocks (default 256)")
    p.add_argument("--adamw", default="fused", choices=("fused", "default"),
                   help="GPTModule's AdamW (fused=True, the committed results) or torch.optim.AdamW(self.parameters())")
    p.add_argument("--worker", nargs=5, metavar=("STRATEGY", "OUT", "PRECISION", "WIDTH", "ADAMW"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _user_script(*args.worker)
        return
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    reps = []
    for rep in range(args.reps):
        order = STRATEGIES[rep % len(STRATEGIES):] + STRATEGIES[:rep % len(STRATEGIES)]
        runs = {}
        for strategy in order:
            r = _run(strategy, out_dir / f".user_launch_{strategy}.json", args.precision, args.width, args.adamw)
            runs[strategy] = {**r, "median_ms": 1e3 * statistics.median(r["step_s"])}
            print(f"[rep {rep}] {strategy:16s} {runs[strategy]['median_ms']:.1f} ms/step,"
                  f" {r['threads']} thread(s), OMP_NUM_THREADS={r['omp']}", flush=True)
        reps.append(runs)
    for strategy in STRATEGIES:
        (out_dir / f".user_launch_{strategy}.json").unlink(missing_ok=True)
    rows = []
    for strategy in STRATEGIES:
        ms = [r[strategy]["median_ms"] for r in reps]
        ratio = [r[strategy]["median_ms"] / r["ddp"]["median_ms"] for r in reps]
        rows.append({"strategy": strategy, "median_ms": statistics.median(ms), "ratio_vs_ddp": statistics.median(ratio),
                     "ratio_min": min(ratio), "ratio_max": max(ratio), "threads": reps[0][strategy]["threads"]})
    stem = "user_launch" if args.precision == "32-true" else f"user_launch_{args.precision}"
    stem += f"_w{args.width}" if args.width != 256 else ""
    stem += "_adamw_default" if args.adamw == "default" else ""
    command = "python benchmarks/bench_user_launch.py" + (f" --reps {args.reps}" if args.reps != 5 else "")
    command += f" --precision {args.precision}" if args.precision != "32-true" else ""
    command += f" --width {args.width}" if args.width != 256 else ""
    command += " --adamw default" if args.adamw == "default" else ""
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "reps": args.reps, "precision": args.precision, "width": args.width, "rows": rows,
              "raw": reps, "command": command}
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Step time as users launch it ({result['date']}, {args.reps} repetitions)", "",
             f"`{result['command']}`: a plain Trainer script per strategy, OMP_NUM_THREADS unset; GPT 6 x {args.width},"
             f" micro-batch 4 x 64 per rank, 2 CPU ranks, {args.precision}, AdamW {args.adamw}.", "",
             "| strategy | threads per rank | ms/step (median) | / ddp, median [min-max] |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['threads']} | {r['median_ms']:.1f} | {r['ratio_vs_ddp']:.3f}"
                     f" [{r['ratio_min']:.3f}-{r['ratio_max']:.3f}] |")
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
