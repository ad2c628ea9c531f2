"""Fp8Linear numerics against fp32 (within the bound FP8 quantization implies), recipes, conversion, export, O2.

[Note: FP8 error bound] Round-to-nearest-even into a format with ``p`` mantissa bits has a
relative error of at most ``u = 2**-(p+1)`` on normal values (E4M3: u = 1/16, E5M2: u = 1/8)
and an absolute error of at most half the subnormal spacing below them (E4M3: 2**-10, E5M2:
2**-17), in scaled units. With ``x_q = cast(x * s)`` and dequantization by ``1/s``, every element
satisfies ``|x^ - x| <= u|x| + d`` with ``d = 2**-10 / s`` (E4M3) or ``2**-17 / s`` (E5M2), as long
as nothing saturates (dynamic scaling guarantees it; delayed scaling when the amax did not grow).
For a GEMM ``C = A B^T`` over K, writing ``|A^ - A| <= E_A = u_a|A| + d_a`` (elementwise):

    |C^ - C| <= E_A (|B| + E_B)^T + |A| E_B^T  +  2 K 2**-24 |A^| |B^|^T      (fp32 accumulation)

elementwise, with row-wise recipes using a ``d`` per row of each operand. The three GEMMs of
a linear layer: y = x W^T (x, W in E4M3), grad_x = g W (g in E5M2 under "hybrid"), grad_W =
g^T x. The tests compute this bound from the actual operands and scales and assert that every
element's error is within it; the measured error is typically 10-30% of the bound.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_ampzero.config import AmpZeroConfig, Fp8Config
from lightning_ampzero.fp8 import (
    Fp8AdamW,
    Fp8Linear,
    convert_from_fp8,
    convert_to_fp8,
    fp8_optimizers,
    optimizer_state_bytes,
    plan_fp8_conversion,
    strip_fp8_state,
)
from lightning_ampzero.fp8.optim import STATE_BYTES_PER_ELEMENT, STATE_BYTES_PER_TENSOR

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
U = {E4M3: 2.0**-4, E5M2: 2.0**-3}
HALF_SUBNORMAL = {E4M3: 2.0**-10, E5M2: 2.0**-17}
FMAX = {E4M3: 448.0, E5M2: 57344.0}


def _dyn_scale(t: torch.Tensor, fmt: torch.dtype, dim=None) -> torch.Tensor:
    a = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    return FMAX[fmt] / a.double().clamp(min=1e-12)


def gemm_bound(a, b, fmt_a, fmt_b, s_a, s_b) -> torch.Tensor:
    """Elementwise bound on |fp8 GEMM(a, b^T) - a @ b^T| (see [Note: FP8 error bound]); a [M,K], b [N,K]."""
    a, b = a.double(), b.double()
    e_a = U[fmt_a] * a.abs() + HALF_SUBNORMAL[fmt_a] / s_a
    e_b = U[fmt_b] * b.abs() + HALF_SUBNORMAL[fmt_b] / s_b
    k = a.shape[1]
    return e_a @ (b.abs() + e_b).t() + a.abs() @ e_b.t() + 2 * k * 2.0**-24 * (a.abs() + e_a) @ (b.abs() + e_b).t()


def _layer_case(recipe: str, m: int, k: int, n: int, *, pad_dims=False, seed=0, lead=()):
    g = torch.Generator().manual_seed(seed)
    ref = nn.Linear(k, n)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        ref.bias.copy_(torch.randn(n, generator=g) * 0.1)
    model = nn.Sequential(copy.deepcopy(ref))
    convert_to_fp8(model, Fp8Config(recipe=recipe, min_features=0, pad_dims=pad_dims))
    x = torch.randn(*lead, m, k, generator=g)
    # Activations with outliers, gradients spanning many magnitudes: what FP8 has to cope with.
    x[..., 0, :3] *= 30
    grad = torch.randn(*lead, m, n, generator=g) * torch.logspace(-4, 0, n).double().float()
    return ref, model, x, grad


def _run(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(grad)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def _check_layer(recipe, ref, fp8_layer, x, grad, scales=None):
    """Assert forward, grad_x, grad_W within the bound; return the max error/bound ratio of each."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k).double()
    g2 = grad.reshape(-1, grad.shape[-1]).double()
    w = ref.weight.detach().double()
    fmt_g = E4M3 if recipe == "rowwise" else E5M2
    y_ref, gx_ref, gw_ref, gb_ref = _run(copy.deepcopy(ref).double(), x.double(), grad.double())
    y, gx, gw, gb = _run(fp8_layer, x, grad)
    if recipe == "rowwise":
        s = dict(fx=_dyn_scale(x2, E4M3, 1), fw=_dyn_scale(w, E4M3, 1),
                 gg=_dyn_scale(g2, fmt_g, 1), gw=_dyn_scale(w, E4M3, 0),
                 wg=_dyn_scale(g2, fmt_g, 0).t(), wx=_dyn_scale(x2, E4M3, 0).t())
    else:
        s = scales or dict(x=_dyn_scale(x2, E4M3), w=_dyn_scale(w, E4M3), g=_dyn_scale(g2, fmt_g))
        s = dict(fx=s["x"], fw=s["w"], gg=s["g"], gw=s["w"], wg=s["g"], wx=s["x"])
    bounds = {
        "forward": (y.reshape(-1, y.shape[-1]).double() - y_ref.reshape(x2.shape[0], -1),
                    gemm_bound(x2, w, E4M3, E4M3, s["fx"], s["fw"]) + 2.0**-22 * ref.bias.double().abs()),
        "grad_input": (gx.reshape(x2.shape).double() - gx_ref.reshape(x2.shape),
                       gemm_bound(g2, w.t(), fmt_g, E4M3, s["gg"], s["gw"].t() if recipe == "rowwise" else s["gw"])),
        "grad_weight": (gw.double() - gw_ref,
                        gemm_bound(g2.t(), x2.t(), fmt_g, E4M3, s["wg"], s["wx"])),
    }
    ratios = {}
    for name, (err, bound) in bounds.items():
        ratio = (err.abs() / bound).max().item()
        assert ratio <= 1.0, f"{recipe} {name}: error exceeds the FP8 bound by {ratio:.3f}x"
        ratios[name] = ratio
    torch.testing.assert_close(gb.double(), gb_ref, rtol=1e-5, atol=1e-6)  # bias grad stays high precision
    return ratios


