"""Which dtype each part of a step runs in, for each precision: one table for the plugin, FSDP2 and DDP.

See docs/precision.md for the user-facing version of this table.

[Note: master weights]
Every precision keeps the parameters the optimizer sees in fp32 ("master weights"), held by the
model itself, so checkpoints, optimizer state and ``named_parameters()`` are the same objects in
every precision and at every stage. "-true" precisions make a low-precision *compute copy* per
forward: under stages 1-3 that is FSDP2's ``MixedPrecisionPolicy(param_dtype=low)`` (the sharded
fp32 DTensor is the master; the all-gather casts the shard and gathers it in the low dtype; the
reduce-scattered gradient is cast back to fp32 into the sharded ``.grad``), under stage 0 the
same casts done by ``lightning_ampzero.precision.ddp.cast_parameters_in_forward``. So the
optimizer updates fp32 shards (stages 1-2: ZeRO's "fp32 master weights kept sharded by the
optimizer"), gradients are computed in the low dtype and reduced in ``reduce_dtype``, as in
DeepSpeed's fp16/bf16 modes, with no second copy of the weights kept between steps.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from lightning_ampzero.config import DEFAULT_SAFE_MODULES, PrecisionConfig

LOW_DTYPES: dict[str, Optional[torch.dtype]] = {
    "32-true": None,
    "16-mixed": torch.float16,
    "bf16-mixed": torch.bfloat16,
    "16-true": torch.float16,
    "bf16-true": torch.bfloat16,
}
COMM_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class DtypePlan:
    """The dtypes of one precision + config.

    Attributes:
        precision: the Lightning precision string.
        low_dtype: float16 / bfloat16, or None for "32-true".
        autocast: "-mixed": forward runs under ``torch.autocast(low_dtype)``, parameters stay fp32.
        low_params: "-true": parameters are cast to ``low_dtype`` for forward and backward.
        reduce_dtype: gradient reduction of every parameter not in a safe module.
        safe_reduce_dtype: "-mixed" with no ``communication_data_type``: the reduction dtype of
            the ``lower_precision_safe_modules`` (None: no module is treated apart).
        safe_modules: class names of those modules.
        safe_low_on_gloo: whether their gradients go in ``safe_reduce_dtype`` on gloo too (the
            modules were listed); ``lower_precision_safe_modules=None`` sends them in fp32 there
            ([Note: the safe modules' gradients on gloo]).
    """

    precision: str
    low_dtype: Optional[torch.dtype]
    autocast: bool
    low_params: bool
    reduce_dtype: torch.dtype
    safe_reduce_dtype: Optional[torch.dtype]
    safe_modules: tuple[str, ...]
    safe_low_on_gloo: bool = True

    @property
    def fp16(self) -> bool:
        return self.low_dtype == torch.float16


# [Note: the safe modules' gradients on gloo]
# Sending the ``lower_precision_safe_modules``' gradients in bf16/fp16 halves their bytes on the
# wire, at the price of casts: each fp32 gradient is cast down (after a division by the world size),
# summed in the low dtype (on CPU element by element through fp32) and cast back into the fp32
# shard. Across a network (NCCL between GPUs, hosts) the bytes are what costs. On gloo the "wire" of
# ranks on one host is memory, as fast as the casts themselves, and the CPU that casts is the one
# that computes. The CPU suite's bf16-mixed GPT, fp32 wire against bf16, 5 repetitions side by side:
# stage 0 0.947x the step time (DDP's comm hook casts in Python), stages 1-3 1.00 / 1.03 / 0.98x
# (no difference resolved), and the fp32 wire reduces as Lightning's ``ddp`` does, bit for bit.
# So with the default ``lower_precision_safe_modules=None`` the safe modules' gradients go in fp32
# on gloo, with the rest of their unit's; at stage 3 their weights still gather in the low dtype
# there (autocast computes on the same bits; that halving measured a win). Naming the modules (the
# default's four included) keeps the low wire on every backend, for DeepSpeed's torch_autocast
# semantics or a multi-host gloo job.
def dtype_plan(precision: str, config: PrecisionConfig) -> DtypePlan:
    low = LOW_DTYPES[precision]
    autocast = precision.endswith("-mixed")
    low_params = precision in ("16-true", "bf16-true")
    comm = COMM_DTYPES[config.communication_data_type] if config.communication_data_type else None
    listed = config.lower_precision_safe_modules
    named = DEFAULT_SAFE_MODULES if listed is None else listed
    if comm is not None:
        reduce_dtype, safe = comm, None
    elif low_params:
        reduce_dtype, safe = low, None  # type: ignore[assignment]
    else:
        reduce_dtype, safe = torch.float32, (low if autocast and named else None)
    return DtypePlan(
        precision=precision,
        low_dtype=low,
        autocast=autocast,
        low_params=low_params,
        reduce_dtype=reduce_dtype,  # type: ignore[arg-type]
        safe_reduce_dtype=safe,
        safe_modules=tuple(named) if safe is not None else (),
        safe_low_on_gloo=listed is not None,
    )


def _named_class(cls: type, class_names: tuple[str, ...]) -> bool:
    """Whether ``cls`` is what one of ``class_names`` names: exactly (no subclass), and a name that
    ``torch.nn`` defines names torch's class only ([Note: another library's Linear])."""
    if cls.__name__ not in class_names:
        return False
    own = getattr(nn, cls.__name__, None)
    return not isinstance(own, type) or cls is own


# [Note: another library's Linear]
# peft's LoRA layer is a class named ``Linear`` (peft.tuners.lora.layer.Linear) that holds the
# frozen ``base_layer`` and the adapters ``lora_A`` / ``lora_B``, all three torch Linears. Matched
# by name, it was a safe module itself: at stage 3 its inputs were cast to bf16 once at its entry
# (``cast_inputs_to``), so the gradients of the base and adapter paths were summed in bf16 before
# the cast back, where autocast (ddp, stages 0-2) casts the input per Linear and sums them in fp32.
# A new-user trial (a Llama with LoRA on q_proj / v_proj, bf16-mixed, AdamW): the adapters were
# 8.6e-3 from ddp's after 4 steps at stage 3, 0.0 at stage 2. The safe modules are meant as
# torch's, DeepSpeed's torch_autocast lists torch.nn.Linear and its kin, so a name torch.nn
# defines now names torch's class: the three Linears inside peft's layer are the safe modules,
# each casting its own input as autocast does. Names torch.nn does not define (a user's own
# class) still match by name.
def safe_modules(model: nn.Module, class_names: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """Modules whose class ``class_names`` names (:func:`_named_class`), that own parameters.

    Exact names on purpose: some Linear subclasses are used by their parent through their
    parameters, never called (``nn.MultiheadAttention.out_proj``), and a module that is never
    called would never have its FSDP2 unit gathered. A module whose parameters are shared with
    a module outside it (tied weights) is left to its block as well, and so is one that
    torch.nn.utils' hook-based ``weight_norm`` / ``spectral_norm`` reparametrizes: their forward
    pre-hook computes the weight from the parameters outside autocast (``spectral_norm`` mixed
    the bf16-gathered weight with its fp32 vectors and stopped at stage 3, and ``weight_norm``
    silently normalized bf16 copies: a new-user trial). Only those hooks: the strategy's own
    hooks on these modules must not change the choice when it is made again (a second fit).
    """
    if not class_names:
        return []
    chosen = [(n, m) for n, m in model.named_modules() if _named_class(type(m), class_names) and m is not model
              and any(True for _ in m.parameters()) and not _reparametrized_by_hook(m)]
    inside = {id(sub) for _, m in chosen for sub in m.modules()}
    outside_params = {id(p) for m in model.modules() if id(m) not in inside for p in m.parameters(recurse=False)}
    return [(n, m) for n, m in chosen if not any(id(p) in outside_params for p in m.parameters())]


def _reparametrized_by_hook(module: nn.Module) -> bool:
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    return any(isinstance(hook, (WeightNorm, SpectralNorm)) for hook in module._forward_pre_hooks.values())


def fsdp_policies(plan: DtypePlan, model: nn.Module, stage: int) -> tuple[object, dict[nn.Module, object]]:
    """FSDP2 policies: the one of every unit, and those of the modules whose gradients reduce apart.

    "-true": every unit gathers parameters in the low dtype and reduces in ``reduce_dtype``.
    "-mixed": parameters stay fp32 (autocast casts per op); the safe modules reduce in the low
    dtype. Under stage 3 they also all-gather in it (autocast would cast their weights to it
    anyway, so the forward is unchanged; the gather moves half the bytes): a
    :class:`~lightning_ampzero.zero.comm.CommDtypePolicy` with ``gather_dtype``, a group of their
    own, or on gloo their parameters inside their unit's group. Below stage 3 they get a :class:`~lightning_ampzero.zero.comm.CommDtypePolicy`:
    gradients kept and accumulated in fp32, sent in the low dtype. How that is sent (in the unit's
    own group on gloo, in a group of their own elsewhere) depends on the mesh and is decided by
    ``apply_zero`` (``_wire_dtypes``).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype = plan.low_dtype if plan.low_params else None
    reduce_dtype = None if plan.reduce_dtype == (param_dtype or torch.float32) else plan.reduce_dtype
    root = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if plan.safe_reduce_dtype is None:
        return root, {}
    from lightning_ampzero.zero.comm import HAS_CUSTOM_REDUCE_SCATTER, CommDtypePolicy

    # Inputs of a safe module (a Linear) are cast to its gathered dtype: what autocast does to
    # them anyway, and no dtype mismatch if it is called outside autocast.
    if stage < 3 and HAS_CUSTOM_REDUCE_SCATTER:
        # Accumulate in fp32 between micro-batches, send in the low dtype: see
        # [Note: stage 1 accumulation dtype] in zero/comm.py.
        safe: MixedPrecisionPolicy = CommDtypePolicy(cast_forward_inputs=True, comm_dtype=plan.safe_reduce_dtype,
                                                     low_on_gloo=plan.safe_low_on_gloo)
    elif HAS_CUSTOM_REDUCE_SCATTER:
        # Gathered and sent in the low dtype, in a group of their own or (gloo) inside their unit's:
        # [Note: safe modules gathered in the low dtype inside their unit's group] in zero/comm.py.
        safe = CommDtypePolicy(param_dtype=plan.low_dtype, reduce_dtype=plan.safe_reduce_dtype, cast_forward_inputs=True,
                               comm_dtype=plan.safe_reduce_dtype, gather_dtype=plan.low_dtype,
                               low_on_gloo=plan.safe_low_on_gloo)
    else:
        safe = MixedPrecisionPolicy(
            param_dtype=plan.low_dtype if stage == 3 else None,
            reduce_dtype=plan.safe_reduce_dtype,
            cast_forward_inputs=True,
        )
    return root, {m: safe for _, m in safe_modules(model, plan.safe_modules)}


