"""Precision: loss scaling (and, in plugin.py, the Lightning precision plugin).

Modules: scaler.py (DeepSpeed's loss scaler behind GradScaler's interface), policy.py (which
dtype each part of a step runs in, per precision: FSDP2 policies, DDP reduce dtypes),
ddp.py (stage 0: per-forward compute copies, per-parameter reduce dtypes), schedulers.py (LR
schedulers that hold on skipped steps), plugin.py (AmpZeroPrecision, the only one importing
Lightning). User documentation: docs/precision.md.

Importing this package must not import Lightning: the scaler is usable on its own.
"""

from lightning_ampzero.precision.scaler import (
    DynamicLossScaler,
    LossScaleAtMinimumError,
    NoLossScaler,
    create_loss_scaler,
    nonfinite_grad_names,
    unscale_and_check_,
)

__all__ = [
    "DynamicLossScaler",
    "LossScaleAtMinimumError",
    "NoLossScaler",
    "create_loss_scaler",
    "nonfinite_grad_names",
    "unscale_and_check_",
]
