"""A LightningCLI script, as users write one: ``python lightning_cli.py fit --config cfg.yaml``.

The strategy comes from the YAML (``class_path``/``init_args``) or from flags
(``--trainer.strategy.stage=3``), as DeepSpeedStrategy's do ([Note: keywords a LightningCLI
sees] in strategy.py). After the fit, rank 0 writes to $AMPZERO_TEST_OUT the strategy it got
and the trained weights (gathered at stages 1-3), for a comparison with the same run under ddp.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

from _common import full_params

from lightning_ampzero.process import run_and_exit


def main() -> None:
    cli = LightningCLI(BoringModel, BoringDataModule, save_config_callback=None)
    strategy = cli.trainer.strategy
    config = getattr(strategy, "config", None)
    weights = full_params(cli.model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(os.environ["AMPZERO_TEST_OUT"]).write_text(json.dumps({
            "strategy": type(strategy).__name__,
            "world_size": cli.trainer.world_size,
            "steps": cli.trainer.global_step,
            "stage": config.zero.stage if config else None,
            "reduce_bucket_size": config.zero.reduce_bucket_size if config else None,
            "offload_optimizer": config.offload.offload_optimizer if config else None,
            "weights": weights,
        }))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
