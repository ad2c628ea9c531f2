"""Step time, page faults and peak memory of a Hugging Face GPT-2 in a plain ``Trainer`` script (issue 16).

    python benchmarks/bench_hf_gpt2.py                       # ddp, ampzero_stage_2, ampzero_stage_3
    python benchmarks/bench_hf_gpt2.py --strategies ddp ampzero_stage_0 --precision 32-true

A model nobody here wrote, at a size where the per-step buffers pass glibc's 32 MiB mmap
ceiling ([Note: page faults per step] in lightning_ampzero/host_memory.py): ``GPT2LMHeadModel``
from ``GPT2Config(n_layer=4, n_embd=768, n_head=12)`` (81M parameters, the 50,257-token embedding
tied to the head) built in ``configure_model``, AdamW, the loss logged with ``sync_dist=True``,
micro-batch 2 x 64 tokens per rank, 2 CPU ranks, ``OMP_NUM_THREADS`` unset; 3 warm-up steps, 8
timed. Each strategy runs as its own command. Prints, for rank 0, the median step time, the median
minor page faults per step and the peak resident memory. Needs ``transformers`` (a test extra).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.suite.user_launch import run_as_user  # noqa: E402

WARMUP, TIMED = 3, 8


def _user_script(strategy: str, precision: str) -> None:
    import resource
    import statistics
    import time

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import GPT2Config, GPT2LMHeadModel

    import lightning_ampzero  # noqa: F401  (registers the ampzero_* strategies)

    class Module(pl.LightningModule):
        def configure_model(self) -> None:
            if not hasattr(self, "model"):
                torch.manual_seed(0)
                self.model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=768, n_head=12, n_positions=128))

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch[0], labels=batch[0]).loss
            self.log("loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.faults: list[int] = []

        def on_train_batch_start(self, *args) -> None:
            self.times.append(time.perf_counter())
            self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)

        def on_train_end(self, trainer, pl_module) -> None:
            if trainer.global_rank == 0:
                step = [b - a for a, b in zip(self.times, self.times[1:])][WARMUP:]
                faults = [b - a for a, b in zip(self.faults, self.faults[1:])][WARMUP:]
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
                print(f"| {strategy} | {precision} | {1e3 * statistics.median(step):.0f} |"
                      f" {statistics.median(faults):.0f} | {peak} |", flush=True)

    torch.manual_seed(1)
    tokens = torch.randint(0, 50257, (2 * 2 * (WARMUP + TIMED + 1), 64))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=WARMUP + TIMED + 1,
                         precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Clock()])
    trainer.fit(Module(), DataLoader(TensorDataset(tokens), batch_size=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", nargs="+", default=["ddp", "ampzero_stage_2", "ampzero_stage_3"])
    p.add_argument("--precision", default="bf16-mixed", choices=("32-true", "bf16-mixed"))
    p.add_argument("--worker", nargs=2, metavar=("STRATEGY", "PRECISION"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _user_script(*args.worker)
        return
    print("| strategy | precision | ms/step (median) | minor page faults / step (median) | peak resident MiB |")
    print("|---|---|---|---|---|", flush=True)
    for strategy in args.strategies:
        proc = run_as_user(__file__, ["--worker", strategy, args.precision], timeout=1200)
        rows = [line for line in proc.stdout.splitlines() if line.startswith(f"| {strategy} |")]
        if proc.returncode != 0 or not rows:
            raise SystemExit(f"{strategy} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        print(rows[-1], flush=True)


if __name__ == "__main__":
    main()
