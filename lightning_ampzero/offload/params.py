"""ZeRO-Infinity parameter offload: stage-3 parameter shards in swap files, read back per unit.

:func:`apply_param_offload` moves every FSDP2 parameter group's shards of a partitioned model
into one swap file per rank and installs the reads that bring a group's shards back just before
FSDP2 all-gathers them (forward, prefetch, the re-gather of backward), into a pool of
``param_buffer_count`` host buffers of ``param_buffer_size`` elements. That pool, not the model,
bounds the parameter memory a rank holds (DeepSpeed's ``offload_param.buffer_count`` /
``buffer_size``). Used for ``offload_param="nvme"`` (and ``"cpu"`` on a CPU accelerator, on tmpfs:
offload/setup.py), always with the optimizer offloaded (:class:`~lightning_ampzero.offload.OffloadedAdam`),
which reads the parameters from the file and writes the updated ones back to it.

[Note: parameter swapping on FSDP2]
In torch 2.13 an ``FSDPParam`` holds its rank's shard as ``_sharded_param_data`` (flat, padded to
the largest rank's shard) and ``sharded_param._local_tensor`` (a view of its first rows, the data
of the DTensor parameter on the module). FSDP2 reads them in one place: the copy-in of
``FSDPParamGroup.unshard`` (``foreach_all_gather``; on a one-rank mesh, in ``wait_for_unshard``).
So each group's ``unshard`` / ``wait_for_unshard`` is wrapped:

    unshard(group):  buffers <- pread(swap file)      (or already read ahead)
                     shards  -> views of the buffers
                     FSDP2's all-gather (copy-in done: on CUDA, events recorded)
                     shards  -> views of the file's memory map; buffers back to the pool

Between all-gathers every shard is a view of a shared memory map of the swap file, never an
unbacked tensor: whatever reads a parameter outside FSDP2 (``state_dict()``, DCP checkpoints,
a callback) sees the real values, and writes through it (loading a checkpoint) land in the file
(the buffers are then invalidated). Reading through the map costs page faults and resident
file pages, so the hot paths use explicit ``pread``/``pwrite``: the all-gather reads into the
buffers, the optimizer writes its updated tiles straight into the file (:meth:`ParamSwapper.write`).
:meth:`ParamSwapper.remap` drops the pages a checkpoint touched.

[Note: read-ahead] The order in which units are all-gathered is recorded until the first
optimizer step (DeepSpeed traces it the same way); afterwards each all-gather starts background
reads of the units that follow it in that order into the free buffers. A read-ahead never evicts
(an evicted unit would be read twice); a unit needed now evicts the read-ahead units furthest away.
The optimizer step rewrites the file, so it first drops every copy read ahead
(:meth:`ParamSwapper.begin_update`).

[Note: failures of the swap file] The file is preallocated (``posix_fallocate``) so that running
out of space shows at setup. A write that fails anyway (disk full, I/O error), a read that comes
back short, or a file found deleted or truncated (checked with ``fstat`` before every read) makes
the swapper refuse all further use with an :class:`NvmeOffloadError` that names the file: the
parameters since the last checkpoint are not trustworthy, the checkpoint itself is untouched
(checkpoints never point at swap files, so a resume may use another ``nvme_path``).
"""

from __future__ import annotations

import shutil
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_ampzero.offload.store import (
    NvmeOffloadError,
    _human,
    create_swap_file,
    failure_reason,
    in_memory_filesystem,
    pread_all,
    pwrite_all,
    round_up,
    swap_file_problem,
)
from lightning_ampzero.zero.groups import module_param_groups

_ALIGN = 64  # bytes: every shard starts aligned for any dtype's view of the buffer / map
_PAGE = 4096  # bytes: each segment starts on a page (one read per segment, page-aligned)
_ATTR = "_ampzero_param_swapper"


