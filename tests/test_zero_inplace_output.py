"""A group's forward output modified in place ([Note: a group's output modified in place] in
lightning_ampzero/zero/apply.py): ``h = self.fc2(...); h += x`` and logits scaled in place, at stage 3.

A Linear on a 3-D input returns a view, and an in-place op on a view drops FSDP2's pre-backward hook:
the group was freed when backward reached it ("setStorage ... storage of size 0"). Now the in-place
model trains bit for bit as the same model written out of place.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from _spawn import spawn


class Block(nn.Module):
    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(32), nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        h = self.fc2(torch.tanh(self.fc1(self.ln(x))))  # a view: the Linear's input is 3-D
        if self.in_place:
            h += x
            return h
        return h + x


class Net(nn.Module):
    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place
        self.inp = nn.Linear(8, 32)
        self.blocks = nn.Sequential(*[Block(in_place) for _ in range(3)])
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        logits = self.head(self.blocks(self.inp(x)))
        if self.in_place:
            logits.mul_(0.5)  # the head's unit ends on a Linear: its output is modified in place too
            return logits
        return logits * 0.5


def _body(rank, world_size, precision):
    import contextlib

    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ampzero.config import PrecisionConfig, ZeroConfig
    from lightning_ampzero.precision.policy import dtype_plan, fsdp_policies
    from lightning_ampzero.zero.apply import apply_zero

    out = {}
    for in_place in (False, True):
        torch.manual_seed(0)
        model = Net(in_place)
        mp, policies = fsdp_policies(dtype_plan(precision, PrecisionConfig()), model, 3)
        # a unit per block, nothing persistent; under bf16-mixed each block's Linears are a group
        cfg = ZeroConfig(stage=3, reduce_bucket_size=3e3, param_persistence_threshold=0)
        apply_zero(model, init_device_mesh("cpu", (2,)), cfg, mp, module_policies=policies)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16-mixed" \
            else contextlib.nullcontext
        losses = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(10 * rank + step))
                with autocast():
                    loss = model(x).float().pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        out[in_place] = {"losses": losses, "warned": sum("returned a view tensor" in str(w.message) for w in caught),
                         "params": {n: p.full_tensor() for n, p in model.named_parameters()}}
    return out


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_group_output_modified_in_place_trains_as_out_of_place(precision):
    for r in spawn(_body, world_size=2, args=(precision,)):
        assert r[True]["losses"] == r[False]["losses"]
        assert all(torch.equal(r[True]["params"][n], p) for n, p in r[False]["params"].items())
        assert r[True]["warned"] == 0  # FSDP2's warning about the hazard, now handled