def ddp_reduce_dtypes(plan: DtypePlan, model: nn.Module, *, gloo: bool = False) -> dict[int, torch.dtype]:
    """Stage 0: ``id(parameter) -> reduction dtype`` for every parameter not reduced in fp32.

    ``gloo``: the process group's backend is gloo ([Note: the safe modules' gradients on gloo])."""
    out: dict[int, torch.dtype] = {}
    if plan.reduce_dtype != torch.float32:
        out.update({id(p): plan.reduce_dtype for p in model.parameters()})
    if plan.safe_reduce_dtype is not None and (plan.safe_low_on_gloo or not gloo):
        for _, m in safe_modules(model, plan.safe_modules):
            out.update({id(p): plan.safe_reduce_dtype for p in m.parameters()})
    return out


def check_device_support(precision: str, device_type: str) -> None:
    """Refuse a low dtype the device cannot compute in, before any step runs."""
    low = LOW_DTYPES[precision]
    if low is None or device_type == "meta":
        return
    name = "float16" if low == torch.float16 else "bfloat16"
    if precision.endswith("-mixed"):
        if not torch.amp.is_autocast_available(device_type):
            raise ValueError(f"precision={precision!r} needs torch.autocast, which has no {device_type!r} backend.")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            enabled = torch.autocast(device_type, dtype=low)._enabled
        if not enabled:
            why = f" (torch: {caught[0].message})" if caught else ""
            raise ValueError(
                f"precision={precision!r} needs torch.autocast with {name} on {device_type!r}, which this torch"
                f" build does not support{why}. Choose another precision ('bf16-mixed', '32-true') or device."
            )
    if device_type == "cuda" and low == torch.bfloat16 and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"precision={precision!r} needs bfloat16, which this GPU does not support (compute capability"
            " 8.0+). Use precision='16-mixed' (float16 with loss scaling) instead."
        )


