"""Evaluate from a single-file checkpoint that Lightning's ddp wrote.

``--phase ddp --file F``: fit 3 steps with Lightning's ``ddp``, save F (one file), validate;
writes the validation loss. ``--phase ampzero --stage K --file F``: a model initialised from
another seed, validated as it is and then with ``ckpt_path=F``; writes both losses.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import lightning.pytorch as pl

from lightning_ampzero.models.gpt import GPTConfig, GPTModule
from lightning_ampzero.process import run_and_exit

from parity import PatternData


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=["ddp", "ampzero"], required=True)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--file", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    pl.seed_everything(0 if args.phase == "ddp" else 1, verbose=False)
    model = GPTModule(model=GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32), lr=3e-3)
    strategy = "ddp" if args.phase == "ddp" else f"ampzero_stage_{args.stage}"
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    data = DataLoader(PatternData(24, 32, 256), batch_size=4)
    result: dict = {}
    if args.phase == "ddp":
        trainer.fit(model, data)
        trainer.save_checkpoint(args.file)
        result["val_loss"] = trainer.validate(model, data, verbose=False)[0]["val_loss"]
    else:
        result["val_loss_own_weights"] = trainer.validate(model, data, verbose=False)[0]["val_loss"]
        result["val_loss"] = trainer.validate(model, data, ckpt_path=args.file, verbose=False)[0]["val_loss"]
        # the weights themselves, gathered: those of the file
        saved = torch.load(args.file, weights_only=False)["state_dict"]
        got = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        result["max_weight_diff"] = max(float((got[k].float() - v.float()).abs().max()) for k, v in saved.items())
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
