"""What the strategy calls to set offload up: the FSDP2 parameter-offload policy, the NVMe
directory, and the optimizer wrapping (``strategy.py`` documents where each runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from lightning_ampzero.config import OffloadConfig
from lightning_ampzero.offload.optimizer import OffloadedAdam, is_offloaded


def param_offload_policy(config: OffloadConfig, device: torch.device, warn: Callable[[str], None]) -> Any:
    """FSDP2's offload policy for ``offload_param`` (stage 3); ``None`` = no offload.

    [Note: parameter offload needs an accelerator] FSDP2's ``CPUOffloadPolicy`` keeps the
    parameter shards (and their gradients) in host memory and copies them to the accelerator for
    each all-gather. With ``accelerator="cpu"`` the shards are in host memory already: there is
    nothing to offload, and the policy itself fails there (it pins memory). So on CPU the setting
    is accepted (a config, or ``ampzero_stage_3_offload``, runs unchanged on a CPU machine) and a
    warning says it does nothing there.
    """
    if config.offload_param == "none":
        return None
    if device.type == "cpu":
        warn(
            "offload.offload_param='cpu' has no effect with accelerator='cpu': it keeps stage-3 parameter shards in"
            " host memory and copies them to the accelerator for each all-gather, and here the parameters live in"
            " host memory already. (FSDP2's CPUOffloadPolicy is not applied: it needs an accelerator.)"
        )
        return None
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=config.pin_memory)


def param_init_device(config: OffloadConfig, device: torch.device) -> torch.device:
    """Where a meta-built model is materialized: the host when its shards are offloaded."""
    return torch.device("cpu") if config.offload_param == "cpu" and device.type != "cpu" else device


def resolve_nvme_dir(config: OffloadConfig, default_root_dir: str, warn: Callable[[str], None]) -> Optional[Path]:
    """The directory for NVMe swap files: ``nvme_path``, or ``<default_root_dir>/ampzero_nvme`` (with a warning)."""
    if config.offload_optimizer != "nvme":
        return None
    if config.nvme_path is not None:
        return Path(config.nvme_path)
    path = Path(default_root_dir) / "ampzero_nvme"
    path.mkdir(parents=True, exist_ok=True)
    warn(
        f"offload.offload_optimizer='nvme' without offload.nvme_path: swapping optimizer state to {path} (under the"
        " Trainer's default_root_dir). Set nvme_path to a directory on a fast local NVMe drive."
    )
    return path


def wrap_optimizers(optimizers: Sequence[Any], config: OffloadConfig, *, nvme_dir: Optional[Path],
                    rank: int) -> list[Any]:
    """Replace each optimizer by an :class:`OffloadedAdam` over it (``offload_optimizer`` cpu / nvme)."""
    if config.offload_optimizer == "none":
        return list(optimizers)
    return [o if is_offloaded(o) else OffloadedAdam(o, config, nvme_dir=nvme_dir, rank=rank) for o in optimizers]


def close_optimizers(optimizers: Sequence[Any]) -> None:
    """Free offload buffers and delete NVMe swap files."""
    for o in optimizers:
        o = getattr(o, "_optimizer", o)
        if isinstance(o, OffloadedAdam):
            o.close()
