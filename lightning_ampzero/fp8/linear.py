"""Fp8Linear: an ``nn.Linear`` whose three GEMMs run in FP8 through ``torch._scaled_mm``.

Forward ``y = x W^T + b``, backward ``grad_x = grad_y W`` and ``grad_W = grad_y^T x``: each
GEMM takes FP8 operands with their scales (E4M3 for x and W, E5M2 for grad_y under the hybrid
format) and accumulates in fp32. ``torch._scaled_mm`` has no autograd formula, hence
:class:`_Fp8LinearFn`.

What is kept for backward: under ``tensorwise`` / ``delayed`` the FP8 input (1 byte per
element instead of 2-4) and the weight *parameter* itself, re-cast in backward with the scale
the forward used (bit-identical), so a ZeRO-3 unit's gathered weight is not held in a second,
FP8 copy across forward and backward; under ``rowwise`` the high-precision input, since each
GEMM needs the operands scaled along a different axis.

[Note: FP8 GEMM shapes] On CUDA, ``_scaled_mm`` needs a's columns and b's columns (K and N of
each GEMM) to be multiples of 16, ``a`` row-major and ``b`` column-major. The batch dimension M
is the contraction of the weight-gradient GEMM, so it is zero-padded to a multiple of 16 there
(zeros add nothing). ``in_features``/``out_features`` that are not multiples of 16 are either
filtered out of conversion or, with ``Fp8Config.pad_dims``, zero-padded in every GEMM and the
results sliced back. CPU has no such constraint; the same padding runs there so CPU tests
cover the CUDA code path.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_ampzero.config import Fp8Config
from lightning_ampzero.fp8 import kernels
from lightning_ampzero.fp8.scaling import GRAD, INPUT, WEIGHT, DelayedScalingSync, current_scale, role_dtypes

_ALIGN = 16


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _pad(q: Tensor, rows: int, cols: int) -> Tensor:
    """Zero-pad a row-major FP8 matrix to [rows, cols] (through uint8: fp8 has no pad kernel; 0x00 is +0)."""
    r, c = q.shape
    if (r, c) == (rows, cols):
        return q
    return F.pad(q.view(torch.uint8), (0, cols - c, 0, rows - r)).view(q.dtype)


def _pad_scale(s: Tensor, dim: int, size: int) -> Tensor:
    """Pad a row-wise scale vector with ones along ``dim`` (padded rows are zeros anyway)."""
    if s.numel() == 1 or s.shape[dim] == size:
        return s
    pad = [0, 0, 0, 0]
    pad[1 if dim == 1 else 3] = size - s.shape[dim]
    return F.pad(s, pad, value=1.0)


def _col_major(q: Tensor, rows: int, cols: int) -> Tensor:
    """``q`` [r, c] as a column-major [rows, cols] matrix, zero-padded (the layout of ``_scaled_mm``'s b)."""
    return _pad(q.t().contiguous(), cols, rows).t()


class _Plan:
    """Everything the autograd function needs to know about its module (not a tensor)."""

    __slots__ = ("module", "dtypes", "rowwise", "emulate", "report_backward")

    def __init__(self, module: "Fp8Linear", report_backward: Optional[bool]) -> None:
        cfg = module.fp8_config
        self.module = module if cfg.recipe == "delayed" else None
        self.report_backward = report_backward  # DelayedScalingSync.on_forward's verdict
        self.dtypes = role_dtypes(cfg)
        self.rowwise = cfg.recipe == "rowwise"
        self.emulate = cfg.emulate


def _unwrap_weight(weight: Tensor) -> tuple[Tensor, Optional[tuple[Tensor, Tensor]]]:
    """(high-precision weight, or (fp8 data, scale) when FSDP2 gathered it in FP8)."""
    from lightning_ampzero.fp8.fsdp import Fp8AllGatherWeight, Fp8GatheredWeight

    if isinstance(weight, Fp8GatheredWeight):
        return weight, (weight._data, weight._scale)
    if isinstance(weight, Fp8AllGatherWeight):
        return weight._tensor, None
    return weight, None


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor], plan: _Plan, out_dtype: torch.dtype) -> Tensor:  # type: ignore[override]
        x_dtype, w_dtype, _ = plan.dtypes
        m, k = x.shape
        n = weight.shape[0]
        kp, np_ = _round_up(k), _round_up(n)
        w_hp, gathered = _unwrap_weight(weight)
        ctx.plan, ctx.shape, ctx.x_dtype = plan, (m, k, n), x.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        if plan.rowwise:
            x_q, x_s = kernels.cast_rowwise(x, x_dtype, dim=-1)           # [M, 1]
            w_q, w_s = kernels.cast_rowwise(w_hp, w_dtype, dim=-1)        # [N, 1]
            y = kernels.scaled_mm(
                _pad(x_q, m, kp), _pad(w_q, np_, kp).t(), x_s.reciprocal(),
                _pad_scale(w_s.reciprocal().t(), 1, np_), out_dtype, emulate=plan.emulate,
            )
            ctx.save_for_backward(x, weight)
        else:
            if gathered is not None:
                w_q, w_s = gathered
            else:
                w_s, record = current_scale(plan.module, WEIGHT, w_hp, w_dtype)
                w_q = kernels.cast(w_hp, w_s, w_dtype, record)
            x_s, record = current_scale(plan.module, INPUT, x, x_dtype)
            x_q = kernels.cast(x, x_s, x_dtype, record)
            x_q = _pad(x_q, m, kp)
            y = kernels.scaled_mm(x_q, _pad(w_q, np_, kp).t(), x_s.reciprocal(), w_s.reciprocal(), out_dtype,
                                  emulate=plan.emulate)
            ctx.save_for_backward(x_q, x_s, w_s.detach().clone(), weight)
        if np_ != n:
            y = y[:, :n]
        if bias is not None:
            y = y + bias.to(out_dtype)
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        plan: _Plan = ctx.plan
        m, k, n = ctx.shape
        mp, kp, np_ = _round_up(m), _round_up(k), _round_up(n)
        x_dtype, w_dtype, g_dtype = plan.dtypes
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_y = grad_y.contiguous()
        grad_x = grad_w = grad_b = None
        if plan.rowwise:
            x, weight = ctx.saved_tensors
            w_hp, _ = _unwrap_weight(weight)
            if need_x:
                g_q, g_s = kernels.cast_rowwise(grad_y, g_dtype, dim=-1)     # [M, 1]
                wc_q, wc_s = kernels.cast_rowwise(w_hp, w_dtype, dim=0)     # [1, K]
                grad_x = kernels.scaled_mm(
                    _pad(g_q, m, np_), _col_major(wc_q, np_, kp),
                    g_s.reciprocal(), _pad_scale(wc_s.reciprocal(), 1, kp), ctx.x_dtype, emulate=plan.emulate,
                )[:, :k]
            if need_w:
                gc_q, gc_s = kernels.cast_rowwise(grad_y, g_dtype, dim=0)    # [1, N]
                xc_q, xc_s = kernels.cast_rowwise(x, x_dtype, dim=0)         # [1, K]
                grad_w = kernels.scaled_mm(
                    _pad(gc_q.t().contiguous(), np_, mp), _col_major(xc_q, mp, kp),
                    _pad_scale(gc_s.reciprocal().t(), 0, np_), _pad_scale(xc_s.reciprocal(), 1, kp),
                    weight.dtype, emulate=plan.emulate,
                )[:n, :k]
        else:
            x_q, x_s, w_s, weight = ctx.saved_tensors
            g_s, record = current_scale(plan.module, GRAD, grad_y, g_dtype)
            g_q, g_qt = kernels.cast_transpose(grad_y, g_s, g_dtype, record)
            if need_x:
                w_hp, gathered = _unwrap_weight(weight)
                w_q = gathered[0] if gathered is not None else kernels.cast(w_hp, w_s, w_dtype)
                # b = W [N, K], column-major.
                grad_x = kernels.scaled_mm(
                    _pad(g_q, m, np_), _col_major(w_q, np_, kp), g_s.reciprocal(), w_s.reciprocal(),
                    ctx.x_dtype, emulate=plan.emulate,
                )[:, :k]
            if need_w:
                # a = grad_y^T [N, M] row-major, b = x [M, K] column-major; M is the contraction.
                grad_w = kernels.scaled_mm(
                    _pad(g_qt, np_, mp), _col_major(x_q, mp, kp), g_s.reciprocal(), x_s.reciprocal(),
                    weight.dtype, emulate=plan.emulate,
                )[:n, :k]
        if plan.report_backward is not None:
            plan.module._fp8_sync.on_backward(plan.report_backward)
        if need_b and ctx.bias_dtype is not None:
            grad_b = grad_y.float().sum(0).to(ctx.bias_dtype)
        grad_x = grad_x.contiguous() if grad_x is not None else None
        grad_w = grad_w.contiguous() if grad_w is not None else None
        return grad_x, grad_w, grad_b, None, None


