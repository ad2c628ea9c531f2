"""register_root_method: a step method that calls forward gathers the root once per micro-batch.

Lightning calls ``training_step``, which usually calls ``self(x)``: two nested forwards of the
root FSDP2 group. Below stage 3 the root stays gathered from forward to backward, so one
forward + backward costs one all-gather of it (counted at the c10d dispatcher), not two.
"""

from __future__ import annotations

import torch
from torch import nn

from _spawn import spawn


class Root(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        return self.body(x)

    def training_step(self, x):
        return self(x).square().mean()  # the usual LightningModule: the step calls forward


def _gathers(register):
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ampzero.config import ZeroConfig
    from lightning_ampzero.zero.apply import apply_zero
    from test_zero_lowp_units import _collectives

    torch.manual_seed(0)
    model = Root()
    apply_zero(model, init_device_mesh("cpu", (2,)), ZeroConfig(stage=1))  # fits one bucket: the root is the unit
    register(model, "training_step")
    counts = []
    for _ in range(2):
        mode = _collectives()
        with mode:
            model.training_step(torch.randn(4, 8)).backward()
        counts.append(sum(1 for op, _ in mode.calls if op == "allgather_base"))
    return counts


def _body(rank, world_size):
    from torch.distributed.fsdp import register_fsdp_forward_method

    from lightning_ampzero.zero.apply import register_root_method

    return {"ours": _gathers(register_root_method), "torch": _gathers(register_fsdp_forward_method)}


def test_nested_forward_keeps_the_root_gathered_until_backward():
    for r in spawn(_body, world_size=2):
        assert r["ours"] == [1, 1]
        assert r["torch"] == [2, 2]  # what torch's registration does: re-gathered for backward
