"""Collectives left in flight on gloo (issue 16; [Note: reduce-scatters in flight] in
lightning_ampzero/zero/comm.py, stages 1-3, and the asynchronous forward prefetch of stages 1-2 in
zero/apply.py): the gradients are complete when ``backward()`` returns and training is bit for bit
that of the blocking collectives, the overlap is really taken where FSDP2 only views the output,
and not where something reads it during backward (accumulation, a post-accumulate-grad hook)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _spawn import spawn


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
        if mixed:  # "-mixed": the Linears' gradients travel in bf16 in their unit's group (and at stage 3
            # are gathered in it, under autocast, as fsdp_policies asks)
            low = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16, "gather_dtype": torch.bfloat16,
                   "cast_forward_inputs": True} if stage == 3 else {}
            policies = {m: comm.CommDtypePolicy(comm_dtype=torch.bfloat16, **low) for m in model.modules()
                        if isinstance(m, nn.Linear)}
        # the reference: the same groups and collectives, with zero.overlap_comm=False
        apply_zero(model, mesh, ZeroConfig(stage=stage, reduce_bucket_size=2000, param_persistence_threshold=0,
                                           overlap_comm=overlap),
                   MixedPrecisionPolicy(), module_policies=policies)
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
                with ctx, torch.autocast("cpu", torch.bfloat16, enabled=mixed and stage == 3):
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
    assert not any(a["later"]) and a["async_gathers"] == 0  # overlap_comm=False really blocks
    assert b["in_flight_after"] == 0


@pytest.mark.parametrize(("stage", "mixed", "forced"), [(1, True, False), (2, True, True), (2, False, True),
                                                        (1, False, False), (3, True, True), (3, False, False)])
def test_collectives_in_flight_train_bit_for_bit_as_blocking_ones(stage, mixed, forced):
    for r in spawn(_body, 2, (stage, mixed, forced, 1, False), timeout=180):
        _check_same(r)
        # every group's reduce-scatter was left in flight, every step
        assert r[True]["groups"] >= 3 and r[True]["later"] == [True] * 3 * r[True]["groups"]
        # and (stages 1-2) each group's all-gather was prefetched asynchronously, when it is a ring
        assert r[True]["async_gathers"] == (3 * r[True]["groups"] if forced and stage < 3 else 0)


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


def _read_during_backward(rank: int, world: int, overlap: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_ampzero.config import ZeroConfig
    from lightning_ampzero.zero import comm
    from lightning_ampzero.zero.apply import apply_zero

    comm.GLOO_REDUCE_SCATTER_MIN_NUMEL = comm.GLOO_ALL_GATHER_MIN_NUMEL = 0  # every collective by the ring
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 24)) for _ in range(3)])
    apply_zero(model, mesh=init_device_mesh("cpu", (world,)), cfg=ZeroConfig(
        stage=2, reduce_bucket_size=2000, overlap_comm=overlap), mp_policy=MixedPrecisionPolicy())
    later = model[1][2].weight  # its group's reduce-scatter is the latest one when block 0's backward starts
    seen: list[torch.Tensor] = []
    # A user's hook on the gradient of block 0's output reads block 1's gradient (a norm, a log).
    def hook_output(module, args, out):  # type: ignore[no-untyped-def]
        out.register_hook(lambda g: seen.append(later.grad.to_local().detach().clone()))

    model[0].register_forward_hook(hook_output)
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).mean().backward()
    return {"seen": seen[0], "final": later.grad.to_local().detach().clone()}


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_comm_false_lets_code_during_backward_read_another_groups_gradient(overlap):
    # [Note: reduce-scatters in flight]: with the overlap such a hook sees the ring's output buffer
    # before the ring has filled it; zero.overlap_comm=False is the way out, and there it sees the
    # final, reduced gradient.
    for r in spawn(_read_during_backward, 2, (overlap,), timeout=120):
        assert torch.equal(r["seen"], r["final"]) is not overlap


def test_overlap_comm_false_where_it_cannot_act_says_so():
    from lightning_ampzero.config import ZeroConfig
    from lightning_ampzero.zero.apply import overlap_comm_note

    assert overlap_comm_note(ZeroConfig(stage=2, overlap_comm=False), "gloo") is None
    assert overlap_comm_note(ZeroConfig(stage=3), "nccl") is None  # the default asks for nothing
    assert "stage 0 is DDP" in overlap_comm_note(ZeroConfig(stage=0, overlap_comm=False), "gloo")
    assert "CUDA streams" in overlap_comm_note(ZeroConfig(stage=1, overlap_comm=False), "nccl")
    assert overlap_comm_note(ZeroConfig(stage=3, overlap_comm=False), "gloo") is None  # stage 3 leaves them in flight too
    assert "CUDA streams" in overlap_comm_note(ZeroConfig(stage=3, overlap_comm=False), "nccl")
    with pytest.raises(ValueError, match="zero.overlap_comm must be true or false"):
        ZeroConfig(overlap_comm="no")


def test_overlap_comm_is_one_setting_in_python_hydra_and_deepspeed_json():
    import warnings

    from lightning_ampzero.deepspeed import convert_deepspeed_config
    from lightning_ampzero.strategy import AmpZeroStrategy
    from lightning_ampzero.train import compose_typed

    assert AmpZeroStrategy(stage=1, overlap_comm=False).config.zero.overlap_comm is False
    assert compose_typed(["strategy=zero1", "strategy.overlap_comm=false"]).amp_config.zero.overlap_comm is False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        imported = convert_deepspeed_config({"zero_optimization": {"stage": 2, "overlap_comm": False}})
    assert imported.config.zero.overlap_comm is False and not imported.no_effect
    assert convert_deepspeed_config({"zero_optimization": {"stage": 1}}).config.zero.overlap_comm is True
