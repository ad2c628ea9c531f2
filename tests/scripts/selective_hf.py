"""A Hugging Face BERT classifier at ZeRO stage 3 under a "-mixed" precision, with and without
``selective`` activation checkpointing ([Note: sharding hooks inside a selectively checkpointed
block] in lightning_ampzero/activation/apply.py): writes (torch.save, rank 0) the final parameters
of each, gathered.

    python selective_hf.py PRECISION --out FILE
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl

from lightning_ampzero import AmpZeroStrategy
from lightning_ampzero.process import run_and_exit


class Classifier(pl.LightningModule):
    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            import transformers

            torch.manual_seed(0)
            self.model = transformers.BertForSequenceClassification(transformers.BertConfig(
                hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=128,
                num_labels=3, max_position_embeddings=64))

    def training_step(self, batch, i):
        return self.model(input_ids=batch[0], labels=batch[1]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(precision: str, mode: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, 128, (16, 16), generator=g), torch.randint(0, 3, (16,), generator=g))
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=2, precision=precision, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         strategy=AmpZeroStrategy(stage=3, activation_checkpointing=mode))
    module = Classifier()
    trainer.fit(module, DataLoader(data, batch_size=4))
    return {k: v.full_tensor().detach().clone() for k, v in module.model.state_dict().items() if hasattr(v, "full_tensor")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("precision")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    result = {mode: fit(args.precision, mode) for mode in ("none", "selective")}
    if torch.distributed.get_rank() == 0:
        torch.save(result, args.out)


if __name__ == "__main__":
    run_and_exit(main)
