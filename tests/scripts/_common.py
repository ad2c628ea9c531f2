"""What several training scripts share."""

from __future__ import annotations

from torch import nn


def full_params(module: nn.Module) -> dict[str, list[float]]:
    """Every parameter of ``module`` whole (a sharded DTensor gathered; a collective at stages 1-3), as JSON lists."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist()
            for n, p in module.named_parameters()}


def full_state(module: nn.Module) -> dict[str, list[float]]:
    """``module.state_dict()`` whole (parameters and buffers; sharded DTensors gathered, a collective), as JSON lists."""
    return {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().flatten().tolist()
            for n, t in module.state_dict().items()}