def fp16_cpu_note(precision: str, device: torch.device) -> Optional[str]:
    """A warning for fp16 on a CPU without fp16 matrix hardware (None where there is nothing to say).

    Lightning's ``ddp`` trains ``16-mixed`` on CPU in bf16 ([Note: 16-mixed on CPU] in plugin.py);
    ampzero keeps fp16, and where oneDNN has no fp16 kernels torch multiplies fp16 matrices on a
    reference path. Measured on this project's 2-core AMD EPYC (AVX-512 with BF16, no AVX512-FP16 or
    AMX-FP16): a 256x256 by 256x1024 product takes 2.0 ms in fp32, 0.7 ms in bf16 and 115 ms in fp16,
    and a new-user trial's ``ampzero-train strategy=zero3 precision=16-mixed`` (the README's
    example) ran at 586 tokens/s against 5,306 in 32-true: over ten minutes for the default job.
    """
    if device.type != "cpu" or LOW_DTYPES.get(precision) != torch.float16:
        return None
    try:
        if torch.ops.mkldnn._is_mkldnn_fp16_supported():
            return None
    except (AttributeError, RuntimeError):  # a build without oneDNN cannot tell: say nothing rather than guess
        return None
    return (
        f"precision={precision!r} on a CPU without fp16 matrix hardware (oneDNN reports no fp16 support): torch"
        " multiplies fp16 matrices on a slow reference path (measured on a 2-core AVX-512 CPU: a matrix product 58x"
        " slower than in fp32, a 16-mixed ampzero-train job 9x slower than 32-true). Lightning's own strategies train"
        " 16-mixed on CPU in bf16. Use precision='bf16-mixed' for speed on CPU; keep fp16 here to check its"
        " numerics and the loss scaler."
    )


