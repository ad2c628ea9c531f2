"""Fine-tune a Hugging Face causal LM from a local directory at ZeRO stage 3, then export it.

    python examples/hf_finetune/finetune.py --make-tiny-model /tmp/tiny-llama   # nothing to download
    python examples/hf_finetune/finetune.py --model-dir /tmp/tiny-llama --out /tmp/tiny-llama-ft

The model is built in ``configure_model()`` with ``lightning_ampzero.hf.from_pretrained``: at
stage 3 it is partitioned while it is built, and strategy "ampzero" streams each process's
shard of the weights out of the safetensors files in setup (no process reads the whole model).
After training, ``lightning_ampzero.hf.save_pretrained`` gathers one tensor at a time and writes a
directory that ``AutoModelForCausalLM.from_pretrained(out)`` loads. The same directory can be
made later from the sharded checkpoint: ``ampzero-consolidate CKPT OUT --hf-config MODEL_DIR``.

Tokens are the bytes of the Shakespeare text shipped with the package (vocabulary 256, no
tokenizer): swap in your tokenized dataset for a real model. 2 CPU processes, about a minute.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_ampzero.hf as hf
from lightning_ampzero import AmpZeroStrategy
from lightning_ampzero.data import DataConfig, TextDataModule


class CausalLMFineTune(pl.LightningModule):
    def __init__(self, model_dir: str, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()

    def configure_model(self) -> None:
        if hasattr(self, "model"):  # fit, then validate/test: keep the trained model
            return
        from transformers import AutoModelForCausalLM

        # Built from the directory's config.json; the weights stream in when the strategy sets up.
        self.model = hf.from_pretrained(AutoModelForCausalLM, self.hparams.model_dir)
        # from_pretrained returns eval mode, as transformers' does; Lightning keeps a module's mode
        # (and warns "Found N module(s) in eval mode"), so train mode is set here, as HF's Trainer does
        self.model.train()

    def _loss(self, batch) -> torch.Tensor:
        x, y = (t.long() for t in batch)  # byte windows: input and next-byte target
        logits = self.model(input_ids=x).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def make_tiny_model(path: Path) -> None:
    """A 2-layer Llama with random weights, saved as a Hugging Face model directory (sharded, with an index)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, bos_token_id=0,
                         eos_token_id=0)
    LlamaForCausalLM(config).save_pretrained(str(path), max_shard_size="200KB")
    print(f"wrote {path}: {sorted(p.name for p in path.iterdir())}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, help="a save_pretrained directory (config.json + safetensors)")
    p.add_argument("--make-tiny-model", type=Path, metavar="DIR", help="write a tiny random Llama to DIR and exit")
    p.add_argument("--out", type=Path, default=None, help="export directory (default: <model-dir>-finetuned)")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()
    if args.make_tiny_model:
        make_tiny_model(args.make_tiny_model)
        return
    if args.model_dir is None:
        p.error("pass --model-dir DIR (or --make-tiny-model DIR first)")
    out = args.out or args.model_dir.with_name(args.model_dir.name + "-finetuned")

    pl.seed_everything(0)
    module = CausalLMFineTune(str(args.model_dir), lr=args.lr)
    data = TextDataModule(DataConfig(block_size=64, batch_size=8))
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=AmpZeroStrategy(stage=args.stage),
        max_steps=args.max_steps, limit_val_batches=4, val_check_interval=args.max_steps // 2,
        logger=False, callbacks=[ModelCheckpoint(dirpath=out.with_name(out.name + "-ckpt"), save_last=True)],
    )
    trainer.fit(module, datamodule=data)

    # Every process takes part (each tensor is gathered from the shards); process 0 writes.
    hf.save_pretrained(module.model, out)
    if trainer.is_global_zero:
        print(f"final train_loss={float(trainer.callback_metrics['train_loss']):.3f}"
              f" val_loss={float(trainer.callback_metrics['val_loss']):.3f}")
        print(f"exported to {out}: {sorted(p.name for p in out.iterdir())}")
        print(f"load it with: AutoModelForCausalLM.from_pretrained({str(out)!r})")


if __name__ == "__main__":
    main()
