"""What a DeepSpeed config converts to, :class:`ImportedDeepSpeedConfig`: applied to a Lightning
Trainer, or written as ``ampzero-train`` Hydra overrides and experiment YAML.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from lightning_ampzero._deepspeed.common import DeepSpeedConfigError, _warn
from lightning_ampzero._deepspeed.optim import OptimizerConfig, SchedulerConfig, build_optimizer, build_scheduler
from lightning_ampzero.config import (
    ActivationCheckpointingConfig,
    AmpZeroConfig,
    CompileConfig,
    Fp8Config,
    LossScalerConfig,
    OffloadConfig,
    PrecisionConfig,
    ZeroConfig,
)


#: Set on an optimizer the config's ``optimizer`` section built.
_FROM_SECTION = "_ampzero_from_deepspeed_section"


def _fix_batch(product: int) -> str:
    """What to change when the config's batch sizes disagree (DeepSpeed's check, with the way out)."""
    return (f"Set train_batch_size to {product}, or leave it out (DeepSpeed derives it), or change the micro-batch"
            " or the accumulation (gradient_accumulation_steps / the Trainer's accumulate_grad_batches) so that"
            " the product is train_batch_size.")


@dataclass(frozen=True)
class ImportedDeepSpeedConfig:
    """What a DeepSpeed config converts to.

    Attributes:
        config: the strategy's typed config.
        trainer: Trainer settings the JSON carries (``gradient_clip_val``, ``gradient_clip_algorithm``,
            ``accumulate_grad_batches``); applied by :meth:`apply_to_trainer`. The precision is in
            ``config.precision.precision``.
        micro_batch_size, train_batch_size: DeepSpeed's batch sizes (the DataLoader's batch size
            is the micro-batch; checked against the world size in :meth:`apply_to_trainer`).
        optimizer, scheduler: used when the LightningModule configures no optimizer; the scheduler
            also steps the module's own optimizer (:meth:`with_config_scheduler`).
        no_effect: ``(key path, reason)`` for every key that changes nothing here.
        notes: ``(key path, how it is read)`` for keys whose meaning here differs from DeepSpeed's
            (the ``activation_checkpointing`` section, ``msamp``).
        auto: key paths whose value was ``"auto"``.
        source: the file it came from, or ``"<dict>"``.
    """

    config: AmpZeroConfig
    trainer: Mapping[str, Any] = field(default_factory=dict)
    micro_batch_size: Optional[int] = None
    train_batch_size: Optional[int] = None
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    no_effect: tuple[tuple[str, str], ...] = ()
    auto: tuple[str, ...] = ()
    source: str = "<dict>"
    #: ``"auto"`` optimizer parameters, resolved when the optimizer is built (``lr``: the module's).
    optimizer_auto: tuple[str, ...] = ()
    notes: tuple[tuple[str, str], ...] = ()
    #: ``(key, target)`` for the ``"auto"`` keys that stand for one setting (``zero.reduce_bucket_size``,
    #: ``trainer.accumulate_grad_batches``, ``batch.micro_batch_size``): see :meth:`auto_values`.
    auto_targets: tuple[tuple[str, str], ...] = ()
    #: [Note: a DeepSpeed optimizer we do not build] The ``optimizer`` section names one of
    #: DeepSpeed's other optimizers (Lamb, OneBitAdam, ...): fine while the module configures its
    #: own (ignored with a warning, as DeepSpeed ignores it for a client optimizer), an error where
    #: the section would have to be built. The message says so. (Its ``params`` were refused as
    #: "unknown keys" before the type was read: Lamb's ``max_coeff``, a new-user trial.)
    unsupported_optimizer: Optional[str] = None
    #: The same for a ``scheduler`` section naming one of DeepSpeed's other schedulers (WarmupCosineLR,
    #: OneCycle, LRRangeTest): an error only where no scheduler of the module's would win over it.
    unsupported_scheduler: Optional[str] = None
    #: ``fp16.enabled: "auto"``: the section's loss-scaler values, for a run whose precision turns out
    #: to be fp16 (:meth:`precision_config`); None when the section sets none.
    fp16_auto_loss_scaler: Optional[LossScalerConfig] = None
    #: ``(target, key)``: the DeepSpeed key each config field was read from (``("zero.stage",
    #: "zero_optimization.stage")``; a key that was absent says so in parentheses).
    sources: tuple[tuple[str, str], ...] = ()

    def precision_config(self, precision: str, config: PrecisionConfig) -> PrecisionConfig:
        """``config`` for a run in ``precision``: the fp16 section's loss scaler where fp16 was "auto" and is on.

        A loss scaler set on the strategy itself (not the default) wins.
        """
        if (self.fp16_auto_loss_scaler is None or precision not in ("16-mixed", "16-true")
                or config.loss_scaler != LossScalerConfig()):
            return config
        return dataclasses.replace(config, loss_scaler=self.fp16_auto_loss_scaler)

    # ---- Lightning -----------------------------------------------------------------------
    def apply_to_trainer(self, trainer: Any) -> None:
        """Apply the Trainer-level settings (called by ``AmpZeroStrategy.setup`` before optimizers exist).

        A setting the Trainer was explicitly given differently wins, with a warning. The
        ``optimizer`` / ``scheduler`` sections are installed when the LightningModule's
        ``configure_optimizers`` is not overridden or returns None.
        """
        clip = self.trainer.get("gradient_clip_val")
        if clip is not None:
            current = getattr(trainer, "gradient_clip_val", None)
            if current is None:
                trainer.gradient_clip_val = clip
                trainer.gradient_clip_algorithm = "norm"
            elif float(current) != float(clip) or str(getattr(trainer, "gradient_clip_algorithm", "norm")) != "norm":
                _warn(f"Trainer(gradient_clip_val={current}, gradient_clip_algorithm="
                      f"{getattr(trainer, 'gradient_clip_algorithm', None)!r}) is used; the DeepSpeed config's"
                      f" gradient_clipping={clip} (by norm) is ignored.")
        accumulate = self.trainer.get("accumulate_grad_batches")
        if accumulate is None and self._accumulation_implied():
            accumulate = self.accumulation(int(getattr(trainer, "world_size", 1) or 1))
        if accumulate is not None:
            current = int(getattr(trainer, "accumulate_grad_batches", 1))
            if current == 1:
                trainer.accumulate_grad_batches = int(accumulate)
            elif current != accumulate:
                _warn(f"Trainer(accumulate_grad_batches={current}) is used; the DeepSpeed config's"
                      f" gradient_accumulation_steps={accumulate} is ignored.")
        precision = self.config.precision.precision
        trainer_precision = str(getattr(trainer, "precision", "32-true"))
        if precision is not None and trainer_precision not in ("32-true", precision):
            _warn(f"Trainer(precision={trainer_precision!r}) differs from the DeepSpeed config's precision"
                  f" ({precision!r}); the DeepSpeed config's is used.")
        self._check_batch(trainer)
        module = getattr(trainer, "lightning_module", None)
        if module is not None:
            self.install_optimizers(module)

    def _check_batch(self, trainer: Any) -> None:
        world = int(getattr(trainer, "world_size", 1) or 1)
        accumulate = int(getattr(trainer, "accumulate_grad_batches", 1))
        micro, total = self.micro_batch_size, self.train_batch_size
        if micro is not None and total is not None and micro * accumulate * world != total:
            raise DeepSpeedConfigError(
                f"DeepSpeed config {self.source}: train_batch_size={total} must equal"
                f" train_micro_batch_size_per_gpu ({micro}) x gradient accumulation ({accumulate}) x world size"
                f" ({world}) = {micro * accumulate * world}. {_fix_batch(micro * accumulate * world)}"
            )

    def check_dataloader(self, trainer: Any) -> None:
        """Warn when the training DataLoader's batch size is not the config's micro-batch.

        Under Lightning the DataLoader makes the micro-batch, and the config's batch sizes only
        check each other (:meth:`_check_batch`); a config of ``train_micro_batch_size_per_gpu: 8``
        beside a DataLoader of 4 trained on half DeepSpeed's global batch without a word (a
        new-user trial, issue 16's note). Called when training starts, once the loader exists.
        """
        world = int(getattr(trainer, "world_size", 1) or 1)
        micro = self.micro_batch(world)
        size = getattr(getattr(trainer, "train_dataloader", None), "batch_size", None)
        if micro is None or not isinstance(size, int) or size == micro:
            return  # "auto" sizes, several loaders, or a batch sampler: nothing to compare
        accumulate = int(getattr(trainer, "accumulate_grad_batches", 1))
        given = [f"{key}={value}" for key, value in (("train_micro_batch_size_per_gpu", self.micro_batch_size),
                                                     ("train_batch_size", self.train_batch_size)) if value is not None]
        _warn(f"DeepSpeed config {self.source}: {' and '.join(given)} {'make' if len(given) > 1 else 'makes'} {micro} samples per process and"
              f" micro-batch, but the training DataLoader's batch_size is {size}. Under Lightning the DataLoader"
              f" decides: each optimizer step trains on {size} x {accumulate} (accumulation) x {world} (processes)"
              f" = {size * accumulate * world} samples, where the config has {micro * accumulate * world}. Give the"
              f" DataLoader batch_size={micro} to train as DeepSpeed would.")

    def auto_values(self, trainer: Any, config: AmpZeroConfig) -> list[str]:
        """What each ``"auto"`` key resolved to in this run, ``"key = value (whose)"``, for the log.

        ``"auto"`` is the Hugging Face integration's placeholder, which its Trainer fills from its
        arguments. Here the Lightning Trainer, the DataLoader, the module's optimizer or our
        defaults fill it, and nothing said which: a user migrating a config could not tell what
        ``reduce_bucket_size: "auto"`` or ``lr: "auto"`` had become. Called when training starts,
        once the optimizer and the DataLoader exist; ``config`` is the strategy's final config.
        """
        targets = dict(self.auto_targets)
        optimizers = list(getattr(trainer, "optimizers", []) or [])
        group = optimizers[0].param_groups[0] if len(optimizers) == 1 else {}
        # (offload's OffloadedAdam wraps the optimizer the section built as its ``optimizer``)
        from_section = len(optimizers) == 1 and any(getattr(o, _FROM_SECTION, False)
                                                    for o in (optimizers[0], getattr(optimizers[0], "optimizer", None)))
        plugin_config = getattr(getattr(trainer, "precision_plugin", None), "config", None)
        scaler_used = getattr(plugin_config, "loss_scaler", None)
        schedulers = [c.scheduler for c in getattr(trainer, "lr_scheduler_configs", []) or []]
        out = []
        for key in self.auto:
            name = key.rsplit(".", 1)[-1]
            target = targets.get(key, "")
            if key.startswith("optimizer.params."):
                # a scheduler has already set the group's lr to its first step's: its base is initial_lr
                name = "initial_lr" if name == "lr" and "initial_lr" in group else name
                # the section built the optimizer: its "auto" took the module's lr or our default (it said
                # "the optimizer's" before, as if the module had configured one: a trial)
                whose = ("the optimizer's" if not from_section
                         else "the LightningModule's lr" if key.endswith(".lr") else "the default")
                value = f"{group[name]!r} ({whose})" if name in group else "the optimizer's own default"
            elif key.startswith("scheduler.params."):
                value = self._auto_scheduler_value(name, schedulers, group)
            elif key.endswith(".enabled"):
                value = self._auto_enabled(key, config.precision.precision or str(getattr(trainer, "precision", "32-true")),
                                           scaler_used)
            elif target == "trainer.accumulate_grad_batches":
                value = f"{getattr(trainer, 'accumulate_grad_batches', 1)} (the Trainer's)"
            elif target == "trainer.gradient_clip_val":
                clip = getattr(trainer, "gradient_clip_val", None)
                value = f"{clip} (the Trainer's)" if clip else "no clipping (the Trainer's)"
            elif target.startswith("batch."):
                size = getattr(getattr(trainer, "train_dataloader", None), "batch_size", None)
                if target == "batch.train_batch_size" and isinstance(size, int):
                    size *= int(getattr(trainer, "accumulate_grad_batches", 1)) * int(getattr(trainer, "world_size", 1))
                value = f"{size} (from the training DataLoader's batch_size)" if size else "the DataLoader's batch size"
            else:
                value = f"{_config_value(config, target)!r} (the default)"
            out.append(f"{key} = {value}")
        return out

    def _auto_enabled(self, key: str, precision: str, scaler_used: Optional[LossScalerConfig] = None) -> str:
        """A precision section's ``enabled: "auto"``: on or off, by the precision in use (and whose loss scaler)."""
        section = key.split(".", 1)[0]
        on = {"fp16": precision.startswith("16-"), "bf16": precision.startswith("bf16-"),
              "bfloat16": precision.startswith("bf16-"), "torch_autocast": precision.endswith("-mixed")}.get(section)
        if on is None:
            return f"{precision!r} (the precision in use)"
        if not on:
            return f"false ({precision!r} is the precision in use)"
        scaler = ""
        if section == "fp16" and self.fp16_auto_loss_scaler is not None:
            scaler = (" with the section's loss-scaler values" if scaler_used in (None, self.fp16_auto_loss_scaler)
                      else "; the strategy's own loss scaler wins over the section's")
        return f"true ({precision!r} is the precision in use{scaler})"

    def _auto_scheduler_value(self, name: str, schedulers: list, group: Mapping[str, Any]) -> str:
        from lightning_ampzero._deepspeed.optim import WarmupDecayLR

        built = next((s for s in schedulers if isinstance(s, WarmupDecayLR)), None)
        if name == "warmup_max_lr":
            lrs = built.max_lrs if built is not None else [group.get("initial_lr", group.get("lr"))]
            return f"{lrs[0] if len(set(lrs)) == 1 else lrs!r} (the optimizer's lr)"
        if name == "total_num_steps" and built is not None:
            return f"{built.total_num_steps} (the Trainer's estimated optimizer steps)"
        value = getattr(self.scheduler, name, None) if self.scheduler is not None else None
        if name == "warmup_num_steps" and isinstance(value, int) and value < 2:
            # not "no warmup": DeepSpeed's WarmupLR warms up over max(2, warmup_num_steps) steps (a trial)
            # "auto" is Hugging Face's: its Trainer's warmup_steps, 0 unless set (DeepSpeed's own default,
            # for a key left out, is 1000: a trial took 0 for that)
            return (f"{value!r} (\"auto\" as Hugging Face fills it: no warmup steps; DeepSpeed warms up over at"
                    " least 2 steps, so the first two optimizer steps run at warmup_min_lr; set warmup_num_steps to"
                    " warm up longer)")
        return f"{value!r} (the default)"

    def install_optimizers(self, module: Any) -> None:
        """Let ``module`` fall back to the ``optimizer`` / ``scheduler`` sections (idempotent).

        Its ``configure_optimizers`` is wrapped on the instance: when the class does not override
        it, or its result is None, the sections are built (DeepSpeed's behaviour); otherwise the
        module's own optimizer wins (the ``optimizer`` section is ignored, with a warning) and the
        ``scheduler`` section steps it, as DeepSpeed does with a client optimizer. Called by
        ``AmpZeroStrategy.connect`` (Lightning rejects a module without configure_optimizers
        before the strategy's setup runs).
        """
        if (self.optimizer is None and self.scheduler is None and self.unsupported_optimizer is None
                and self.unsupported_scheduler is None):
            return
        original = module.configure_optimizers
        if getattr(original, "_ampzero_deepspeed", False):
            return
        from lightning.pytorch.utilities.model_helpers import is_overridden

        overridden = is_overridden("configure_optimizers", module)
        imported = self

        def configure_optimizers(this: Any) -> Any:
            result = original() if overridden else None
            if result is None:
                return imported.configure_optimizers(this, this.trainer)
            return imported.with_config_scheduler(result, this.trainer)

        configure_optimizers._ampzero_deepspeed = True  # type: ignore[attr-defined]
        module.configure_optimizers = types.MethodType(configure_optimizers, module)

    def with_config_scheduler(self, result: Any, trainer: Any = None) -> Any:
        """The module's own ``configure_optimizers`` result, with the ``scheduler`` section applied to its optimizer.

        DeepSpeed's engine takes a client optimizer ("Using client Optimizer as basic optimizer") and
        builds the configured LR scheduler on it ("DeepSpeed using configured LR scheduler") unless
        it is given a client scheduler too, which wins since DeepSpeed 0.15 (its PR 5846; before,
        the section won: this method followed that until a trial compared it with 0.19.8). So: the
        module's optimizer is kept (the ``optimizer`` section is ignored, with a warning), its own
        scheduler too (the ``scheduler`` section is then ignored, with a warning), and a module
        without a scheduler gets the section's, stepped after every optimizer step.
        """
        if self.optimizer is not None or self.unsupported_optimizer is not None:
            _warn("The LightningModule configures its own optimizer; the DeepSpeed config's optimizer section is"
                  " ignored, as DeepSpeed ignores it for a client optimizer. To train with the section's optimizer"
                  " (what Lightning's DeepSpeedStrategy and Hugging Face's Trainer do), return None from"
                  " configure_optimizers.")
        if self.unsupported_scheduler is not None:
            single, own = _single_optimizer(result)
            if single is not None and own is None:  # the section's would step it: DeepSpeed builds it there
                raise DeepSpeedConfigError(f"DeepSpeed config {self.source}: the LightningModule configures no LR"
                                           f" scheduler, and the config's {self.unsupported_scheduler}")
            _warn("The LightningModule configures its own LR scheduler; the DeepSpeed config's scheduler section is"
                  " ignored, as DeepSpeed (0.15 and later) ignores it for a client scheduler.")
            return result
        if self.scheduler is None or self.scheduler.type is None:
            return result
        optimizer, own_scheduler = _single_optimizer(result)
        if optimizer is None:
            _warn("The LightningModule configures several optimizers; the DeepSpeed config's scheduler section"
                  " (one scheduler for one optimizer) is ignored.")
            return result
        if own_scheduler is not None:
            _warn("The LightningModule configures its own LR scheduler; the DeepSpeed config's scheduler section is"
                  " ignored, as DeepSpeed (0.15 and later) ignores it for a client scheduler. Remove the module's"
                  " scheduler to train with the section's.")
            return result
        total = getattr(trainer, "estimated_stepping_batches", None) if trainer is not None else None
        # warmup_max_lr "auto": each group's own learning rate, as the client optimizer set it.
        lrs = [float(group["lr"]) for group in optimizer.param_groups]
        scheduler = build_scheduler(self.scheduler, optimizer, lr=lrs, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_optimizers(self, module: Any, trainer: Any = None) -> Any:
        """Build the ``optimizer`` and ``scheduler`` sections for ``module`` (Lightning's return format)."""
        for unsupported in (self.unsupported_optimizer, self.unsupported_scheduler):
            if unsupported is not None:
                raise DeepSpeedConfigError(f"DeepSpeed config {self.source}: the LightningModule configures no"
                                           f" optimizer, and the config's {unsupported}")
        opt_cfg = self.optimizer or OptimizerConfig()
        if "lr" in self.optimizer_auto:
            lr = _module_lr(module)
            if lr is None:
                raise DeepSpeedConfigError(
                    f"DeepSpeed config {self.source}: optimizer.params.lr is \"auto\", and the LightningModule has"
                    " no `lr` / `learning_rate` attribute or hyperparameter to take it from. Set a number."
                )
            opt_cfg = dataclasses.replace(opt_cfg, lr=lr)
        optimizer = build_optimizer(opt_cfg, [p for p in module.parameters() if p.requires_grad])
        setattr(optimizer, _FROM_SECTION, True)  # for auto_values' log line
        if self.scheduler is None or self.scheduler.type is None:
            return optimizer
        total = None
        if trainer is not None:
            total = getattr(trainer, "estimated_stepping_batches", None)
        scheduler = build_scheduler(self.scheduler, optimizer, lr=opt_cfg.lr, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- Hydra ---------------------------------------------------------------------------
    def _accumulation_implied(self) -> bool:
        """Only the two batch sizes given: DeepSpeed infers gradient_accumulation_steps from them.

        (``"auto"`` is the Trainer's value, as Hugging Face's integration fills it in.)
        """
        return ("accumulate_grad_batches" not in self.trainer and "gradient_accumulation_steps" not in self.auto
                and self.train_batch_size is not None and self.micro_batch_size is not None)

    def accumulation(self, world_size: Optional[int]) -> int:
        """Gradient accumulation: the config's, or, where it gives only the two batch sizes, their quotient.

        DeepSpeed takes any two of train_batch_size, train_micro_batch_size_per_gpu and
        gradient_accumulation_steps and infers the third: train_batch_size / (micro-batch x world
        size), which must divide (a Megatron-DeepSpeed script's config of 8 and 2 on 2 ranks was
        refused as "must equal 4": a new-user trial).
        """
        given = self.trainer.get("accumulate_grad_batches")
        if given is not None:
            return int(given)
        if not self._accumulation_implied() or world_size is None:
            return 1
        assert self.train_batch_size is not None and self.micro_batch_size is not None
        per_step = self.micro_batch_size * world_size
        if self.train_batch_size % per_step:
            raise DeepSpeedConfigError(
                f"DeepSpeed config {self.source}: train_batch_size={self.train_batch_size} is not a multiple of"
                f" train_micro_batch_size_per_gpu ({self.micro_batch_size}) x world size ({world_size}) = {per_step},"
                " so no gradient_accumulation_steps gives it (DeepSpeed infers it as their quotient). Change"
                " one of the batch sizes, or the number of processes."
            )
        return self.train_batch_size // per_step

    def micro_batch(self, world_size: Optional[int]) -> Optional[int]:
        """The per-process batch size: given, or derived from train_batch_size and ``world_size``.

        With both sizes and ``world_size`` known, they must agree (DeepSpeed's check, which
        :meth:`apply_to_trainer` makes again at fit time with the Trainer's world size).
        """
        if self.train_batch_size is None or world_size is None:
            return self.micro_batch_size
        accumulate = self.accumulation(world_size)
        per_step = accumulate * world_size
        if self.micro_batch_size is not None:
            if self.micro_batch_size * per_step != self.train_batch_size:
                raise DeepSpeedConfigError(
                    f"DeepSpeed config {self.source}: train_batch_size={self.train_batch_size} must equal"
                    f" train_micro_batch_size_per_gpu ({self.micro_batch_size}) x gradient accumulation"
                    f" ({accumulate}) x world size ({world_size}) = {self.micro_batch_size * per_step}."
                    f" {_fix_batch(self.micro_batch_size * per_step)}"
                )
            return self.micro_batch_size
        if self.train_batch_size % per_step:
            raise DeepSpeedConfigError(
                f"DeepSpeed config {self.source}: train_batch_size={self.train_batch_size} is not divisible by"
                f" gradient accumulation x world size = {per_step}. Set it to a multiple of {per_step}, or leave it"
                " out and give train_micro_batch_size_per_gpu (or the DataLoader's batch_size)."
            )
        return self.train_batch_size // per_step

    def hydra_values(self, world_size: Optional[int] = None) -> dict[str, Any]:
        """Nested values for ``ampzero-train``'s config: only what differs from the option files' defaults.

        ``world_size`` lets a config that gives only ``train_batch_size`` set ``data.batch_size``.
        """
        if self.unsupported_optimizer is not None:  # ampzero-train builds the optimizer from the `optim` node
            raise DeepSpeedConfigError(f"DeepSpeed config {self.source}: {self.unsupported_optimizer} ampzero-train"
                                       " builds its optimizer from the optim node: remove the optimizer section.")
        if self.unsupported_scheduler is not None:
            raise DeepSpeedConfigError(f"DeepSpeed config {self.source}: {self.unsupported_scheduler} ampzero-train"
                                       " builds its schedule from the optim node: remove the scheduler section.")
        out: dict[str, Any] = {}
        zero = _diff(self.config.zero, ZeroConfig(stage=self.config.zero.stage))
        if zero:
            out["strategy"] = zero
        prec = _diff(self.config.precision, PrecisionConfig(precision=self.config.precision.precision))
        if prec:
            out["precision"] = prec
        # Each against what its group option (hydra_groups) sets: conf/<group>/<option>.yaml.
        cfg = self.config
        for node, value, default in (
            ("offload", cfg.offload, OffloadConfig()),
            ("activation_checkpointing", cfg.activation_checkpointing,
             ActivationCheckpointingConfig(mode=cfg.activation_checkpointing.mode)),
            ("fp8", cfg.fp8, Fp8Config(recipe=cfg.fp8.recipe) if cfg.fp8.enabled else Fp8Config.off()),
            ("compile", cfg.compile, CompileConfig()),
        ):
            diff = _diff(value, default)
            if diff:
                out[node] = diff
        trainer = dict(self.trainer)
        if self._accumulation_implied() and world_size is not None:
            trainer["accumulate_grad_batches"] = self.accumulation(world_size)  # as DeepSpeed infers it
        if trainer:
            out["trainer"] = trainer
        micro = self.micro_batch(world_size)
        if micro is not None:
            out["data"] = {"batch_size": micro}
        if self.optimizer is not None:
            out["optim"] = dataclasses.asdict(self.optimizer)
            for key in self.optimizer_auto:
                out["optim"].pop(key, None)
        if self.scheduler is not None:
            out["scheduler"] = dataclasses.asdict(self.scheduler)
        return _lists(out)

    def hydra_groups(self) -> dict[str, str]:
        """Config-group choices: ``{"strategy": "zero3", "precision": "16-mixed", "activation_checkpointing": "full"}``.

        Offload is written as ``offload.*`` values over ``strategy=zero<stage>`` (explicit, rather than
        the strategy group's *_offload presets, whose other values would have to be diffed too).
        """
        cfg = self.config
        groups = {"strategy": f"zero{cfg.zero.stage}"}
        if cfg.precision.precision is not None:
            groups["precision"] = cfg.precision.precision
        if cfg.activation_checkpointing.enabled:
            groups["activation_checkpointing"] = cfg.activation_checkpointing.mode
        if cfg.fp8.enabled:
            groups["fp8"] = cfg.fp8.recipe
        return groups

    def hydra_overrides(self, world_size: Optional[int] = None) -> list[str]:
        """Command-line overrides for ``ampzero-train`` equivalent to this config."""
        out = [f"{g}={v}" for g, v in self.hydra_groups().items()]
        for path, value in _flatten(self.hydra_values(world_size)):
            out.append(f"{path}={_override_value(value)}")
        return out

    def hydra_yaml(self, name: str = "deepspeed", world_size: Optional[int] = None) -> str:
        """An ``experiment/<name>.yaml`` equivalent to this config (``ampzero-train experiment=<name>``)."""
        from omegaconf import OmegaConf

        lines = [
            "# @package _global_",
            f"# Converted from the DeepSpeed config {self.source} by `ampzero-config from-deepspeed`.",
            f"# Use: save as <config dir>/experiment/{name}.yaml and run",
            f"#   ampzero-train --config-dir <config dir> experiment={name}",
        ]
        for key, reason in self.no_effect:
            lines.append(f"# no effect: {key} ({reason})")
        for key, reason in self.notes:
            lines.append(f"# note: {key}: {reason}")
        for key in self.auto:
            lines.append(f"# \"auto\": {key} (takes the default)")
        if self.micro_batch_size is None and self.train_batch_size is not None and world_size is None:
            lines.append(f"# train_batch_size={self.train_batch_size}: set data.batch_size to it divided by"
                         " (trainer.accumulate_grad_batches x world size)")
        body: dict[str, Any] = {"defaults": [{f"override /{g}": v} for g, v in self.hydra_groups().items()]}
        body.update(self.hydra_values(world_size))
        return "\n".join(lines) + "\n" + OmegaConf.to_yaml(OmegaConf.create(body))


def _config_value(config: AmpZeroConfig, target: str) -> Any:
    """The value at ``target`` (``zero.reduce_bucket_size``) of ``config``, or ``"?"``."""
    value: Any = config
    for part in target.split("."):
        if not hasattr(value, part):
            return "?"
        value = getattr(value, part)
    return value


def _single_optimizer(result: Any) -> tuple[Any, Any]:
    """``(optimizer, its scheduler or None)`` from a ``configure_optimizers`` result with one optimizer, else ``(None, None)``."""
    from torch.optim import Optimizer

    if isinstance(result, Optimizer):
        return result, None
    if isinstance(result, Mapping) and isinstance(result.get("optimizer"), Optimizer):
        return result["optimizer"], result.get("lr_scheduler")
    if isinstance(result, (list, tuple)):
        if len(result) == 1:
            return _single_optimizer(result[0])
        if len(result) == 2 and all(isinstance(r, (list, tuple)) for r in result) and len(result[0]) == 1:
            optimizer, _ = _single_optimizer(result[0][0])
            return optimizer, (result[1][0] if result[1] else None)
    return None, None


def _module_lr(module: Any) -> Optional[float]:
    for name in ("lr", "learning_rate"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        hparams = getattr(module, "hparams", None)
        if hparams is not None and isinstance(hparams.get(name) if hasattr(hparams, "get") else None, (int, float)):
            return float(hparams.get(name))
    return None


def _diff(cfg: Any, default: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        a, b = getattr(cfg, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(a):
            sub = _diff(a, b)
            if sub:
                out[f.name] = sub
        elif a != b:
            out[f.name] = a
    return out


def _lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    return value


def _flatten(values: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in values.items():
        path = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.extend(_flatten(v, path + "."))
        else:
            out.append((path, v))
    return out


def _override_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value)
    return str(value)