# [Note: a safe module run with autocast off]
# Stage 3 under "-mixed" gathers the lower_precision_safe_modules' weights in the low dtype
# (autocast would cast them to it anyway), so inside ``torch.autocast(enabled=False)``, where a
# model asks for full precision (a router or a final projection kept in fp32), such a Linear
# computed in bf16 where DDP and stages 0-2 compute in fp32, with nothing said (a new-user trial,
# issue 16's note). Its fp32 weight is only this rank's shard there; gathering it in fp32 would be
# a collective no other rank may be making. So the first such call warns (rank 0, once: the ranks
# run the same code), with the way out, pointing at the line that called the module.
SAFE_MODULE_WITHOUT_AUTOCAST = (
    "{name} ({cls}) ran with torch.autocast disabled at ZeRO stage 3 under a '-mixed' precision, on {dtype}"
    " inputs: stage 3 gathers the weights of precision.lower_precision_safe_modules in {low}, so it computed in"
    " {low} where DDP and stages 0-2 compute in {dtype}. To keep it in {dtype}, make it an instance of a subclass"
    " (the list matches exact class names, e.g. `class FullPrecisionLinear(nn.Linear): pass`) or set"
    " precision.lower_precision_safe_modules to a list without '{cls}' (the default stands for Linear, Conv1d,"
    " Conv2d, Conv3d; a list also sends the listed modules' gradients in {low} on gloo). This names the first"
    " such call only; other safe modules run that way are not named."
)


def warn_if_run_without_autocast(module: nn.Module, name: str, low: torch.dtype) -> None:
    """Warn, once and on rank 0, when ``module`` (gathered in ``low``) runs with autocast off on wider inputs."""

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if _warned_without_autocast:
            return
        for arg in (*args, *kwargs.values()):
            if isinstance(arg, torch.Tensor) and arg.is_floating_point():
                if arg.dtype.itemsize > low.itemsize and not torch.is_autocast_enabled(arg.device.type):
                    _warned_without_autocast.append(name)
                    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                        from lightning_ampzero.zero.recover import user_stacklevel

                        warnings.warn(SAFE_MODULE_WITHOUT_AUTOCAST.format(
                            name=name or "the model", cls=type(module).__name__, dtype=arg.dtype, low=low),
                            stacklevel=user_stacklevel())
                return

    module.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True)


_warned_without_autocast: list[str] = []
