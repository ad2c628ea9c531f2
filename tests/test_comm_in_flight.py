"""Collectives left in flight on gloo (issue 16; [Note: reduce-scatters in flight] in
lightning_ampzero/zero/comm.py, and the asynchronous forward prefetch of stages 1-2 in
zero/apply.py): the gradients are complete when ``backward()`` returns and training is bit for bit
that of the blocking collectives, the overlap is really taken where FSDP2 only views the output,
and not where something reads it during backward (accumulation, a post-accumulate-grad hook)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _spawn import spawn


def _blocking(model: nn.Module) -> None:
    """Turn every overlap of ``apply_zero`` off: the reference layout (same groups, same collectives)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_modules_to_forward_prefetch([])
            m._set_unshard_async_op(False)
            group = m._get_fsdp_state()._fsdp_param_group
            if group is not None and hasattr(group._reduce_scatter_comm, "overlap"):
                group._reduce_scatter_comm.overlap = False


def _body(rank: int, world: int, stage: int, mixed: bool, forced: bool, accumulate: int, hook: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    from lightning_ampzero.config import ZeroConfig
    from lightning_ampzero.zero import comm
    from lightning_ampzero.zero.apply import apply_zero, no_sync

    if forced:  # every collective by the ring, whatever its size
        comm.GLOO_REDUCE_SCATTER_MIN_NUMEL = comm.GLOO_ALL_GATHER_MIN_NUMEL = 0
    launched: list[bool] = []  # per reduce-scatter: left in flight or not
    launch = comm._launch

    def counting_launch(steps, *, later: bool):  # type: ignore[no-untyped-def]
        launched.append(later)
        return launch(steps, later=later)

    comm._launch = counting_launch
    async_gathers = []
    steps_work = comm._StepsWork

    class CountingWork(steps_work):  # type: ignore[misc,valid-type]
        def __init__(self, steps):  # type: ignore[no-untyped-def]
            async_gathers.append(1)
            super().__init__(steps)

    comm._StepsWork = CountingWork
    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(24, 40), nn.LayerNorm(40), nn.Linear(40, 24))
                                for _ in range(3)], nn.Linear(24, 7))
        policies = {}
        if mixed:  # "-mixed" below stage 3: the Linears' gradients travel in bf16 in their unit's group
            policies = {m: comm.CommDtypePolicy(comm_dtype=torch.bfloat16) for m in model.modules()
                        if isinstance(m, nn.Linear)}
        apply_zero(model, mesh, ZeroConfig(stage=stage, reduce_bucket_size=2000, param_persistence_threshold=0),
                   MixedPrecisionPolicy(), module_policies=policies)
        if not overlap:
            _blocking(model)
        seen: list[torch.Tensor] = []
        if hook:  # a reader during backward: FSDP2 calls it right after the output is viewed
            p = next(model.parameters())
            p.register_post_accumulate_grad_hook(lambda q: seen.append(q.grad.to_local().detach().clone()))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        launched.clear()
        async_gathers.clear()
        groups = len({id(m._get_fsdp_state()) for m in model.modules() if isinstance(m, FSDPModule)
                      and m._get_fsdp_state()._fsdp_param_group is not None})
        losses, grads = [], []
        for step in range(3):
            for micro in range(accumulate):
                x = torch.randn(6, 24, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))
                ctx = no_sync(model, stage) if micro < accumulate - 1 else torch.enable_grad()
                with ctx:
                    loss = model(x).float().pow(2).mean()
                    loss.backward()
                losses.append(loss.item())
            # read as the loss scaler or clipping would, the moment backward has returned
            grads.append([q.grad.to_local().detach().clone() for q in model.parameters()])
            opt.step()
            opt.zero_grad()
        out[overlap] = {"losses": losses, "grads": grads, "params": [q.to_local().detach().clone()
                                                                      for q in model.parameters()],
                        "later": list(launched), "groups": groups, "async_gathers": len(async_gathers), "seen": seen,
                        "in_flight_after": len(comm._in_flight)}
    return out


def _check_same(r: dict) -> None:
    a, b = r[False], r[True]
    assert a["losses"] == b["losses"]
    for ga, gb in zip(a["grads"], b["grads"]):
        assert all(torch.equal(x, y) for x, y in zip(ga, gb))
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    assert len(a["seen"]) == len(b["seen"]) and all(torch.equal(x, y) for x, y in zip(a["seen"], b["seen"]))
    assert not any(a["later"]) and a["async_gathers"] == 0  # the reference really blocks
    assert b["in_flight_after"] == 0


@pytest.mark.parametrize(("stage", "mixed", "forced"), [(1, True, False), (2, True, True), (2, False, True),
                                                        (1, False, False)])
def test_collectives_in_flight_train_bit_for_bit_as_blocking_ones(stage, mixed, forced):
    for r in spawn(_body, 2, (stage, mixed, forced, 1, False), timeout=180):
        _check_same(r)
        # every group's reduce-scatter was left in flight, every step
        assert r[True]["groups"] >= 3 and r[True]["later"] == [True] * 3 * r[True]["groups"]
        # and each group's all-gather was prefetched asynchronously, when it is a ring
        assert r[True]["async_gathers"] == (3 * r[True]["groups"] if forced else 0)


def test_collectives_in_flight_on_three_ranks():
    # a ring of 3 has two steps: the second one runs when the next unit starts its reduce-scatter
    for r in spawn(_body, 3, (2, True, True, 1, False), timeout=240):
        _check_same(r)
        assert r[True]["later"] == [True] * 3 * r[True]["groups"]


def test_a_gradient_read_during_backward_keeps_the_reduce_scatter_blocking():
    # Stage 2 with accumulation: the second micro-batch adds into the shard FSDP2 holds, so it
    # must have arrived; a post-accumulate-grad hook reads the gradient at once.
    for r in spawn(_body, 2, (2, True, True, 2, True), timeout=180):
        _check_same(r)
        later, n = r[True]["later"], r[True]["groups"]
        assert len(later) == 6 * n
        # per step: the first micro-batch overlaps but for the hooked parameter's group, the second not at all
        for step in range(3):
            first, second = later[2 * n * step:2 * n * step + n], later[2 * n * step + n:2 * n * (step + 1)]
            assert first.count(False) == 1 and not any(second)
        assert len(r[True]["seen"]) == 6
