"""Initialisation that gives the same values whether a parameter is whole or sharded.

Each parameter's full value is drawn from a generator seeded by (seed, its qualified name),
on CPU, one parameter at a time; a sharded parameter (FSDP2 DTensor) keeps only its local
chunk. So a model built on the meta device and initialised after sharding (ZeRO-3 never
holds the whole model on one rank) starts from exactly the weights a single process would
use, which is what makes parity tests against an unsharded run meaningful. Peak memory is
one full parameter, not the model.
"""

from __future__ import annotations

import zlib
from typing import Callable

import torch
from torch import nn


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


@torch.no_grad()
def fill_(param: torch.Tensor, full_value: torch.Tensor) -> None:
    """Write ``full_value`` (the unsharded value) into ``param``, keeping only the local shard of a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds the same full value, so slice locally, no collective.
        local = distribute_tensor(
            full_value.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        param.to_local().copy_(local.to(param.device))
    else:
        param.copy_(full_value.to(device=param.device, dtype=param.dtype))


@torch.no_grad()
def init_parameters_(module: nn.Module, seed: int, rule: Callable[[str, torch.Size, torch.Generator], torch.Tensor]) -> None:
    """Initialise every parameter of ``module``: ``rule(name, full_shape, generator)`` returns its full value."""
    for name, param in module.named_parameters():
        # On CPU whatever the caller's default device: Lightning's `init_module()` on a GPU makes
        # CUDA the default, and a CPU generator then fails to draw (`Expected a 'cuda' device type
        # for generator`), which stopped the main job on every GPU.
        with torch.device("cpu"):
            value = rule(name, param.shape, _generator(seed, name))
        fill_(param, value)
