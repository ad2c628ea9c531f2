"""The conversion: the top-level keys, the converter that each section's ``convert_*`` records
into, and :func:`convert_deepspeed_config`.
"""

from __future__ import annotations

import difflib
import os
from typing import Any, Iterable, Mapping, Optional, Union

from lightning_ampzero._deepspeed.common import (
    _FSDP,
    _HANDLED,
    _MONITOR,
    DeepSpeedConfigError,
    _is_auto,
    _load,
    _NoEffect,
    _warn,
)
from lightning_ampzero._deepspeed.compile import convert_compile
from lightning_ampzero._deepspeed.features import convert_features
from lightning_ampzero._deepspeed.optim import OptimizerConfig, SchedulerConfig, convert_optimizer, convert_scheduler
from lightning_ampzero._deepspeed.precision import convert_precision
from lightning_ampzero._deepspeed.result import ImportedDeepSpeedConfig
from lightning_ampzero._deepspeed.zero import _ZERO, convert_zero
from lightning_ampzero._schema import config_from_dict
from lightning_ampzero.config import AmpZeroConfig, LossScalerConfig

# DeepSpeed's top-level keys (the tables' format: common.py).
_TOP: dict[str, Any] = {
    "train_batch_size": "batch.train_batch_size",
    "train_micro_batch_size_per_gpu": "batch.micro_batch_size",
    "gradient_accumulation_steps": "trainer.accumulate_grad_batches",
    "gradient_clipping": "trainer.gradient_clip_val",
    "communication_data_type": _HANDLED,
    "fp32_allreduce": _HANDLED,
    "vocabulary_size": _NoEffect("DeepSpeed's own model-side features read it; the model here is yours"),
    "zero_optimization": _HANDLED,
    "fp16": _HANDLED,
    "bf16": _HANDLED,
    "bfloat16": _HANDLED,
    "torch_autocast": _HANDLED,
    "amp": _HANDLED,
    "optimizer": _HANDLED,
    "scheduler": _HANDLED,
    "activation_checkpointing": _HANDLED,
    "aio": _HANDLED,
    "msamp": _HANDLED,
    "zero_allow_untested_optimizer": _NoEffect("any torch optimizer works with FSDP2-sharded parameters"),
    "zero_force_ds_cpu_optimizer": _NoEffect("there is no DeepSpeed CPU optimizer here"),
    "prescale_gradients": _NoEffect("gradients are averaged by the reduce-scatter / all-reduce"),
    "gradient_predivide_factor": _NoEffect("gradients are averaged by the reduce-scatter / all-reduce"),
    "sparse_gradients": _NoEffect("sparse gradients are not supported by FSDP2"),
    "steps_per_print": _NoEffect("Lightning's progress bar and loggers report progress"),
    "wall_clock_breakdown": _NoEffect(_MONITOR),
    "memory_breakdown": _NoEffect(_MONITOR),
    "dump_state": _NoEffect(_MONITOR),
    "flops_profiler": _NoEffect(_MONITOR),
    "tensorboard": _NoEffect(_MONITOR),
    "wandb": _NoEffect(_MONITOR),
    "csv_monitor": _NoEffect(_MONITOR),
    "comet": _NoEffect(_MONITOR),
    "comms_logger": _NoEffect(_MONITOR),
    "timers": _NoEffect(_MONITOR),
    # Keys DeepSpeed's own parser never reads, carried by popular templates (LLaMA-Factory's
    # ds_z*_config.json): DeepSpeed ignores them, so refusing them as misspellings blocked those
    # configs from importing (a new-user trial).
    "comms_config": _NoEffect("DeepSpeed does not read it either (its key is comms_logger); " + _MONITOR),
    "monitor_config": _NoEffect("DeepSpeed does not read it either (its keys are tensorboard, wandb, csv_monitor);"
                                " " + _MONITOR),
    "fp8": _NoEffect("DeepSpeed does not read an fp8 section either (FP8 comes from Transformer Engine there);"
                     " FP8 here is AmpZeroStrategy(fp8=...) or the msamp section"),
    "disable_allgather": _NoEffect(_FSDP),
    "seq_parallel_communication_data_type": _NoEffect("sequence parallelism is not part of lightning_ampzero"),
    "sequence_parallel_size": _NoEffect("sequence parallelism is not part of lightning_ampzero"),
    "tensor_parallel": _NoEffect("tensor parallelism is not part of lightning_ampzero"),
    "pipeline": _NoEffect("pipeline parallelism is not part of lightning_ampzero"),
    "elasticity": _NoEffect("elastic training is Lightning's/TorchElastic's job"),
    "autotuning": _NoEffect("there is no autotuner here; see the memory estimator"),
    "checkpoint": _NoEffect("checkpoints are sharded torch.distributed.checkpoint directories"),
    "nebula": _NoEffect("checkpoints are sharded torch.distributed.checkpoint directories"),
    "data_types": _NoEffect("gradients accumulate in the parameters' dtype"),
    "dataloader_drop_last": _NoEffect("the DataLoader is yours (drop_last=...)"),
    "data_efficiency": _NoEffect("data efficiency / curriculum learning is not part of lightning_ampzero"),
    "curriculum_learning": _NoEffect("data efficiency / curriculum learning is not part of lightning_ampzero"),
    "eigenvalue": _NoEffect("not part of lightning_ampzero"),
    "progressive_layer_drop": _NoEffect("not part of lightning_ampzero"),
    "sparse_attention": _NoEffect("not part of lightning_ampzero"),
    "compression_training": _NoEffect("not part of lightning_ampzero"),
    "quantize_training": _NoEffect("not part of lightning_ampzero"),
    "weight_quantization": _NoEffect("not part of lightning_ampzero"),
    "hybrid_engine": _NoEffect("not part of lightning_ampzero"),
    "graph_harvesting": _NoEffect("not part of lightning_ampzero"),
    "use_data_before_expert_parallelism": _NoEffect("expert parallelism is not part of lightning_ampzero"),
    "compile": _HANDLED,
    "zero_allow_comm_data_type_fp32": _NoEffect("communication_data_type is honoured as given"),
}


