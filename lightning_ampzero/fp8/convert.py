"""``convert_to_fp8(model, cfg)``: swap ``nn.Linear`` layers for :class:`Fp8Linear` in place; and back.

Which layers are converted (:func:`plan_fp8_conversion` says why each one is or is not):
exactly ``nn.Linear`` (subclasses such as ``nn.MultiheadAttention.out_proj`` are used through
their parameters by their owner, never called), with ``in_features`` and ``out_features``
multiples of 16 (the FP8 GEMM's alignment; ``pad_dims`` lifts this), not smaller than
``min_features``, not matching ``skip_fqns``, whose weight no other module uses (a tied weight
would be quantized for one user only), and accepted by ``module_filter_fn(module, fqn)``.
"""

from __future__ import annotations

import fnmatch
from typing import Callable, Optional

import torch
from torch import nn

from lightning_ampzero.config import Fp8Config
from lightning_ampzero.fp8.fsdp import unwrap_all_gather_weight
from lightning_ampzero.fp8.linear import Fp8Linear
from lightning_ampzero.fp8.scaling import DelayedScalingSync

ModuleFilter = Callable[[nn.Module, str], bool]

#: Keys that Fp8Linear adds to a state dict (delayed recipe); nn.Linear has none of them.
FP8_STATE_SUFFIXES = ("fp8_amax_history", "fp8_scale")

CONVERTED = "fp8"


def _shared_weights(model: nn.Module) -> dict[int, list[str]]:
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(p), []).append(f"{name}.{pname}" if name else pname)
    return owners


def plan_fp8_conversion(model: nn.Module, config: Fp8Config,
                        module_filter_fn: Optional[ModuleFilter] = None) -> dict[str, str]:
    """For every ``nn.Linear`` (and Fp8Linear) in ``model``: ``"fp8"`` or why it stays in high precision."""
    owners = _shared_weights(model)
    plan: dict[str, str] = {}
    for fqn, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            plan[fqn] = CONVERTED
            continue
        if not isinstance(module, nn.Linear):
            continue
        if type(module) is not nn.Linear:
            plan[fqn] = f"{type(module).__name__} is a subclass of nn.Linear (its owner may use its weight directly)"
        elif not config.enabled:
            plan[fqn] = "fp8 is disabled"
        elif not config.pad_dims and (module.in_features % 16 or module.out_features % 16):
            plan[fqn] = (f"in_features={module.in_features}, out_features={module.out_features}: not multiples of 16"
                         " (set fp8.pad_dims=true to zero-pad)")
        elif min(module.in_features, module.out_features) < config.min_features:
            plan[fqn] = (f"smaller than fp8.min_features={config.min_features} "
                         f"({module.in_features}x{module.out_features}): casts would cost more than FP8 saves")
        elif any(fnmatch.fnmatchcase(fqn, pattern) for pattern in config.skip_fqns):
            plan[fqn] = "matches fp8.skip_fqns"
        elif len(owners.get(id(module.weight), ())) > 1:
            plan[fqn] = f"weight shared with {[o for o in owners[id(module.weight)] if o != fqn + '.weight']}"
        elif module_filter_fn is not None and not module_filter_fn(module, fqn):
            plan[fqn] = "rejected by module_filter_fn"
        else:
            plan[fqn] = CONVERTED
    return plan


