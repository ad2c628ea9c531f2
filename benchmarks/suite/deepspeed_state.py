"""DeepSpeed's model-state bytes per rank, read from the tensors its engine holds.

DeepSpeed keeps its state in attributes of the ZeRO optimizer object (flat fp32 partitions,
gradient partitions, reduction buckets) and in the module's parameters (stage 3: the
partition in ``param.ds_tensor``; the full ``param.data`` is empty unless gathered). There
is no public accounting, so we walk the objects: the engine's ZeRO optimizer (its attributes,
lists and dicts, recursively, DeepSpeed and torch.optim objects only), the wrapped torch
optimizer's ``state``, and the module's parameters with their ``.grad`` and ``ds_tensor``.
Each storage is counted once (views share one) and a storage of 0 bytes (a freed or
released buffer) counts nothing, as in ``lightning_ampzero.memory``.

Categories, matching the formula's columns (``lightning_ampzero.memory.as_zero_categories``):

* ``params``: the parameters the module computes with (full under stages 0-2, the
  ``ds_tensor`` partition under stage 3, plus anything gathered at the sampling point);
* ``grads``: gradient tensors (``.grad`` of parameters and of the fp32 partitions, DeepSpeed's
  gradient partitions and accumulators);
* ``optimizer``: the fp32 master partition(s) and the torch optimizer's state;
* ``buffers``: gradient reduction buckets (``ipg_buckets``). They are
  allocated with ``torch.empty(reduce_bucket_size)``: their size is virtual (pages never
  written are not resident), so they are reported apart and left out of the total.

Every counted tensor is listed by attribute path in ``paths`` so the classification can be
checked.
"""

from __future__ import annotations

import re
from typing import Any

import torch

_MASTER = re.compile(r"fp32|single_partition|master", re.I)
_GRAD = re.compile(r"grad", re.I)
_BUFFER = re.compile(r"ipg|bucket", re.I)


def _walk(obj: Any, path: str, out: list[tuple[str, torch.Tensor]], seen: set[int], depth: int) -> None:
    if depth > 6 or id(obj) in seen:
        return
    if isinstance(obj, torch.Tensor):
        seen.add(id(obj))
        out.append((path, obj))
        grad = getattr(obj, "grad", None) if obj.is_leaf else None
        if isinstance(grad, torch.Tensor):
            out.append((path + ".grad", grad))
        return
    seen.add(id(obj))
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{path}[{i}]", out, seen, depth + 1)
    elif isinstance(obj, dict):
        for k, v in list(obj.items()):
            _walk(v, f"{path}[{k if isinstance(k, (str, int)) else type(k).__name__}]", out, seen, depth + 1)
    elif type(obj).__module__.startswith(("deepspeed", "torch.optim")) and hasattr(obj, "__dict__"):
        if isinstance(obj, torch.nn.Module):
            return  # the module is walked through its parameters below
        for k, v in list(vars(obj).items()):
            if k in ("param_names", "module", "engine", "parameter_offload"):
                continue
            _walk(v, f"{path}.{k}", out, seen, depth + 1)


def _category(path: str) -> str:
    if path.startswith("module."):
        return "grads" if path.endswith(".grad") else "params"
    if ".optimizer.state" in path or ".optimizer.param_groups" in path:
        return "optimizer"  # the torch optimizer's state, and the fp32 partitions it updates
    if _BUFFER.search(path):
        return "buffers"
    if _GRAD.search(path):
        return "grads"
    if _MASTER.search(path):
        return "optimizer"
    return "other"


def measure_deepspeed(engine: Any) -> tuple[dict[str, int], dict[str, int]]:
    """(bytes per category, bytes per attribute path) held now on this rank by ``engine``."""
    tensors: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for name, p in engine.module.named_parameters():
        ds = getattr(p, "ds_tensor", None)
        if ds is not None:
            tensors.append((f"module.{name}.ds_tensor", ds))
        tensors.append((f"module.{name}", p))
        if p.grad is not None:
            tensors.append((f"module.{name}.grad", p.grad))
        seen.add(id(p))
    _walk(engine.optimizer, "zero", tensors, seen, 0)
    counted: set[int] = set()
    cats = {"params": 0, "grads": 0, "optimizer": 0, "buffers": 0, "other": 0}
    paths: dict[str, int] = {}
    for path, t in tensors:
        if t.device.type == "meta":
            continue
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if storage.nbytes() == 0 or storage.data_ptr() in counted:
            continue
        counted.add(storage.data_ptr())
        cat = _category(path)
        cats[cat] += storage.nbytes()
        key = re.sub(r"\[\d+\]", "[i]", path)
        key = re.sub(r"^module\..*?(\.ds_tensor|\.grad)?$", lambda m: "module.<param>" + (m.group(1) or ""), key)
        paths[f"{cat}:{key}"] = paths.get(f"{cat}:{key}", 0) + storage.nbytes()
    return cats, paths
