"""The optimizer and scheduler: their typed configs (also the ``optim`` / ``scheduler`` nodes of
ampzero-train), the torch objects built from them, and DeepSpeed's ``optimizer`` / ``scheduler``
sections converted into them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

from lightning_ampzero._deepspeed.common import _is_auto
from lightning_ampzero._schema import FromDict, check_choice, check_number, suggest

OPTIMIZERS = ("AdamW", "Adam")
SCHEDULERS = ("WarmupLR", "WarmupDecayLR")
WARMUP_TYPES = ("log", "linear")


@dataclass(frozen=True)
class OptimizerConfig(FromDict, section="optim"):
    """A torch optimizer, as DeepSpeed's ``optimizer`` section describes it.

    Attributes:
        type: ``AdamW`` (decoupled weight decay) or ``Adam`` (L2 penalty added to the gradient).
            DeepSpeed's ``"Adam"`` is AdamW unless its ``adam_w_mode`` is false; the importer
            resolves that, so here the names mean the torch classes.
        lr, betas, eps, weight_decay: the torch optimizer's arguments.
    """

    type: str = "AdamW"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        check_choice("optim", "type", self.type, OPTIMIZERS)
        check_number("optim", "lr", self.lr, minimum=0)
        check_number("optim", "eps", self.eps, minimum=0)
        check_number("optim", "weight_decay", self.weight_decay, minimum=0)
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), got {self.betas!r}.")
        object.__setattr__(self, "betas", tuple(float(b) for b in betas))


@dataclass(frozen=True)
class SchedulerConfig(FromDict, section="scheduler"):
    """DeepSpeed's ``WarmupLR`` / ``WarmupDecayLR`` (stepped after every optimizer step).

    Attributes:
        type: ``None`` (constant learning rate), ``WarmupLR`` or ``WarmupDecayLR``.
        warmup_min_lr: learning rate at the first step.
        warmup_max_lr: learning rate reached after warmup; ``None`` = the optimizer's ``lr``.
        warmup_num_steps: optimizer steps of warmup.
        warmup_type: ``log`` (DeepSpeed's default) or ``linear`` growth during warmup.
        total_num_steps: ``WarmupDecayLR``: the step at which the rate has decayed linearly to
            ``warmup_min_lr``; ``None`` = the Trainer's estimated number of optimizer steps.
    """

    type: Optional[str] = None
    warmup_min_lr: float = 0.0
    warmup_max_lr: Optional[float] = None
    warmup_num_steps: int = 1000
    warmup_type: str = "log"
    total_num_steps: Optional[int] = None

    def __post_init__(self) -> None:
        if self.type is not None:
            check_choice("scheduler", "type", self.type, SCHEDULERS)
        check_number("scheduler", "warmup_min_lr", self.warmup_min_lr, minimum=0)
        if self.warmup_max_lr is not None:
            check_number("scheduler", "warmup_max_lr", self.warmup_max_lr, minimum=0)
        check_number("scheduler", "warmup_num_steps", self.warmup_num_steps, minimum=0, integral=True)
        check_choice("scheduler", "warmup_type", self.warmup_type, WARMUP_TYPES)
        if self.total_num_steps is not None:
            check_number("scheduler", "total_num_steps", self.total_num_steps, minimum=1, integral=True)


def build_optimizer(cfg: OptimizerConfig, params: Iterable[Any]) -> Any:
    """The torch optimizer of ``cfg`` over ``params`` (tensors or param-group dicts)."""
    import torch

    from lightning_ampzero.optim import adam_implementation

    params = list(params)
    cls = torch.optim.AdamW if cfg.type == "AdamW" else torch.optim.Adam
    return cls(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
               **adam_implementation(params))


def _lr_scheduler_base() -> type:
    import torch

    return torch.optim.lr_scheduler.LRScheduler


class WarmupDecayLR(_lr_scheduler_base()):  # type: ignore[misc]
    """DeepSpeed's ``WarmupLR`` (``total_num_steps=None``) and ``WarmupDecayLR`` as a torch scheduler.

    DeepSpeed sets absolute rates: ``min + (max - min) * gamma`` with, during warmup,
    ``gamma = log(i + 1) / log(warmup)`` (or ``i / warmup`` for ``linear``), then 1 (WarmupLR) or
    ``max(0, (total - i) / max(1, total - warmup))`` (WarmupDecayLR), where ``i`` counts the
    scheduler's ``step()`` calls minus one; DeepSpeed clamps ``warmup`` to at least 2 (log of 1).
    Its engine steps the scheduler after each optimizer step, so the k-th optimizer step
    (k = 0, 1, ...) runs at ``i = k - 1``, and at ``min`` for k = 0. Torch's ``last_epoch`` is
    ``k`` here, hence ``i = max(k - 1, 0)`` (both give ``min`` for k = 0 and 1).
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float,
        warmup_max_lr: Union[float, list[float]],
        warmup_num_steps: int,
        warmup_type: str = "log",
        total_num_steps: Optional[int] = None,
        last_epoch: int = -1,
    ) -> None:
        n = len(optimizer.param_groups)
        max_lrs = list(warmup_max_lr) if isinstance(warmup_max_lr, (list, tuple)) else [warmup_max_lr] * n
        self.min_lr = float(warmup_min_lr)
        self.max_lrs = [float(v) for v in max_lrs]
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, last_epoch)

    def gamma(self, k: int) -> float:
        i = max(k - 1, 0)
        if i < self.warmup_num_steps:
            if self.warmup_type == "log":
                return math.log(i + 1) / math.log(self.warmup_num_steps)
            return i / self.warmup_num_steps
        if self.total_num_steps is None:
            return 1.0
        return max(0.0, (self.total_num_steps - i) / max(1.0, self.total_num_steps - self.warmup_num_steps))

    def get_lr(self) -> list[float]:
        g = self.gamma(self.last_epoch)
        return [self.min_lr + (hi - self.min_lr) * g for hi in self.max_lrs]


