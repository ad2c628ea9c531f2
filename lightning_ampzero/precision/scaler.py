"""Loss scaling with DeepSpeed's semantics behind ``torch.amp.GradScaler``'s interface.

``DynamicLossScaler`` reproduces DeepSpeed's fp16 dynamic loss scaler step for step
(hysteresis, consecutive hysteresis, scale window, minimum scale; see [Note: DeepSpeed
scale arithmetic]) and answers the calls Lightning's precision plugins make on a
``GradScaler``: ``scale``, ``unscale_``, ``step``, ``update``, ``state_dict``.
``NoLossScaler`` is the same interface with the scale fixed at 1, for bf16 / fp32: it
can still skip steps whose gradients are non-finite (DeepSpeed's bf16
``check_grad_overflow``), or do nothing at all.

The overflow check is ``unscale_and_check_``: one fused unscale + inf/NaN kernel per
(device, dtype) over the local gradient shards, then a single ``all_reduce(MAX)`` of the
flag so every rank takes the same decision, and one host sync to read it.

[Note: DeepSpeed scale arithmetic]
DeepSpeed (``runtime/fp16/loss_scaler.py``, ``DynamicLossScaler.update_scale``) counts
updates in ``cur_iter`` (incremented after every update, overflow or not) and remembers
``last_overflow_iter`` (initially -1). On a clean update at iteration ``i`` the number of
clean updates *before* this one since the last overflow is ``i - last_overflow_iter - 1``;
the scale doubles when that number is positive and a multiple of the window. So the
first doubling comes on the (window + 1)-th clean update, both from the start and after
an overflow, and then every ``window`` clean updates. Halving does not refill the
hysteresis: once it has run down to 1, every further overflow halves until a clean
update refills it (every clean update with ``consecutive_hysteresis``, otherwise only a
doubling does). The minimum check is on the scale *before* halving: an overflow that
would halve a scale already at ``min_loss_scale`` is the error case; one that would halve
a scale above it clamps to the minimum. Trajectories are tested in tests/test_scaler.py.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import defaultdict
from typing import Any, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_ampzero._local import local_tensor
from lightning_ampzero.config import LossScalerConfig
from lightning_ampzero.process import collective_device

__all__ = [
    "DynamicLossScaler",
    "LossScaleAtMinimumError",
    "NoLossScaler",
    "create_loss_scaler",
    "nonfinite_grad_names",
    "unscale_and_check_",
]

# Names listed in an error message; the rest is counted.
_MAX_NAMES_SHOWN = 20
_FP16_PRECISIONS = ("16-mixed", "16-true")


class LossScaleAtMinimumError(RuntimeError):
    """An fp16 overflow happened with the loss scale already at ``min_loss_scale``."""


# ---------------------------------------------------------------------------------------
# Fused unscale + overflow check
# ---------------------------------------------------------------------------------------


def _resolve_group(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The group the overflow flag is reduced over, or None when there is nobody to agree with."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = dist.group.WORLD if group is None else group
    return group if dist.get_world_size(group) > 1 else None


def _flag_device(group: Optional[dist.ProcessGroup], devices: list[torch.device]) -> torch.device:
    """Where the overflow flag must live for ``group``'s backend to reduce it (grads may sit on the
    CPU under optimizer offload; NCCL only reduces GPU tensors)."""
    fallback = devices[0] if devices else torch.device("cpu")
    return collective_device(group, fallback) if group is not None else fallback


@torch.no_grad()
def unscale_and_check_(
    grads: Iterable[Optional[Tensor]],
    inv_scale: Union[float, Tensor],
    group: Optional[dist.ProcessGroup] = None,
) -> bool:
    """Multiply ``grads`` in place by ``inv_scale`` and tell whether any rank saw inf/NaN.

    Gradients may be plain tensors or DTensors (FSDP2 shards: their local tensor is
    processed); ``None`` entries are ignored. One fused
    ``torch._amp_foreach_non_finite_check_and_unscale_`` runs per (device, dtype), with no
    per-tensor host sync; then one ``all_reduce(MAX)`` of the flag over ``group`` (default:
    the world group when ``torch.distributed`` is initialized; none in a single process),
    and one host sync to read the result. Every rank of ``group`` must call it, also a
    rank holding no gradients, and they all get the same answer.

    Non-finite values stay non-finite after unscaling, so ``nonfinite_grad_names`` can
    still find them afterwards.
    """
    buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for grad in grads:
        if grad is None:
            continue
        local = local_tensor(grad)
        if local.is_sparse:
            # As GradScaler does: the values are what is stored and scaled.
            local = local._values()
        buckets[(local.device, local.dtype)].append(local)

    found: dict[torch.device, Tensor] = {}
    inv: dict[torch.device, Tensor] = {}
    for (device, _), tensors in buckets.items():
        if device not in found:
            found[device] = torch.zeros(1, dtype=torch.float32, device=device)
            if isinstance(inv_scale, Tensor):
                inv[device] = inv_scale.detach().to(device=device, dtype=torch.float32).reshape(1)
            else:
                inv[device] = torch.full((1,), float(inv_scale), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found[device], inv[device])

    group = _resolve_group(group)
    flag_device = _flag_device(group, list(found))
    flag = torch.zeros(1, dtype=torch.float32, device=flag_device)
    for per_device in found.values():
        flag += per_device.to(flag_device)
    if group is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item() > 0)


@torch.no_grad()
def nonfinite_grad_names(named_parameters: Iterable[tuple[str, Tensor]]) -> list[str]:
    """Names of the parameters whose local gradient holds an inf or NaN, in the given order.

    Meant for the error path: one reduction per parameter, then one host sync per device.
    """
    entries: list[tuple[str, torch.device, int]] = []
    flags: dict[torch.device, list[Tensor]] = defaultdict(list)
    for name, param in named_parameters:
        if param.grad is None:
            continue
        local = local_tensor(param.grad)
        if local.is_sparse:
            local = local._values()
        entries.append((name, local.device, len(flags[local.device])))
        flags[local.device].append(~torch.isfinite(local).all())
    on_host = {device: torch.stack(values).tolist() for device, values in flags.items()}
    return [name for name, device, i in entries if on_host[device][i]]


# ---------------------------------------------------------------------------------------
# GradScaler-compatible scalers
# ---------------------------------------------------------------------------------------

_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"


class _ScalerBase:
    """``GradScaler``'s per-optimizer protocol (unscale_ -> step -> update) and the counters.

    Subclasses give the scale and how an update moves it (``_advance``).
    """

    def __init__(self, *, group: Optional[dist.ProcessGroup] = None, module: Optional[nn.Module] = None) -> None:
        #: Group whose ranks must agree on skipping; None = the world group (when initialized).
        self.group = group
        #: Where parameter names for error messages come from (set it to the trained model).
        self.module = module
        #: Whether the last completed iteration (``update()``) skipped its step.
        self.last_step_skipped = False
        self._scale = 1.0
        self._iteration = 0
        self._last_overflow_iter = -1
        self._overflows = 0
        self._skipped_steps = 0
        self._per_optimizer: dict[int, dict[str, Any]] = {}
        self._nonfinite_names: list[str] = []

    # -- what subclasses decide --------------------------------------------------------

    @property
    def _checks_overflow(self) -> bool:
        return True

    def _names_needed(self) -> bool:
        """Whether an overflow found now must be explained by parameter names (error path)."""
        return False

    def _advance(self, overflow: bool, names: list[str]) -> None:
        """Move the scale for one finished iteration; counters are the base class's job."""

    # -- the GradScaler interface ------------------------------------------------------

    def is_enabled(self) -> bool:
        return True

    @property
    def checks_overflow(self) -> bool:
        """Whether ``step`` can skip (fp16, or bf16/fp32 with the overflow check): the caller must log it."""
        return self._checks_overflow

    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``unscale_`` found non-finite gradients (on any rank) for ``optimizer`` this iteration."""
        state = self._per_optimizer.get(id(optimizer))
        return bool(state and state["found_inf"])

    def is_unscaled(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``unscale_`` already ran for ``optimizer`` in this iteration (before its ``step``)."""
        state = self._per_optimizer.get(id(optimizer))
        return bool(state and state["stage"] == _UNSCALED)

    def get_scale(self) -> float:
        return self._scale

    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor (or a list/tuple/dict of tensors) by the current scale."""
        if isinstance(outputs, Tensor):
            return outputs * self._scale
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if isinstance(outputs, Mapping):
            return {k: self.scale(v) for k, v in outputs.items()}
        raise ValueError(f"scale() takes a tensor or a list/tuple/dict of tensors, got {type(outputs).__name__}.")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale ``optimizer``'s gradients in place and decide (for all ranks) whether they overflowed.

        Call it before gradient clipping; ``step`` calls it when you have not.
        """
        state = self._per_optimizer.setdefault(id(optimizer), {"stage": _READY, "found_inf": False})
        if state["stage"] == _UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] == _STEPPED:
            raise RuntimeError("unscale_() is being called after step(): call it before, or not at all.")
        found_inf = False
        if self._checks_overflow:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
            found_inf = unscale_and_check_(grads, 1.0 / self._scale, self.group)
            if found_inf and self._names_needed():
                self._nonfinite_names.extend(self._gather_names(optimizer))
        state.update(stage=_UNSCALED, found_inf=found_inf)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step(*args, **kwargs)`` unless the gradients overflowed; None when skipped."""
        if "closure" in kwargs:
            raise RuntimeError(
                "step(closure=...) is not supported with loss scaling: run forward and backward first (as"
                " Lightning's precision plugins do), then call step(optimizer)."
            )
        state = self._per_optimizer.get(id(optimizer))
        if state is not None and state["stage"] == _STEPPED:
            raise RuntimeError("step() has already been called on this optimizer since the last update().")
        if state is None or state["stage"] == _READY:
            self.unscale_(optimizer)
            state = self._per_optimizer[id(optimizer)]
        state["stage"] = _STEPPED
        if state["found_inf"]:
            self._skipped_steps += 1
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: Optional[Union[float, Tensor]] = None) -> None:
        """Finish the iteration: move the scale as DeepSpeed would (or set ``new_scale``)."""
        if not self._per_optimizer:
            if not self._checks_overflow:
                return
            raise RuntimeError("No inf checks were recorded before update(): call step(optimizer) first.")
        overflow = any(state["found_inf"] for state in self._per_optimizer.values())
        names, self._nonfinite_names = self._nonfinite_names, []
        self._per_optimizer.clear()
        self.last_step_skipped = overflow
        if new_scale is not None:
            # GradScaler's meaning: the caller sets the scale, the growth/backoff logic is bypassed.
            self._set_scale(float(new_scale.item() if isinstance(new_scale, Tensor) else new_scale))
            return
        self._advance(overflow, names)
        if overflow:
            self._overflows += 1
            self._last_overflow_iter = self._iteration
        self._iteration += 1

    def _set_scale(self, value: float) -> None:
        raise RuntimeError(f"{type(self).__name__} has a fixed scale of {self._scale}; update(new_scale=...) cannot change it.")

    # -- diagnostics and checkpointing -------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Numbers to log every step."""
        return {
            "loss_scale": float(self._scale),
            "overflows": float(self._overflows),
            "skipped_steps": float(self._skipped_steps),
            "last_overflow_iter": float(self._last_overflow_iter),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "iteration": self._iteration,
            "last_overflow_iter": self._last_overflow_iter,
            "overflows": self._overflows,
            "skipped_steps": self._skipped_steps,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        missing = [k for k in self.state_dict() if k not in state_dict]
        if missing:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the state has no {', '.join(missing)} (keys found:"
                f" {', '.join(sorted(state_dict)) or 'none'}). Was it saved by another scaler (e.g."
                " torch.amp.GradScaler, or a run without fp16)?"
            )
        self._scale = float(state_dict["scale"])
        self._iteration = int(state_dict["iteration"])
        self._last_overflow_iter = int(state_dict["last_overflow_iter"])
        self._overflows = int(state_dict["overflows"])
        self._skipped_steps = int(state_dict["skipped_steps"])

    def __getstate__(self) -> dict[str, Any]:
        # Launchers pickle the precision plugin to their workers: leave the model behind.
        state = self.__dict__.copy()
        state["module"] = None
        return state

    # -- error path --------------------------------------------------------------------

    def _gather_names(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """Names of the non-finite gradients of ``optimizer``'s parameters on every rank.

        Runs on all ranks together: they share the overflow flag and the scaler state.
        """
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if self.module is not None:
            ids = {id(p) for p in params}
            named = [(n, p) for n, p in self.module.named_parameters() if id(p) in ids]
        else:
            named = [
                (f"param_groups[{i}]['params'][{j}] (shape {tuple(p.shape)})", p)
                for i, group in enumerate(optimizer.param_groups)
                for j, p in enumerate(group["params"])
            ]
        names = nonfinite_grad_names(named)
        group = _resolve_group(self.group)
        if group is None:
            return names
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, names, group=group)
        return list(dict.fromkeys(n for rank_names in gathered for n in rank_names))


class DynamicLossScaler(_ScalerBase):
    """DeepSpeed's fp16 loss scaler (dynamic, or static when ``config.loss_scale > 0``).

    Drop-in for ``torch.amp.GradScaler`` in a precision plugin::

        loss = scaler.scale(loss); loss.backward()
        scaler.unscale_(optimizer)      # optional: before gradient clipping
        scaler.step(optimizer)          # skipped (returns None) when any rank overflowed
        scaler.update()                 # hysteresis / halving / doubling, see the module note

    A static scaler never changes its scale but still skips overflowing steps.
    ``module`` (optional, settable later) names the parameters in the error raised when an
    overflow happens at ``min_loss_scale`` with ``at_min_scale="raise"``.
    """

    def __init__(
        self,
        config: Optional[LossScalerConfig] = None,
        *,
        group: Optional[dist.ProcessGroup] = None,
        module: Optional[nn.Module] = None,
    ) -> None:
        super().__init__(group=group, module=module)
        self.config = config = LossScalerConfig() if config is None else config
        if config.dynamic:
            self._scale = 2.0 ** config.initial_scale_power
            if self._scale < config.min_loss_scale:
                raise ValueError(
                    f"loss_scaler.initial_scale_power={config.initial_scale_power} starts the scale at"
                    f" {self._scale}, below loss_scaler.min_loss_scale={config.min_loss_scale}. Raise"
                    " initial_scale_power or lower min_loss_scale."
                )
        else:
            self._scale = float(config.loss_scale)
        self._hysteresis = config.hysteresis

    def _names_needed(self) -> bool:
        return self.config.at_min_scale != "skip" and self._would_halve() and self._at_minimum()

    def _would_halve(self) -> bool:
        return self.config.dynamic and (self.config.hysteresis == 1 or self._hysteresis == 1)

    def _at_minimum(self) -> bool:
        return self._scale <= self.config.min_loss_scale

    def _advance(self, overflow: bool, names: list[str]) -> None:
        cfg = self.config
        if not cfg.dynamic:
            return
        if overflow:
            if not self._would_halve():
                self._hysteresis -= 1
                return
            if self._at_minimum():
                self._overflow_at_minimum(names)
            # The hysteresis is not refilled here (DeepSpeed): further overflows keep halving.
            self._scale = max(self._scale / 2.0, cfg.min_loss_scale)
            return
        if cfg.consecutive_hysteresis:
            self._hysteresis = cfg.hysteresis
        clean_before = self._iteration - self._last_overflow_iter - 1
        if clean_before > 0 and clean_before % cfg.loss_scale_window == 0:
            self._hysteresis = cfg.hysteresis
            self._scale *= 2.0

    def _overflow_at_minimum(self, names: list[str]) -> None:
        policy = self.config.at_min_scale
        if policy == "skip":
            return
        shown = ", ".join(names[:_MAX_NAMES_SHOWN])
        if len(names) > _MAX_NAMES_SHOWN:
            shown += f" (and {len(names) - _MAX_NAMES_SHOWN} more)"
        where = (
            f"Non-finite gradients in: {shown}."
            if names
            else "No parameter names are available (set the scaler's `module` to the trained model to get them)."
        )
        advice = (
            "Try: bf16 (precision='bf16-mixed': fp32's range, no loss scaling); a lower"
            " loss_scaler.min_loss_scale (the scale may then fall further, below 1 if need be); a lower learning"
            " rate, or gradient clipping (Trainer(gradient_clip_val=1.0)), if the overflows began after the weights"
            " grew (clipping acts after the overflow, on later steps' updates, not on this step's fp16 gradients);"
            " or loss_scaler.at_min_scale='skip'/'warn' to skip such steps."
        )
        if policy == "warn":
            warnings.warn(
                f"fp16 gradients overflowed with the loss scale at its minimum ({self._scale}); step skipped."
                f" {where} {advice}",
                UserWarning,
                stacklevel=4,
            )
            return
        raise LossScaleAtMinimumError(
            f"Current loss scale already at minimum - cannot decrease scale anymore"
            f" (loss_scaler.min_loss_scale={self.config.min_loss_scale}): fp16 gradients overflowed at"
            f" iteration {self._iteration} (overflow {self._overflows + 1} of the run; {self._overflows} earlier"
            f" overflowing step(s) skipped). {where} {advice}"
        )

    def _set_scale(self, value: float) -> None:
        self._scale = value

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["hysteresis"] = self._hysteresis
        state["config"] = dataclasses.asdict(self.config)
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._hysteresis = int(state_dict["hysteresis"])
        saved = state_dict.get("config", {})
        current = dataclasses.asdict(self.config)
        changed = [f"{k}: {saved[k]!r} -> {v!r}" for k, v in current.items() if k in saved and saved[k] != v]
        if changed:
            warnings.warn(
                "Loss scaler restored from a checkpoint saved with other settings; the current ones apply from"
                f" now on ({'; '.join(changed)}).",
                UserWarning,
                stacklevel=2,
            )


class NoLossScaler(_ScalerBase):
    """The scaler of bf16 / fp32 runs: the scale is 1 and never changes ("off means absent").

    With ``check_overflow=True`` (DeepSpeed's bf16 ``check_grad_overflow``) it still runs the
    fused inf/NaN check and the one all-reduce, and skips the step on every rank when any
    gradient is non-finite. With ``check_overflow=False`` it does nothing: ``step`` is
    ``optimizer.step``.
    """

    def __init__(
        self,
        check_overflow: bool = False,
        *,
        group: Optional[dist.ProcessGroup] = None,
        module: Optional[nn.Module] = None,
    ) -> None:
        super().__init__(group=group, module=module)
        self.check_overflow = check_overflow

    @property
    def _checks_overflow(self) -> bool:
        return self.check_overflow

    def is_enabled(self) -> bool:
        return False

    def scale(self, outputs: Any) -> Any:
        return outputs

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        # A bf16 run may resume from a checkpoint that stored no scaler state.
        if state_dict:
            super().load_state_dict(state_dict)
            self._scale = 1.0


def create_loss_scaler(
    precision: str,
    config: Optional[LossScalerConfig] = None,
    *,
    check_grad_overflow: bool = False,
    group: Optional[dist.ProcessGroup] = None,
    module: Optional[nn.Module] = None,
) -> Union[DynamicLossScaler, NoLossScaler]:
    """The scaler a Lightning precision string calls for.

    fp16 ("16-mixed", "16-true") gets a ``DynamicLossScaler`` built from ``config``;
    anything else a ``NoLossScaler`` that checks for non-finite gradients only when
    ``check_grad_overflow`` is set.
    """
    if precision in _FP16_PRECISIONS:
        return DynamicLossScaler(config, group=group, module=module)
    return NoLossScaler(check_grad_overflow, group=group, module=module)
