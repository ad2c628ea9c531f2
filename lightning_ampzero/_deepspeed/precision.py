"""DeepSpeed's precision keys (``fp16``, ``bf16`` / ``bfloat16``, ``torch_autocast``, ``amp``,
``communication_data_type``) -> ``precision.*`` and ``precision.loss_scaler.*``.
"""

from __future__ import annotations

from typing import Any, Mapping

from lightning_ampzero._deepspeed.common import _HANDLED, _NoEffect, _is_auto
from lightning_ampzero._schema import config_from_dict
from lightning_ampzero.config import LossScalerConfig

_FP16: dict[str, Any] = {
    "enabled": _HANDLED,
    "auto_cast": _HANDLED,
    "loss_scale": "precision.loss_scaler.loss_scale",
    "initial_scale_power": "precision.loss_scaler.initial_scale_power",
    "loss_scale_window": "precision.loss_scaler.loss_scale_window",
    "hysteresis": "precision.loss_scaler.hysteresis",
    "consecutive_hysteresis": "precision.loss_scaler.consecutive_hysteresis",
    "min_loss_scale": "precision.loss_scaler.min_loss_scale",
    "fp16_master_weights_and_grads": _NoEffect("parameters stay fp32 under 16-mixed (autocast)"),
    "fp16_optimizer_states": _NoEffect("optimizer states follow the parameters' dtype"),
}

_BF16: dict[str, Any] = {
    "enabled": _HANDLED,
    "check_grad_overflow": "precision.check_grad_overflow",
    "immediate_grad_update": _NoEffect("gradients are reduced in the dtype set by communication_data_type"),
    "bf16_master_weights_and_grads": _NoEffect("parameters stay fp32 under bf16-mixed (autocast)"),
    "bf16_optimizer_states": _NoEffect("optimizer states follow the parameters' dtype"),
}

_AUTOCAST = ("enabled", "dtype", "lower_precision_safe_modules")
_AMP = _NoEffect("Apex AMP is not supported: use fp16 / bf16 / torch_autocast (or Trainer precision=...)")

_COMM_DTYPES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "bf16": "bf16", "bfp16": "bf16", "bfloat16": "bf16",
}
_AUTOCAST_DTYPES = {
    "torch.bfloat16": "bf16-mixed", "bfloat16": "bf16-mixed", "bf16": "bf16-mixed",
    "torch.float16": "16-mixed", "float16": "16-mixed", "fp16": "16-mixed", "torch.half": "16-mixed", "half": "16-mixed",
}


def convert_precision(conv: Any, data: Mapping[str, Any]) -> None:
    fp16 = conv.section(data.get("fp16"), "fp16")
    bf16_key = "bfloat16" if "bfloat16" in data else "bf16"
    bf16 = conv.section(data.get(bf16_key), bf16_key)
    autocast = conv.section(data.get("torch_autocast"), "torch_autocast")
    chosen: list[tuple[str, str]] = []
    fp16_on = conv.flag(fp16, "fp16") if fp16 else False
    if fp16_on:
        conv.walk(fp16, _FP16, "fp16")
        chosen.append(("16-mixed", "fp16.enabled"))
        if fp16.get("auto_cast") not in (None, False, True) and not _is_auto(fp16.get("auto_cast")):
            conv.errors.append(f"fp16.auto_cast must be true or false, got {fp16['auto_cast']!r}.")
        elif fp16.get("auto_cast") is not None:
            # Accepted without a word before (a trial): DeepSpeed's switch for casting the inputs of
            # its fp16 model, which has no counterpart under autocast.
            conv.no_effect.append(("fp16.auto_cast", "fp16 runs as \"16-mixed\": torch autocast casts each op's"
                                   " inputs over fp32 parameters, whatever auto_cast says (precision=\"16-true\""
                                   " keeps fp16 parameters with fp32 masters)"))
    elif fp16:
        conv.check_keys(fp16, _FP16, "fp16")
        if fp16_on is None:
            # "auto" (the Hugging Face integration's placeholder): fp16 is on when the run's precision
            # is an fp16 one, and then the section's loss-scaler values are DeepSpeed's, as in a config
            # that says true. They are kept apart and applied once the precision is known (the
            # strategy's precision plugin): set as the schema's loss_scaler they would be refused
            # under bf16, and dropped they were (initial_scale_power 8 ran as 16: a trial).
            scaler = {target.rsplit(".", 1)[-1]: fp16[key] for key, target in _FP16.items()
                      if isinstance(target, str) and target != _HANDLED and key in fp16 and not _is_auto(fp16[key])}
            try:
                conv.fp16_auto_loss_scaler = config_from_dict(LossScalerConfig, scaler, path="fp16") if scaler else None
            except (TypeError, ValueError) as e:
                conv.errors.append(f"{e} (from the fp16 section)")
        # Like DeepSpeed, the scaler keys of a section that says false count for nothing.
    if bf16:
        conv.walk(bf16, _BF16, bf16_key)
    conv.check_keys(autocast, _AUTOCAST, "torch_autocast")
    if bf16 and conv.flag(bf16, bf16_key):
        chosen.append(("bf16-mixed", f"{bf16_key}.enabled"))
    if autocast and conv.flag(autocast, "torch_autocast"):
        dtype = str(autocast.get("dtype", "torch.bfloat16"))
        mapped = _AUTOCAST_DTYPES.get(dtype.lower())
        if mapped is None:
            conv.errors.append(f"torch_autocast.dtype={dtype!r} is not valid. Allowed values: torch.bfloat16,"
                               " torch.float16.")
        else:
            chosen.append((mapped, "torch_autocast.enabled"))
        modules = autocast.get("lower_precision_safe_modules")
        if modules is not None:
            if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
                conv.errors.append("torch_autocast.lower_precision_safe_modules must be a list of class names.")
            else:
                # DeepSpeed takes import paths ("torch.nn.Linear"); the schema holds class names.
                conv.set("precision.lower_precision_safe_modules", [m.rsplit(".", 1)[-1] for m in modules],
                         "torch_autocast.lower_precision_safe_modules")
    distinct = sorted({p for p, _ in chosen})
    if len(distinct) > 1:
        both = " are both" if len(chosen) == 2 else " are all"
        conv.errors.append(" and ".join(k for _, k in chosen) + both + " set: enable one precision.")
    elif distinct:
        # In the strategy's config, so it holds whatever the Trainer's precision= says.
        conv.values["precision.precision"] = (distinct[0], chosen[0][1])
    comm = data.get("communication_data_type")
    if comm is not None:
        mapped = _COMM_DTYPES.get(str(comm).lower())
        if mapped is None:
            conv.errors.append(f"communication_data_type={comm!r} is not valid. Allowed values: fp32, fp16, bf16.")
        else:
            conv.set("precision.communication_data_type", mapped, "communication_data_type")
    # DeepSpeed's older switch for the same thing (reduce the gradients in fp32); communication_data_type
    # wins where both are given, as in DeepSpeed. It was refused as a misspelt key (a new-user trial).
    fp32_allreduce = data.get("fp32_allreduce")
    if fp32_allreduce is True and comm is None:
        conv.set("precision.communication_data_type", "fp32", "fp32_allreduce")
    elif fp32_allreduce is not None:
        conv.no_effect.append(("fp32_allreduce", "communication_data_type is given" if fp32_allreduce else
                               "false is the default: gradients reduce in the precision's own dtype"))
    amp = conv.section(data.get("amp"), "amp")
    if amp.get("enabled"):
        conv.no_effect.append(("amp", _AMP.reason))
