"""AmpZeroPrecision: the Lightning Precision plugin of the ``ampzero`` strategy.

It owns what changes numerics around the step: autocast, module conversion, loss scaling
and unscale -> clip -> step -> update. The strategy owns sharding. Clipping is done here
because Lightning routes ``gradient_clip_val`` through the precision plugin; it uses the
sharding-aware global norm (lightning_ampzero.zero.clip).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Union

import torch
from torch.optim import Optimizer

from lightning.pytorch.plugins.precision import Precision

from lightning_ampzero.config import PRECISIONS, PrecisionConfig
from lightning_ampzero.zero.clip import clip_grad_norm_, clip_grad_value_

SUPPORTED = ("32-true",)


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


class AmpZeroPrecision(Precision):
    def __init__(self, precision: str = "32-true", config: Optional[PrecisionConfig] = None) -> None:
        super().__init__()
        self.config = config or PrecisionConfig()
        precision = self.config.precision or precision
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is not valid. Allowed values: {', '.join(PRECISIONS)}.")
        if precision not in SUPPORTED:
            raise ValueError(
                f"precision={precision!r} is not available with strategy 'ampzero' yet; supported:"
                f" {', '.join(SUPPORTED)}."
            )
        self.precision = precision

    @classmethod
    def from_lightning(cls, plugin: Precision, config: Optional[PrecisionConfig] = None) -> "AmpZeroPrecision":
        return cls(precision_string(plugin), config)

    @property
    def mp_policy(self) -> Any:
        """The FSDP2 MixedPrecisionPolicy for this precision (None = parameters' own dtype)."""
        return None

    @staticmethod
    def _params(optimizer: Optimizer) -> Iterator[torch.Tensor]:
        for group in optimizer.param_groups:
            yield from group["params"]

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        clip_grad_norm_(list(self._params(optimizer)), float(clip_val))

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        clip_grad_value_(list(self._params(optimizer)), float(clip_val))
