"""The smallest use of lightning_ampzero: `Trainer(strategy="ampzero")` on a LightningModule.

    python examples/minimal_trainer.py            # 2 CPU processes, ZeRO stage 2, ~30 s

Nothing else changes in a Lightning script: "ampzero" is ZeRO stage 2 (optimizer states and
gradients sharded over the processes); "ampzero_stage_0" ... "ampzero_stage_3" pick a stage, and
`AmpZeroStrategy(stage=3, reduce_bucket_size=5e7, ...)` takes any field of the typed config.
"""

import lightning.pytorch as pl

import lightning_ampzero  # noqa: F401  registers the strategy names (an installed package does it by itself)
from lightning_ampzero.data import DataConfig, TextDataModule
from lightning_ampzero.models.gpt import GPTConfig, GPTModule


def main() -> None:
    pl.seed_everything(0)
    # The GPT is built in configure_model(), so stage 3 can build it sharded from the start.
    model = GPTModule(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32), lr=3e-3)
    data = TextDataModule(DataConfig(block_size=32, batch_size=16))  # the Shakespeare corpus shipped with the package
    trainer = pl.Trainer(
        strategy="ampzero",
        accelerator="cpu",
        devices=2,
        max_steps=60,
        limit_val_batches=4,
        val_check_interval=30,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        print(f"final train_loss={float(trainer.callback_metrics['train_loss']):.3f}"
              f" val_loss={float(trainer.callback_metrics['val_loss']):.3f}")


if __name__ == "__main__":
    main()
