"""What the hang detector costs a training step (a benchmark, not a test).

The same fit of the package's small GPT on 2 CPU processes (ZeRO stage 2) with the watchdog off
(``watchdog_s=0``) and on (the default), alternated off/on, on/off, ... in the same processes so
that both see the same machine load and neither always runs first; the median step time of each fit after warm-up, and the
ratio of the on and off medians (the issue's target: under 2% slower).

On a shared 2-core machine two fits differ by a few percent from noise alone, more than the
detector could cost; so the benchmark also measures the cost itself: the CPU time the watchdog
thread used per second of training (``time.thread_time`` in that thread), and the main thread's
marks (four attribute writes a step, timed over a million calls). Their sum over the step time
bounds what the detector can take from a step (a GIL it holds for that long, at most).

Usage::

    python benchmarks/bench_watchdog.py [--rounds 3] [--steps 60] [--layers 4] [--width 256]

Writes ``benchmarks/results/watchdog_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import lightning.pytorch as pl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))
from parity import PatternData  # noqa: E402

from lightning_ampzero.models.gpt import GPTConfig, GPTModule  # noqa: E402
from lightning_ampzero.process import run_and_exit  # noqa: E402
from lightning_ampzero.strategy import AmpZeroStrategy  # noqa: E402

WARMUP = 10


class StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0
        self._fit_start = 0.0
        self.watchdog_cpu_per_s: float | None = None

    def on_train_start(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        self._fit_start = time.perf_counter()

    def on_train_batch_start(self, *args) -> None:  # type: ignore[no-untyped-def]
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:  # type: ignore[no-untyped-def]
        self.times.append(time.perf_counter() - self._start)

    def on_train_end(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        hooks = (getattr(trainer.strategy, "_watchdog", None) or (None, None))[1]
        if hooks is not None:  # its thread's CPU seconds (taken at its last beat) per second of training
            self.watchdog_cpu_per_s = hooks.watchdog.cpu_s / (time.perf_counter() - self._fit_start)


def mark_cost_s() -> float:
    """Seconds one step's marks take on the main thread (four, as the callback makes)."""
    from lightning_ampzero.watchdog import Watchdog

    dog = Watchdog(store=None, rank=0, world_size=1, timeout_s=300)
    n = 1_000_000
    start = time.perf_counter()
    for i in range(n):
        dog.mark(i, "training_step")
    return 4 * (time.perf_counter() - start) / n


LAST_TIMER: StepTimer | None = None


def fit(watchdog_s: float, args: argparse.Namespace) -> float:
    pl.seed_everything(0, verbose=False)
    model = GPTModule(GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=4, block_size=64, vocab_size=256),
                      lr=1e-3)
    timer = StepTimer()
    trainer = pl.Trainer(strategy=AmpZeroStrategy(stage=2, watchdog_s=watchdog_s), accelerator="cpu", devices=2,
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[timer])
    trainer.fit(model, DataLoader(PatternData(args.steps * 8, 64, 256, seed=1), batch_size=4))
    global LAST_TIMER
    LAST_TIMER = timer
    return statistics.median(timer.times[WARMUP:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    off, on, cpu = [], [], []

    def fit_on() -> None:
        on.append(fit(300.0, args))
        assert LAST_TIMER is not None and LAST_TIMER.watchdog_cpu_per_s is not None
        cpu.append(LAST_TIMER.watchdog_cpu_per_s)

    for r in range(args.rounds):
        # Alternate which goes first: a later fit in the same processes can be systematically slower.
        if r % 2 == 0:
            off.append(fit(0.0, args))
            fit_on()
        else:
            fit_on()
            off.append(fit(0.0, args))
    marks = mark_cost_s()
    if dist.get_rank() == 0:
        step = statistics.median(off)
        thread = statistics.median(cpu)  # CPU seconds per second: per step, that times the step
        result = {
            "step_ms_off": [round(t * 1e3, 3) for t in off], "step_ms_on": [round(t * 1e3, 3) for t in on],
            "median_ms_off": round(step * 1e3, 3), "median_ms_on": round(statistics.median(on) * 1e3, 3),
            "ratio_on_off": round(statistics.median(on) / step, 4),
            "ratio_per_round": [round(a / b, 4) for a, b in zip(on, off)],
            "watchdog_thread_cpu_ms_per_s": round(thread * 1e3, 4),
            "marks_us_per_step": round(marks * 1e6, 3),
            # the bound: the thread's share of each second plus the marks' share of each step
            "cost_bound_percent": round(100 * (thread + marks / step), 4),
            "config": vars(args),
        }
        out = ROOT / "benchmarks" / "results" / "watchdog_cpu.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    run_and_exit(main)