# ---------------------------------------------------------------------------------------------
# Acceptance 1: forward and backward within the FP8 bound, each recipe, padded and filtered shapes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
@pytest.mark.parametrize("shape,pad", [((37, 64, 48), False), ((24, 40, 24), True), ((4, 8, 32, 16), False)],
                         ids=["M-padded", "KN-padded", "3d-input"])
def test_fp8_linear_within_quantization_bound(recipe, shape, pad):
    if len(shape) == 4:
        lead, (m, k, n) = (shape[0],), shape[1:]
    else:
        lead, (m, k, n) = (), shape
    ref, model, x, grad = _layer_case(recipe, m, k, n, pad_dims=pad, lead=lead)
    layer = model[0]
    assert isinstance(layer, Fp8Linear)
    ratios = _check_layer(recipe, ref, layer, x, grad)
    # The bound is not vacuous: the error is a visible fraction of it.
    assert max(ratios.values()) > 0.02, ratios


def test_fp8_matches_dequantized_reference_exactly():
    """Mechanics: the FP8 GEMM equals fp64 math on the dequantized operands, up to fp32 accumulation."""
    ref, model, x, _ = _layer_case("tensorwise", 37, 64, 48)
    y = model(x).detach().double()
    sx, sw = _dyn_scale(x, E4M3).float(), _dyn_scale(ref.weight.detach(), E4M3).float()
    xq = (x * sx).clamp(-448, 448).to(E4M3).double() / sx.double()
    wq = (ref.weight.detach() * sw).clamp(-448, 448).to(E4M3).double() / sw.double()
    expected = xq @ wq.t() + ref.bias.detach().double()
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)