class _Converter:
    """What a conversion has found so far. Each section's ``convert_*(conv, section)`` records into it."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.stage_given = False
        self.values: dict[str, Any] = {}
        self.no_effect: list[tuple[str, str]] = []
        self.auto: list[str] = []
        self.auto_targets: dict[str, str] = {}  # "auto" key -> what it stands for (a _TOP / table target)
        self.unknown: list[str] = []
        self.errors: list[str] = []
        self.optimizer: Optional[OptimizerConfig] = None
        self.unsupported_optimizer: Optional[str] = None
        self.unsupported_scheduler: Optional[str] = None
        self.optimizer_auto: list[str] = []
        self.scheduler: Optional[SchedulerConfig] = None
        self.notes: list[tuple[str, str]] = []
        self.offload_optimizer = "none"  # the offload_optimizer device (aio needs it)
        self.fp16_auto_loss_scaler: Optional[LossScalerConfig] = None  # fp16.enabled "auto": see precision.py

    # -- helpers ---------------------------------------------------------------------------
    def section(self, data: Any, path: str) -> dict[str, Any]:
        if data is None:
            return {}
        if not isinstance(data, Mapping):
            self.errors.append(f"{path} must be a JSON object, got {data!r}.")
            return {}
        return dict(data)

    def check_keys(self, data: Mapping[str, Any], known: Iterable[str], path: str) -> None:
        known = tuple(known)
        prefix = f"{path}." if path else ""
        for key in data:
            if key not in known:
                home = _home_of(key)
                if home is not None and home != path:
                    # A known key in the wrong section (the Hugging Face guide's `aio` inside
                    # zero_optimization): say where it belongs rather than guess a spelling.
                    where = "at the top level of the config" if not home else f"inside {home!r}"
                    hint = f" (a DeepSpeed key that belongs {where}: move it there)"
                else:
                    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                self.unknown.append(f"{prefix}{key}{hint}")

    def walk(self, data: Mapping[str, Any], table: Mapping[str, Any], path: str) -> None:
        """Apply a key table: map targets, record no-effect keys, flag unknown ones."""
        prefix = f"{path}." if path else ""
        self.check_keys(data, table, path)
        for key, value in data.items():
            rule = table.get(key)
            if rule is None or rule == _HANDLED:
                continue
            if isinstance(rule, _NoEffect):
                # Every key given is named, whatever its value: `overlap_comm: false` and
                # `stage3_max_live_parameters: 0` ask for something too (0 == False in Python).
                if value is not None and not _is_auto(value):
                    self.no_effect.append((prefix + key, rule.reason))
                continue
            self.set(rule, value, prefix + key)

    def set(self, target: str, value: Any, key: str) -> None:
        if _is_auto(value):
            self.auto.append(key)
            self.auto_targets[key] = target
            return
        if target in self.values and self.values[target][0] != value:
            self.errors.append(f"{key}={value!r} contradicts {self.values[target][1]}={self.values[target][0]!r}.")
            return
        self.values[target] = (value, key)

    def flag(self, section: Mapping[str, Any], path: str) -> Optional[bool]:
        """The ``enabled`` flag of a section: True, False, or None for "auto"."""
        value = section.get("enabled", False)
        if _is_auto(value):
            self.auto.append(f"{path}.enabled")
            return None
        if not isinstance(value, bool):
            self.errors.append(f"{path}.enabled must be true, false or \"auto\", got {value!r}.")
            return False
        return value

    # -- sections --------------------------------------------------------------------------
    def convert(self, data: Mapping[str, Any]) -> None:
        data = dict(data)
        if "bfloat16" in data and "bf16" in data:
            self.errors.append("bf16 and bfloat16 are the same section: give one.")
        self.walk(data, _TOP, "")
        zero = data.get("zero_optimization")
        if isinstance(zero, bool):
            # DeepSpeed's deprecated form, which it still runs: true is stage 1, false stage 0 (refused
            # here as "must be a JSON object" before: a trial).
            zero = {"stage": int(zero)}
        convert_zero(self, self.section(zero, "zero_optimization"))
        convert_precision(self, data)
        convert_features(self, data)
        convert_compile(self, data)
        convert_optimizer(self, self.section(data.get("optimizer"), "optimizer"))
        convert_scheduler(self, self.section(data.get("scheduler"), "scheduler"))

    # -- result ----------------------------------------------------------------------------
    def result(self) -> ImportedDeepSpeedConfig:
        if self.unknown:
            raise DeepSpeedConfigError(
                f"Unknown DeepSpeed config keys in {self.source}: " + "; ".join(self.unknown)
                + ". Fix or remove them (a misspelt key would change nothing, so it is an error here)."
            )
        nested: dict[str, Any] = {}
        trainer: dict[str, Any] = {}
        batch: dict[str, Any] = {}
        for target, (value, key) in self.values.items():
            head, _, rest = target.partition(".")
            if head == "trainer":
                trainer[rest] = (value, key)
            elif head == "batch":
                batch[rest] = (value, key)
            else:
                node = nested
                parts = target.split(".")
                for p in parts[:-1]:
                    node = node.setdefault(p, {})
                node[parts[-1]] = value
        trainer_kwargs = self._trainer(trainer)
        sizes = {}
        for name, (value, key) in batch.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                self.errors.append(f"{key} must be a positive whole number, got {value!r}.")
            else:
                sizes[name] = value
        config = None
        try:
            config = config_from_dict(AmpZeroConfig, nested)
        except (ValueError, TypeError) as e:
            self.errors.append(f"{e} (from the DeepSpeed keys {_keys_for(self.values, e)})")
        if self.errors:
            raise DeepSpeedConfigError(f"DeepSpeed config {self.source} cannot be converted: " + " ".join(self.errors))
        assert config is not None
        return ImportedDeepSpeedConfig(
            config=config, trainer=trainer_kwargs, micro_batch_size=sizes.get("micro_batch_size"),
            train_batch_size=sizes.get("train_batch_size"), optimizer=self.optimizer, scheduler=self.scheduler,
            no_effect=tuple(self.no_effect), auto=tuple(self.auto), source=self.source,
            optimizer_auto=tuple(self.optimizer_auto), notes=tuple(self.notes),
            unsupported_optimizer=self.unsupported_optimizer, unsupported_scheduler=self.unsupported_scheduler,
            auto_targets=tuple(self.auto_targets.items()), fp16_auto_loss_scaler=self.fp16_auto_loss_scaler,
            sources=tuple((target, key) for target, (_, key) in self.values.items()),
        )

    def _trainer(self, trainer: dict[str, tuple[Any, str]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if "gradient_clip_val" in trainer:
            value, key = trainer["gradient_clip_val"]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                self.errors.append(f"{key} must be a number >= 0, got {value!r}.")
            elif value > 0:
                out["gradient_clip_val"] = float(value)
                out["gradient_clip_algorithm"] = "norm"
        if "accumulate_grad_batches" in trainer:
            value, key = trainer["accumulate_grad_batches"]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                self.errors.append(f"{key} must be a whole number >= 1, got {value!r}.")
            else:
                out["accumulate_grad_batches"] = value
        return out


def _home_of(key: str) -> Optional[str]:
    """The section a DeepSpeed key belongs in ("" = the top level), if it is a known key of exactly one."""
    homes = [path for path, table in (("", _TOP), ("zero_optimization", _ZERO)) if key in table]
    return homes[0] if len(homes) == 1 else None


def _keys_for(values: Mapping[str, tuple[Any, str]], error: Exception) -> str:
    text = str(error)
    keys = [key for target, (_, key) in values.items() if target.rsplit(".", 1)[-1] in text]
    return ", ".join(keys) or "above"


def convert_deepspeed_config(
    config: Union[str, os.PathLike, Mapping[str, Any]], *, warn: bool = True, stage_given: bool = False
) -> ImportedDeepSpeedConfig:
    """Convert a DeepSpeed config (path to its JSON file, or a dict) to :class:`ImportedDeepSpeedConfig`.

    ``stage_given``: a stage is given beside the config (``AmpZeroStrategy(config=..., stage=3)``) and wins,
    so a config without ``zero_optimization.stage`` is not noted as meaning stage 0.

    Raises :class:`DeepSpeedConfigError` for unknown keys (with suggestions), bad values and
    contradictions. With ``warn``, keys that have no effect here are listed in one
    :class:`DeepSpeedConfigWarning`.
    """
    data, source = _load(config)
    converter = _Converter(source)
    converter.stage_given = stage_given
    converter.convert(data)
    result = converter.result()
    parts = []
    if result.no_effect:
        parts.append(f"{len(result.no_effect)} key(s) have no effect with lightning_ampzero: "
                     + "; ".join(f"{k} ({r})" for k, r in result.no_effect) + ".")
    if result.notes:
        parts.append("Read differently from DeepSpeed: " + "; ".join(f"{k}: {r}" for k, r in result.notes) + ".")
    if warn and parts:
        _warn(f"DeepSpeed config {source}: " + " ".join(parts))
    return result
