"""AmpZeroPrecision: precision selection, invalid combinations, dtypes per mode, the scaled step,
checkpoint state (fast, one process); then on 2 CPU ranks through Lightning (tests/scripts/precision.py):
acceptance 2 (an inf in one rank's shard skips the step everywhere), 3 (each precision trains the
small GPT to within 2% of fp32) and 4 (resume restores the scaler exactly)."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import lightning.pytorch as pl

from _scripts import max_rel_diff, run_json
from _spawn import spawn
from lightning_ampzero.config import LossScalerConfig, PrecisionConfig
from lightning_ampzero.models.gpt import GPT, GPTConfig
from lightning_ampzero.precision.ddp import cast_parameters_in_forward, register_reduce_dtypes
from lightning_ampzero.precision.plugin import AmpZeroPrecision
from lightning_ampzero.precision.policy import check_device_support, ddp_reduce_dtypes, dtype_plan, fsdp_policies
from lightning_ampzero.precision.scaler import DynamicLossScaler, NoLossScaler
from lightning_ampzero.precision.schedulers import SkipAwareScheduler
from lightning_ampzero.strategy import AmpZeroStrategy

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


# ---------------------------------------------------------------------------------------------
# Selection: Trainer precision strings, the strategy's config, 16-mixed on CPU
# ---------------------------------------------------------------------------------------------


def _trainer(**kw) -> pl.Trainer:
    # Building a Trainer launches nothing; fit() would.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pl.Trainer(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False, **kw)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-true", "bf16-true"])
def test_trainer_precision_selects_our_plugin(precision):
    trainer = _trainer(strategy="ampzero_stage_3", precision=precision)
    plugin = trainer.precision_plugin
    assert isinstance(plugin, AmpZeroPrecision) and trainer.precision == precision
    assert isinstance(plugin.scaler, DynamicLossScaler) == (precision == "16-true")


def test_16_mixed_on_cpu_is_honoured_not_rewritten_to_bf16():
    """Lightning rewrites Trainer(precision="16-mixed") on CPU to "bf16-mixed"; ampzero keeps fp16."""
    trainer = _trainer(strategy="ampzero", precision="16-mixed")
    assert trainer.precision == "16-mixed"
    assert trainer.precision_plugin.plan.low_dtype == F16
    assert isinstance(trainer.precision_plugin.scaler, DynamicLossScaler)
    # A real bf16-mixed request stays bf16 and unscaled.
    bf16 = _trainer(strategy="ampzero", precision="bf16-mixed").precision_plugin
    assert bf16.plan.low_dtype == BF16 and isinstance(bf16.scaler, NoLossScaler)


@pytest.mark.parametrize("strategy_precision", [None, "16-mixed"])
def test_lightnings_bf16_lines_are_corrected_when_16_mixed_is_kept_on_cpu(monkeypatch, strategy_precision):
    # With "16-mixed" given to the strategy as well, Lightning's "Using bf16-mixed instead" lines were
    # the only precision lines printed, and the model trained in fp16 (a new-user trial).
    from lightning_ampzero.precision import plugin

    said: list[str] = []
    monkeypatch.setattr(plugin, "rank_zero_info", lambda message, *a, **k: said.append(message))
    strategy = AmpZeroStrategy(precision=strategy_precision)
    trainer = _trainer(strategy=strategy, precision="16-mixed")
    assert trainer.precision_plugin.plan.low_dtype == F16
    assert len([m for m in said if "do not apply: the model trains in float16" in m]) == 1


def test_strategy_precision_wins_over_the_trainer_flag():
    trainer = _trainer(strategy=AmpZeroStrategy(stage=2, precision="16-mixed"))
    assert trainer.precision == "16-mixed"
    cfg = PrecisionConfig(precision="bf16-true", check_grad_overflow=True)
    trainer = _trainer(strategy=AmpZeroStrategy(stage=2, precision=cfg), precision="bf16-mixed")
    assert trainer.precision == "bf16-true" and trainer.precision_plugin.scaler.checks_overflow


def test_strategy_precision_takes_lightnings_older_spellings_and_refuses_the_rest_on_construction():
    # precision=16 (Lightning users' habit) was stored unchecked and failed inside fit with an AttributeError
    for given, meant in ((16, "16-mixed"), ("16", "16-mixed"), (32, "32-true"), ("bf16", "bf16-mixed")):
        assert AmpZeroStrategy(stage=2, precision=given).config.precision.precision == meant
    assert _trainer(strategy=AmpZeroStrategy(stage=2, precision=16)).precision == "16-mixed"
    for bad in (64, True, 16.0):
        with pytest.raises(ValueError, match=rf"precision.precision={bad!r} is not valid. Allowed values: '32-true'"):
            AmpZeroStrategy(stage=2, precision=bad)


# ---------------------------------------------------------------------------------------------
# Invalid combinations, rejected on construction with a message naming them
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision,kwargs,match", [
    ("bf16-mixed", {"loss_scaler": LossScalerConfig(loss_scale=128.0)}, r"loss_scaler is configured \(loss_scale=128.0\).*'bf16-mixed'"),
    ("bf16-true", {"loss_scaler": LossScalerConfig(hysteresis=1)}, r"hysteresis=1.*'bf16-true'.*check_grad_overflow"),
    ("32-true", {"loss_scaler": LossScalerConfig(initial_scale_power=8)}, r"initial_scale_power=8.*'32-true'"),
    ("bf16-mixed", {"communication_data_type": "fp16"}, r"communication_data_type='fp16' with precision='bf16-mixed'"),
    ("16-true", {"lower_precision_safe_modules": ["Linear"]}, r"lower_precision_safe_modules=\['Linear'\].*'16-true'"),
])
def test_invalid_combinations_name_both_settings(precision, kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrecisionConfig(precision=precision, **kwargs)
    # The same when the precision comes from the Trainer (config without one).
    with pytest.raises(ValueError, match=match):
        AmpZeroPrecision(precision, PrecisionConfig(**kwargs))


def test_invalid_values_are_rejected():
    with pytest.raises(ValueError, match="'16-mix' is not valid"):
        AmpZeroPrecision("16-mix")
    with pytest.raises(ValueError, match="class names such as 'Linear'"):
        PrecisionConfig(lower_precision_safe_modules=["torch.nn.Linear"])
    with pytest.raises(ValueError, match="list of class names"):
        PrecisionConfig(lower_precision_safe_modules="Linear")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_low_precision_on_a_device_without_support_is_refused():
    with pytest.raises(ValueError, match=r"'16-mixed' needs torch.autocast with float16 on 'cuda'"):
        AmpZeroPrecision("16-mixed", device="cuda")
    with pytest.raises(ValueError, match="'bf16-mixed' needs torch.autocast, which has no 'vulkan' backend"):
        check_device_support("bf16-mixed", "vulkan")
    check_device_support("16-mixed", "cpu")  # CPU autocast supports float16


# ---------------------------------------------------------------------------------------------
# Which dtype where: the plan, FSDP2 policies, DDP reduce dtypes, forward context, conversion
# ---------------------------------------------------------------------------------------------


def _gpt() -> GPT:
    return GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=8))


def test_fsdp_policies_per_precision_and_stage():
    model = _gpt()
    linears = {m for m in model.modules() if type(m) is nn.Linear}
    # "-mixed": fp32 units; Linear units of their own reduce in the low dtype, gather in it at stage 3.
    root, per_module = fsdp_policies(dtype_plan("16-mixed", PrecisionConfig()), model, 3)
    assert (root.param_dtype, root.reduce_dtype) == (None, None)
    assert set(per_module) == linears and len(linears) == 9
    assert {(p.param_dtype, p.reduce_dtype) for p in per_module.values()} == {(F16, F16)}
    # below stage 3: fp32 gradients (accumulation), sent in the low dtype (how: apply_zero decides by the mesh)
    _, per_module = fsdp_policies(dtype_plan("bf16-mixed", PrecisionConfig()), model, 2)
    assert {(p.param_dtype, p.reduce_dtype, p.comm_dtype) for p in per_module.values()} == {(None, None, BF16)}
    # an explicit communication dtype applies to everything: no per-module units
    root, per_module = fsdp_policies(dtype_plan("bf16-mixed", PrecisionConfig(communication_data_type="fp32")), model, 3)
    assert per_module == {} and root.reduce_dtype is None
    root, per_module = fsdp_policies(dtype_plan("bf16-mixed", PrecisionConfig(lower_precision_safe_modules=[])), model, 3)
    assert per_module == {}
    # "-true": every unit gathers in the low dtype and reduces in it, or in the communication dtype
    root, per_module = fsdp_policies(dtype_plan("bf16-true", PrecisionConfig()), model, 1)
    assert (root.param_dtype, root.reduce_dtype, per_module) == (BF16, None, {})
    root, _ = fsdp_policies(dtype_plan("16-true", PrecisionConfig(communication_data_type="fp32")), model, 2)
    assert (root.param_dtype, root.reduce_dtype) == (F16, F32)
    root, _ = fsdp_policies(dtype_plan("32-true", PrecisionConfig(communication_data_type="bf16")), model, 2)
    assert (root.param_dtype, root.reduce_dtype) == (None, BF16)


def test_safe_modules_are_exact_class_names_and_never_tied():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.emb.weight
            self.attn = nn.MultiheadAttention(4, 1)  # out_proj: a Linear subclass used by weight only
            self.proj = nn.Linear(4, 4)

    model = Tied()
    _, per_module = fsdp_policies(dtype_plan("16-mixed", PrecisionConfig()), model, 2)
    assert set(per_module) == {model.proj}


def test_a_module_with_a_forward_pre_hook_is_not_a_safe_module():
    # torch.nn.utils' hook-based spectral_norm computes the weight from its parameters before the
    # forward, outside autocast: gathered in bf16 at stage 3 it stopped on "addmv input tensors
    # must have the same dtype", and weight_norm normalized bf16 copies (a new-user trial).
    model = nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 4)), nn.utils.weight_norm(nn.Linear(4, 4)),
                          nn.Linear(4, 4))
    for stage in (2, 3):
        _, per_module = fsdp_policies(dtype_plan("bf16-mixed", PrecisionConfig()), model, stage)
        assert set(per_module) == {model[2]}
    assert set(ddp_reduce_dtypes(dtype_plan("bf16-mixed", PrecisionConfig()), model)) == {
        id(p) for p in model[2].parameters()}


def test_ddp_reduce_dtypes():
    model = _gpt()
    ln = {id(p) for n, p in model.named_parameters() if "ln" in n or "wte" in n or "wpe" in n}
    lin = {id(p) for m in model.modules() if type(m) is nn.Linear for p in m.parameters()}
    assert ddp_reduce_dtypes(dtype_plan("32-true", PrecisionConfig()), model) == {}
    mixed = ddp_reduce_dtypes(dtype_plan("bf16-mixed", PrecisionConfig()), model)
    assert set(mixed) == lin and set(mixed.values()) == {BF16} and not (ln & set(mixed))
    true = ddp_reduce_dtypes(dtype_plan("16-true", PrecisionConfig()), model)
    assert set(true) == {id(p) for p in model.parameters()} and set(true.values()) == {F16}


def test_forward_context_and_input_conversion():
    x = torch.randn(2, 4)
    w = torch.randn(4, 4)
    with AmpZeroPrecision("16-mixed", device="cpu").forward_context():
        assert (x @ w).dtype == F16 and torch.softmax(x, -1).dtype == F32
    true = AmpZeroPrecision("bf16-true", device="cpu")
    with true.forward_context():
        assert torch.zeros(1).dtype == BF16
    assert torch.zeros(1).dtype == F32
    batch = true.convert_input({"x": x, "ids": torch.arange(3)})
    assert batch["x"].dtype == BF16 and batch["ids"].dtype == torch.int64
    assert AmpZeroPrecision("16-mixed").convert_input(x) is x


def test_true_precision_converts_buffers_not_parameters():
    model = nn.BatchNorm1d(3)
    AmpZeroPrecision("16-true").convert_module(model)
    assert model.weight.dtype == F32 and model.running_mean.dtype == F16
    assert model.num_batches_tracked.dtype == torch.int64


def test_parameter_cast_computes_low_and_accumulates_fp32_master_gradients():
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 4)
            self.ln = nn.LayerNorm(4)
            self.seen: list[torch.dtype] = []

        def forward(self, idx, nested=False):
            if not nested:
                self.seen.append(self(idx, nested=True).dtype)  # a nested call of the root
            h = self.ln(self.emb(idx))
            self.seen.append(h.dtype)
            return h @ self.emb.weight.t()  # tied use, outside emb's own forward

    net = Net()
    params = dict(net.named_parameters())
    cast = cast_parameters_in_forward(net, BF16)
    out = net(torch.tensor([[1, 2, 3]]))
    assert out.dtype == BF16 and set(net.seen) == {BF16}
    out.float().sum().backward()
    # the masters are still the parameters, fp32, and hold the gradients
    assert dict(net.named_parameters()) == params
    assert all(p.dtype == F32 and p.grad is not None and p.grad.dtype == F32 for p in params.values())
    # restored even when forward raises
    with pytest.raises(IndexError):
        net(torch.tensor([[9]]))
    assert all(type(p) is nn.Parameter and p.dtype == F32 for p in net.parameters())
    cast.remove()
    assert net(torch.tensor([[1]])).dtype == F32


def _ddp_reduce_body(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3, bias=False), nn.LayerNorm(3))
    ddp = nn.parallel.DistributedDataParallel(model)
    lin, ln = model[0].weight, model[1].weight
    register_reduce_dtypes(ddp, {id(lin): F16})
    # Per-rank gradients whose mean is not representable in float16.
    x = torch.full((1, 3), 1.0 + rank * 1e-3 + 1e-4)
    ddp(x).sum().backward()
    return lin.grad.clone(), ln.grad.clone(), x


def test_ddp_hook_reduces_each_parameter_in_its_dtype():
    results = spawn(_ddp_reduce_body, world_size=2, timeout=120)
    (lin0, ln0, _), (lin1, ln1, _) = results
    assert torch.equal(lin0, lin1) and torch.equal(ln0, ln1)
    # the reference: each rank's own gradients, reduced by hand
    torch.manual_seed(0)
    local = []
    for rank in range(2):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(3, 3, bias=False), nn.LayerNorm(3))
        m(torch.full((1, 3), 1.0 + rank * 1e-3 + 1e-4)).sum().backward()
        local.append((m[0].weight.grad, m[1].weight.grad))
    lin_fp16 = (local[0][0] / 2).half() + (local[1][0] / 2).half()
    ln_fp32 = local[0][1] / 2 + local[1][1] / 2
    assert torch.equal(lin0, lin_fp16.float())
    assert torch.allclose(ln0, ln_fp32, rtol=0, atol=1e-7)
    assert not torch.equal(ln0, ln_fp32.half().float())  # fp16 would have changed the LayerNorm's


# ---------------------------------------------------------------------------------------------
# The step (closure -> unscale -> hooks/clip -> step unless overflow -> update -> log), checkpoint state
# ---------------------------------------------------------------------------------------------


class _StubModule:
    """What optimizer_step touches of a LightningModule: logging and the optimization mode."""

    def __init__(self):
        self.automatic_optimization = True
        self._current_fx_name = "optimizer_step"
        self._trainer = object()
        self.logged: list[dict] = []

    def log_dict(self, metrics, **kw):
        assert kw["on_step"] and not kw["on_epoch"]
        assert kw["logger"] == bool(getattr(self._trainer, "loggers", True))  # none with Trainer(logger=False)
        self.logged.append(dict(metrics))


def _step(plugin, net, opt, grad_value: float, overflow: bool = False):
    """One optimizer_step; the 'closure' writes scaled gradients like a backward of a scaled loss."""
    seen = {}

    def closure():
        for p in net.parameters():
            p.grad = plugin.scaler.scale(torch.full_like(p, grad_value))
        if overflow:
            next(net.parameters()).grad.view(-1)[0] = float("inf")
        return torch.tensor(1.0)

    plugin._after_closure = lambda model, optimizer: seen.setdefault("grad", next(net.parameters()).grad.clone())
    return plugin.optimizer_step(opt, model=plugin._stub, closure=closure), seen


def test_optimizer_step_unscales_before_hooks_and_skips_on_overflow():
    cfg = PrecisionConfig(loss_scaler=LossScalerConfig(initial_scale_power=4, hysteresis=1, loss_scale_window=2))
    plugin = AmpZeroPrecision("16-mixed", cfg, device="cpu")
    plugin._stub = _StubModule()
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=1.0, momentum=0.9)
    before = [p.detach().clone() for p in net.parameters()]
    _, seen = _step(plugin, net, opt, 0.5)
    assert torch.equal(seen["grad"], torch.full((2, 2), 0.5))  # hooks and clipping see unscaled gradients
    moved = [p.detach().clone() for p in net.parameters()]
    assert not torch.equal(moved[0], before[0])
    state = {k: v.clone() for k, v in opt.state[net.weight].items()}
    result, _ = _step(plugin, net, opt, 0.5, overflow=True)
    assert result is None and plugin.scaler.last_step_skipped
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), moved))
    assert torch.equal(opt.state[net.weight]["momentum_buffer"], state["momentum_buffer"])
    assert plugin._stub.logged == [{"skipped_steps": 0.0, "loss_scale": 16.0}, {"skipped_steps": 1.0, "loss_scale": 8.0}]


def test_the_scaler_is_logged_without_a_logger_warning_when_the_trainer_has_none():
    import types

    plugin = AmpZeroPrecision("16-mixed", PrecisionConfig(), device="cpu")
    plugin._stub = _StubModule()
    plugin._stub._trainer = types.SimpleNamespace(loggers=[])  # Trainer(logger=False)
    net = nn.Linear(2, 2)
    _step(plugin, net, torch.optim.SGD(net.parameters(), lr=1.0), 0.5)
    assert plugin._stub.logged == [{"skipped_steps": 0.0, "loss_scale": 65536.0}]  # logged, logger=False


def test_overflow_at_minimum_scale_names_the_connected_model_parameters():
    from lightning_ampzero.precision.scaler import LossScaleAtMinimumError

    cfg = PrecisionConfig(loss_scaler=LossScalerConfig(initial_scale_power=0, hysteresis=1, min_loss_scale=1.0))
    plugin = AmpZeroPrecision("16-true", cfg)
    plugin._stub = _StubModule()
    net = _gpt()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    plugin.connect(net, [opt], [])
    with pytest.raises(LossScaleAtMinimumError, match=r"Non-finite gradients in: wte\.weight\..*Try: bf16.*a lower"
                                                     r" loss_scaler\.min_loss_scale"):
        _step(plugin, net, opt, 0.5, overflow=True)


def test_bf16_pays_nothing_and_checks_only_when_asked():
    plain = AmpZeroPrecision("bf16-mixed", device="cpu")
    assert not plain.scaler.checks_overflow and plain.state_dict() == {}
    loss = torch.tensor(2.0)
    assert plain.scaler.scale(loss) is loss  # no scaling: the loss goes to backward untouched
    checked = AmpZeroPrecision("bf16-mixed", PrecisionConfig(check_grad_overflow=True), device="cpu")
    checked._stub = _StubModule()
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    before = [p.detach().clone() for p in net.parameters()]
    result, _ = _step(checked, net, opt, 0.5, overflow=True)
    assert result is None and all(torch.equal(a, b) for a, b in zip(net.parameters(), before))
    assert checked._stub.logged == [{"skipped_steps": 1.0}]  # no loss_scale: there is none
    assert checked.state_dict()["scaler"]["skipped_steps"] == 1


def test_plugin_state_round_trip_and_precision_change():
    cfg = PrecisionConfig(loss_scaler=LossScalerConfig(initial_scale_power=4, hysteresis=3))
    a = AmpZeroPrecision("16-mixed", cfg)
    a._stub = _StubModule()
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for overflow in (False, True, False):
        _step(a, net, opt, 0.5, overflow)
    state = a.state_dict()
    b = AmpZeroPrecision("16-mixed", cfg)
    b.load_state_dict(state)
    assert b.state_dict() == state and b.scaler._hysteresis == 2 and b.scaler._iteration == 3
    with pytest.warns(UserWarning, match="saved with precision='16-mixed'.*not restored"):
        AmpZeroPrecision("bf16-mixed", PrecisionConfig(check_grad_overflow=True)).load_state_dict(state)


def test_skip_aware_scheduler():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    inner = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    skipped = [False]
    sched = SkipAwareScheduler(inner, lambda: skipped[0])
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    opt.step()
    sched.step()
    skipped[0] = True
    sched.step()
    assert inner.last_epoch == 1 and sched.last_epoch == 1 and sched.skipped_calls == 1
    assert sched.get_last_lr() == [0.5] and sched.state_dict() == inner.state_dict()
    sched.base_lrs = [2.0]
    assert inner.base_lrs == [2.0]


def test_connect_wraps_step_schedulers_only_when_steps_can_be_skipped():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)

    def configs():
        return [SimpleNamespace(interval="step", scheduler=torch.optim.lr_scheduler.StepLR(opt, 1)),
                SimpleNamespace(interval="epoch", scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))]

    model = nn.Linear(1, 1)
    _, _, wrapped = AmpZeroPrecision("16-mixed").connect(model, [opt], configs())
    assert [type(c.scheduler) is SkipAwareScheduler for c in wrapped] == [True, False]
    _, _, plain = AmpZeroPrecision("bf16-mixed").connect(model, [opt], configs())
    assert not any(type(c.scheduler) is SkipAwareScheduler for c in plain)


# ---------------------------------------------------------------------------------------------
# 2 CPU ranks through Lightning
# ---------------------------------------------------------------------------------------------

TRAIN_CONFIGS = [
    "2:32-true", "2:16-mixed", "2:bf16-mixed", "2:16-true", "2:bf16-true",
    "0:16-mixed@flag", "0:bf16-true", "1:16-true", "3:16-mixed", "3:bf16-true",
    "2:32-true:norm=0.5", "2:16-mixed:norm=0.5",
]
LOW = {"16": "torch.float16", "bf16": "torch.bfloat16"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("precision")
    return run_json("precision.py", tmp / "train.json", "--scenario", "train", "--configs", ",".join(TRAIN_CONFIGS),
                    "--steps", "50", timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [c for c in TRAIN_CONFIGS if "32-true" not in c])
def test_acceptance3_each_precision_trains_within_2_percent_of_fp32(trained, cfg):
    stage, precision, *clip = cfg.split(":")
    ref = trained["2:32-true" + (":" + clip[0] if clip else "")]["losses"]
    got = trained[cfg]
    assert len(got["losses"]) == 50
    assert abs(got["losses"][-1] - ref[-1]) / ref[-1] < 0.02, (got["losses"][-1], ref[-1])
    precision = precision.removesuffix("@flag")
    assert got["trainer_precision"] == precision
    low = LOW[precision.split("-")[0]]
    # the dtypes of docs/precision.md, seen inside the step
    assert got["master_dtypes"] == got["grad_dtypes"] == got["opt_state_dtypes"] == ["torch.float32"]
    assert got["dtypes"]["linear"] == low
    if precision.endswith("-mixed"):
        assert got["dtypes"]["layernorm"] == "torch.float32"
        # stage 3 all-gathers the Linear weights in the low dtype; others keep them fp32
        assert got["dtypes"]["linear_weight"] == (low if stage == "3" else "torch.float32")
    else:
        assert got["dtypes"]["layernorm"] == got["dtypes"]["layernorm_weight"] == low
    fp16 = precision.startswith("16")
    assert (got["precision_state"] != {}) == fp16 and got["skipped_steps"] == 0


@pytest.mark.slow
def test_acceptance3_the_comparison_means_something(trained):
    fp32, clipped = trained["2:32-true"]["losses"], trained["2:32-true:norm=0.5"]["losses"]
    assert fp32[-1] < fp32[0] - 2.0  # it learns
    # clipping changes the run by more than the tolerance, so "16-mixed + clip within 2% of fp32 +
    # clip" shows unscale-before-clip (clipping scaled gradients would clip 2**16 times harder)
    assert abs(clipped[-1] - fp32[-1]) / fp32[-1] > 0.02


@pytest.mark.slow
@pytest.mark.parametrize("a,b", [("0:16-mixed@flag", "2:16-mixed"), ("3:16-mixed", "2:16-mixed"),
                                 ("0:bf16-true", "2:bf16-true"), ("3:bf16-true", "2:bf16-true")])
def test_stages_agree_within_a_precision(trained, a, b):
    """Stage 0's DDP casts and comm hook give FSDP2's numerics; stage 3's low-dtype gather changes nothing."""
    assert max_rel_diff(trained[a]["losses"], trained[b]["losses"]) < 1e-5


