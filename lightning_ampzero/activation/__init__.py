"""Activation checkpointing (ZeRO-R): which blocks, full or selective, checkpoints in CPU memory
(docs/activation_checkpointing.md)."""

from lightning_ampzero.activation.apply import (
    SAVE_OPS,
    ActivationCheckpointing,
    apply_activation_checkpointing,
    select_blocks,
)
from lightning_ampzero.activation.measure import count_flops, saved_activations
from lightning_ampzero.activation.saved import BufferPool, SavedInputsHooks

__all__ = [
    "SAVE_OPS",
    "ActivationCheckpointing",
    "BufferPool",
    "SavedInputsHooks",
    "apply_activation_checkpointing",
    "count_flops",
    "saved_activations",
    "select_blocks",
]