class WarmupLR(WarmupDecayLR):
    """DeepSpeed's ``WarmupLR``: :class:`WarmupDecayLR` without the decay (the name the config asked for)."""

    def __init__(self, optimizer: Any, warmup_min_lr: float, warmup_max_lr: Union[float, list[float]],
                 warmup_num_steps: int, warmup_type: str = "log", last_epoch: int = -1) -> None:
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, None, last_epoch)


def build_scheduler(cfg: SchedulerConfig, optimizer: Any, *, lr: Union[float, list[float]],
                    total_steps: Optional[int] = None) -> Any:
    """The scheduler of ``cfg`` (or None), ``lr`` (one, or one per param group) standing for ``warmup_max_lr=None``."""
    if cfg.type is None:
        return None
    total = None
    if cfg.type == "WarmupDecayLR":
        total = cfg.total_num_steps or total_steps
        if not total or total < 0 or total == math.inf:
            raise ValueError(
                "scheduler WarmupDecayLR needs total_num_steps: set it, or give the Trainer max_steps"
                " (or max_epochs with a sized DataLoader) so it can be estimated."
            )
    max_lr = lr if cfg.warmup_max_lr is None else cfg.warmup_max_lr
    if total is None:
        return WarmupLR(optimizer, cfg.warmup_min_lr, max_lr, cfg.warmup_num_steps, cfg.warmup_type)
    return WarmupDecayLR(optimizer, cfg.warmup_min_lr, max_lr, cfg.warmup_num_steps, cfg.warmup_type, total)


# ---------------------------------------------------------------------------------------
# DeepSpeed's `optimizer` and `scheduler` sections
# ---------------------------------------------------------------------------------------