@pytest.mark.slow
def test_units_and_their_policies(trained):
    mixed = {u[0]: u[2:] for u in trained["3:16-mixed"]["units"]}
    # on gloo the Linears have no group of their own: their unit's group gathers them in fp16
    # ([Note: safe modules gathered in the low dtype inside their unit's group]) and the rest in fp32
    assert "model.blocks.0.mlp.0" not in mixed
    assert mixed["model.blocks.0"] == mixed["model.ln_f"] == mixed["model.head"] == mixed[""] == ["None", "None"]
    gathered = trained["3:16-mixed"]["gathered"]
    assert gathered["model.blocks.0.mlp.0"] == gathered["model.head"] == "torch.float16"
    assert gathered["model.blocks.0.ln_1"] == gathered["model.ln_f"] == "torch.float32"
    true = {u[0]: u[2:] for u in trained["3:bf16-true"]["units"]}
    assert set(map(tuple, true.values())) == {("torch.bfloat16", "None")}
    assert "model.blocks.0.mlp.0" not in true  # no per-module units outside "-mixed"


@pytest.fixture(scope="module")
def injected(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inject")
    return run_json("precision.py", tmp / "inject.json", "--scenario", "inject", "--configs", "2,3", "--steps", "12",
                    timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["2", "3"])
def test_acceptance2_inf_in_one_rank_shard_skips_the_step_on_every_rank(injected, stage):
    r = injected[stage]
    rows = r["rows"]  # per rank, per step
    # inf injected into rank 1's shard at step 3, rank 0's at step 4: both ranks skip both
    for rank_rows in rows:
        assert [row["skipped"] for row in rank_rows] == [i in (3, 4) for i in range(12)]
        for i, row in enumerate(rank_rows):
            skipped = i in (3, 4)
            assert row["params_unchanged"] == skipped and row["opt_state_unchanged"] == skipped
        # scheduler not stepped on the skipped steps (LambdaLR counts its steps in last_epoch)
        assert [row["scheduler_steps"] for row in rank_rows] == [1, 2, 3, 3, 3, 4, 5, 6, 7, 8, 9, 10]
        # scale (start 2**8, hysteresis 2, window 5): the first overflow is absorbed, the second
        # halves; the 6th clean update after it doubles (DeepSpeed's arithmetic)
        assert [row["scale"] for row in rank_rows] == [256.0] * 4 + [128.0] * 6 + [256.0] * 2
        assert rank_rows[-1]["skipped_steps"] == 2
    strip = lambda rank_rows: [{k: v for k, v in row.items() if k != "loss"} for row in rank_rows]  # noqa: E731
    assert strip(rows[0]) == strip(rows[1])  # each rank's loss is its own batch's
    # training continues: every later step updates, losses finite
    assert all(row["loss"] == row["loss"] and abs(row["loss"]) < 10 for row in rows[0])
    assert r["global_step"] == 12  # skipped steps count as steps, as DeepSpeed's global_steps
    # the Trainer's logger got the scale and the skip count at every step, without user code
    logged = [row for row in r["logged"] if "loss_scale" in row]
    assert [row["step"] for row in logged] == list(range(12))
    assert [row["loss_scale"] for row in logged] == [row["scale"] for row in rows[0]]
    assert [row["skipped_steps"] for row in logged] == [row["skipped_steps"] for row in rows[0]]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    return run_json("precision.py", tmp / "resume.json", "--scenario", "resume", "--configs", "3", "--tmp", str(tmp),
                    timeout=600)["3"]


@pytest.mark.slow
def test_acceptance4_resume_restores_the_scaler_exactly(resumed):
    r = resumed
    full, first, again = r["full"], r["first"], r["resumed"]
    assert len(full) == 12 and len(first) == 6 and len(again) == 6
    # the checkpoint holds the scaler as it was, with a state that matters (overflows, hysteresis run down)
    assert r["saved_state"] == r["first_state"]
    saved = r["saved_state"]["scaler"]
    assert (saved["scale"], saved["hysteresis"], saved["last_overflow_iter"], saved["iteration"]) == (512.0, 1, 2, 6)
    # the resumed run takes the uninterrupted run's path: the first step after resume overflows
    # and halves (a hysteresis of 2 would have absorbed it)
    assert [row["skipped"] for row in again] == [row["skipped"] for row in full[6:]] == [True] + [False] * 5
    assert [row["scale"] for row in again] == [row["scale"] for row in full[6:]]
    assert again[0]["scale"] == 256.0
    assert [row["skipped_steps"] for row in again] == [row["skipped_steps"] for row in full[6:]]
    assert max_rel_diff([row["loss"] for row in again], [row["loss"] for row in full[6:]]) < 1e-6
    assert r["resumed_state_end"] == r["full_state_end"]
    assert r["resumed_scheduler"] == r["full_scheduler"] == 12 - 3


@pytest.mark.parametrize(("precision", "dtype"), [("16-mixed", "torch.float16"), ("bf16-mixed", "torch.bfloat16")])
def test_ampzero_train_computes_its_matmuls_in_the_low_dtype_on_cpu(tmp_path, precision, dtype):
    # Lightning rewrites "16-mixed" to "bf16-mixed" on CPU; ampzero-train must compute in fp16 (its
    # losses being close to fp32's says nothing about that): checked on the kernels' input dtypes.
    from _scripts import run_script

    out = tmp_path / "dtypes.json"
    run_script("matmul_dtypes.py", str(out), str(tmp_path / "job"), f"precision={precision}",
               "trainer.max_steps=2", "model=gpt_tiny", timeout=300)
    seen = json.loads(out.read_text())
    assert sum(seen.values()) > 0, seen
    assert all(key.endswith(f":{dtype}") for key in seen), seen  # every product, forward and backward


def test_skipped_steps_are_said_rate_limited_and_summed_up_at_teardown(monkeypatch):
    import lightning_ampzero.precision.plugin as plugin_module

    said: list[str] = []
    monkeypatch.setattr(plugin_module, "rank_zero_info", said.append)
    cfg = PrecisionConfig(loss_scaler=LossScalerConfig(initial_scale_power=20, hysteresis=2, loss_scale_window=100))
    plugin = AmpZeroPrecision("16-mixed", cfg, device="cpu")
    plugin._stub = _StubModule()
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    for _ in range(9):
        _step(plugin, net, opt, 0.5, overflow=True)
    # skips 1, 2, 3, then 4 and 8: five lines for nine skips
    lines = [s for s in said if "skipped, non-finite gradients" in s]
    assert len(lines) == 5, said
    assert "loss scale kept at 1.04858e+06 (hysteresis); 1 skipped so far" in lines[0]
    assert "loss scale 1.04858e+06 -> 524288; 2 skipped so far" in lines[1]
    assert "8 skipped so far" in lines[4]
    plugin.teardown()
    assert "9 optimizer step(s) skipped for non-finite gradients" in said[-1] and "final loss scale 4096" in said[-1]
    # a static scale is not kept by hysteresis (a migration trial's "loss_scale": 65536)
    said.clear()
    static = AmpZeroPrecision("16-mixed", PrecisionConfig(loss_scaler=LossScalerConfig(loss_scale=65536)), device="cpu")
    static._stub = _StubModule()
    _step(static, net, opt, 0.5, overflow=True)
    assert "loss scale kept at 65536 (static loss scale); 1 skipped so far" in said[0], said
    # nor is a scale already at min_loss_scale, skipping (at_min_scale="skip"; a trial read "hysteresis")
    said.clear()
    at_min = AmpZeroPrecision("16-mixed", PrecisionConfig(loss_scaler=LossScalerConfig(
        initial_scale_power=0, hysteresis=1, at_min_scale="skip")), device="cpu")
    at_min._stub = _StubModule()
    _step(at_min, net, opt, 0.5, overflow=True)
    assert "loss scale kept at 1 (at min_loss_scale); 1 skipped so far" in said[0], said


# ---- [Note: clipping before the step]: manual optimization clips unscaled gradients ----------------
def _whole(p: torch.Tensor) -> torch.Tensor:
    p = p.detach()
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).clone()


