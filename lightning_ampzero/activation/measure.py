"""Measure what a forward pass keeps alive for backward, and where (tests, benchmarks).

Mechanism-independent: every storage created by an op during the forward is recorded (a
dispatch mode below autograd sees them all, including the copies made by saved-tensor hooks
and the outputs that selective checkpointing caches); after the forward, those still alive,
other than the outputs themselves, are exactly what the autograd graph holds for backward.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _StorageRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int, str]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # Views and in-place results share an input's storage (e.g. a weight's transpose): not new memory.
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and not t.is_meta}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                s = t.untyped_storage()
                key = s.data_ptr()
                if key in inputs:
                    continue
                seen = self.storages.get(key)
                # A freed storage's address is reused by later allocations: only a live entry is a duplicate.
                if s.nbytes() and (seen is None or seen[0].expired()):
                    self.storages[key] = (StorageWeakRef(s), s.nbytes(), t.device.type)
        return out


@dataclass
class SavedActivations:
    bytes: int = 0
    count: int = 0
    bytes_by_device: dict[str, int] = field(default_factory=dict)


def saved_activations(fn: Callable[[], Any]) -> tuple[Any, SavedActivations]:
    """Run ``fn()`` (a forward returning e.g. the loss); return its result and the bytes of the
    storages created during it that are still alive afterwards, less the result's own."""
    recorder = _StorageRecorder()
    with recorder:
        out = fn()
    exclude = {t.untyped_storage().data_ptr() for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
    by_device: dict[str, int] = defaultdict(int)
    total = count = 0
    for key, (ref, nbytes, device) in recorder.storages.items():
        if key in exclude or ref.expired():
            continue
        total += nbytes
        count += 1
        by_device[device] += nbytes
    return out, SavedActivations(total, count, dict(by_device))


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of ``fn()`` (forward and backward, as ``torch.utils.flop_counter`` counts them: matmuls,
    convolutions, attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()
