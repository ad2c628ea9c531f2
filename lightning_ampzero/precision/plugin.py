"""AmpZeroPrecision: the Lightning Precision plugin of the ``ampzero`` strategy.

It owns what changes numerics around the step: autocast, the low-precision compute copies,
the reduction dtypes, loss scaling and unscale -> clip -> step -> update. The strategy owns
sharding: it asks this plugin for the FSDP2 policies (:meth:`AmpZeroPrecision.fsdp_policies`,
stages 1-3) or hands it the DDP module (:meth:`AmpZeroPrecision.setup_ddp`, stage 0). Clipping
is done here because Lightning routes ``gradient_clip_val`` through the precision plugin; it
uses the sharding-aware global norm (lightning_ampzero.zero.clip). Which op runs in which dtype
per precision: docs/precision.md.

The step, when the scaler can skip (fp16, or ``check_grad_overflow``)::

    closure()                  forward + (scaled) backward; gradients reduced by DDP/FSDP2
    scaler.unscale_(opt)       one fused unscale + inf/NaN check over the local shards, one all-reduce
    on_before_optimizer_step   the user sees unscaled gradients
    clip                       global norm over the shards (not when the step is skipped)
    scaler.step(opt)           optimizer.step() unless a rank saw inf/NaN: all ranks skip together
    scaler.update()            DeepSpeed's hysteresis / halving / doubling
    log                        loss_scale, skipped_steps -> the Trainer's loggers

A skipped step leaves parameters and optimizer state as they were, and the step-interval LR
schedulers do not step (precision/schedulers.py). Lightning's global_step still counts it, as
DeepSpeed's global_steps does.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable, Generator, Iterator, Optional, Union

import torch
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer

from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities import apply_to_collection

from lightning_ampzero.config import PRECISIONS, PrecisionConfig
from lightning_ampzero.precision.policy import (
    DtypePlan,
    check_device_support,
    ddp_reduce_dtypes,
    dtype_plan,
    fsdp_policies,
)
from lightning_ampzero.precision.scaler import DynamicLossScaler, create_loss_scaler
from lightning_ampzero.precision.schedulers import SkipAwareScheduler
from lightning_ampzero.zero.clip import clip_grad_norm_, clip_grad_value_
from lightning_ampzero.zero.local_step import on_local_shards, steps_on_local_shards

#: Keys logged every optimizer step when the scaler can skip steps.
LOSS_SCALE_KEY = "loss_scale"
SKIPPED_STEPS_KEY = "skipped_steps"


def precision_string(plugin: Precision) -> str:
    """The precision string a Lightning plugin stands for ("32-true" for the plain Precision)."""
    value = getattr(plugin, "precision", None)
    if value is None and type(plugin) is Precision:
        return "32-true"
    value = str(value)
    if value not in PRECISIONS:
        raise ValueError(
            f"strategy 'ampzero' does not support precision={value!r} ({type(plugin).__name__})."
            f" Choose one of: {', '.join(PRECISIONS)}."
        )
    return value


def _trainer_precision_flag() -> Optional[str]:
    """The ``precision=`` the user gave the Trainer being built, before Lightning rewrote it.

    [Note: 16-mixed on CPU]
    With ``accelerator="cpu"`` Lightning's accelerator connector turns ``precision="16-mixed"``
    into ``"bf16-mixed"`` (with a warning that fp16 AMP is not supported on CPU) *before* it builds
    a plugin, so the plugin our strategy's setter receives says "bf16-mixed". torch's CPU autocast
    does support float16 (and DeepSpeed-style loss scaling works on CPU), so with strategy
    ampzero we honour the user's choice. The original value survives only as the ``precision``
    argument of the connector's ``__init__``, which is on the stack while it assigns the plugin
    to the strategy; we read it there. Where it cannot be found (another caller, a changed
    Lightning) nothing changes; the documented way that does not depend on this is
    ``AmpZeroStrategy(precision="16-mixed")`` / ``PrecisionConfig(precision="16-mixed")``, which
    takes precedence over the Trainer's flag.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__init__" and type(frame.f_locals.get("self")).__name__ == "_AcceleratorConnector":
            value = frame.f_locals.get("precision")
            if value is None:
                return None
            value = str(value)
            return {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true"}.get(value, value)
        frame = frame.f_back
    return None


def _compute_device(module: nn.Module) -> Optional[torch.device]:
    """The device the step computes on: the strategy's root device when a Trainer runs ``module``.

    Not the parameters' device: with ``offload_param='cpu'`` the parameter shards live in host
    memory while the GPU computes, and a "-mixed" run would autocast for "cpu", that is, compute
    in fp32 on the GPU without a word (issue 14, item 2). Without a Trainer (the plugin used
    on its own), the first parameter's device.
    """
    try:
        root = module._trainer.strategy.root_device  # type: ignore[union-attr]
    except (AttributeError, AssertionError):  # no Trainer, or a strategy whose devices are not set yet
        root = None
    if isinstance(root, torch.device):
        return root
    param = next(module.parameters(), None)
    return param.device if param is not None else None


class AmpZeroPrecision(Precision):
    """Precision plugin of strategy ampzero: "32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true".

    Args:
        precision: the Lightning precision string; ``config.precision``, when set, wins.
        config: a :class:`~lightning_ampzero.config.PrecisionConfig` (loss scaler, overflow check,
            safe modules, communication dtype).
        device: the device type autocast runs on ("cpu", "cuda", ...); if not given, taken
            when the plugin connects from the strategy's root device (or, without a Trainer, from
            the model's first parameter).

    Raises:
        ValueError: an unknown precision, settings that contradict it (naming both), or a low
            dtype the device does not support.
    """

    def __init__(
        self, precision: str = "32-true", config: Optional[PrecisionConfig] = None, *, device: Optional[str] = None
    ) -> None:
        super().__init__()
        self.config = config or PrecisionConfig()
        precision = self.config.precision or precision
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is not valid. Allowed values: {', '.join(PRECISIONS)}.")
        self.config.check_combination(precision)
        self.precision = precision
        self.plan: DtypePlan = dtype_plan(precision, self.config)
        self.device = device
        if device is not None:
            check_device_support(precision, device)
        self.scaler = create_loss_scaler(
            precision, self.config.loss_scaler, check_grad_overflow=self.config.check_grad_overflow
        )
        self._ddp_cast: Any = None
        self._skips: list[Any] = []  # the global steps skipped this fit, for the lines and the summary

    @classmethod
    def from_lightning(cls, plugin: Precision, config: Optional[PrecisionConfig] = None) -> "AmpZeroPrecision":
        """Our plugin for the one Lightning built from ``Trainer(precision=...)``."""
        config = config or PrecisionConfig()
        requested = precision_string(plugin)
        device = getattr(plugin, "device", None)
        if requested == "bf16-mixed" and device == "cpu" and _trainer_precision_flag() == "16-mixed":
            requested = "16-mixed"
            if config.precision in (None, "16-mixed"):  # else the mismatch warning below says what is used
                rank_zero_info(
                    "strategy 'ampzero' keeps precision='16-mixed' on CPU: torch's CPU autocast supports float16,"
                    " with dynamic loss scaling. Lightning's two lines above, that it uses 'bf16-mixed' and bfloat16 AMP"
                    " instead, do not apply: the model trains in float16."
                )
        # "32-true" is also what Lightning builds when precision= is not given: said only when the user
        # gave it (a trial's explicit Trainer(precision="32-true") under a DeepSpeed config's bf16 passed silently).
        given = requested != "32-true" or _trainer_precision_flag() is not None
        if config.precision is not None and requested != config.precision and given:
            rank_zero_warn(
                f"Trainer(precision={requested!r}) differs from the strategy's precision config"
                f" ({config.precision!r}); the strategy's is used."
            )
        return cls(requested, config, device=device if isinstance(device, str) else None)

    # ---- dtypes: module conversion, FSDP2 policies, DDP ----------------------------------
    @property
    def mp_policy(self) -> Any:
        """The FSDP2 MixedPrecisionPolicy of every unit (see :meth:`fsdp_policies` for per-module ones)."""
        return fsdp_policies(self.plan, nn.Module(), 3)[0]

    def fsdp_policies(self, module: nn.Module, stage: int) -> tuple[Any, dict[nn.Module, Any]]:
        """Stages 1-3: the policy of every unit, and the modules whose gradients reduce apart.

        "-mixed" with no ``communication_data_type``: the ``lower_precision_safe_modules``
        modules get a low-dtype policy, reducing in the low dtype (on gloo only when they were
        listed: [Note: the safe modules' gradients on gloo] in policy.py) and, under stage 3,
        all-gathering in it. How (a group of their own inside each unit, [Note: low-precision groups],
        or on gloo inside the unit's group) depends on the mesh and is decided by ``apply_zero``
        (``_wire_dtypes``).
        """
        return fsdp_policies(self.plan, module, stage)

    def setup_ddp(self, ddp: nn.Module) -> None:
        """Stage 0: "-true" compute copies of the fp32 parameters; gradient reduction dtypes."""
        from lightning_ampzero.precision.ddp import cast_parameters_in_forward, register_reduce_dtypes

        module = ddp.module  # type: ignore[attr-defined]
        if self.plan.low_params and self._ddp_cast is None:
            assert self.plan.low_dtype is not None
            self._ddp_cast = cast_parameters_in_forward(module, self.plan.low_dtype)
        group = getattr(ddp, "process_group", None)
        gloo = torch.distributed.is_initialized() and torch.distributed.get_backend(group) == "gloo"
        dtypes = ddp_reduce_dtypes(self.plan, module, gloo=gloo)
        if dtypes:
            register_reduce_dtypes(ddp, dtypes)  # type: ignore[arg-type]

    def convert_module(self, module: nn.Module) -> nn.Module:
        # "-true": parameters stay fp32 (the master weights; cast per forward by FSDP2 or
        # setup_ddp), floating buffers take the low dtype as under Lightning's HalfPrecision.
        if self.plan.low_params:
            for sub in module.modules():
                for name, buf in sub._buffers.items():
                    if buf is not None and buf.is_floating_point():
                        sub._buffers[name] = buf.to(self.plan.low_dtype)
        return module

    def convert_input(self, data: Any) -> Any:
        if not self.plan.low_params:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self.plan.low_dtype)

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.plan.autocast:
            device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
            with torch.autocast(device, dtype=self.plan.low_dtype, cache_enabled=False):
                yield
        elif self.plan.low_params:
            # Tensors created inside forward follow the compute dtype (as under HalfPrecision).
            default = torch.get_default_dtype()
            torch.set_default_dtype(self.plan.low_dtype)  # type: ignore[arg-type]
            try:
                yield
            finally:
                torch.set_default_dtype(default)
        else:
            yield

    # ---- connection ------------------------------------------------------------------------
    def connect(self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        module = getattr(model, "module", model)  # DDP's wrapped module at stage 0
        self.scaler.module = module  # names the parameters in the at-minimum-scale error
        if self.device is None:
            device = _compute_device(module)
            if device is not None:
                self.device = device.type
                check_device_support(self.precision, self.device)
        if self.scaler.checks_overflow:
            for config in lr_schedulers:
                if getattr(config, "interval", None) == "step" and type(config.scheduler) is not SkipAwareScheduler:
                    config.scheduler = SkipAwareScheduler(config.scheduler, self._last_step_skipped)
        return model, optimizers, lr_schedulers

    def _last_step_skipped(self) -> bool:
        return self.scaler.last_step_skipped

    # ---- the step --------------------------------------------------------------------------
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        return super().pre_backward(self.scaler.scale(tensor), module)

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if not self.scaler.checks_overflow:
            # bf16 / fp32 without the overflow check: nothing to unscale or decide.
            if not steps_on_local_shards(optimizer):
                return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
            # What torch's step does with a closure (run it with grad on, then step), split in two so that
            # the step can run on the local shards ([Note: the optimizer step on local shards]).
            with torch.enable_grad():
                closure_result = self._wrap_closure(model, optimizer, closure)
            with on_local_shards(optimizer):
                optimizer.step(**kwargs)
            return closure_result
        if isinstance(optimizer, LBFGS):
            raise TypeError(
                f"precision={self.precision!r} with loss scaling or check_grad_overflow cannot drive LBFGS (it"
                " re-evaluates the closure inside step()). Use another optimizer or precision='bf16-mixed'."
            )
        closure_result = closure()
        if closure_result is None and getattr(model, "automatic_optimization", False):
            # training_step returned None: Lightning skipped backward, there is nothing to step.
            return closure_result
        if not self.scaler.is_unscaled(optimizer):  # unless clip_gradients did ([Note: clipping before the step])
            self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        scale_before = self.scaler.get_scale()
        with on_local_shards(optimizer):
            result = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        self._log_scaler(model)
        if self.scaler.last_step_skipped:
            self._say_skipped(model, scale_before)
        return result

    def _say_skipped(self, model: Any, scale_before: float) -> None:
        """One line per skipped step, rate-limited (the 1st, 2nd, 3rd, then each power of two)."""
        step = getattr(getattr(model, "_trainer", None), "global_step", None)
        skipped = int(self.scaler.stats()["skipped_steps"])
        self._skips.append(step)
        if skipped > 3 and skipped & (skipped - 1):
            return
        scale = self.scaler.get_scale()
        config = getattr(self.scaler, "config", None)
        # A dynamic scale is kept by hysteresis, or because it is at min_loss_scale already (at_min_scale
        # "skip"/"warn"): a trial read "hysteresis" for the latter, with hysteresis 1.
        at_min = scale <= getattr(config, "min_loss_scale", 0)
        kept_by = "at min_loss_scale" if at_min else "hysteresis"
        why = kept_by if getattr(config, "dynamic", False) else "static loss scale"
        change = f"loss scale {scale_before:g} -> {scale:g}" if scale != scale_before else f"loss scale kept at {scale:g} ({why})"
        more = " (further skips are reported at powers of two; the count is logged as 'skipped_steps')" if skipped == 3 else ""
        rank_zero_info(f"precision={self.precision!r}: step {step} skipped, non-finite gradients on some rank;"
                       f" {change}; {skipped} skipped so far.{more}")

    def teardown(self) -> None:
        if self._skips:
            first, last = self._skips[0], self._skips[-1]
            rank_zero_info(f"precision={self.precision!r}: {len(self._skips)} optimizer step(s) skipped for non-finite"
                           f" gradients (first at step {first}, last at step {last}); final loss scale"
                           f" {self.scaler.get_scale():g}.")
            self._skips = []
        super().teardown()

    def _log_scaler(self, model: Any) -> None:
        # Through LightningModule.log, so it reaches every logger at the Trainer's
        # log_every_n_steps cadence and lands in callback_metrics; the value is the same on every
        # rank (the decision is global), so no sync.
        if getattr(model, "_current_fx_name", None) is None or getattr(model, "_trainer", None) is None:
            return
        metrics = {SKIPPED_STEPS_KEY: float(self.scaler.stats()["skipped_steps"])}
        if isinstance(self.scaler, DynamicLossScaler):
            metrics[LOSS_SCALE_KEY] = float(self.scaler.get_scale())
        # Trainer(logger=False): still in callback_metrics, without Lightning's "no logger configured"
        # warning at every step (a new-user trial saw 16 of them in 8 steps)
        logger = bool(getattr(model._trainer, "loggers", True))
        model.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False, logger=logger, batch_size=1)

    @staticmethod
    def _params(optimizer: Optimizer) -> Iterator[torch.Tensor]:
        for group in optimizer.param_groups:
            yield from group["params"]

    # [Note: clipping before the step]
    # Under manual optimization the user clips between manual_backward and opt.step(), as torch
    # and Lightning document (self.clip_gradients(opt, ...)); the gradients are still multiplied by
    # the loss scale there, since the plugin unscales in the step. Clipping them as they are clipped
    # almost nothing (a new-user trial, 16-mixed: the weights moved 4e-6 in 16 steps where fp32
    # moved 0.064), silently. So clipping unscales first, once per iteration, as torch's
    # GradScaler.unscale_ is meant to be called before clipping; the step then does not unscale
    # again (nor does it after the user's own scaler.unscale_(optimizer)). In automatic optimization
    # the step has already unscaled when Lightning clips, so nothing changes there.
    def clip_gradients(self, optimizer: Optimizer, clip_val: Union[int, float] = 0.0, gradient_clip_algorithm: Any = None) -> None:  # type: ignore[override]
        raw = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer (self.optimizers()) wraps it
        if self.scaler.checks_overflow and not self.scaler.is_unscaled(raw) and not self.scaler.found_inf(raw):
            self.scaler.unscale_(raw)
        if self.scaler.found_inf(raw):
            return  # the step is skipped on every rank; clipping inf/NaN gradients is wasted work
        if gradient_clip_algorithm is None:
            super().clip_gradients(optimizer, clip_val)
        else:
            super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        clip_grad_norm_(list(self._params(optimizer)), float(clip_val))

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        clip_grad_value_(list(self._params(optimizer)), float(clip_val))

    # ---- checkpointing -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (Lightning stores it in the checkpoint under this class's name); {} when none."""
        if not self.scaler.checks_overflow:
            return {}
        return {"precision": self.precision, "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("precision")
        scaler_state = state_dict.get("scaler", {})
        if saved is not None and (saved in ("16-mixed", "16-true")) != self.plan.fp16:
            rank_zero_warn(
                f"Resuming precision={self.precision!r} from a checkpoint saved with precision={saved!r}: the"
                " loss scaler's state belongs to the other kind of scaler and is not restored."
            )
            return
        if scaler_state and self.scaler.checks_overflow:
            self.scaler.load_state_dict(scaler_state)
