"""The torch 2.11 paths of zero/groups.py ([Note: FSDP2 across torch versions]), run on the torch CI has.

CI's torch (2.13) has what those paths stand in for, so each test here forces the torch 2.11 path
and checks it against 2.13's own mechanism: the same parameters after the same steps, bit for
bit (2 gloo ranks, a bare loop over FSDP2). The whole CPU suite and the GPU checks also ran on
torch 2.11 itself (README, "On a GPU").
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from _spawn import spawn
from lightning_ampzero.zero import groups


def test_param_groups_reads_a_list_or_the_single_group():
    a, b = object(), object()
    assert groups.param_groups(SimpleNamespace(_fsdp_param_groups=[a, b])) == [a, b]  # torch 2.13
    assert groups.param_groups(SimpleNamespace(_fsdp_param_group=a)) == [a]  # torch 2.11
    assert groups.param_groups(SimpleNamespace(_fsdp_param_group=None)) == []


class _Twice(torch.autograd.Function):
    """Calls ``repeated_post_backward`` twice from inside one backward, as torch 2.11's final callback does."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        group.seen = [groups.repeated_post_backward(group, "a"), groups.repeated_post_backward(group, "b"),
                      groups.repeated_post_backward(group, "a")]
        group.fsdp_params[0].unsharded_param.grad = torch.ones(1)  # a gradient to reduce again: a real call
        group.seen.append(groups.repeated_post_backward(group, "a"))
        return grad, None


def test_a_repeated_post_backward_is_told_apart_only_without_gradients_and_per_caller():
    param = nn.Parameter(torch.zeros(1))
    fp = SimpleNamespace(_unsharded_param=param, unsharded_param=param, unsharded_accumulated_grad=None)
    group = SimpleNamespace(fsdp_params=[fp])
    x = torch.ones(1, requires_grad=True)
    _Twice.apply(x, group).sum().backward()
    # caller "a" twice: the repeat; caller "b" its own first; with a gradient: a real call again.
    assert group.seen == [False, False, True, False]
    assert groups.repeated_post_backward(group, "a") is False  # outside a backward: never a repeat


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, branch: int) -> torch.Tensor:
        h = self.shared(x)
        return (self.a(h) if branch == 0 else self.b(h)).pow(2).mean()


def _unused_body(rank: int, world_size: int, by_hand: bool) -> list[list[float]]:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ampzero.config import ZeroConfig
    from lightning_ampzero.zero import unused
    from lightning_ampzero.zero.apply import apply_zero

    torch.manual_seed(0)
    model = _Net()
    apply_zero(model, init_device_mesh("cpu", (world_size,)), ZeroConfig(stage=2))
    tracker = unused.UnusedTracker(None)
    tracker.install(model)
    if by_hand:  # torch 2.11: FSDP2 ignores the flag, the tracker gives the zero gradients itself
        unused.FSDP2_REDUCES_UNUSED = False
        for group in groups.param_groups(model._get_fsdp_state()):
            group.reduce_scatter_unused_params = False
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        model(torch.randn(4, 8, generator=gen), branch=rank).backward()  # rank 0 uses a, rank 1 b
        opt.step()
        opt.zero_grad()
    return [p.full_tensor().flatten().tolist() for p in model.parameters()]


@pytest.mark.skipif(not groups.FSDP2_REDUCES_UNUSED, reason="compares with torch 2.13's own option")
def test_zero_gradients_by_hand_reduce_as_fsdp2s_unused_option():
    native = spawn(_unused_body, world_size=2, args=(False,), timeout=120)
    by_hand = spawn(_unused_body, world_size=2, args=(True,), timeout=120)
    assert native[0] == native[1] and by_hand[0] == by_hand[1]
    assert by_hand[0] == native[0]


def _reset_body(rank: int, world_size: int, by_hand: bool) -> list[list[float]]:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ampzero.config import ZeroConfig
    from lightning_ampzero.zero.apply import apply_zero

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 1))
    apply_zero(model, init_device_mesh("cpu", (world_size,)), ZeroConfig(stage=3, reduce_bucket_size=200))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for step in range(4):
        x = torch.randn(4, 8, generator=gen)
        if step == 1:  # a backward interrupted half-way, on every rank
            out = model(x).sum()
            hook = model[2].weight.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))
            with pytest.raises(RuntimeError, match="boom"):
                out.backward()
            hook.remove()
            if by_hand:
                with pytest.MonkeyPatch.context() as mp:
                    mp.delattr(FSDPModule, "reset_iter_state")  # as on torch 2.11
                    groups.reset_iter_state(model)
            else:
                model.reset_iter_state()
            for p in model.parameters():
                p.grad = None
            continue
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    return [p.full_tensor().flatten().tolist() for p in model.parameters()]


@pytest.mark.skipif(not hasattr(FSDPModule, "reset_iter_state"), reason="compares with torch 2.13's own reset")
def test_the_reset_by_hand_trains_on_as_fsdp2s_reset_iter_state():
    native = spawn(_reset_body, world_size=2, args=(False,), timeout=120)
    by_hand = spawn(_reset_body, world_size=2, args=(True,), timeout=120)
    assert native[0] == native[1]
    assert by_hand == native
