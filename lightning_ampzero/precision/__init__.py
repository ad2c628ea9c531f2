"""Precision: loss scaling (and, in plugin.py, the Lightning precision plugin).

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
