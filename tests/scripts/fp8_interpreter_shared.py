"""What tests/scripts/fp8_interpreter.py shares with the in-process tests of tests/test_fp8_kernels.py.

No triton import here: the pytest process imports this module, and the interpreter script must
be the only process that sets ``TRITON_INTERPRET`` (see its docstring).
"""

from __future__ import annotations

from typing import Any

import torch

#: (recipe, where the NaN is) for every recipe: a NaN in the input reaches the forward casts, one
#: in the output gradient only the backward casts.
CASES = [(recipe, where) for recipe in ("tensorwise", "delayed", "rowwise") for where in ("input", "grad")]


def differences(a: torch.Tensor, b: torch.Tensor) -> str:
    """'' when ``a`` and ``b`` agree (dtype, shape, strides, NaN positions, bits elsewhere), else what differs."""
    # The stride of a dimension of size 1 is arbitrary (torch.empty and .contiguous() differ there).
    strides_a, strides_b = ([st for st, n in zip(t.stride(), t.shape) if n > 1] for t in (a, b))
    if a.dtype != b.dtype or a.shape != b.shape or strides_a != strides_b:
        return f"layout {a.dtype}{tuple(a.shape)}{a.stride()} vs {b.dtype}{tuple(b.shape)}{b.stride()}"
    nan_a, nan_b = a.float().isnan(), b.float().isnan()
    if not torch.equal(nan_a, nan_b):
        return f"NaN at {int(nan_a.sum())} vs {int(nan_b.sum())} positions"
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    ba, bb = a.contiguous().view(bits)[~nan_a], b.contiguous().view(bits)[~nan_b]
    wrong = (ba != bb).nonzero().flatten()
    if len(wrong):
        i = int(wrong[0])
        return (f"{len(wrong)} of {ba.numel()} elements differ, e.g. {a.float()[~nan_a][i].item()!r} vs"
                f" {b.float()[~nan_b][i].item()!r}")
    return ""



def nan_reaches_scaler(recipe: str, where: str) -> dict[str, Any]:
    """One step of an Fp8Linear with a NaN in its input or output gradient, under a DynamicLossScaler.

    Without NaN propagation in the casts, a NaN would be quantized to a finite value (-448) and
    the step taken with garbage gradients; the scaler must see it and skip the step.
    """
    from lightning_ampzero.config import Fp8Config
    from lightning_ampzero.fp8 import Fp8Linear
    from lightning_ampzero.precision.scaler import DynamicLossScaler

    torch.manual_seed(0)
    # No bias: its gradient is computed in high precision and would carry a NaN to the scaler by
    # itself; without it every route to the gradients goes through the FP8 casts.
    layer = Fp8Linear(32, 32, bias=False, config=Fp8Config(recipe=recipe, min_features=0))
    before = layer.weight.detach().clone()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = DynamicLossScaler()
    x = torch.randn(16, 32)
    grad = torch.ones(16, 32)
    (x if where == "input" else grad)[3, 5] = float("nan")
    y = layer(x)
    forward_finite = bool(y.isfinite().all())
    scaler.scale(y).backward(grad)
    scaler.step(opt)
    found = scaler.found_inf(opt)
    scaler.update()
    return {"found_inf": found, "forward_finite": forward_finite, "skipped": scaler.stats()["skipped_steps"],
            "weight_unchanged": bool(torch.equal(layer.weight.detach(), before))}
