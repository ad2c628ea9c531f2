"""ZeRO partitioning on FSDP2: ``apply_zero(model, mesh, cfg)`` and its helpers."""

from lightning_ampzero.zero.apply import apply_zero, fsdp_modules, no_sync
from lightning_ampzero.zero.clip import clip_grad_norm_, clip_grad_value_, global_grad_norm
from lightning_ampzero.zero.init import ZeroInit, take_local_shards
from lightning_ampzero.zero.materialize import materialize_meta_
from lightning_ampzero.zero.units import Unit, find_blocks, group_units

__all__ = [
    "Unit", "ZeroInit", "apply_zero", "clip_grad_norm_", "clip_grad_value_", "find_blocks", "fsdp_modules",
    "global_grad_norm", "group_units", "materialize_meta_", "no_sync", "take_local_shards",
]
