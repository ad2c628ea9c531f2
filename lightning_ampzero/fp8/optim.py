"""MS-AMP O2 optimizer states: AdamW with the first moment in FP8 and the second in fp16.

Per parameter element, torch's AdamW keeps two fp32 moments (8 bytes); :class:`Fp8AdamW` keeps
``exp_avg`` in E4M3 (1 byte) and ``exp_avg_sq`` in fp16 (2 bytes): 3 bytes, 62.5% less (the
figure MS-AMP reports). Each moment has one fp32 scale per parameter tensor (stored value =
moment * scale, the amax mapped to the format's largest value), so their small dynamic range
is spent where the values are; the second moment (squares of gradients, ~1e-8 and below)
would flush to zero in unscaled fp16. Per tensor there are three fp32 scalars: the two scales
and ``step``. The master weights are the parameters themselves (fp32, sharded by ZeRO).

A step, per tensor: dequantize the moments, update them in fp32 as AdamW does, apply the update
with the fp32 moments, re-quantize with new scales. [Note: global moment scales] Under ZeRO the
moments are sharded with their parameter, but a scale must be the whole tensor's, or a
checkpoint (which stores one replicated scale) would not describe the other ranks' shards. So a
step computes the new moments' local amaxes first, all-reduces them (one collective for all
tensors), then recomputes the moments (same ops, same values) and casts them: twice the
elementwise work of the update, which is memory-bound and small next to forward/backward.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_ampzero._local import local_tensor
from lightning_ampzero.fp8.kernels import EPS

M_DTYPE = torch.float8_e4m3fn
V_DTYPE = torch.float16
_M_MAX = 448.0
_V_MAX = float(torch.finfo(torch.float16).max)

#: Design: bytes of optimizer state per parameter element, and per parameter tensor.
STATE_BYTES_PER_ELEMENT = 1 + 2
STATE_BYTES_PER_TENSOR = 3 * 4


def _local(t: Tensor) -> Tensor:
    """The plain local tensor (a DTensor's shard; the fp32 data inside an FP8 all-gather wrapper)."""
    from lightning_ampzero.fp8.fsdp import Fp8AllGatherWeight

    t = local_tensor(t)
    if isinstance(t, Fp8AllGatherWeight):
        t = t._tensor
    return t


def _like_param(local: Tensor, param: Tensor) -> Tensor:
    """``local`` as a DTensor with ``param``'s sharding (so checkpoints store it per shard), or as is."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return local


class Fp8AdamW(Optimizer):
    """AdamW whose moments are stored in FP8 (first) and fp16 (second), with per-tensor scales.

    Same hyper-parameters as ``torch.optim.AdamW``; ``decoupled_weight_decay=False`` gives
    ``torch.optim.Adam``'s L2 penalty instead. ``amsgrad`` is not supported.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, decoupled_weight_decay: bool = True) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"Fp8AdamW: invalid lr={lr}, betas={betas}, eps={eps} or weight_decay={weight_decay}.")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)
        self.register_load_state_dict_post_hook(_restore_state_dtypes)

    @classmethod
    def from_optimizer(cls, optimizer: Optimizer) -> "Fp8AdamW":
        """An Fp8AdamW over ``optimizer``'s param groups (the same dicts: LR schedulers keep working).

        ``optimizer`` must be ``torch.optim.Adam`` or ``AdamW`` without state yet.
        """
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise TypeError(
                f"fp8.msamp='O2' stores Adam's moments in FP8/fp16, so it needs torch.optim.Adam or AdamW; got"
                f" {type(optimizer).__name__}. Use msamp='O1' (FP8 GEMMs and all-gather, optimizer unchanged) or"
                " an Adam optimizer."
            )
        if any(len(s) for s in optimizer.state.values()):
            raise ValueError("Fp8AdamW.from_optimizer needs an optimizer that has not stepped yet (its state is fp32).")
        for group in optimizer.param_groups:
            if group.get("amsgrad"):
                raise ValueError("fp8.msamp='O2' does not support amsgrad=True (a third, fp32 moment).")
            if group.get("maximize"):
                raise ValueError("fp8.msamp='O2' does not support maximize=True.")
        new = cls.__new__(cls)
        Optimizer.__init__(new, [{"params": []}], dict(optimizer.defaults))
        new.param_groups = optimizer.param_groups
        decoupled = isinstance(optimizer, torch.optim.AdamW)
        for group in new.param_groups:
            group["decoupled_weight_decay"] = decoupled or bool(group.get("decoupled_weight_decay", False))
        new.defaults.setdefault("decoupled_weight_decay", decoupled)
        new.register_load_state_dict_post_hook(_restore_state_dtypes)
        return new

    def _init_state(self, p: Tensor) -> dict[str, Any]:
        local = _local(p)
        state = self.state[p]
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = _like_param(torch.zeros(local.shape, dtype=M_DTYPE, device=local.device), p)
        state["exp_avg_sq"] = _like_param(torch.zeros(local.shape, dtype=V_DTYPE, device=local.device), p)
        state["exp_avg_scale"] = torch.ones((), dtype=torch.float32, device=local.device)
        state["exp_avg_sq_scale"] = torch.ones((), dtype=torch.float32, device=local.device)
        return state

    def _moments(self, p: Tensor, group: dict[str, Any], state: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """The new fp32 moments of ``p``'s local shard (deterministic: called twice per step)."""
        beta1, beta2 = group["betas"]
        g = _local(p.grad).float()
        if group["weight_decay"] and not group["decoupled_weight_decay"]:
            g = g.add(_local(p).float(), alpha=group["weight_decay"])
        m = _local(state["exp_avg"]).float().div_(state["exp_avg_scale"])
        v = _local(state["exp_avg_sq"]).float().div_(state["exp_avg_sq_scale"])
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        return m, v

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p] if len(self.state[p]) else self._init_state(p)
                work.append((p, group, state))
        if not work:
            return loss
        # Pass 1: local amaxes of the new moments; one all-reduce makes them per-tensor (global).
        amax = torch.zeros(len(work), 2, dtype=torch.float32, device=_local(work[0][0]).device)
        for i, (p, group, state) in enumerate(work):
            m, v = self._moments(p, group, state)
            if m.numel():
                amax[i, 0] = m.abs().max()
                amax[i, 1] = v.max()
        group_pg = _reduce_group([p for p, _, _ in work])
        if group_pg is not None:
            import torch.distributed as dist

            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group_pg)
        m_scale = torch.where(amax[:, 0] > 0, _M_MAX / amax[:, 0].clamp(min=EPS), torch.ones_like(amax[:, 0]))
        v_scale = torch.where(amax[:, 1] > 0, _V_MAX / amax[:, 1].clamp(min=EPS), torch.ones_like(amax[:, 1]))
        # Pass 2: the same moments again; update the parameter, store the moments re-quantized.
        for i, (p, group, state) in enumerate(work):
            m, v = self._moments(p, group, state)
            state["step"] += 1
            step = float(state["step"])
            beta1, beta2 = group["betas"]
            lr = float(group["lr"])
            param = _local(p)
            if group["weight_decay"] and group["decoupled_weight_decay"]:
                param.mul_(1 - lr * group["weight_decay"])
            denom = (v / (1 - beta2**step)).sqrt_().add_(group["eps"])
            param.addcdiv_(m.to(param.dtype), denom.to(param.dtype), value=-lr / (1 - beta1**step))
            _local(state["exp_avg"]).copy_((m * m_scale[i]).clamp_(-_M_MAX, _M_MAX).to(M_DTYPE))
            _local(state["exp_avg_sq"]).copy_((v * v_scale[i]).clamp_(max=_V_MAX).to(V_DTYPE))
            state["exp_avg_scale"].copy_(m_scale[i])
            state["exp_avg_sq_scale"].copy_(v_scale[i])
        return loss