class Fp8Linear(nn.Linear):
    """``nn.Linear`` computing its forward and backward GEMMs in FP8 (see the module docstring).

    Build it with :func:`lightning_ampzero.fp8.convert_to_fp8` (or :meth:`from_linear`); it keeps
    the original parameters (fp32 masters), so optimizers, sharding and checkpoints see the same
    parameter names and shapes as the ``nn.Linear`` it replaces. Under the ``delayed`` recipe it
    adds two persistent buffers (``fp8_amax_history``, ``fp8_scale``; see
    [Note: delayed scaling state] in ``scaling.py``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None, dtype: Any = None,
                 *, config: Optional[Fp8Config] = None) -> None:
        self.fp8_config = config or Fp8Config()
        super().__init__(in_features, out_features, bias, device, dtype)
        self._fp8_sync: Optional[DelayedScalingSync] = None
        self._fp8_ready = (False, False, False)  # per role: a scale from history exists
        if self.fp8_config.recipe == "delayed":
            h = self.fp8_config.amax_history_len
            self.register_buffer("fp8_amax_history", torch.zeros(3, h, device=device, dtype=torch.float32))
            self.register_buffer("fp8_scale", torch.zeros(3, device=device, dtype=torch.float32))
            self.register_load_state_dict_post_hook(_history_ready_after_load)
        self.register_state_dict_post_hook(_plain_weight_in_state_dict)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: Fp8Config, *, fp8_all_gather: bool = False) -> "Fp8Linear":
        """An Fp8Linear sharing ``linear``'s parameters (on any device, meta included)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, config=config)
        weight = linear.weight
        if fp8_all_gather and config.recipe == "rowwise":
            raise ValueError("FP8 all-gather needs one scale per weight tensor; recipe='rowwise' has one per row.")
        if fp8_all_gather:
            from lightning_ampzero.fp8.fsdp import Fp8AllGatherWeight

            weight = nn.Parameter(Fp8AllGatherWeight(weight.data, role_dtypes(config)[WEIGHT]),
                                  requires_grad=weight.requires_grad)
        new.weight = weight
        new.bias = linear.bias
        for name, buf in list(new._buffers.items()):
            new._buffers[name] = torch.zeros_like(buf, device=linear.weight.device)
        new.train(linear.training)
        return new

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.reset_fp8_state()

    @torch.no_grad()
    def reset_fp8_state(self) -> None:
        """Forget the delayed recipe's amax history (the next step scales dynamically)."""
        if "fp8_amax_history" in self._buffers:
            self.fp8_amax_history.zero_()
            self.fp8_scale.zero_()
        self._fp8_ready = (False, False, False)

    def _apply(self, fn: Any, recurse: bool = True) -> "Fp8Linear":
        super()._apply(fn, recurse)
        # `.to(bf16)` / "-true" conversions cast floating buffers; amaxes and scales stay fp32.
        for name in ("fp8_amax_history", "fp8_scale"):
            buf = self._buffers.get(name)
            if buf is not None and buf.dtype != torch.float32:
                self._buffers[name] = buf.float()
        return self

    def forward(self, x: Tensor) -> Tensor:
        report = None
        if self._fp8_sync is not None and self.training:
            report = self._fp8_sync.on_forward(torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
        if torch.is_autocast_enabled(x.device.type):
            out_dtype = torch.get_autocast_dtype(x.device.type)
        else:
            out_dtype = x.dtype
        lead = x.shape[:-1]
        with torch.autocast(x.device.type, enabled=False):
            y = _Fp8LinearFn.apply(x.reshape(-1, self.in_features), self.weight, self.bias, _Plan(self, report), out_dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        cfg = self.fp8_config
        return f"{super().extra_repr()}, recipe={cfg.recipe}, format={cfg.resolved_format}"


def _history_ready_after_load(module: Fp8Linear, incompatible_keys: Any) -> None:
    # A resumed run continues from the saved scales (0 = a role that had no history yet).
    if not module.fp8_scale.is_meta:
        module._fp8_ready = tuple(bool(v) for v in (module.fp8_scale > 0).tolist())


def _plain_weight_in_state_dict(module: Fp8Linear, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    # The FP8 all-gather wrapper is an FSDP2 detail: checkpoints hold the plain fp32 weight
    # (same storage), so they load into nn.Linear / Fp8Linear with or without it.
    from lightning_ampzero.fp8.fsdp import unwrap_all_gather_weight

    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = unwrap_all_gather_weight(state_dict[key])
