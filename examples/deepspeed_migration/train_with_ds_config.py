"""Train a LightningModule with the DeepSpeed config you already have: AmpZeroStrategy(config="ds_config.json").

    python examples/deepspeed_migration/train_with_ds_config.py examples/deepspeed_migration/ds_configs/zero3_cpu_offload.json
    python examples/deepspeed_migration/train_with_ds_config.py examples/deepspeed_migration/ds_configs/*.json --steps 10 --out results.json
    python examples/deepspeed_migration/train_with_ds_config.py examples/deepspeed_migration/ds_configs/zero3_infinity_nvme_auto.json --nvme-path /tmp/swap

The module below has no ``configure_optimizers``: the config's ``optimizer`` and ``scheduler``
sections are used (DeepSpeed's behaviour). ``gradient_clipping`` and
``gradient_accumulation_steps`` become the Trainer's; ``train_micro_batch_size_per_gpu`` is the
DataLoader's batch size. Offload, ``aio``, ``activation_checkpointing`` and ``msamp`` turn on
the strategy's features. Keys with no effect here are listed in one warning; a misspelt key is
an error. ``--nvme-path`` redirects the NVMe offload of configs that use one (their
``nvme_path``, e.g. ``/local_nvme``, may not exist on this machine). With several configs, each
is trained in turn in the same processes and its losses (or its error) are written to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lightning.pytorch as pl

from lightning_ampzero.data import DataConfig, TextDataModule
from lightning_ampzero.deepspeed import convert_deepspeed_config
from lightning_ampzero.models.gpt import GPT, GPTConfig
from lightning_ampzero.strategy import AmpZeroStrategy


class LitGPT(pl.LightningModule):
    """A GPT with no configure_optimizers: the DeepSpeed config's optimizer section is used."""

    def __init__(self, lr: float = 2e-3) -> None:
        super().__init__()
        self.lr = lr  # what an "auto" lr in the DeepSpeed config resolves to
        self.model_cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32)
        self.model: Any = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(self.model_cfg)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        self.losses.append(float(loss.detach()))
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss


def train(ds_config: str, steps: int, devices: int, nvme_path: Optional[str] = None) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    overrides = {}
    offload = convert_deepspeed_config(ds_config, warn=False).config.offload
    if nvme_path and "nvme" in (offload.offload_optimizer, offload.offload_param):
        overrides["nvme_path"] = nvme_path  # an OffloadConfig field, over the JSON's value
    strategy = AmpZeroStrategy(config=ds_config, **overrides)
    imported = strategy.imported
    batch_size = imported.micro_batch(devices) or 4  # "auto" / absent: our choice
    module = LitGPT()
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False, limit_val_batches=0,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    data = TextDataModule(DataConfig(block_size=32, batch_size=batch_size))
    trainer.fit(module, datamodule=data)
    offload, checkpointing = strategy.config.offload, strategy.activation_checkpointing
    losses = torch.tensor(module.losses, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(losses)
        losses /= dist.get_world_size()
    return {
        "losses": losses.tolist(),
        "stage": strategy.config.zero.stage,
        "precision": str(trainer.precision),
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "gradient_clip_val": trainer.gradient_clip_val,
        "optimizer": type(getattr(trainer.optimizers[0], "optimizer", trainer.optimizers[0])).__name__,
        "optimizer_wrapper": type(trainer.optimizers[0]).__name__,  # OffloadedAdam with offload_optimizer
        "offload": {"optimizer": offload.offload_optimizer, "param": offload.offload_param, "nvme_path": offload.nvme_path},
        "checkpointed_blocks": list(checkpointing.blocks) if checkpointing is not None else [],
        "lr_schedulers": [type(c.scheduler).__name__ for c in trainer.lr_scheduler_configs],
        "optimizer_steps": trainer.global_step,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("configs", nargs="+", help="DeepSpeed JSON config(s)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per config")
    p.add_argument("--devices", type=int, default=2, help="CPU processes")
    p.add_argument("--out", help="write {config: result or error} here as JSON (rank 0)")
    p.add_argument("--nvme-path", help="directory for the NVMe offload swap files of configs that offload to nvme")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    results: dict[str, Any] = {}
    for path in args.configs:
        try:
            results[path] = train(path, args.steps, args.devices, args.nvme_path)
        except Exception as e:  # keep going: report which configs did not train, and why
            if len(args.configs) == 1:
                raise
            results[path] = {"error": f"{type(e).__name__}: {e}"}
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        for path, r in results.items():
            status = r.get("error") or f"loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}"
            print(f"{path}: {status}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
