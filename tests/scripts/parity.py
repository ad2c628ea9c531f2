"""Train the small GPT under several configurations and write per-micro-batch losses as JSON.

Run as a script (never inside pytest: Lightning's launcher re-runs the command line for the
other ranks). ``--devices 1 --reference`` trains with Lightning's default single-device
strategy on the global batch; otherwise every configuration uses strategy ampzero with
``--devices`` processes per node, each rank getting ``global_batch / world`` samples.
Each configuration is ``stage:accumulate:clip`` (clip "none", "norm:<v>" or "value:<v>").
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import lightning.pytorch as pl

from lightning_ampzero.models.gpt import GPTConfig, GPTModule
from lightning_ampzero.process import run_and_exit


class PatternData(Dataset):
    """Deterministic token sequences with learnable structure (a noisy arithmetic progression)."""

    def __init__(self, n: int, block: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        seq = (start + step * torch.arange(block + 1)) % vocab
        noise = torch.rand(seq.shape, generator=g) < 0.1
        self.data = torch.where(noise, torch.randint(0, vocab, seq.shape, generator=g), seq)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        row = self.data[i]
        return row[:-1], row[1:]


class Recorder(GPTModule):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.losses.append(loss.detach().float().item())
        return loss


def run(cfg: str, args: argparse.Namespace) -> list[float]:
    stage, accumulate, clip = cfg.split(":")
    pl.seed_everything(0, verbose=False)
    model = Recorder(model=GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32), lr=3e-3)
    world = args.devices * args.num_nodes
    micro = args.global_batch // (1 if args.reference else world)
    steps = args.steps * int(accumulate)
    clip_kw = {}
    if clip != "none":
        algo, val = clip.split("=")
        clip_kw = {"gradient_clip_val": float(val), "gradient_clip_algorithm": algo}
    strategy = "auto" if args.reference else f"ampzero_stage_{stage}"
    if not args.reference and (args.strategy_kwargs or args.no_registry):
        from lightning_ampzero.strategy import AmpZeroStrategy

        strategy = AmpZeroStrategy(stage=int(stage), **json.loads(args.strategy_kwargs or "{}"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=strategy,
        max_steps=args.steps, accumulate_grad_batches=int(accumulate), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, **clip_kw,
    )
    # Lightning's injected sampler always shuffles training data; parity needs rank r to get
    # exactly the samples r, r+world, ... of the reference's sequential global batches.
    dataset = PatternData(micro * (1 if args.reference else world) * steps, 32, 256)
    sampler = None
    if not args.reference:
        sampler = DistributedSampler(dataset, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False)
    data = DataLoader(dataset, batch_size=micro, sampler=sampler, shuffle=False)
    trainer.fit(model, data)
    losses = torch.tensor(model.losses, dtype=torch.float64)
    if dist.is_initialized() and not args.reference:
        dist.all_reduce(losses)
        losses /= dist.get_world_size()
    return losses.tolist()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", required=True, help="comma list of stage:accumulate:clip")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--reference", action="store_true")
    p.add_argument("--strategy-kwargs", default="")
    p.add_argument("--no-registry", action="store_true", help="build AmpZeroStrategy directly, not by name")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.use_deterministic_algorithms(True)
    results = {cfg: run(cfg, args) for cfg in args.configs.split(",")}
    if int(os.environ.get("RANK", os.environ.get("GLOBAL_RANK", 0))) == 0 and (not dist.is_initialized() or dist.get_rank() == 0):
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