class _ManualClip(pl.LightningModule):
    def __init__(self, algorithm: str, clip: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.automatic_optimization = False
        self.algorithm, self.clip = algorithm, clip
        self.moves: list[tuple[float, float]] = []  # (norm, max abs) of each step's change of the weights

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        before = [_whole(p) for p in self.parameters()]
        opt.zero_grad()
        self.manual_backward(((self.net(batch[0]) - batch[1]) ** 2).mean())
        self.clip_gradients(opt, self.clip, self.algorithm)
        opt.step()
        delta = torch.cat([(_whole(p) - b).flatten() for p, b in zip(self.parameters(), before)])
        self.moves.append((delta.norm().item(), delta.abs().max().item()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_manual_clip_gradients_under_fp16_clips_the_unscaled_gradients(algorithm):
    """SGD at lr 1 moves the weights by exactly the clipped gradient: clip norm 0.5 gives steps of norm
    0.5, as in fp32. Before the fix fp16 clipped the gradients times the loss scale (65536) and moved
    them 0.5 / 65536 per step."""
    clip = 0.5 if algorithm == "norm" else 0.01
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    moved = {}
    for precision in ("32-true", "16-mixed"):
        module = _ManualClip(algorithm, clip)
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="ampzero_stage_2", precision=precision,
                             max_steps=16, logger=False, enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
        taken = [m for m in module.moves if m[0] > 0]  # fp16 skips its first steps (DeepSpeed's scale 2^16)
        assert len(taken) >= 4, module.moves
        moved[precision] = taken
    for precision, taken in moved.items():
        for norm, largest in taken:
            measured = norm if algorithm == "norm" else largest
            assert measured == pytest.approx(clip, rel=2e-3), (precision, taken)


@pytest.mark.parametrize(("trainer_precision", "warned"), [(None, False), ("32-true", True), (32, True),
                                                           ("bf16-true", True), ("bf16-mixed", False)])
def test_a_trainer_precision_other_than_the_strategys_is_warned_also_when_it_is_32_true(trainer_precision, warned):
    # The strategy's precision wins over the Trainer's (docs/precision.md: with a warning). An explicit
    # Trainer(precision="32-true") under a DeepSpeed config's bf16 section was overridden silently, as
    # "32-true" is also what Lightning builds when precision= is not given (a migration trial).
    import lightning.pytorch as pl

    from lightning_ampzero.strategy import AmpZeroStrategy

    kwargs = {} if trainer_precision is None else {"precision": trainer_precision}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                             strategy=AmpZeroStrategy(config={"bf16": {"enabled": True}}, stage=2), **kwargs)
    said = [str(w.message) for w in caught if "differs from the strategy's precision config" in str(w.message)]
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed"
    assert bool(said) == warned, said


def test_fp16_on_a_cpu_without_fp16_hardware_is_said_once_at_setup(monkeypatch):
    # A docs trial: the README's `ampzero-train strategy=zero3 precision=16-mixed` ran 9x slower than
    # 32-true on this CPU (fp16 GEMMs on torch's reference path), with nothing said.
    from _scripts import setup_warnings
    from lightning_ampzero.precision.policy import fp16_cpu_note

    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False)
    for precision in ("16-mixed", "16-true"):
        note = fp16_cpu_note(precision, cpu)
        assert note is not None and f"precision={precision!r} on a CPU without fp16 matrix hardware" in note
        assert "bf16-mixed" in note
    for precision in ("32-true", "bf16-mixed", "bf16-true"):
        assert fp16_cpu_note(precision, cpu) is None
    assert fp16_cpu_note("16-mixed", torch.device("cuda", 0)) is None

    needle = "without fp16 matrix hardware"
    assert len(setup_warnings("ampzero_stage_2", needle, precision="16-mixed")) == 1
    assert setup_warnings("ampzero_stage_2", needle, precision="bf16-mixed") == []
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: True)  # e.g. AMX-FP16
    assert fp16_cpu_note("16-mixed", cpu) is None