@dataclass(eq=False)
class _Entry:
    """One FSDPParam's place: ``nbytes`` at ``file_offset``, in segment ``segment`` at ``seg_offset``."""

    fsdp_param: Any
    fqn: str
    dtype: torch.dtype
    padded_numel: int
    local_numel: int
    sharded_size: torch.Size
    nbytes: int
    segment: int = 0
    seg_offset: int = 0
    file_offset: int = 0


@dataclass
class _Segment:
    file_offset: int
    nbytes: int


@dataclass(eq=False)
class _Unit:
    """One FSDPParamGroup: its entries packed into segments, one buffer per segment while resident."""

    index: int
    group: Any
    name: str
    world: int
    entries: list[_Entry]
    segments: list[_Segment] = field(default_factory=list)
    buffers: Optional[list[int]] = None  # while read ahead or pinned
    future: Optional[Future] = None  # a read in flight
    pinned: bool = False


def _groups(model: nn.Module) -> list[tuple[str, Any]]:
    """(module name, FSDPParamGroup) for every FSDP2 group under ``model``, each once, in module order."""
    from torch.distributed.fsdp import FSDPModule

    seen: set[int] = set()
    out = []
    for name, m in model.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        for group in module_param_groups(m):
            if id(group) not in seen and group.fsdp_params:
                seen.add(id(group))
                out.append((name or "<root>", group))
    return out


def _group_world(group: Any) -> int:
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    return group._all_gather_process_group.size() if isinstance(group.mesh_info, FSDPMeshInfo) else 1