_OPTIMIZER_NAMES = {"adam": "Adam", "adamw": "AdamW"}
_DS_OTHER_OPTIMIZERS = ("adagrad", "lamb", "onebitadam", "zerooneadam", "onebitlamb", "muadam", "muadamw",
                        "musgd", "lion", "muon", "sgd", "cpuadam", "fusedadam")
_OPTIMIZER_PARAMS = ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction",
                     "amsgrad", "fused")
_SCHEDULER_PARAMS = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps",
                     "last_batch_iteration")
#: DeepSpeed's other schedulers, and what to configure in the module instead.
_DS_OTHER_SCHEDULERS = {
    "LRRangeTest": "Lightning's Tuner(trainer).lr_find",
    "OneCycle": "torch.optim.lr_scheduler.OneCycleLR(anneal_strategy='linear')",
    "WarmupCosineLR": "torch.optim.lr_scheduler.SequentialLR of LinearLR and CosineAnnealingLR",
}
#: What to configure in the module for one of DeepSpeed's other optimizers (the message's example).
_OPTIMIZER_STANDINS = {
    "sgd": "torch.optim.SGD", "adagrad": "torch.optim.Adagrad", "cpuadam": "torch.optim.AdamW",
    "fusedadam": "torch.optim.AdamW", "onebitadam": "torch.optim.AdamW, without 1-bit compression",
    "zerooneadam": "torch.optim.AdamW, without 0/1 compression", "muadam": "mup.MuAdam", "muadamw": "mup.MuAdamW",
    "musgd": "mup.MuSGD", "muon": "torch.optim.Muon for the 2-D weights plus AdamW for the rest, as DeepSpeed does",
    "lion": "e.g. lion_pytorch.Lion", "lamb": "e.g. timm.optim.Lamb", "onebitlamb": "e.g. timm.optim.Lamb",
}


def _type_and_params(conv: Any, data: dict[str, Any], section: str, known: tuple[str, ...]) -> tuple[str, Any]:
    """The ``type`` and the checked ``params`` of an ``optimizer`` / ``scheduler`` section."""
    conv.check_keys(data, ("type", "params"), section)
    params = conv.section(data.get("params"), f"{section}.params")
    conv.check_keys(params, known, f"{section}.params")
    return str(data.get("type", "")), params


def convert_optimizer(conv: Any, opt: dict[str, Any]) -> None:
    if not opt:
        return
    conv.check_keys(opt, ("type", "params"), "optimizer")
    name = str(opt.get("type", ""))
    kind = _OPTIMIZER_NAMES.get(name.lower())
    # DeepSpeed also builds any other torch.optim class by its name (RMSprop, ...): refused as unknown
    # here even beside the module's own optimizer before (a review of a trial's fixes).
    import torch

    torch_class = getattr(torch.optim, name, None) if name and not name.startswith("_") else None
    in_torch = (isinstance(torch_class, type) and issubclass(torch_class, torch.optim.Optimizer)
                and torch_class is not torch.optim.Optimizer)
    if kind is None and (name.lower() in _DS_OTHER_OPTIMIZERS or in_torch):
        # Another of DeepSpeed's optimizers (Lamb, OneBitAdam, ...), its params its own: needed only
        # when the module configures no optimizer ([Note: a DeepSpeed optimizer we do not build]).
        standin = _OPTIMIZER_STANDINS.get(name.lower(), f"torch.optim.{name}" if in_torch else "its own implementation")
        conv.unsupported_optimizer = (
            f"optimizer.type={name!r} ({'a torch' if in_torch else 'a DeepSpeed'}"
            " optimizer) is not built here: only 'Adam' and 'AdamW' are."
            f" Configure it in the LightningModule's configure_optimizers() ({standin}), and the"
            " config's optimizer section is ignored, as DeepSpeed ignores it for a client optimizer.")
        return
    if kind is None:
        hint = suggest(name, _OPTIMIZER_NAMES.values())
        conv.errors.append(f"optimizer.type={name!r} is not supported. Allowed values: 'Adam', 'AdamW'.{hint}")
        return
    _, params = _type_and_params(conv, opt, "optimizer", _OPTIMIZER_PARAMS)
    if kind == "Adam" and params.get("adam_w_mode", True) is not False:
        kind = "AdamW"  # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false.
    for key in ("torch_adam", "fused"):
        if key in params:
            conv.no_effect.append((f"optimizer.params.{key}", "torch's fused Adam(W) is used on CPU and CUDA, foreach elsewhere"))
    if params.get("amsgrad"):
        conv.errors.append("optimizer.params.amsgrad=true is not supported by the section: configure"
                           f" torch.optim.{kind}(..., amsgrad=True) in the LightningModule's configure_optimizers()"
                           " (the section is then ignored).")
    if params.get("bias_correction") is False:
        conv.errors.append("optimizer.params.bias_correction=false is not supported (torch Adam(W) always corrects):"
                           " remove it, or configure an optimizer without bias correction in the LightningModule.")
    kwargs: dict[str, Any] = {"type": kind}
    for key in ("lr", "betas", "eps", "weight_decay"):
        if key not in params:
            continue
        if _is_auto(params[key]):
            conv.auto.append(f"optimizer.params.{key}")
            conv.optimizer_auto.append(key)
        else:
            kwargs[key] = params[key]
    try:
        conv.optimizer = OptimizerConfig(**kwargs)
    except ValueError as e:
        conv.errors.append(f"optimizer: {e}")


