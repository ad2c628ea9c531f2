"""A Hugging Face wav2vec2 with layerdrop, whose ranks draw different layers to drop
([Note: layers dropped on some ranks] in lightning_ampzero/zero/unused.py).

Reference: Lightning's ``ddp_find_unused_parameters_true`` on the same model with transformers'
synced mode turned on by hand (every module's ``_is_fsdp_managed_module``, which ``fully_shard``
sets at stages 1-3): every rank runs every layer. What a dropped layer's output becomes in that
mode is transformers' choice, so the comparison holds for any version. The JSON holds, per
system, the final parameters; the reference without the mode (plain ddp, dropping layers, which
must differ, or the ranks drew alike and the test could not fail); and the warnings of the runs.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from transformers import Wav2Vec2Config, Wav2Vec2Model

import lightning.pytorch as pl

from _common import full_params

from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy


class Module(pl.LightningModule):
    def __init__(self, synced_by_hand: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        # No dropout or masking: the only randomness is layerdrop's draw per layer.
        config = Wav2Vec2Config(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
                                conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                num_conv_pos_embedding_groups=2, layerdrop=0.5, hidden_dropout=0.0,
                                attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
                                mask_time_prob=0.0)
        self.model = Wav2Vec2Model(config)
        if synced_by_hand:
            for m in self.model.modules():
                m._is_fsdp_managed_module = True

    def training_step(self, batch, i):
        # Each rank its own draws, as ranks get once their batches differ in length (a CPU
        # generator's draws per dropout mask depend on the tensor's size).
        torch.manual_seed(100 * self.global_rank + i)
        return self.model(batch[0]).last_hidden_state.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _run(strategy, synced_by_hand: bool = False, warned: list | None = None) -> dict[str, list[float]]:
    pl.seed_everything(0, verbose=False)
    module = Module(synced_by_hand)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    data = TensorDataset(torch.randn(16, 400, generator=torch.Generator().manual_seed(1)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(data, batch_size=2))
    if warned is not None:
        warned.extend(str(w.message) for w in caught)
    return full_params(module)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = {"ddp/synced": _run("ddp_find_unused_parameters_true", synced_by_hand=True),
           "ddp/dropping": _run("ddp_find_unused_parameters_true")}
    warned: list[str] = []
    for stage in (1, 2, 3):
        out[f"stage{stage}"] = _run(AmpZeroStrategy(stage=stage), warned=warned)
    out["warning"] = "\n".join(warned)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
