"""DynamicLossScaler / NoLossScaler: DeepSpeed's trajectories, GradScaler's interface, the fused check.

Expected trajectories are derived by hand from DeepSpeed's rules (lightning_ampzero/precision/
scaler.py, [Note: DeepSpeed scale arithmetic]); each test spells the derivation out. Patterns:
"c" = a clean step, "o" = a step whose gradients overflow.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _spawn import spawn
from lightning_ampzero.config import LossScalerConfig
from lightning_ampzero.precision.scaler import (
    DynamicLossScaler,
    LossScaleAtMinimumError,
    NoLossScaler,
    create_loss_scaler,
    nonfinite_grad_names,
    unscale_and_check_,
)

INF, NAN = float("inf"), float("nan")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 2)
        self.head = nn.Linear(2, 1)


def _setup(scaler):
    net = _Net()
    scaler.module = net
    return net, torch.optim.SGD(net.parameters(), lr=1.0)


def _set_grads(net, scale: float, overflow: bool) -> None:
    for p in net.parameters():
        p.grad = torch.full_like(p, scale)  # unscales to exactly 1
    if overflow:
        net.head.weight.grad[0, 1] = INF


def replay(scaler, pattern: str, net=None, opt=None) -> list[float]:
    """Run one step per pattern letter through the GradScaler interface; the scale after each update."""
    if net is None:
        net, opt = _setup(scaler)
    scales = []
    for letter in pattern.replace(" ", ""):
        _set_grads(net, scaler.get_scale(), overflow=letter == "o")
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def dyn(**kwargs) -> DynamicLossScaler:
    return DynamicLossScaler(LossScalerConfig(**kwargs))


# --------------------------------------------------------------------------------------
# Fused unscale + check (plain tensors, one process)
# --------------------------------------------------------------------------------------


def test_unscale_and_check_unscales_every_dtype_in_place():
    grads = [
        torch.tensor([8.0, -4.0]),
        torch.tensor([2.0, 6.0], dtype=torch.float16),
        torch.tensor([[16.0]], dtype=torch.bfloat16),
        None,
        torch.tensor([4.0]),
    ]
    found = unscale_and_check_(grads, 0.25)
    assert found is False
    assert grads[0].tolist() == [2.0, -1.0]
    assert grads[1].dtype == torch.float16 and grads[1].tolist() == [0.5, 1.5]
    assert grads[2].dtype == torch.bfloat16 and grads[2].tolist() == [[4.0]]
    assert grads[4].tolist() == [1.0]


@pytest.mark.parametrize("bad", [INF, -INF, NAN])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unscale_and_check_flags_inf_and_nan(bad, dtype):
    clean = torch.tensor([2.0, 4.0])
    dirty = torch.tensor([2.0, bad, 4.0], dtype=dtype)
    assert unscale_and_check_([clean, dirty], 0.5) is True
    assert clean.tolist() == [1.0, 2.0]  # the finite tensors are still unscaled
    assert dirty[0].item() == 1.0
    assert not math.isfinite(dirty[1].item())  # and the bad value stays findable


def test_unscale_and_check_with_no_grads_is_clean():
    assert unscale_and_check_([], 0.5) is False
    assert unscale_and_check_([None, None], 0.5) is False


def test_unscale_and_check_accepts_a_tensor_inv_scale():
    g = torch.tensor([3.0])
    assert unscale_and_check_([g], torch.tensor(1 / 3.0, dtype=torch.float64)) is False
    assert g.item() == pytest.approx(1.0)


def test_nonfinite_grad_names_in_module_order():
    net = _Net()
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    net.head.bias.grad[0] = NAN
    net.body.weight.grad[1, 2] = -INF
    assert nonfinite_grad_names(net.named_parameters()) == ["body.weight", "head.bias"]
    net.body.weight.grad = None
    assert nonfinite_grad_names(net.named_parameters()) == ["head.bias"]


# --------------------------------------------------------------------------------------
# DeepSpeed trajectories
# --------------------------------------------------------------------------------------


def test_hysteresis_1_growth_needs_window_plus_one_clean_steps():
    # clean steps before the current one since the last overflow (-1 at start):
    # iters 0..4 -> 0,1,2,3,4: doubles at 2 and 4 (window 2); overflow at 5 halves;
    # iters 6,7,8 -> 0,1,2: doubles again at 8.
    s = dyn(initial_scale_power=4, loss_scale_window=2, hysteresis=1)
    assert replay(s, "ccccc o ccc") == [16, 16, 32, 32, 64, 32, 32, 32, 64]
    assert s.stats() == {"loss_scale": 64.0, "overflows": 1.0, "skipped_steps": 1.0, "last_overflow_iter": 5.0}


def test_window_1_doubles_from_the_second_clean_step():
    s = dyn(initial_scale_power=0, loss_scale_window=1, hysteresis=1)
    assert replay(s, "cccc o cc") == [1, 2, 4, 8, 4, 4, 8]


def test_hysteresis_2_without_consecutive_refills_only_when_the_scale_grows():
    # it0 o: h 2->1, keep 8 | it1 c: no refill | it2 o: h==1 -> 4 | it3 o: h still 1 -> 2
    # it4..6 c: 0,1,2 clean before | it7 c: 3 -> double to 4, refill h=2
    # it8 o: h 2->1, keep 4 | it9 o: halve to 2
    s = dyn(initial_scale_power=3, loss_scale_window=3, hysteresis=2)
    hysteresis = []
    net, opt = _setup(s)
    scales = []
    for letter in "ocoocccc oo".replace(" ", ""):
        scales += replay(s, letter, net, opt)
        hysteresis.append(s.state_dict()["hysteresis"])
    assert scales == [8, 8, 4, 2, 2, 2, 2, 4, 4, 2]
    assert hysteresis == [1, 1, 1, 1, 1, 1, 1, 2, 1, 1]


def test_hysteresis_2_with_consecutive_refills_on_every_clean_step():
    # same sequence: the clean step at it1 refills h, so the overflow at it2 is absorbed.
    s = dyn(initial_scale_power=3, loss_scale_window=3, hysteresis=2, consecutive_hysteresis=True)
    assert replay(s, "ocoocccc oo") == [8, 8, 8, 4, 4, 4, 4, 8, 8, 4]


def test_halving_stops_at_a_minimum_that_is_not_a_power_of_two():
    s = dyn(initial_scale_power=4, hysteresis=1, min_loss_scale=3.0, at_min_scale="skip")
    assert replay(s, "ooo") == [8, 4, 3]


def test_overflow_at_minimum_raises_naming_the_parameters():
    s = dyn(initial_scale_power=2, hysteresis=1, min_loss_scale=1.0)
    net, opt = _setup(s)
    assert replay(s, "oo", net, opt) == [2, 1]
    before = s.state_dict()
    _set_grads(net, 1.0, overflow=True)
    net.body.bias.grad[1] = NAN
    assert s.step(opt) is None
    with pytest.raises(LossScaleAtMinimumError) as info:
        s.update()
    msg = str(info.value)
    assert "Current loss scale already at minimum" in msg
    assert "body.bias, head.weight" in msg and "body.weight" not in msg
    # the counts agree with the run's summary ("2 optimizer step(s) skipped"): this one raised, not skipped
    assert "overflow 3 of the run; 2 earlier overflowing step(s) skipped" in msg
    for advice in ("bf16", "min_loss_scale", "learning rate", "clipping"):
        assert advice in msg
    # as DeepSpeed: the raising update leaves scale, iteration and hysteresis as they were
    after = s.state_dict()
    assert {k: after[k] for k in ("scale", "iteration", "last_overflow_iter", "hysteresis")} == {
        k: before[k] for k in ("scale", "iteration", "last_overflow_iter", "hysteresis")
    }


def test_overflow_at_minimum_without_module_names_the_optimizer_slots():
    s = dyn(initial_scale_power=0, hysteresis=1)
    p = nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.full((2, 2), INF)
    s.step(opt)
    with pytest.raises(LossScaleAtMinimumError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(2, 2\)\)"):
        s.update()


def test_hysteresis_is_spent_before_the_minimum_raises():
    s = dyn(initial_scale_power=0, hysteresis=2, min_loss_scale=1.0)
    assert replay(s, "o") == [1]  # h 2 -> 1, no halving, no error
    with pytest.raises(LossScaleAtMinimumError):
        replay(s, "o")


def test_skip_policy_keeps_going_silently_at_the_minimum():
    s = dyn(initial_scale_power=1, hysteresis=1, loss_scale_window=2, at_min_scale="skip")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # it0 o -> 1 (min) | it1,2 o at min: stay 1 | it3,4 c: 0,1 clean before | it5 c: 2 -> 2
        assert replay(s, "ooo ccc") == [1, 1, 1, 1, 1, 2]
    assert s.stats()["skipped_steps"] == 3 and s.stats()["overflows"] == 3
    assert s.stats()["last_overflow_iter"] == 2


def test_warn_policy_skips_and_warns_with_the_names():
    s = dyn(initial_scale_power=0, hysteresis=1, at_min_scale="warn")
    net, opt = _setup(s)
    before = net.head.weight.detach().clone()
    with pytest.warns(UserWarning, match="head.weight"):
        replay(s, "o", net, opt)
    assert s.get_scale() == 1.0 and s.last_step_skipped
    assert torch.equal(net.head.weight, before)  # the step was skipped
    replay(s, "c", net, opt)
    assert not s.last_step_skipped
    assert torch.equal(net.head.weight, before - 1.0)  # a clean step applies (grad 1, lr 1)


def test_static_scale_never_moves_but_skips_overflows():
    s = dyn(loss_scale=128.0)
    net, opt = _setup(s)
    assert replay(s, "c" * 5 + "ooo" + "c" * 5, net, opt) == [128.0] * 13
    assert s.stats()["skipped_steps"] == 3
    assert s.stats()["last_overflow_iter"] == 7


def test_initial_scale_below_minimum_is_rejected():
    with pytest.raises(ValueError, match="initial_scale_power=1.*min_loss_scale=4"):
        dyn(initial_scale_power=1, min_loss_scale=4.0)


# --------------------------------------------------------------------------------------
# Checkpointing
# --------------------------------------------------------------------------------------


def test_state_dict_round_trip_mid_sequence_continues_identically():
    cfg = LossScalerConfig(initial_scale_power=5, loss_scale_window=3, hysteresis=2, at_min_scale="skip")
    pattern = "ccoccocooccccccoooocccccccocc" * 2
    split = 28
    whole = DynamicLossScaler(cfg)
    expected = replay(whole, pattern)

    first = DynamicLossScaler(cfg)
    head = replay(first, pattern[:split])
    state = first.state_dict()
    assert state["hysteresis"] == 1  # mid-hysteresis: the restore must carry it
    resumed = DynamicLossScaler(cfg)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    assert head + replay(resumed, pattern[split:]) == expected
    assert resumed.state_dict() == whole.state_dict()
    assert len(set(expected)) > 3  # the pattern really exercises growth and backoff


def test_load_state_dict_rejects_a_gradscaler_state():
    gs_state = torch.amp.GradScaler("cpu").state_dict()
    with pytest.raises(ValueError, match="iteration"):
        DynamicLossScaler().load_state_dict(gs_state)


def test_load_state_dict_warns_when_the_settings_changed():
    state = dyn(loss_scale_window=10).state_dict()
    with pytest.warns(UserWarning, match="loss_scale_window: 10 -> 1000"):
        DynamicLossScaler().load_state_dict(state)


# --------------------------------------------------------------------------------------
# The GradScaler interface
# --------------------------------------------------------------------------------------


def test_scale_multiplies_tensors_and_containers():
    s = dyn(initial_scale_power=3)
    loss = torch.tensor(1.5)
    assert s.scale(loss).item() == 12.0
    out = s.scale({"a": [torch.tensor(1.0), (torch.tensor(2.0),)]})
    assert out["a"][0].item() == 8.0 and out["a"][1][0].item() == 16.0
    with pytest.raises(ValueError, match="tensor"):
        s.scale(1.0)


def test_step_applies_unscaled_grads_and_returns_the_optimizer_result():
    s = dyn(initial_scale_power=3)
    p = nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.SGD([p], lr=0.5)
    s.scale(p.sum()).backward()  # grad = 8 each
    assert p.grad.tolist() == [8.0, 8.0]
    assert s.step(opt) is None  # SGD.step returns None; the values tell it ran
    assert p.grad.tolist() == [1.0, 1.0]
    assert p.tolist() == [0.5, 1.5]
    s.update()

    class Returns(torch.optim.SGD):
        def step(self, closure=None):
            super().step()
            return "stepped"

    opt2 = Returns([p], lr=0.0)
    p.grad = torch.ones(2)
    assert s.step(opt2) == "stepped"


def test_protocol_errors_match_gradscaler():
    s = dyn()
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    with pytest.raises(RuntimeError, match="No inf checks"):
        s.update()
    p.grad = torch.ones(1)
    s.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        s.unscale_(opt)
    s.step(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        s.step(opt)
    with pytest.raises(RuntimeError, match="closure"):
        s.step(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), closure=lambda: None)
    s.update()
    assert s.is_enabled()


def test_explicit_unscale_before_step_unscales_once():
    s = dyn(initial_scale_power=2)
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.tensor([4.0])
    s.unscale_(opt)
    assert p.grad.item() == 1.0
    s.step(opt)
    assert p.grad.item() == 1.0 and p.item() == -1.0


def test_update_new_scale_sets_the_scale():
    s = dyn(initial_scale_power=4)
    replay(s, "c")
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.ones(1)
    s.step(opt)
    s.update(new_scale=torch.tensor(2.0))
    assert s.get_scale() == 2.0


def test_two_optimizers_share_one_overflow_decision():
    s = dyn(initial_scale_power=4, hysteresis=1)
    a, b = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    opt_a, opt_b = torch.optim.SGD([a], lr=1.0), torch.optim.SGD([b], lr=1.0)
    a.grad, b.grad = torch.tensor([16.0]), torch.tensor([INF])
    s.step(opt_a)
    assert s.step(opt_b) is None
    s.update()
    assert a.item() == -1.0 and b.item() == 0.0
    assert s.get_scale() == 8.0 and s.stats()["overflows"] == 1 and s.stats()["skipped_steps"] == 1


# --------------------------------------------------------------------------------------
# bf16 / fp32: NoLossScaler
# --------------------------------------------------------------------------------------


def test_no_loss_scaler_checking_skips_non_finite_steps():
    s = NoLossScaler(check_overflow=True)
    loss = torch.tensor(3.0)
    assert s.scale(loss) is loss and s.get_scale() == 1.0 and not s.is_enabled()
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.tensor([1.0, NAN])
    assert s.step(opt) is None
    s.update()
    assert p.tolist() == [0.0, 0.0] and s.last_step_skipped
    p.grad = torch.tensor([0.5, 0.25])
    s.step(opt)
    s.update()
    assert p.tolist() == [-0.5, -0.25]  # grads were not rescaled
    assert s.stats() == {"loss_scale": 1.0, "overflows": 1.0, "skipped_steps": 1.0, "last_overflow_iter": 0.0}
    restored = NoLossScaler(check_overflow=True)
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()


def test_no_loss_scaler_off_is_plain_optimizer_step():
    s = NoLossScaler()
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    s.update()  # nothing recorded: a no-op, as a disabled GradScaler
    p.grad = torch.tensor([INF])
    s.step(opt)
    s.update()
    assert p.item() == -INF  # no check, no skip: absent
    assert s.stats()["skipped_steps"] == 0
    s.load_state_dict({})  # a bf16 checkpoint may carry no scaler state


def test_create_loss_scaler_picks_by_precision():
    cfg = LossScalerConfig(initial_scale_power=7)
    fp16 = create_loss_scaler("16-mixed", cfg)
    assert isinstance(fp16, DynamicLossScaler) and fp16.get_scale() == 128.0
    assert isinstance(create_loss_scaler("16-true"), DynamicLossScaler)
    bf16 = create_loss_scaler("bf16-mixed", cfg, check_grad_overflow=True)
    assert isinstance(bf16, NoLossScaler) and bf16.check_overflow
    assert not create_loss_scaler("32-true").check_overflow


# --------------------------------------------------------------------------------------
# Two ranks (gloo): one rank's inf makes every rank skip, with one all_reduce
# --------------------------------------------------------------------------------------


class _PlainSGD(torch.optim.Optimizer):
    """SGD without torch.optim.SGD's first-step import of torch._dynamo (seconds per child)."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def _inf_on_rank_1(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    net = _Net()
    # body.weight sharded on dim 0 as FSDP2 holds it (a DTensor); the rest plain tensors.
    net.body.weight = nn.Parameter(distribute_tensor(net.body.weight.detach(), mesh, [Shard(0)]))
    opt = _PlainSGD(net.parameters(), lr=0.5)
    scaler = DynamicLossScaler(LossScalerConfig(initial_scale_power=3, hysteresis=1, min_loss_scale=4.0), module=net)

    def set_grads(scale: float, inf_on_rank_1: bool) -> None:
        for p in net.parameters():
            full = torch.full(p.shape, scale)
            p.grad = distribute_tensor(full, mesh, [Shard(0)]) if p is net.body.weight else full
        if inf_on_rank_1 and rank == 1:
            net.body.weight.grad._local_tensor[0, 0] = INF

    calls = []
    all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls.append(1)
        return all_reduce(*args, **kwargs)

    out: dict = {"local_rows": net.body.weight.to_local().shape[0]}
    w0 = net.body.weight.to_local().clone()

    # 1. clean step: local shards unscaled (8 -> 1) and stepped
    set_grads(8.0, inf_on_rank_1=False)
    dist.all_reduce = counting_all_reduce
    try:
        scaler.unscale_(opt)
    finally:
        dist.all_reduce = all_reduce
    out["clean_calls"] = len(calls)
    out["clean_grad"] = net.body.weight.grad.to_local().unique().tolist()
    scaler.step(opt)
    scaler.update()
    out["clean_moved"] = torch.equal(net.body.weight.to_local(), w0 - 0.5)
    out["clean_skipped"] = scaler.last_step_skipped

    # 2. inf only in rank 1's shard: both ranks skip, with exactly one all_reduce
    w1 = net.body.weight.to_local().clone()
    bias1 = net.head.bias.detach().clone()
    set_grads(8.0, inf_on_rank_1=True)
    calls.clear()
    dist.all_reduce = counting_all_reduce
    try:
        out["step_result"] = scaler.step(opt)
    finally:
        dist.all_reduce = all_reduce
    scaler.update()
    out["overflow_calls"] = len(calls)
    out["overflow_skipped"] = scaler.last_step_skipped
    out["unchanged"] = torch.equal(net.body.weight.to_local(), w1) and torch.equal(net.head.bias, bias1)
    out["scale"] = scaler.get_scale()

    # 3. again, now at the minimum: every rank raises, naming the parameter of rank 1's shard
    set_grads(4.0, inf_on_rank_1=True)
    scaler.step(opt)
    try:
        scaler.update()
        out["error"] = None
    except LossScaleAtMinimumError as err:
        out["error"] = str(err)

    # 4. the bare function: a flag raised on rank 1 alone is seen by both
    out["bare_flag"] = unscale_and_check_([torch.tensor([INF if rank == 1 else 1.0])], 1.0)
    return out


def test_inf_on_one_rank_makes_every_rank_skip():
    results = spawn(_inf_on_rank_1, world_size=2, timeout=60)
    for rank, out in enumerate(results):
        assert out["local_rows"] == 1, rank  # really sharded: 2 rows over 2 ranks
        assert out["clean_calls"] == 1 and out["clean_grad"] == [1.0], rank
        assert out["clean_moved"] and not out["clean_skipped"], rank
        assert out["overflow_calls"] == 1, rank
        assert out["step_result"] is None and out["overflow_skipped"] and out["unchanged"], rank
        assert out["scale"] == 4.0, rank
        assert out["error"] is not None and "body.weight" in out["error"], rank
        assert "head.weight" not in out["error"], rank
        assert out["bare_flag"] is True, rank


def _rank_1_fails(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_spawn_reraises_a_child_error():
    # The helper must never let a failing rank pass silently.
    with pytest.raises(Exception, match="boom on rank 1"):
        spawn(_rank_1_fails, world_size=2, timeout=60)
