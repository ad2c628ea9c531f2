"""Is an fp16 run with skipped steps the fp32 run without those updates? (issue 17, acceptance 3)

    python examples/fp16_skip_check.py                   # the issue's run: 20 steps, two jobs, ~80 s on 2 CPU cores
    python examples/fp16_skip_check.py --plain           # and the plain 32-true job, for comparison (~120 s)
    python examples/fp16_skip_check.py strategy=zero0    # any ampzero-train override

It trains ``ampzero-train precision=16-mixed trainer.max_steps=20`` (the default model, data,
optimizer, schedule and ZeRO stage 2, composed from the shipped config exactly as the CLI does)
and then the same job in ``32-true`` with the updates of the steps the fp16 run skipped left
out, and prints both per-step train losses (mean over ranks, what the logger gets).

Why not compare with the plain 32-true run: at DeepSpeed's default scale 2**16, the gradients of
the Shakespeare batch at step 18 overflow fp16, so that update is skipped (as it must be). In
32-true it is applied, and it is what teaches the model the patterns that bring batch 19 (which
resembles batch 18) down to 3.29; without it batch 19's loss is about 7.4 in any precision. So
the reference for a run with skipped steps is the fp32 run with the same steps left out. On
this machine (2 CPU ranks, torch 2.13): fp16 step 19 7.449, 32-true with step 18 left out
7.439 (+0.14%), plain 32-true 3.29. Which steps overflow can differ between machines (a trial on
2026-12-02 skipped steps 18 and 19: 7.4457 against 7.4387, +0.09%); the script leaves out
whichever steps the fp16 run skipped.

How a step is left out (usable in any LightningModule, see :class:`LeaveOutSteps`):
``optimizer_step`` runs the closure (forward and backward on the batch, so data and random
streams advance as in the fp16 run) but does not step the optimizer, and ``lr_scheduler_step``
does not step the scheduler, as the loss scaler does on an overflow. Exit status 1 when the
last step's losses differ by more than ``--tolerance`` (5%).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist

import lightning.pytorch as pl

from lightning_ampzero.data.text import TextDataModule
from lightning_ampzero.strategy import AmpZeroStrategy
from lightning_ampzero.train import build_module, compose_typed


class LeaveOutSteps:
    """Mixin: the optimizer steps in ``leave_out`` (global step numbers) run forward and backward, but no update.

    Put it before the LightningModule's class (``class M(LeaveOutSteps, MyModule)``), or give an
    existing module the subclass with :func:`leave_out_steps`.
    """

    leave_out: frozenset[int] = frozenset()
    _left_out = False

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if self.trainer.global_step in self.leave_out:
            optimizer_closure()  # forward + backward, as the skipped step did; no optimizer.step()
            self._left_out = True
            return
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)  # type: ignore[misc]

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        if self._left_out:  # the scheduler does not advance for a step that was left out
            self._left_out = False
            return
        super().lr_scheduler_step(scheduler, metric)  # type: ignore[misc]


def leave_out_steps(module: pl.LightningModule, steps: set[int]) -> pl.LightningModule:
    """``module``, now of a subclass of its class with :class:`LeaveOutSteps` mixed in."""
    module.__class__ = type(f"LeaveOut{type(module).__name__}", (LeaveOutSteps, type(module)), {})
    module.leave_out = frozenset(steps)  # type: ignore[attr-defined]
    return module


class Losses(pl.Callback):
    """Per optimizer step: the train loss (mean over ranks, as ``sync_dist`` logs it) and whether fp16 skipped it."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.skipped: list[int] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler.checks_overflow and scaler.last_step_skipped:
            self.skipped.append(trainer.global_step - 1)

    def mean_losses(self) -> list[float]:
        t = torch.tensor(self.losses, dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(t)
            t /= dist.get_world_size()
        return t.tolist()


def run(overrides: list[str], leave_out: set[int] = frozenset()) -> Losses:
    """One ampzero-train job (as lightning_ampzero.train.train builds it), without its reports and checkpoints."""
    app = compose_typed(overrides)
    pl.seed_everything(app.seed, workers=True, verbose=False)
    module = build_module(app)
    if leave_out:
        module = leave_out_steps(module, leave_out)
    record = Losses()
    trainer = pl.Trainer(**{**app.trainer.kwargs(), "enable_progress_bar": False, "enable_model_summary": False},
                         strategy=AmpZeroStrategy(config=app.amp_config), callbacks=[record], logger=False,
                         enable_checkpointing=False)
    trainer.fit(module, datamodule=TextDataModule(app.data))
    return record


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--plain", action="store_true", help="also run plain 32-true (every update applied)")
    p.add_argument("overrides", nargs="*", help="ampzero-train overrides, e.g. strategy=zero0")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    common = [f"trainer.max_steps={args.steps}", *args.overrides]
    fp16 = run(["precision=16-mixed", *common])
    skipped = sorted(set(fp16.skipped))
    fp32_left_out = run(["precision=32-true", *common], leave_out=set(skipped))
    plain = run(["precision=32-true", *common]) if args.plain else None
    rows = [fp16.mean_losses(), fp32_left_out.mean_losses()] + ([plain.mean_losses()] if plain else [])
    if dist.is_initialized() and dist.get_rank() != 0:
        return 0
    names = ["16-mixed", "32-true, skipped steps left out"] + (["32-true"] if plain else [])
    print(f"\nfp16 skipped steps: {skipped or 'none'}")
    print(f"{'step':>4}  " + "  ".join(f"{n:>32}" for n in names))
    for step, values in enumerate(zip(*rows)):
        mark = "  <- skipped in fp16" if step in skipped else ""
        print(f"{step:>4}  " + "  ".join(f"{v:>32.4f}" for v in values) + mark)
    got, ref = rows[0][-1], rows[1][-1]
    rel = abs(got - ref) / abs(ref)
    verdict = "OK" if rel <= args.tolerance else "FAIL"
    print(f"\nlast step: 16-mixed {got:.4f} vs 32-true with the same steps left out {ref:.4f}: {rel:+.2%}"
          f" (tolerance {args.tolerance:.0%}) {verdict}")
    if not skipped:
        print("(the fp16 run skipped no step here: the comparison is plain fp16 vs fp32)")
    return 0 if rel <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