def test_filtered_shapes_stay_exact_linear():
    """Dims that are not multiples of 16 (without pad_dims) and tiny layers are not converted."""
    model = nn.Sequential(nn.Linear(40, 24), nn.Linear(24, 64), nn.Linear(64, 64))
    ref = copy.deepcopy(model)
    plan = plan_fp8_conversion(model, Fp8Config(min_features=32))
    assert "not multiples of 16" in plan["0"] and "not multiples of 16" in plan["1"]
    assert plan["2"] == "fp8"
    convert_to_fp8(model, Fp8Config(min_features=32))
    assert [type(m) for m in model] == [nn.Linear, nn.Linear, Fp8Linear]
    x = torch.randn(5, 40)
    torch.testing.assert_close(model[1](model[0](x)), ref[1](ref[0](x)), rtol=0, atol=0)
    with pytest.warns(UserWarning, match="no layer was converted"):
        convert_to_fp8(nn.Sequential(nn.Linear(64, 64)), Fp8Config())  # min_features=1024 by default


def test_bf16_autocast_output_dtype_and_bound():
    ref, model, x, grad = _layer_case("tensorwise", 32, 64, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x.requires_grad_())
    assert y.dtype == torch.bfloat16
    y.backward(grad.bfloat16())
    assert x.grad.dtype == torch.float32 and model[0].weight.grad.dtype == torch.float32
    y_ref = ref(x).double()
    bound = gemm_bound(x, ref.weight.detach(), E4M3, E4M3, _dyn_scale(x, E4M3), _dyn_scale(ref.weight.detach(), E4M3))
    bound = bound + 2.0**-8 * y_ref.abs() * 1.01  # bf16 rounding of the output
    assert ((y.double() - y_ref).abs() <= bound).all()


# ---------------------------------------------------------------------------------------------
# The delayed recipe: history, scales, DP reduction point, saturation, checkpoint state
# ---------------------------------------------------------------------------------------------


