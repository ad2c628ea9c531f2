"""Where the checkpointed inputs live between forward and backward: CPU memory, a reused buffer pool.

Non-reentrant ``torch.utils.checkpoint`` keeps exactly one thing per checkpointed block alive
until backward: the block's inputs (everything the block computes is recomputed). It saves
them through the saved-tensor hooks that are active when ``checkpoint`` is *called* (its own
hooks, installed inside, take over for the tensors saved in the block). So installing
:class:`SavedInputsHooks` around the call moves exactly the checkpoints, nothing else:

* ``cpu_checkpointing`` (ZeRO-R): each checkpoint is copied to host memory. On CUDA the copy is
  asynchronous, on a side stream, into pinned memory, so it overlaps the next block's compute;
  the device copy is freed once the copy has finished (``record_stream``). Backward copies it
  back on the compute stream. On a CPU device the copy is a copy within host memory: the
  mechanics run, nothing is saved.
* ``contiguous_memory_optimization``: the copies go into slots of one preallocated arena per
  (shape, dtype, device) instead of fresh allocations every step (DeepSpeed's contiguous
  checkpoint buffer: no fragmentation from thousands of short-lived activation blocks). A slot
  is returned when autograd frees the saved input, i.e. after the block's backward.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor


@dataclass
class PoolStats:
    arenas: int = 0
    arena_bytes: int = 0
    acquired: int = 0
    reused: int = 0
    overflow: int = 0  # requests beyond an arena's capacity, served by a fresh allocation


class _Arena:
    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, pin: bool, capacity: int) -> None:
        self.flat = torch.empty(numel * capacity, dtype=dtype, device=device, pin_memory=pin)
        self.numel = numel
        self.free = list(range(capacity - 1, -1, -1))
        self.used_once: set[int] = set()

    def slot(self, i: int) -> Tensor:
        return self.flat[i * self.numel : (i + 1) * self.numel]


class _Lease:
    """A slot of an arena; returned to it when the saved input holding it is freed."""

    __slots__ = ("pool", "arena", "index", "__weakref__")

    def __init__(self, pool: "BufferPool", arena: _Arena, index: int) -> None:
        self.pool, self.arena, self.index = pool, arena, index

    def __del__(self) -> None:
        with self.pool._lock:
            self.arena.free.append(self.index)


class BufferPool:
    """Arenas of ``capacity`` equally sized slots, one per (numel, dtype, device, pinned)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"BufferPool capacity must be >= 1, got {capacity}.")
        self.capacity = capacity
        self.stats = PoolStats()
        self._arenas: dict[tuple, _Arena] = {}
        self._lock = threading.Lock()

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device, pin: bool) -> tuple[Tensor, Optional[_Lease]]:
        key = (numel, dtype, device, pin)
        with self._lock:
            arena = self._arenas.get(key)
            if arena is None:
                arena = self._arenas[key] = _Arena(numel, dtype, device, pin, self.capacity)
                self.stats.arenas += 1
                self.stats.arena_bytes += arena.flat.untyped_storage().nbytes()
            self.stats.acquired += 1
            if not arena.free:
                self.stats.overflow += 1
                return torch.empty(numel, dtype=dtype, device=device, pin_memory=pin), None
            index = arena.free.pop()
            if index in arena.used_once:
                self.stats.reused += 1
            arena.used_once.add(index)
        return arena.slot(index), _Lease(self, arena, index)


@dataclass
class _Packed:
    data: Tensor
    shape: torch.Size
    device: torch.device
    event: Any = None
    lease: Optional[_Lease] = None


@dataclass
class SavedStats:
    packed: int = 0  # checkpoints copied (cumulative)
    packed_bytes: int = 0
    bytes_by_device: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # where the copies went


class SavedInputsHooks:
    """Saved-tensor hooks for the inputs of a checkpointed block (see the module docstring).

    Args:
        cpu: copy the checkpoints to host memory.
        pool: a :class:`BufferPool` to copy them into (``contiguous_memory_optimization``), or None.
        pin_memory: pin the host copies; applied only when the source is on CUDA (pinning fails
            on a machine without an accelerator, and is pointless for a host-to-host copy).
    """

    def __init__(self, *, cpu: bool, pool: Optional[BufferPool], pin_memory: bool = True) -> None:
        self.cpu = cpu
        self.pool = pool
        self.pin_memory = pin_memory
        self.stats = SavedStats()
        self._streams: dict[torch.device, Any] = {}

    def context(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def _side_stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def pack(self, t: Tensor) -> Any:
        if not t.is_floating_point() or t.numel() == 0:
            return t
        target = torch.device("cpu") if self.cpu else t.device
        pin = self.pin_memory and self.cpu and t.is_cuda
        if self.pool is not None:
            buf, lease = self.pool.acquire(t.numel(), t.dtype, target, pin)
        else:
            buf, lease = torch.empty(t.numel(), dtype=t.dtype, device=target, pin_memory=pin), None
        buf = buf.view(t.shape)
        event = None
        if t.is_cuda and target.type == "cpu":
            # [Note: async checkpoint copy] the copy runs on a side stream after the producer of t,
            # overlapping the next block; record_stream keeps t's memory from being reused by the
            # compute stream before the copy has read it. unpack waits for the event.
            stream = self._side_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                buf.copy_(t.detach(), non_blocking=pin)
                t.record_stream(stream)
                event = torch.cuda.Event()
                event.record(stream)
        else:
            buf.copy_(t.detach())
        self.stats.packed += 1
        nbytes = buf.numel() * buf.element_size()
        self.stats.packed_bytes += nbytes
        self.stats.bytes_by_device[buf.device.type] += nbytes
        return _Packed(buf, t.shape, t.device, event, lease)

    def unpack(self, packed: Any) -> Tensor:
        if not isinstance(packed, _Packed):
            return packed
        if packed.event is not None:
            torch.cuda.current_stream(packed.device).wait_event(packed.event)
        if packed.data.device != packed.device:
            return packed.data.to(packed.device, non_blocking=packed.data.is_pinned())
        return packed.data
