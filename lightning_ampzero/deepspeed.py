"""Import a DeepSpeed JSON config into the one schema.

``convert_deepspeed_config("ds_config.json")`` (or a dict) returns an
:class:`ImportedDeepSpeedConfig`: the :class:`~lightning_ampzero.config.AmpZeroConfig` it stands
for, the Trainer settings DeepSpeed keeps in its JSON (gradient clipping, accumulation,
precision), its ``optimizer`` / ``scheduler`` sections, and the keys that have no effect here.
``AmpZeroStrategy(config="ds_config.json")`` uses it, and ``ampzero-config from-deepspeed``
prints it as Hydra overrides or an experiment YAML.

Rules (DeepSpeed silently ignores a misspelt key; we do not):

* A key DeepSpeed does not know is an error naming its path, with a "did you mean".
* A key DeepSpeed knows but that changes nothing here is listed, with the reason, in one
  :class:`DeepSpeedConfigWarning` per conversion (on global rank 0 only).
* ``"auto"`` (the Hugging Face integration's placeholder) takes our default, or what the
  Trainer / LightningModule already says; :attr:`ImportedDeepSpeedConfig.auto` lists those keys.
* Values are validated by the typed configs, so a bad value names the allowed ones.

Features: ``zero_optimization.offload_optimizer`` / ``offload_param`` / ``sub_group_size`` and
``aio`` become :class:`~lightning_ampzero.config.OffloadConfig`, ``activation_checkpointing``
turns on full checkpointing of the repeated blocks
(:class:`~lightning_ampzero.config.ActivationCheckpointingConfig`), and ``msamp`` becomes
:class:`~lightning_ampzero.config.Fp8Config` (``_deepspeed/features.py``). Keys whose meaning
here differs from DeepSpeed's are listed as notes (:attr:`ImportedDeepSpeedConfig.notes`).

Precision: ``fp16`` maps to ``"16-mixed"`` and ``bf16`` to ``"bf16-mixed"``, as Lightning's
own DeepSpeed integration maps them; DeepSpeed's fp16 loss-scaler keys keep their names and
semantics (:class:`~lightning_ampzero.config.LossScalerConfig`). ``torch_autocast`` picks the
"-mixed" precision of its dtype and its ``lower_precision_safe_modules``.

The implementation is in :mod:`lightning_ampzero._deepspeed`, one module per config section.
"""

from __future__ import annotations

from lightning_ampzero._deepspeed.common import DeepSpeedConfigError, DeepSpeedConfigWarning
from lightning_ampzero._deepspeed.convert import convert_deepspeed_config
from lightning_ampzero._deepspeed.optim import (
    OptimizerConfig,
    SchedulerConfig,
    WarmupDecayLR,
    build_optimizer,
    build_scheduler,
)
from lightning_ampzero._deepspeed.result import ImportedDeepSpeedConfig

# Module constants that were importable from here before the split (not part of __all__).
from lightning_ampzero._deepspeed.common import AUTO  # noqa: F401
from lightning_ampzero._deepspeed.optim import OPTIMIZERS, SCHEDULERS, WARMUP_TYPES  # noqa: F401

__all__ = [
    "DeepSpeedConfigError",
    "DeepSpeedConfigWarning",
    "ImportedDeepSpeedConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "WarmupDecayLR",
    "build_optimizer",
    "build_scheduler",
    "convert_deepspeed_config",
]
