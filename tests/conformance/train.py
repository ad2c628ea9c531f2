"""Train one zoo model (tests/conformance/zoo.py) under several ZeRO configurations, as a user would.

Run as a script, never inside pytest (Lightning's launcher re-runs the command line for the
other ranks)::

    python tests/conformance/train.py --model gpt2 --configs 0,1,2,2s,3,3s --out result.json

Each configuration is a plain ``Trainer(accelerator="cpu", devices=2, strategy=...)`` fit of
:class:`ConformanceModule`, whose ``configure_model`` builds the model from a fixed seed. Every
process also trains the one-process reference in plain torch: the same model from the same
seed, the same AdamW, each step's gradient the mean of the per-rank chunks' gradients and the
buffers following rank 0's chunk, which is what DDP computes (rank 0's buffers are broadcast
before every forward; after the last step each rank holds its own chunk's update). Rank 0 writes, per configuration: parameters and buffers whose value
after setup differs from the reference's initial one (bit for bit), per-step losses (mean over
ranks), the metrics' values, and the largest difference of the final buffers; and the
reference's losses and metrics.

Configurations: ``<stage>`` uses the registered name ``ampzero_stage_<stage>`` (all defaults);
``<stage>s`` is ``AmpZeroStrategy(stage=..., reduce_bucket_size=<an eighth of the model>,
param_persistence_threshold=0)``: several units, and at stage 3 every unit resharded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import lightning.pytorch as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zoo import ZOO, Entry, step as forward_step  # noqa: E402

from lightning_ampzero.process import run_and_exit  # noqa: E402

SEED = 1234
WORLD = 2
GLOBAL_BATCH = 4
LR = 3e-3


def global_batch(entry: Entry, step: int) -> dict[str, torch.Tensor]:
    return entry.batch(torch.Generator().manual_seed(10_000 + step), GLOBAL_BATCH)


def chunk(batch: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    n = GLOBAL_BATCH // WORLD
    return {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}


def build(entry: Entry) -> nn.Module:
    torch.manual_seed(SEED)
    return entry.build()


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (gathered from their shards) and buffers, by name; every rank must call it."""
    state = {}
    for name, p in module.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        state[name] = full.detach().clone()
    for name, b in module.named_buffers():
        state[name] = b.detach().clone()
    return state


def reference(entry: Entry, steps: int) -> dict[str, Any]:
    """One process, DDP's arithmetic: see the module docstring."""
    model = build(entry)
    initial = full_state(model)
    opt = optimizer(model)
    losses, correct, total = [], 0, 0
    for step in range(steps):
        batch = global_batch(entry, step)
        start = {n: b.clone() for n, b in model.named_buffers()}
        after: dict[int, dict[str, torch.Tensor]] = {}
        step_losses = []
        opt.zero_grad()
        for rank in range(WORLD):
            with torch.no_grad():
                for n, b in model.named_buffers():
                    b.copy_(start[n])
            part = chunk(batch, rank)
            loss, predicted = forward_step(entry, model, part)
            (loss / WORLD).backward()
            step_losses.append(loss.item())
            after[rank] = {n: b.clone() for n, b in model.named_buffers()}
            if predicted is not None:
                logits, y = predicted
                correct, total = correct + int((logits.argmax(-1) == y).sum()), total + int(y.numel())
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(after[0][n])
        opt.step()
        losses.append(sum(step_losses) / WORLD)
    metrics = {"mean_loss": sum(losses) / len(losses)}
    if entry.predict is not None:
        metrics["accuracy"] = correct / total
    # Each rank ends with its own chunk's update of the last step's (rank 0's) buffers.
    return {"initial": initial, "losses": losses, "metrics": metrics, "buffers": after}


class ConformanceModule(pl.LightningModule):
    def __init__(self, name: str, ref: dict[str, Any]) -> None:
        super().__init__()
        import torchmetrics

        self.entry = ZOO[name]
        self.ref = ref
        self.net: nn.Module | None = None
        # Metric states are tensors that are neither parameters nor buffers: sharded
        # construction must leave them as built.
        self.loss_mean = torchmetrics.MeanMetric()
        self.accuracy = (torchmetrics.classification.MulticlassAccuracy(self.entry.classes, average="micro")
                         if self.entry.classes else None)
        self.losses: list[float] = []
        self.result: dict[str, Any] = {}

    def configure_model(self) -> None:
        if self.net is None:
            self.net = build(self.entry)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer(self)

    def on_fit_start(self) -> None:
        state = full_state(self)
        expected = {f"net.{k}": v for k, v in self.ref["initial"].items()}
        self.result["init_mismatch"] = sorted(
            k for k in expected.keys() | state.keys()
            if k not in state or k not in expected or state[k].dtype != expected[k].dtype
            or not torch.equal(state[k], expected[k]))
        self.result["metric_states_clean"] = all(
            torch.equal(getattr(m, s), d) for m in (self.loss_mean, self.accuracy) if m is not None
            for s, d in m._defaults.items() if isinstance(d, torch.Tensor))

    def training_step(self, step: int, batch_idx: int) -> torch.Tensor:
        part = chunk(global_batch(self.entry, int(step)), self.global_rank)
        loss, predicted = forward_step(self.entry, self.net, part)
        self.losses.append(loss.item())
        self.loss_mean.update(loss.detach())
        if self.accuracy is not None:
            self.accuracy.update(*predicted)
        return loss

    def on_train_end(self) -> None:
        losses = torch.tensor(self.losses, dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(losses)
            losses /= dist.get_world_size()
        self.result["losses"] = losses.tolist()
        self.result["metrics"] = {"mean_loss": float(self.loss_mean.compute())}
        if self.accuracy is not None:
            self.result["metrics"]["accuracy"] = float(self.accuracy.compute())
        buffers = {n: b for n, b in self.named_buffers()}
        diffs = [float((buffers[f"net.{n}"].double() - b.double()).abs().max()) if b.numel() else 0.0
                 for n, b in self.ref["buffers"][self.global_rank].items()]
        # Every rank's buffers: DDP gives each rank rank 0's before every forward.
        worst = torch.tensor([max(diffs, default=0.0)], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        self.result["buffer_max_diff"] = float(worst)


def strategy_for(config: str, numel: int) -> Any:
    from lightning_ampzero.strategy import AmpZeroStrategy

    if config.endswith("a"):  # activation checkpointing of every block, by its string form
        return AmpZeroStrategy(stage=int(config[:-1]), activation_checkpointing="full")
    if not config.endswith("s"):
        return f"ampzero_stage_{int(config)}"

    return AmpZeroStrategy(stage=int(config[:-1]), reduce_bucket_size=max(1, numel // 8),
                           param_persistence_threshold=0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, choices=sorted(ZOO))
    p.add_argument("--configs", default="0,1,2,2s,3,3s,3a")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    entry = ZOO[args.model]
    ref = reference(entry, args.steps)
    numel = sum(t.numel() for n, t in ref["initial"].items() if n in dict(build(entry).named_parameters()))
    results: dict[str, Any] = {"reference": {"losses": ref["losses"], "metrics": ref["metrics"]}, "numel": numel}
    for config in args.configs.split(","):
        module = ConformanceModule(args.model, ref)
        trainer = pl.Trainer(
            accelerator="cpu", devices=WORLD, strategy=strategy_for(config, numel), max_steps=args.steps,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            use_distributed_sampler=False,
        )
        trainer.fit(module, torch.utils.data.DataLoader(list(range(args.steps)), batch_size=None))
        results[config] = module.result
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and (not dist.is_initialized() or dist.get_rank() == 0):
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