def _delayed_model(h=4, margin=0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    convert_to_fp8(model, Fp8Config(recipe="delayed", min_features=0, amax_history_len=h, margin=margin))
    return model


def test_delayed_history_and_scales_follow_the_recipe():
    model = _delayed_model(h=3, margin=1)
    layer = model[0]
    amaxes = []
    for s in (1.0, 4.0, 0.5, 0.25, 0.25):
        x = torch.randn(8, 32) * s
        y = model(x)
        amaxes.append(x.abs().max().item())
        assert layer.fp8_amax_history[0, 0].item() == pytest.approx(amaxes[-1])  # recorded while casting
        y.sum().backward()
        # The last backward of the step synced: history rolled, scales updated, nothing pending.
        assert layer.fp8_amax_history[0, 0] == 0 and not layer._fp8_sync.pending
        assert layer.fp8_amax_history[0, 1].item() == pytest.approx(amaxes[-1])
        expected = 448.0 / max(amaxes[-3:]) / 2.0  # window of 3, margin 1
        assert layer.fp8_scale[0].item() == pytest.approx(expected, rel=1e-6)
    assert layer._fp8_ready == (True, True, True)
    # Forwards without backward (no_grad) record amaxes but do not count as a step.
    with torch.no_grad():
        model(torch.randn(8, 32) * 100)
    assert layer.fp8_amax_history[0, 0] > 0 and layer._fp8_sync.outstanding == 0


def test_delayed_recipe_under_activation_checkpointing_matches_plain():
    """Forwards recomputed in backward are not new steps: same grads, same scaling state, one sync per step."""
    from torch.utils.checkpoint import checkpoint

    plain = _delayed_model()
    ckpt = _delayed_model()
    for step in range(3):
        x = torch.randn(8, 32) * (step + 1)
        plain(x).square().sum().backward()
        checkpoint(ckpt, x, use_reentrant=False).square().sum().backward()
        assert not ckpt[0]._fp8_sync.pending and ckpt[0]._fp8_sync.outstanding == 0
        for a, b in zip(plain.state_dict().values(), ckpt.state_dict().values()):
            assert torch.equal(a, b)
        for a, b in zip(plain.parameters(), ckpt.parameters()):
            assert torch.equal(a.grad, b.grad)


def test_delayed_within_bound_using_history_scales():
    ref, model, x, grad = _layer_case("delayed", 37, 64, 48)
    layer = model[0]
    _run(layer, x, grad)
    layer.zero_grad(set_to_none=True)
    layer._fp8_sync.sync()
    scales = {"x": layer.fp8_scale[0].double(), "w": layer.fp8_scale[1].double(), "g": layer.fp8_scale[2].double()}
    # Smaller inputs than the history saw: cast with the historical (delayed) scale, no saturation.
    _check_layer("delayed", ref, layer, 0.3 * x, 0.3 * grad, scales=scales)


def test_delayed_saturates_instead_of_overflowing_and_recovers():
    model = _delayed_model()
    x = torch.randn(8, 32)
    model(x).sum().backward()
    big = 1000 * x
    y = model(big)  # scale from history is 1000x too large: the cast saturates at 448, no inf/NaN
    assert torch.isfinite(y).all()
    y.sum().backward()
    # Each layer's history catches up one step after its input's producer did (layer 2 saw the
    # saturated output of layer 0 on the first large step): two layers, recovered after two steps.
    model(big).sum().backward()
    ref = copy.deepcopy(model)
    convert_from_fp8(ref)
    y2 = model(big)
    assert (y2 - ref(big)).abs().max() < 0.1 * ref(big).abs().max()


def test_delayed_state_is_saved_and_restored():
    model = _delayed_model()
    for _ in range(3):
        model(torch.randn(8, 32)).sum().backward()
    model(torch.randn(8, 32))
    state = model.state_dict()
    assert {"0.fp8_amax_history", "0.fp8_scale", "2.fp8_amax_history", "2.fp8_scale"} <= set(state)
    fresh = _delayed_model()
    assert fresh[0]._fp8_ready == (False, False, False)
    fresh.load_state_dict(state)
    assert fresh[0]._fp8_ready == (True, True, True)
    torch.testing.assert_close(fresh[0].fp8_scale, model[0].fp8_scale, rtol=0, atol=0)
    x = torch.randn(8, 32)
    model.eval(), fresh.eval()
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)


def test_delayed_buffers_stay_fp32_and_meta_conversion_materializes():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 32))
    convert_to_fp8(model, Fp8Config(recipe="delayed", min_features=0))
    assert model[0].weight.is_meta and model[0].fp8_scale.is_meta
    model.to_empty(device="cpu")
    model[0].reset_parameters()
    assert model[0].fp8_scale.abs().sum() == 0 and not any(model[0]._fp8_ready)
    model.to(torch.bfloat16)
    assert model[0].fp8_amax_history.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Config, conversion plan, export
# ---------------------------------------------------------------------------------------------


def test_config_validation_names_the_field():
    assert not AmpZeroConfig().fp8.enabled  # off by default ("off means absent")
    assert AmpZeroConfig.from_dict({"fp8": {"recipe": "delayed"}}).fp8.enabled
    with pytest.raises(ValueError, match="fp8.recipe='dynamic' is not valid"):
        Fp8Config(recipe="dynamic")
    with pytest.raises(ValueError, match="only applies to recipe='delayed'"):
        Fp8Config(amax_history_len=32)
    with pytest.raises(ValueError, match="E4M3 operands"):
        Fp8Config(recipe="rowwise", format="hybrid")
    with pytest.raises(ValueError, match="one scale per tensor"):
        Fp8Config(recipe="rowwise", msamp="O1")
    with pytest.raises(ValueError, match="Did you mean 'margin'"):
        Fp8Config.from_dict({"recipe": "delayed", "margn": 1})
    assert Fp8Config(recipe="rowwise").resolved_format == "e4m3"
    from lightning_ampzero.strategy import AmpZeroStrategy

    assert AmpZeroStrategy(stage=3, fp8=Fp8Config(recipe="delayed")).config.fp8.recipe == "delayed"


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.body = nn.Linear(32, 32)
        self.attn = nn.MultiheadAttention(32, 2)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight


