"""``adam_implementation(params)``: the fastest torch Adam(W) implementation for where the parameters live.

torch's ``fused`` Adam(W) updates each tensor in one vectorized pass (kernels for CPU and CUDA);
``foreach`` runs a dozen whole-list ops, each a pass over memory. Under ZeRO every rank steps
many small shards (DTensors whose local pieces are separate tensors), where that difference is
largest: AdamW over the benchmark GPT's 53 parameter shards (3.3M elements, one CPU thread)
takes 4.0 ms fused against 16.2 ms foreach, and 9.5 ms foreach over one flat buffer (the layout
DeepSpeed's ZeRO optimizer steps). The update rule is the same; only the order of rounding
inside an element's update may differ from ``foreach``, as between any two torch implementations.
"""

from __future__ import annotations

from typing import Any, Iterable

# Devices with torch fused Adam/AdamW kernels that this package targets.
_FUSED_DEVICES = frozenset({"cpu", "cuda"})


def adam_implementation(params: Iterable[Any]) -> dict[str, bool]:
    """``{"fused": True}`` when every parameter is on a device with fused kernels, else ``{"foreach": True}``.

    ``params``: tensors or param-group dicts, as given to the optimizer.
    """
    devices = set()
    for item in params:
        tensors = item["params"] if isinstance(item, dict) else [item]
        devices.update(t.device.type for t in tensors)
    return {"fused": True} if devices and devices <= _FUSED_DEVICES else {"foreach": True}
