"""Hugging Face GPT-2 (tied lm_head) and ViT (parameters on ViTEmbeddings) through Lightning; losses as JSON.

Run as a script (never inside pytest: Lightning's launcher re-runs the command line for the other
rank). Each configuration is ``model:stage:reduce_bucket_size:precision`` (bucket 0: the
default). The model is built in ``__init__``; every rank reads its own samples; the recorded
losses are the mean over ranks of each micro-batch's loss.
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import lightning.pytorch as pl

from lightning_ampzero.process import run_and_exit


class Samples(Dataset):
    def __init__(self, kind: str, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.kind = kind
        if kind == "gpt2":
            self.x = torch.randint(0, 64, (n, 9), generator=g)
        else:
            self.x = torch.randn(n, 3, 8, 8, generator=g)
            self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return (self.x[i],) if self.kind == "gpt2" else (self.x[i], self.y[i])


class HFModule(pl.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        import transformers as t

        self.kind = kind
        if kind == "gpt2":
            cfg = t.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
                               eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
            self.model = t.GPT2LMHeadModel(cfg)
        else:
            cfg = t.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                              image_size=8, patch_size=4, num_labels=3, hidden_dropout_prob=0.0,
                              attention_probs_dropout_prob=0.0)
            self.model = t.ViTForImageClassification(cfg)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        if self.kind == "gpt2":
            loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        else:
            loss = self.model(pixel_values=batch[0], labels=batch[1]).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run(cfg: str, args: argparse.Namespace) -> list[float]:
    from lightning_ampzero.strategy import AmpZeroStrategy

    kind, stage, bucket, precision = cfg.split(":")
    pl.seed_everything(0, verbose=False)
    model = HFModule(kind)
    strategy = AmpZeroStrategy(stage=int(stage), **({"reduce_bucket_size": int(bucket)} if int(bucket) else {}))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision=precision, max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0)
    data = Samples(kind, 4 * 2 * args.steps)
    sampler = DistributedSampler(data, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False)
    trainer.fit(model, DataLoader(data, batch_size=4, sampler=sampler))
    losses = torch.tensor(model.losses, dtype=torch.float64)
    dist.all_reduce(losses)
    return (losses / dist.get_world_size()).tolist()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", required=True, help="comma list of model:stage:reduce_bucket_size:precision")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    results = {cfg: run(cfg, args) for cfg in args.configs.split(",")}
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