def test_conversion_plan_reasons_and_filters():
    model = _Tied()
    plan = plan_fp8_conversion(model, Fp8Config(min_features=0))
    assert plan["body"] == "fp8"
    assert "weight shared" in plan["head"]
    assert "subclass" in plan["attn.out_proj"]
    assert "skip_fqns" in plan_fp8_conversion(model, Fp8Config(min_features=0, skip_fqns=("bo*",)))["body"]
    assert "module_filter_fn" in plan_fp8_conversion(model, Fp8Config(min_features=0),
                                                     module_filter_fn=lambda m, fqn: fqn != "body")["body"]
    assert plan_fp8_conversion(model, Fp8Config.off())["body"] == "fp8 is disabled"
    before = list(model.modules())
    assert convert_to_fp8(model, Fp8Config.off()) is model and list(model.modules()) == before
    weight = model.body.weight
    convert_to_fp8(model, Fp8Config(min_features=0))
    assert isinstance(model.body, Fp8Linear) and model.body.weight is weight  # same parameter object
    convert_to_fp8(model, Fp8Config(min_features=0))  # idempotent
    assert isinstance(model.body, Fp8Linear)


def test_export_back_to_plain_linear():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16))
    ref = copy.deepcopy(model)
    convert_to_fp8(model, Fp8Config(recipe="delayed", min_features=0), fp8_all_gather=True)
    model(torch.randn(4, 32)).sum().backward()
    state = model.state_dict()
    assert type(state["0.weight"]) is torch.Tensor  # the all-gather wrapper never reaches a checkpoint
    plain = copy.deepcopy(ref)
    plain.load_state_dict(strip_fp8_state(state))
    convert_from_fp8(model)
    assert [type(m) for m in model] == [nn.Linear, nn.Linear]
    assert type(model[0].weight.data) is torch.Tensor
    x = torch.randn(4, 32)
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)  # weights were not touched


def test_scaled_mm_emulation_equals_fp8_gemm():
    from lightning_ampzero.fp8 import kernels

    a = torch.randn(32, 48).to(E4M3)
    b = torch.randn(16, 48).to(E4M3).t()
    sa, sb = torch.tensor(0.5), torch.tensor(0.25)
    # torch's own FP8 GEMM (CPU runs the dequantized product: [Note: the FP8 GEMM on CPU])
    fp8_gemm = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    for emulate in (True, False):
        torch.testing.assert_close(kernels.scaled_mm(a, b, sa, sb, torch.float32, emulate=emulate), fp8_gemm,
                                   rtol=1e-6, atol=1e-6)


def test_old_gpu_falls_back_with_one_warning(monkeypatch):
    from lightning_ampzero.fp8 import kernels

    kernels._cuda_fp8.cache_clear()
    kernels._warn_no_fp8.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    try:
        with pytest.warns(UserWarning, match="compute capability 8.0") as record:
            assert not kernels.fp8_gemm_supported(torch.device("cuda", 0))
            assert not kernels.fp8_gemm_supported(torch.device("cuda", 0))
        assert len([w for w in record if "compute capability" in str(w.message)]) == 1
    finally:
        kernels._cuda_fp8.cache_clear()
        kernels._warn_no_fp8.cache_clear()


# ---------------------------------------------------------------------------------------------
# O2: FP8 / fp16 Adam moments
# ---------------------------------------------------------------------------------------------


def _regression(opt_factory, steps=60):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    opt = opt_factory(model.parameters())
    g = torch.Generator().manual_seed(1)
    w_true = torch.randn(16, 4, generator=g)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 16, generator=g)
        loss = (model(x) - x @ w_true).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, opt, losses