def convert_scheduler(conv: Any, sched: dict[str, Any]) -> None:
    if not sched:
        return
    name = str(sched.get("type", ""))
    if name not in SCHEDULERS:
        # before its params: OneCycle's own (cycle_min_lr, ...) were refused as misspelt keys (a trial)
        conv.check_keys(sched, ("type", "params"), "scheduler")
        if name in _DS_OTHER_SCHEDULERS:
            # Needed only where the module configures no scheduler of its own (DeepSpeed 0.15+ lets the
            # client's win); it was refused outright, beside a module's own (a migration trial).
            conv.unsupported_scheduler = (
                f"scheduler.type={name!r} (a DeepSpeed scheduler) is not built here: only 'WarmupLR' and"
                f" 'WarmupDecayLR' are. Configure it in the LightningModule's configure_optimizers() (e.g."
                f" {_DS_OTHER_SCHEDULERS[name]}): the config's scheduler section is then ignored, as DeepSpeed"
                " ignores it for a client scheduler.")
            return
        conv.errors.append(f"scheduler.type={name!r} is not supported. Allowed values: 'WarmupLR',"
                           f" 'WarmupDecayLR'.{suggest(name, SCHEDULERS)}")
        return
    _, params = _type_and_params(conv, sched, "scheduler", _SCHEDULER_PARAMS)
    kwargs: dict[str, Any] = {"type": name}
    for key in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"):
        if key not in params:
            continue
        if _is_auto(params[key]):
            conv.auto.append(f"scheduler.params.{key}")
            if key == "warmup_num_steps":
                kwargs[key] = 0  # the Hugging Face meaning of "auto" here: no warmup unless configured
        else:
            kwargs[key] = params[key]
    if params.get("last_batch_iteration", -1) not in (-1, None):
        conv.no_effect.append(("scheduler.params.last_batch_iteration", "resume from a checkpoint instead"))
    if name == "WarmupLR":
        kwargs.pop("total_num_steps", None)
    if "scheduler.params.warmup_max_lr" in conv.auto:
        kwargs["warmup_max_lr"] = None  # "auto": the optimizer's lr
    else:
        kwargs.setdefault("warmup_max_lr", 0.001)  # DeepSpeed's default, not the optimizer's lr
    try:
        conv.scheduler = SchedulerConfig(**kwargs)
    except ValueError as e:
        conv.errors.append(f"scheduler: {e}")
