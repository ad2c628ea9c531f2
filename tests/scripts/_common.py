"""What several training scripts share."""

from __future__ import annotations

from torch import nn


def full_params(module: nn.Module) -> dict[str, list[float]]:
    """Every parameter of ``module`` whole (a sharded DTensor gathered; a collective at stages 1-3), as JSON lists."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist()
            for n, p in module.named_parameters()}


def full_state(module: nn.Module) -> dict[str, list[float]]:
    """The parameters and buffers the module holds, whole (sharded DTensors gathered, a collective), as JSON lists.

    Read from the module's attributes, as a user's code reads them, not through ``state_dict()``,
    whose FSDP2 hook reshards first and so hides a stale gathered copy.
    """
    return {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().flatten().tolist()
            for n, t in [*module.named_parameters(), *module.named_buffers()]}


def full_tensors(module: nn.Module) -> dict:
    """Every parameter of ``module`` whole (a sharded DTensor gathered; a collective at stages 1-3), as tensors."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in module.named_parameters()}


def quiet_trainer(strategy, root, steps: int):
    """A 2-rank CPU Trainer for ``steps`` optimizer steps that writes nothing but its own checkpoints."""
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(root))


def fit_until_sigterm(trainer, module, loader, out: str, rank: int) -> None:
    """``trainer.fit``; then write ``<out>.<rank>.json``: the batches ``module.trained`` recorded and how the fit ended."""
    import json

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    ended = "finished"
    try:
        trainer.fit(module, train_dataloaders=loader)
    except SIGTERMException:
        ended = "sigterm"
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"trained": module.trained, "ended": ended, "global_step": trainer.global_step}, f)
