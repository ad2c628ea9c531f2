"""ZeRO-Offload / ZeRO-Infinity: optimizer state on the host or NVMe, parameters on the host (docs/offload.md)."""

from lightning_ampzero.offload.optimizer import OffloadedAdam, is_offloaded
from lightning_ampzero.offload.store import HostStore, NvmeOffloadError, NvmeStore

__all__ = ["HostStore", "NvmeOffloadError", "NvmeStore", "OffloadedAdam", "is_offloaded"]