def convert_to_fp8(model: nn.Module, config: Fp8Config, *, module_filter_fn: Optional[ModuleFilter] = None,
                   fp8_all_gather: Optional[bool] = None, process_group: object = None) -> nn.Module:
    """Replace the eligible ``nn.Linear`` layers of ``model`` by :class:`Fp8Linear`, in place; returns ``model``.

    Works on models built on the meta device (ZeRO-3), before sharding. Parameters are kept
    (same objects unless wrapped for FP8 all-gather), so names, shapes and initialisation are
    unchanged. A disabled ``config`` converts nothing.

    Args:
        module_filter_fn: ``(module, fqn) -> bool``; False keeps that layer in high precision
            (applied after the automatic rules, see :func:`plan_fp8_conversion`).
        fp8_all_gather: wrap the weights so FSDP2 all-gathers them in FP8; ``None`` = when
            ``config.msamp`` is "O1" or "O2" and the recipe has one scale per tensor. Only for
            models FSDP2 will shard (ZeRO stages 1-3): DDP cannot broadcast the wrapper.
        process_group: the data-parallel group the delayed recipe reduces amaxes over
            (None = the default group).
    """
    if not config.enabled:
        return model
    if fp8_all_gather is None:
        fp8_all_gather = config.msamp != "none" and config.recipe != "rowwise"
    plan = plan_fp8_conversion(model, config, module_filter_fn)
    if plan.get("") == CONVERTED and not isinstance(model, Fp8Linear):
        raise ValueError("convert_to_fp8 converts the layers inside a model; wrap a lone nn.Linear in a module first.")
    new_modules: list[Fp8Linear] = []
    for fqn, verdict in plan.items():
        if verdict != CONVERTED:
            continue
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        if isinstance(old, Fp8Linear):
            continue  # converted earlier (e.g. by the user in configure_model)
        new = Fp8Linear.from_linear(old, config, fp8_all_gather=fp8_all_gather)
        setattr(parent, child, new)
        new_modules.append(new)
    if config.recipe == "delayed" and new_modules:
        sync = DelayedScalingSync(config, process_group)
        sync.register(new_modules)
        for m in new_modules:
            m._fp8_sync = sync
    if not any(v == CONVERTED for v in plan.values()):
        from lightning.fabric.utilities.rank_zero import rank_zero_warn

        reasons = sorted(set(plan.values()))[:3]
        rank_zero_warn(
            f"fp8 is enabled but no layer was converted ({len(plan)} nn.Linear layers; reasons: {reasons})."
            " Lower fp8.min_features, set fp8.pad_dims=true, or check fp8.skip_fqns.",
            category=UserWarning,
        )
    return model


@torch.no_grad()
def fp8_device_note(config: Fp8Config, device: torch.device) -> Optional[str]:
    """A warning for FP8 on a device without FP8 matrix units (None where there is nothing to say).

    Measured with ampzero-train on this project's 2-core CPU machine (``precision=bf16-mixed
    trainer.max_steps=60``, fp8=tensorwise against fp8=none, one after the other): 14,060 against
    15,090 tokens/s. The figure of an earlier CPU path (165 against 23,000) stayed in this note after
    that path was made as fast as bf16 (docs/fp8.md), and a trial read "about 140x slower" at 0.93x.
    """
    if not config.enabled or device.type != "cpu":
        return None
    return (
        "FP8 on CPU runs the torch path (each GEMM on the dequantised FP8 operands in fp32): the same numerics"
        " as a GPU's FP8 GEMM, and no speed-up (measured: about 0.93x the tokens/s of bf16-mixed on the default"
        " model). FP8 is for GPUs with FP8 matrix units (compute capability 8.9+); on CPU use it to check numerics."
    )


def convert_from_fp8(model: nn.Module) -> nn.Module:
    """Replace every :class:`Fp8Linear` by a plain ``nn.Linear`` with the same parameters, in place (export).

    The FP8 scaling state is dropped; the weights are the high-precision masters. For a model
    sharded by ZeRO, export its consolidated state dict instead and load it (after
    :func:`strip_fp8_state`) into the plain model.
    """
    for fqn, module in list(model.named_modules()):
        if not isinstance(module, Fp8Linear) or not fqn:
            continue
        parent_name, _, child = fqn.rpartition(".")
        with torch.device("meta"):
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        weight = unwrap_all_gather_weight(module.weight.data)
        plain.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
        plain.bias = module.bias
        plain.train(module.training)
        setattr(model.get_submodule(parent_name), child, plain)
    return model


def strip_fp8_state(state_dict: dict) -> dict:
    """``state_dict`` without the FP8 scaling buffers, so it loads into the ``nn.Linear`` model."""
    return {k: v for k, v in state_dict.items() if not k.endswith(FP8_STATE_SUFFIXES)}
