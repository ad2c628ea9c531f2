"""FP8 training without Transformer Engine or MS-AMP: Fp8Linear, scaling recipes, FP8 all-gather and optimizer states.

Usage, with the strategy (it converts the model before sharding; see docs/fp8.md)::

    AmpZeroStrategy(stage=3, fp8=Fp8Config(recipe="delayed"))        # + Trainer(precision="bf16-mixed")

or by hand, on any model::

    convert_to_fp8(model, Fp8Config(recipe="tensorwise"), module_filter_fn=lambda m, fqn: "head" not in fqn)

Module map: ``config`` (Fp8Config lives in lightning_ampzero.config, the one schema),
``linear`` (Fp8Linear and its autograd function), ``scaling`` (recipes, delayed-scaling state),
``convert`` (conversion, export), ``fsdp`` (FP8 all-gather under FSDP2), ``optim`` (O2 Adam
states), ``kernels`` (Triton on CUDA, torch elsewhere).
"""

from lightning_ampzero.config import Fp8Config
from lightning_ampzero.fp8.convert import convert_from_fp8, convert_to_fp8, plan_fp8_conversion, strip_fp8_state
from lightning_ampzero.fp8.fsdp import Fp8AllGatherWeight, Fp8GatheredWeight
from lightning_ampzero.fp8.linear import Fp8Linear
from lightning_ampzero.fp8.optim import Fp8AdamW, fp8_optimizers, optimizer_state_bytes
from lightning_ampzero.fp8.scaling import DelayedScalingSync

__all__ = [
    "DelayedScalingSync",
    "Fp8AdamW",
    "Fp8AllGatherWeight",
    "Fp8Config",
    "Fp8GatheredWeight",
    "Fp8Linear",
    "convert_from_fp8",
    "convert_to_fp8",
    "fp8_optimizers",
    "optimizer_state_bytes",
    "plan_fp8_conversion",
    "strip_fp8_state",
]