class ParamSwapper:
    """The swap file, the buffer pool and the hooks of one partitioned model (see the module docstring).

    Built by :func:`apply_param_offload`. ``bytes_read`` / ``bytes_written`` count swap-file I/O;
    ``peak_buffers_in_use`` the most buffers holding data at once.
    """

    def __init__(self, model: nn.Module, root: Path, *, buffer_count: int, buffer_size: int, io_threads: int,
                 pin: bool, rank: int, purpose: str = "offload.offload_param='nvme'") -> None:
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule):
            raise ValueError("apply_param_offload needs the model partitioned by apply_zero (stage 3) first.")
        self.purpose = purpose
        # FSDP2's lazy init re-pads and re-points the shards once (reset_sharded_param); it must see
        # them resident, so it runs now rather than at the first forward.
        model._get_fsdp_state()._lazy_init()
        groups = _groups(model)
        itemsize = max(fp.sharded_param.dtype.itemsize for _, g in groups for fp in g.fsdp_params)
        capacity = int(buffer_size) * itemsize
        self.units: list[_Unit] = []
        self._entries: dict[int, _Entry] = {}
        offset = 0
        for index, (name, group) in enumerate(groups):
            unit = _Unit(index, group, name, _group_world(group), [])
            for fp in group.fsdp_params:
                self._check_param(fp, name)
                data = fp._sharded_param_data
                entry = _Entry(fp, fp._param_fqn or name, data.dtype, data.numel(), fp._sharded_local_tensor.numel(),
                               fp.sharded_size, data.numel() * data.element_size())
                if entry.nbytes > capacity:
                    raise ValueError(
                        f"{purpose}: the shard of parameter {entry.fqn!r} on this rank has {entry.padded_numel:,}"
                        f" elements, more than offload.param_buffer_size={int(buffer_size):,}: a buffer holds whole"
                        f" shards. Set param_buffer_size >= {entry.padded_numel:,} (DeepSpeed's"
                        " offload_param.buffer_size)."
                    )
                # Greedy packing in order: a new segment when the shard does not fit the current one.
                if not unit.segments or round_up(unit.segments[-1].nbytes, _ALIGN) + entry.nbytes > capacity:
                    offset = round_up(offset, _PAGE)
                    unit.segments.append(_Segment(offset, 0))
                seg = unit.segments[-1]
                entry.segment = len(unit.segments) - 1
                entry.seg_offset = round_up(seg.nbytes, _ALIGN)
                entry.file_offset = seg.file_offset + entry.seg_offset
                seg.nbytes = entry.seg_offset + entry.nbytes
                offset = seg.file_offset + seg.nbytes
                unit.entries.append(entry)
                self._entries[id(fp.sharded_param)] = entry
            if len(unit.segments) > buffer_count:
                raise ValueError(
                    f"{purpose}: unit {name!r} needs {len(unit.segments)} buffers of param_buffer_size="
                    f"{int(buffer_size):,} elements at once (its shards on this rank: "
                    f"{_human(sum(s.nbytes for s in unit.segments))}), more than offload.param_buffer_count="
                    f"{buffer_count}. Raise param_buffer_count to >= {len(unit.segments)} or param_buffer_size."
                )
            self.units.append(unit)
        self.file_bytes = round_up(max(offset, 1), _PAGE)
        self.buffer_count = int(buffer_count)
        # No buffer larger than the largest segment: with the default 1e8 elements a small model
        # would otherwise reserve gigabytes it never fills (NvmeStore clamps its tile the same way).
        self.buffer_bytes = max(s.nbytes for u in self.units for s in u.segments)
        self.device = self.units[0].group.device
        self.dir, self.path, self._fd = create_swap_file(root, "params", rank, self.file_bytes, purpose=purpose,
                                                         what="this rank's parameter shards")
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        # offload_param="cpu" on a CPU accelerator swaps to /dev/shm: that file is host memory too
        self.file_in_memory = in_memory_filesystem(self.dir)
        self._broken: Optional[str] = None
        self._unlinked = False
        self.bytes_read = 0
        self.bytes_written = 0
        self.peak_buffers_in_use = 0
        self._lock = threading.Lock()
        with torch.no_grad():
            for unit in self.units:
                for entry in unit.entries:
                    self._pwrite(entry.fsdp_param._sharded_param_data.reshape(-1), entry.file_offset, "writing")
        self._map = self._new_map()
        for unit in self.units:
            self._point_at_map(unit)
        self._pin = bool(pin and self.device.type == "cuda")
        # Untouched until read into: resident memory is what the reads fill, at most the pool.
        self.buffers = [torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=self._pin)
                        for _ in range(self.buffer_count)]
        self._events: list[list[Any]] = [[] for _ in self.buffers]
        self._free = list(range(self.buffer_count))
        self._ahead: list[_Unit] = []  # units read ahead (in flight or done), in the order issued
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="ampzero-params")
        self._trace: list[int] = []
        self._recording = True
        self._cursor = 0
        for unit in self.units:
            self._wrap(unit)
        setattr(model, _ATTR, self)

    # ---- setup helpers ---------------------------------------------------------------------------
    def _check_param(self, fp: Any, unit: str) -> None:
        local, data = fp._sharded_local_tensor, fp._sharded_param_data
        if type(local) is not torch.Tensor or type(data) is not torch.Tensor:
            raise ValueError(
                f"{self.purpose}: parameter {fp._param_fqn!r} (unit {unit!r}) is sharded as a"
                f" {type(local).__name__} (an FSDP2 all-gather extension, e.g. fp8.msamp's FP8 all-gather), which"
                " parameter swapping does not support. Set fp8.msamp='none' or offload_param='none'."
            )
        if data.device.type != "cpu":
            raise ValueError(
                f"{self.purpose}: parameter {fp._param_fqn!r} is sharded on {data.device}; swapped shards live in"
                " host buffers, so the groups need FSDP2's CPUOffloadPolicy (the strategy sets it)."
            )

    def _new_map(self) -> Tensor:
        return torch.from_file(str(self._reachable_path()), shared=True, size=self.file_bytes, dtype=torch.uint8)

    def _reachable_path(self) -> Path:
        """The swap file's name, or after :meth:`unlink` the open descriptor's entry in /proc (Linux).

        A consolidated export after ``fit`` (which unlinks the file) remaps at its end: by the removed
        name that stopped with torch's "unable to open file" after the export had been written (a
        new-user trial).
        """
        return Path(f"/proc/self/fd/{self._fd}") if self._unlinked else self.path

    @staticmethod
    def _point(entry: _Entry, raw: Tensor) -> None:
        """Make the FSDPParam's shard tensors views of ``raw`` (exactly ``entry.nbytes`` bytes)."""
        data = raw.view(entry.dtype)
        fp = entry.fsdp_param
        fp._sharded_param_data = data
        fp.sharded_param._local_tensor = data[: entry.local_numel].view(entry.sharded_size)

    def _point_at_map(self, unit: _Unit) -> None:
        for e in unit.entries:
            self._point(e, self._map[e.file_offset : e.file_offset + e.nbytes])

    def _point_at_buffers(self, unit: _Unit) -> None:
        assert unit.buffers is not None
        for e in unit.entries:
            self._point(e, self.buffers[unit.buffers[e.segment]][e.seg_offset : e.seg_offset + e.nbytes])

    def _wrap(self, unit: _Unit) -> None:
        group = unit.group
        unshard, wait_for_unshard = group.unshard, group.wait_for_unshard

        def unshard_swapped(async_op: bool = False) -> None:
            if not self._will_read(group):
                return unshard(async_op)
            self._acquire(unit)
            try:
                unshard(async_op)
            finally:
                # A one-rank mesh copies the shards in wait_for_unshard (torch 2.13): keep them till then.
                if unit.world > 1 or group._all_gather_result is None:
                    self._release(unit)

        def wait_swapped() -> None:
            try:
                wait_for_unshard()
            finally:
                if unit.pinned:
                    self._release(unit)

        group.unshard = unshard_swapped
        group.wait_for_unshard = wait_swapped

    @staticmethod
    def _will_read(group: Any) -> bool:
        """Whether FSDP2's ``unshard`` is going to copy the sharded data in (its own early returns, mirrored)."""
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        if group._all_gather_result is not None or not group.is_sharded:
            return False  # gathered, pending, or resharded to the hpZ group (its own copy)
        return group.unshard_in_backward or group._training_state != TrainingState.PRE_BACKWARD

    # ---- raw I/O ---------------------------------------------------------------------------------
    def _pwrite(self, src: Tensor, offset: int, what: str) -> None:
        try:
            n = pwrite_all(self._fd, src, offset)
        except OSError as e:
            raise self._fail(f"{what} parameters", e) from e
        with self._lock:
            self.bytes_written += n

    def _pread(self, dst: Tensor, offset: int) -> None:
        """Fill ``dst`` (contiguous) from the file; raises OSError on a short read (a truncated file)."""
        n = pread_all(self._fd, dst, offset, self.path)
        with self._lock:
            self.bytes_read += n

    def _read_unit(self, unit: _Unit, buffers: list[int]) -> None:
        """Runs on an I/O thread: each segment into its buffer, after the buffer's last reader finished."""
        for seg, b in zip(unit.segments, buffers):
            for event in self._events[b]:
                event.synchronize()  # CUDA: the all-gather copy-in from this buffer is done
            self._events[b] = []
            self._pread(self.buffers[b][: seg.nbytes], seg.file_offset)

    # ---- checks and failure ----------------------------------------------------------------------
    def _check(self) -> None:
        if self._broken is not None:
            raise NvmeOffloadError(self._broken)
        problem = swap_file_problem(self._fd, self.path, self.file_bytes, unlinked=self._unlinked, label="swap file")
        if problem is not None:
            raise self._fail("reading parameters", problem)

    def _fail(self, what: str, e: "BaseException | str") -> NvmeOffloadError:
        why = failure_reason(e, self.path)
        if self._broken is None:
            self._broken = (
                f"{self.purpose}: {what} failed: {why}. This rank's parameters since the last checkpoint cannot be"
                f" trusted, so the swap directory {self.dir} has been deleted and the run cannot go on. Nothing"
                " else is lost: checkpoints are self-contained (never point at swap files). Resume from the last"
                " checkpoint after freeing space or fixing the drive (another nvme_path is fine)."
            )
            pool = getattr(self, "_pool", None)
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
            self._finalizer()
        return NvmeOffloadError(self._broken)

    # ---- the buffer pool -------------------------------------------------------------------------
    def _wait(self, unit: _Unit) -> None:
        fut, unit.future = unit.future, None
        if fut is not None:
            try:
                fut.result()
            except OSError as e:
                raise self._fail("reading parameters", e) from e

    def _drop(self, unit: _Unit) -> None:
        """Give a read-ahead unit's buffers back (its read finished or failed)."""
        try:
            self._wait(unit)
        finally:
            self._ahead.remove(unit)
            self._free.extend(unit.buffers or [])
            unit.buffers = None

    def _take(self, n: int, unit: _Unit) -> list[int]:
        while len(self._free) < n and self._ahead:
            self._drop(self._ahead[-1])  # the read-ahead furthest away
        if len(self._free) < n:
            held = [u.name for u in self.units if u.pinned]
            raise NvmeOffloadError(
                f"{self.purpose}: unit {unit.name!r} needs {n} of offload.param_buffer_count={self.buffer_count}"
                f" buffers while units {held} hold theirs for their all-gather. Raise param_buffer_count."
            )
        taken, self._free = self._free[:n], self._free[n:]
        in_use = self.buffer_count - len(self._free)
        self.peak_buffers_in_use = max(self.peak_buffers_in_use, in_use)
        return taken

    def _acquire(self, unit: _Unit) -> None:
        self._check()
        if unit in self._ahead:
            self._ahead.remove(unit)
        else:
            unit.buffers = self._take(len(unit.segments), unit)
            unit.future = self._pool.submit(self._read_unit, unit, unit.buffers)
        self._wait(unit)
        self._point_at_buffers(unit)
        unit.pinned = True
        self._read_ahead(unit)

    def _release(self, unit: _Unit) -> None:
        unit.pinned = False
        if self.device.type == "cuda" and unit.buffers:
            # The copy-in reads the buffers on FSDP2's copy-in stream (or the current one) and the
            # host-to-device copy is asynchronous from pinned memory: the next read into these
            # buffers waits for both.
            streams = {torch.cuda.current_stream(self.device)}
            ctx = unit.group.comm_ctx
            if hasattr(ctx, "all_gather_copy_in_stream"):
                streams.add(ctx.all_gather_copy_in_stream)
            for b in unit.buffers:
                for s in streams:
                    event = torch.cuda.Event()
                    event.record(s)
                    self._events[b].append(event)
        self._point_at_map(unit)
        self._free.extend(unit.buffers or [])
        unit.buffers = None

    def _read_ahead(self, unit: _Unit) -> None:
        """[Note: read-ahead]: record the order, or start reading the units that follow ``unit`` in it."""
        if self._recording:
            if len(self._trace) < 8 * len(self.units):  # forward-only loops never reach a step
                self._trace.append(unit.index)
            return
        if not self._trace:
            return
        pos = None
        for start in (self._cursor, 0):
            try:
                pos = self._trace.index(unit.index, start)
                break
            except ValueError:
                continue
        if pos is None:
            return
        self._cursor = pos + 1
        for index in self._trace[self._cursor :]:
            nxt = self.units[index]
            if nxt.pinned or nxt in self._ahead:
                continue
            if len(self._free) < len(nxt.segments):
                break
            nxt.buffers = self._take(len(nxt.segments), nxt)
            nxt.future = self._pool.submit(self._read_unit, nxt, nxt.buffers)
            self._ahead.append(nxt)

    def _drain(self) -> None:
        """Wait for every read in flight and forget every copy read ahead (the file is about to change)."""
        while self._ahead:
            self._drop(self._ahead[-1])
        for unit in self.units:
            if unit.pinned:  # an unshard whose wait never came (a one-rank mesh): not in use any more
                self._release(unit)

    # ---- the optimizer's side ----------------------------------------------------------------------
    def owns(self, param: Tensor) -> bool:
        return id(param) in self._entries

    def begin_update(self) -> None:
        """Before the optimizer writes parameters: no read in flight, no stale copy kept. Ends the trace."""
        self._check()
        self._drain()
        self._recording = False
        self._cursor = 0

    def write(self, param: Tensor, lo: int, hi: int, src: Tensor) -> None:
        """Elements ``[lo, hi)`` of ``param``'s local shard (flat) := ``src``, written into the swap file."""
        entry = self._entries[id(param)]
        if self._broken is not None:
            raise NvmeOffloadError(self._broken)
        self._pwrite(src.to(entry.dtype), entry.file_offset + lo * entry.dtype.itemsize, "writing")

    def read(self, param: Tensor, lo: int, hi: int, out: Tensor) -> None:
        """``out`` := elements ``[lo, hi)`` of ``param``'s local shard (flat), read from the swap file."""
        entry = self._entries[id(param)]
        self._check()
        direct = out.dtype == entry.dtype and out.is_contiguous() and out.device.type == "cpu"
        dst = out if direct else torch.empty(hi - lo, dtype=entry.dtype)
        try:
            self._pread(dst, entry.file_offset + lo * entry.dtype.itemsize)
        except OSError as e:
            raise self._fail("reading parameters", e) from e
        if not direct:
            out.copy_(dst)

    # ---- checkpoints and lifetime --------------------------------------------------------------------
    def remap(self) -> None:
        """After parameters were read or written through the memory map (a checkpoint saved or loaded):
        forget copies read ahead and map the file afresh, so the pages the checkpoint touched leave
        this process (the old map lives on in whatever still holds a view of it)."""
        self._check()
        self._drain()
        if not self._reachable_path().exists():  # unlinked, and no /proc to reopen it by: keep the old map
            return
        self._map = self._new_map()
        for unit in self.units:
            self._point_at_map(unit)

    def resident_bytes(self) -> int:
        """Host memory the pool can hold (allocated lazily: what reads have filled counts in RSS)."""
        return self.buffer_count * self.buffer_bytes

    def host_bytes(self) -> int:
        """Host memory this swapper holds: the pool, and the swap file where it is on tmpfs."""
        return self.resident_bytes() + (self.file_bytes if self.file_in_memory else 0)

    def held_tensors(self) -> list[Tensor]:
        """Tensors whose storages are this swapper's, not the model's: the file's map (on the drive, paged
        in on read) and the pool (:meth:`resident_bytes`). A measurement of the model skips them."""
        return [self._map, *self.buffers]

    def unlink(self) -> None:
        """Remove the swap file's name (end of fit): the data stays reachable through the open file and
        its map, so the model keeps working, and the space is freed when the process ends, however it
        ends. A later fit in the same process keeps using it."""
        if not self._unlinked:
            self._unlinked = True
            self._finalizer()

    @property
    def numel(self) -> int:
        return sum(e.local_numel for e in self._entries.values())


def apply_param_offload(model: nn.Module, root: Path, *, buffer_count: int, buffer_size: float, io_threads: int,
                        pin: bool, rank: int, purpose: str = "offload.offload_param='nvme'") -> ParamSwapper:
    """Swap the stage-3 parameter shards of ``model`` (already partitioned and materialized) to a file
    under ``root``; returns the :class:`ParamSwapper`. In place: the model keeps its parameters
    (views of the file between all-gathers). Call it once; :func:`param_swapper` finds it again."""
    existing = param_swapper(model)
    if existing is not None:
        return existing
    return ParamSwapper(model, Path(root), buffer_count=int(buffer_count), buffer_size=int(buffer_size),
                        io_threads=int(io_threads), pin=pin, rank=rank, purpose=purpose)


def param_swapper(model: Optional[nn.Module]) -> Optional[ParamSwapper]:
    """The :class:`ParamSwapper` installed on ``model``, or None."""
    return getattr(model, _ATTR, None) if model is not None else None


def after_checkpoint(model: Optional[nn.Module]) -> Callable[[], None]:
    """What to run once a checkpoint has been saved or loaded through the parameters' memory map."""
    swapper = param_swapper(model)
    return swapper.remap if swapper is not None else (lambda: None)