def _reduce_group(params: list[Tensor]) -> Any:
    """The group to reduce moment amaxes over: the mesh of sharded (DTensor) parameters, if any."""
    from torch.distributed.tensor import DTensor

    for p in params:
        if isinstance(p, DTensor) and p.device_mesh.size() > 1:
            return p.device_mesh.get_group()
    return None


def _restore_state_dtypes(optimizer: Optimizer) -> None:
    # Optimizer.load_state_dict casts every floating state tensor to its parameter's dtype (fp32);
    # put the moments back in their storage dtypes (exact: the values came from them).
    for state in optimizer.state.values():
        for key, dtype in (("exp_avg", M_DTYPE), ("exp_avg_sq", V_DTYPE)):
            value = state.get(key)
            if isinstance(value, Tensor) and value.dtype != dtype:
                state[key] = value.to(dtype)


def optimizer_state_bytes(optimizer: Optimizer) -> tuple[int, int, int]:
    """(bytes of optimizer state on this rank, parameter elements on this rank, parameter tensors with state)."""
    total = elements = tensors = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            tensors += 1
            elements += _local(p).numel()
            for value in state.values():
                if isinstance(value, Tensor):
                    local = _local(value)
                    total += local.numel() * local.element_size()
    return total, elements, tensors


def fp8_optimizers(optimizers: list[Optimizer], lr_scheduler_configs: list[Any], config: Any) -> list[Optimizer]:
    """The strategy's optimizers under ``config`` (an Fp8Config): Adam/AdamW become Fp8AdamW for msamp O2.

    LR schedulers keep working: the new optimizer shares the old one's param-group dicts, and
    each scheduler is re-pointed at it. Any other level (or fp8 off) returns ``optimizers``.
    """
    if not config.enabled or config.msamp != "O2":
        return optimizers
    out = []
    for opt in optimizers:
        new = Fp8AdamW.from_optimizer(opt)
        for cfg in lr_scheduler_configs:
            if getattr(cfg.scheduler, "optimizer", None) is opt:
                cfg.scheduler.optimizer = new
                _track_step_for_scheduler(new)
        out.append(new)
    return out


def _track_step_for_scheduler(optimizer: Optimizer) -> None:
    # What an LRScheduler does to the optimizer it is built with (it checks that step() ran
    # before its own first step); ours is built later, so do it here.
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]