def test_fp8_adamw_tracks_adamw_and_stores_3_bytes_per_parameter():
    kw = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)
    _, ref_opt, ref_losses = _regression(lambda p: torch.optim.AdamW(p, **kw))
    model, opt, losses = _regression(lambda p: Fp8AdamW(p, **kw))
    assert losses[-1] < 0.2 * losses[0]
    assert abs(losses[-1] - ref_losses[-1]) <= 0.1 * ref_losses[-1], (losses[-1], ref_losses[-1])
    state = opt.state[model[0].weight]
    assert state["exp_avg"].dtype == E4M3 and state["exp_avg_sq"].dtype == torch.float16
    total, elements, tensors = optimizer_state_bytes(opt)
    assert total == STATE_BYTES_PER_ELEMENT * elements + STATE_BYTES_PER_TENSOR * tensors
    ref_total, ref_elements, _ = optimizer_state_bytes(ref_opt)
    assert ref_elements == elements
    # Per element: 3 bytes vs AdamW's 8 (62.5% less).
    assert (total - STATE_BYTES_PER_TENSOR * tensors) / elements == 3.0
    assert (ref_total - 4 * tensors) / elements == 8.0


def test_fp8_adamw_state_dict_round_trip_keeps_dtypes():
    model, opt, _ = _regression(lambda p: Fp8AdamW(p, lr=1e-2), steps=3)
    saved = copy.deepcopy(opt.state_dict())
    other = Fp8AdamW(model.parameters(), lr=1e-2)
    other.load_state_dict(saved)
    a, b = opt.state[model[0].weight], other.state[model[0].weight]
    assert b["exp_avg"].dtype == E4M3 and b["exp_avg_sq"].dtype == torch.float16
    assert torch.equal(a["exp_avg"].view(torch.uint8), b["exp_avg"].view(torch.uint8))
    assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"]) and a["exp_avg_scale"] == b["exp_avg_scale"]


def test_o2_replaces_adam_keeping_param_groups_and_schedulers():
    from types import SimpleNamespace

    model = nn.Linear(8, 8)
    adam = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.StepLR(adam, step_size=1, gamma=0.5)
    cfgs = [SimpleNamespace(scheduler=sched)]
    assert fp8_optimizers([adam], cfgs, Fp8Config(msamp="O1")) == [adam]
    (new,) = fp8_optimizers([adam], cfgs, Fp8Config(msamp="O2"))
    assert isinstance(new, Fp8AdamW) and new.param_groups is adam.param_groups
    assert new.param_groups[0]["decoupled_weight_decay"] and sched.optimizer is new
    model(torch.randn(2, 8)).sum().backward()
    new.step()
    sched.step()
    assert new.param_groups[0]["lr"] == pytest.approx(0.05)
    with pytest.raises(TypeError, match="needs torch.optim.Adam or AdamW; got SGD"):
        fp8_optimizers([torch.optim.SGD(model.parameters(), lr=0.1)], [], Fp8Config(msamp="O2"))
    with pytest.raises(ValueError, match="amsgrad"):
        Fp8AdamW.from_optimizer(torch.optim.Adam(model.parameters(), amsgrad=True))


def test_fp8_on_cpu_says_it_is_for_gpus():
    from lightning_ampzero.config import Fp8Config
    from lightning_ampzero.fp8.convert import fp8_device_note

    note = fp8_device_note(Fp8Config(recipe="tensorwise"), torch.device("cpu"))
    assert note is not None and "no speed-up" in note and "compute capability 8.9+" in note
    assert fp8_device_note(Fp8Config.off(), torch.device("cpu")) is None
    assert fp8_device_note(Fp8Config(recipe="tensorwise"), torch.device("cuda", 0)) is None


def test_the_fp8_on_cpu_note_is_said_once_per_strategy_not_at_each_trainer_call():
    # setup runs for fit, validate and test: a trial read the same note three times in one script.
    from _scripts import setup_warnings
    from lightning_ampzero.config import Fp8Config
    from lightning_ampzero.strategy import AmpZeroStrategy

    notes = setup_warnings(AmpZeroStrategy(stage=2, fp8=Fp8Config()), "FP8 on CPU runs the torch path")
    assert len(notes) == 1, notes
