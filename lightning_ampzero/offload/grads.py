"""ZeRO-Infinity gradient offload: each unit's reduced gradient shard written to a swap file.

:func:`apply_grad_offload` gives a partitioned (stage-3) model one gradient swap file per rank
and makes every FSDP2 unit write its reduced gradient shards there right after its
reduce-scatter, so a rank holds one unit's reduced gradients at a time instead of the whole
gradient shard (4 bytes per parameter of its partition) from backward to the optimizer step.
:class:`~lightning_ampzero.offload.OffloadedAdam` reads them back tile by tile. Used for
``offload_grad`` (``auto`` = with ``offload_optimizer="nvme"``, as DeepSpeed does; offload/setup.py).

[Note: gradient swapping on FSDP2]
In torch 2.13 a unit's gradients reach their shards in ``FSDPParamGroup.post_backward``
(``foreach_reduce`` in _fsdp_collectives.py): it reduce-scatters the unit's unsharded gradients
into one flat output, and each parameter's ``sharded_param.grad`` becomes a DTensor whose local
tensor is a view of that output, or, when a gradient is already there (accumulation over
micro-batches), FSDP2 adds into it: ``grad._local_tensor += new``. ``post_backward`` runs once per
unit and backward, from the unit's autograd node or from the root's final callback, and both
look it up on the group, so it is wrapped per group, as params.py wraps ``unshard``:

    post_backward(unit):  gradients the file holds -> set aside (p.grad = None)
                          FSDP2's reduce-scatter: fresh shards, views of its output
                          set-aside ones: shard += pread(file)       (in pieces of _CHUNK elements)
                          pwrite(shards -> file); each p.grad's local tensor := a view of the
                          file's shared memory map

after which nothing references the reduce-scatter output and it is freed. Setting the old
gradient aside rather than letting FSDP2 add into it keeps the accumulation off the memory map
(an add through the map would fault the whole shard back in); FSDP2 computes old + new, this
computes new + old, the same IEEE sum bit for bit. Not a post-accumulate-grad hook: FSDP2 calls
those after its add, per parameter, when the unit's output is still referenced by the others.

Between backward and step every swapped ``p.grad`` is a DTensor over a view of the map: gradient
clipping, the loss scaler's inf/nan check, ``zero_grad``, callbacks all work on it (reads fault
file pages in; in-place scaling writes through to the file). The optimizer's hot path does not
touch the map: it reads each tile with ``pread`` (:meth:`GradSwapper.read`), and first drops from
this process the pages that such readers faulted in (``madvise(MADV_DONTNEED)``, which for a
shared file mapping loses nothing: the data is the file's). A unit whose gradients are not
reduced this backward keeps its views; a gradient someone assigned in between is taken over.

Failures of the swap file are handled as in params.py ([Note: failures of the swap file]): the
file is preallocated; a write that fails, a read that comes back short, or the file found
deleted or truncated (``fstat`` before every unit's write and every read) deletes the swap
directory and makes every further use raise an :class:`NvmeOffloadError` naming the file.
"""

from __future__ import annotations

import mmap
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_ampzero.offload.params import _groups
from lightning_ampzero.offload.store import (
    NvmeOffloadError,
    create_swap_file,
    failure_reason,
    pread_all,
    pwrite_all,
    round_up,
    swap_file_problem,
)
from lightning_ampzero.zero.comm import finish_in_flight
from lightning_ampzero.zero.groups import has_local_gradient, repeated_post_backward

_ALIGN = 64  # bytes: every shard starts aligned for any dtype's view of the map
_PAGE = 4096
_CHUNK = 1 << 20  # elements: accumulation reads the sum so far in pieces this large (4 MiB in fp32)
_ATTR = "_ampzero_grad_swapper"  # on the model, and on each swapped parameter (how OffloadedAdam finds it)


@dataclass(eq=False)
class _Entry:
    """One FSDPParam's gradient shard: ``nbytes`` at ``file_offset``; ``view``: its map view."""

    fsdp_param: Any
    fqn: str
    dtype: torch.dtype
    numel: int
    shape: torch.Size
    nbytes: int
    file_offset: int
    view: Optional[Tensor] = None


@dataclass(eq=False)
class _Unit:
    name: str
    group: Any
    entries: list[_Entry]


class GradSwapper:
    """The gradient swap file of one partitioned model and the post-backward wrappers (module docstring).

    ``bytes_written`` / ``bytes_read`` count swap-file I/O; ``peak_pending_bytes`` the most bytes of
    reduced gradients held in memory at once before being written (one unit's shards).
    """

    def __init__(self, model: nn.Module, root: Path, *, rank: int,
                 purpose: str = "offload.offload_grad='nvme'") -> None:
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule):
            raise ValueError("apply_grad_offload needs the model partitioned by apply_zero (stage 3) first.")
        self.purpose = purpose
        model._get_fsdp_state()._lazy_init()  # the shards' final sizes (FSDP2 re-pads once there)
        self.units: list[_Unit] = []
        self._entries: dict[int, _Entry] = {}
        offset = 0
        for name, group in _groups(model):
            unit = _Unit(name, group, [])
            for fp in group.fsdp_params:
                param = fp.sharded_param
                if param.device.type != "cpu":
                    raise ValueError(
                        f"{purpose}: the gradient shards of parameter {fp._param_fqn!r} (unit {name!r}) are reduced"
                        f" on {param.device}; gradient swapping writes them from host memory, so it needs"
                        " offload_param='cpu' or 'nvme' on an accelerator (FSDP2 then copies them to the host)."
                        " Set offload_param, or offload_grad='none'."
                    )
                if not param.requires_grad:
                    continue
                numel = fp.sharded_size.numel()
                nbytes = numel * param.dtype.itemsize
                offset = round_up(offset, _ALIGN)
                entry = _Entry(fp, fp._param_fqn or name, param.dtype, numel, fp.sharded_size, nbytes, offset)
                offset += nbytes
                unit.entries.append(entry)
                self._entries[id(param)] = entry
            if unit.entries:
                self.units.append(unit)
        self.file_bytes = round_up(max(offset, 1), _PAGE)
        self.dir, self.path, self._fd = create_swap_file(root, "grads", rank, self.file_bytes, purpose=purpose,
                                                         what="this rank's gradient shards")
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        self._broken: Optional[str] = None
        self._unlinked = False
        self.bytes_written = 0
        self.bytes_read = 0
        self.peak_pending_bytes = 0
        self._chunk: Optional[Tensor] = None
        self._new_map()
        for unit in self.units:
            self._wrap(unit)
            for e in unit.entries:
                setattr(e.fsdp_param.sharded_param, _ATTR, self)
        setattr(model, _ATTR, self)

    # ---- the map -----------------------------------------------------------------------------------
    def _new_map(self) -> None:
        # Python's mmap rather than torch.from_file: it can madvise (drop_pages).
        self._mm = mmap.mmap(self._fd, self.file_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        raw = torch.frombuffer(self._mm, dtype=torch.uint8)  # keeps the mmap alive as long as any view
        for e in self._entries.values():
            e.view = raw[e.file_offset : e.file_offset + e.nbytes].view(e.dtype).view(e.shape)

    def drop_pages(self) -> None:
        """Take the map's pages out of this process (readers through ``p.grad`` faulted them in)."""
        if self._broken is None:
            self._mm.madvise(mmap.MADV_DONTNEED)

    # ---- the post-backward wrapper -----------------------------------------------------------------
    def _wrap(self, unit: _Unit) -> None:
        group = unit.group
        post_backward = group.post_backward

        def post_backward_swapped(*args: Any) -> None:
            if repeated_post_backward(group, "grads"):  # [Note: FSDP2 across torch versions] in groups.py
                return post_backward(*args)
            reduced = [e for e in unit.entries if self._will_reduce(e.fsdp_param, group)]
            if not reduced:
                return post_backward(*args)
            self._check("writing gradients")
            held: list[tuple[_Entry, Tensor]] = []  # (entry, its p.grad) whose sum so far is in the file
            for e in reduced:
                grad = e.fsdp_param.sharded_param.grad
                if grad is not None and grad._local_tensor is e.view:
                    held.append((e, grad))
                    e.fsdp_param.sharded_param.grad = None
            try:
                post_backward(*args)
                # The reduce-scatter may still be in flight ([Note: reduce-scatters in flight] in
                # zero/comm.py): the file takes its output now, so it has to be there.
                finish_in_flight()
            except BaseException:
                for e, grad in held:
                    if e.fsdp_param.sharded_param.grad is None:
                        e.fsdp_param.sharded_param.grad = grad
                raise
            self._write_unit(unit, {id(e) for e, _ in held})

        group.post_backward = post_backward_swapped

    @staticmethod
    def _will_reduce(fp: Any, group: Any) -> bool:
        """Whether FSDP2's ``post_backward`` is going to reduce-scatter this gradient (its own tests, mirrored)."""
        if not group.reduce_grads or not hasattr(fp, "_unsharded_param"):
            return False
        return has_local_gradient(fp) or (getattr(group, "reduce_scatter_unused_params", False)
                                          and fp._unsharded_param.requires_grad)

    def _write_unit(self, unit: _Unit, held: set[int]) -> None:
        pending = []
        for e in unit.entries:
            grad = e.fsdp_param.sharded_param.grad
            if grad is None or grad._local_tensor is e.view:
                continue  # not reduced this time: the file holds it already (or nothing)
            if grad.dtype != e.dtype or grad._local_tensor.shape != e.shape:
                raise ValueError(f"{self.purpose}: the gradient of {e.fqn!r} is {grad.dtype} {tuple(grad.shape)}, the"
                                 f" parameter shard {e.dtype} {tuple(e.shape)}: it cannot be swapped.")
            pending.append((e, grad))
        self.peak_pending_bytes = max(self.peak_pending_bytes, sum(e.nbytes for e, _ in pending))
        with torch.no_grad():
            for e, grad in pending:
                event = getattr(e.fsdp_param, "grad_offload_event", None)
                if event is not None:
                    event.synchronize()  # CUDA: FSDP2's non-blocking device-to-host copy has landed
                flat = grad._local_tensor.detach().contiguous().view(-1)
                if id(e) in held:
                    self._accumulate(e, flat)
                self._pwrite(flat, e.file_offset)
                grad._local_tensor = e.view

    def _accumulate(self, e: _Entry, flat: Tensor) -> None:
        """``flat`` (this backward's reduced shard) += the sum of the earlier micro-batches, from the file."""
        n = flat.numel()
        if n == 0:  # this rank's shard of a parameter with fewer rows than ranks (a 1-output head)
            return
        step = min(n, _CHUNK)
        if self._chunk is None or self._chunk.numel() < step * e.dtype.itemsize:
            self._chunk = torch.empty(step * e.dtype.itemsize, dtype=torch.uint8)
        buf = self._chunk[: step * e.dtype.itemsize].view(e.dtype)
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            part = buf[: hi - lo]
            self._pread_checked(part, e.file_offset + lo * e.dtype.itemsize, "reading gradients")
            flat[lo:hi].add_(part)

    # ---- raw I/O and failure ---------------------------------------------------------------------
    def _pwrite(self, src: Tensor, offset: int) -> None:
        try:
            self.bytes_written += pwrite_all(self._fd, src, offset)
        except OSError as e:
            raise self._fail("writing gradients", e) from e

    def _pread_checked(self, dst: Tensor, offset: int, what: str) -> None:
        try:
            self.bytes_read += pread_all(self._fd, dst, offset, self.path)
        except OSError as e:
            raise self._fail(what, e) from e

    def _check(self, what: str) -> None:
        if self._broken is not None:
            raise NvmeOffloadError(self._broken)
        problem = swap_file_problem(self._fd, self.path, self.file_bytes, unlinked=self._unlinked,
                                    label="gradient swap file")
        if problem is not None:
            raise self._fail(what, problem)

    def _fail(self, what: str, e: "BaseException | str") -> NvmeOffloadError:
        why = failure_reason(e, self.path)
        if self._broken is None:
            self._broken = (
                f"{self.purpose}: {what} failed: {why}. This rank's gradients of this step cannot be trusted, so the"
                f" swap directory {self.dir} has been deleted and the run cannot go on. Nothing else is lost:"
                " checkpoints never hold gradients or point at swap files. Resume from the last checkpoint after"
                " freeing space or fixing the drive (another nvme_path is fine)."
            )
            self._finalizer()
        return NvmeOffloadError(self._broken)

    # ---- the optimizer's side ------------------------------------------------------------------------
    def owns(self, param: Tensor) -> bool:
        return id(param) in self._entries

    def holds(self, param: Tensor) -> bool:
        """Whether ``param.grad`` is the swapped one (its value is in the file, read it with :meth:`read`)."""
        entry = self._entries.get(id(param))
        grad = param.grad
        return entry is not None and grad is not None and getattr(grad, "_local_tensor", None) is entry.view

    def begin_step(self) -> None:
        """Before the optimizer reads gradients: the file is sound; pages faulted in by readers go."""
        self._check("reading gradients")
        self.drop_pages()

    def read(self, param: Tensor, lo: int, hi: int, out: Tensor) -> None:
        """``out`` := elements ``[lo, hi)`` of ``param``'s gradient shard (flat), read from the swap file."""
        entry = self._entries[id(param)]
        self._check("reading gradients")
        direct = out.dtype == entry.dtype and out.is_contiguous() and out.device.type == "cpu"
        dst = out if direct else torch.empty(hi - lo, dtype=entry.dtype)
        self._pread_checked(dst, entry.file_offset + lo * entry.dtype.itemsize, "reading gradients")
        if not direct:
            out.copy_(dst)

    def zero(self, param: Tensor) -> None:
        """``param.grad`` := 0 in the file (``zero_grad(set_to_none=False)``), without faulting the map in."""
        entry = self._entries[id(param)]
        self._check("writing gradients")
        zeros = torch.zeros(min(max(entry.nbytes, 1), _CHUNK), dtype=torch.uint8)
        for lo in range(0, entry.nbytes, zeros.numel()):
            self._pwrite(zeros[: min(zeros.numel(), entry.nbytes - lo)], entry.file_offset + lo)

    def held_tensors(self) -> list[Tensor]:
        """Views of the file's map (gradient shards on the drive): a measurement of the model skips them."""
        return [e.view for e in self._entries.values()]

    def resident_bytes(self) -> int:
        """Bytes of gradient shards held in memory now, not in the file (tracked, not measured)."""
        total = 0
        for e in self._entries.values():
            grad = e.fsdp_param.sharded_param.grad
            if grad is not None and grad._local_tensor is not e.view:
                total += e.nbytes
        return total

    def unlink(self) -> None:
        """Remove the swap file's name (end of fit): swapped gradients stay readable through the open file
        and its map until the process ends; a later fit in the same process keeps using it."""
        if not self._unlinked:
            self._unlinked = True
            self._finalizer()

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self._entries.values())


def apply_grad_offload(model: nn.Module, root: Path, *, rank: int,
                       purpose: str = "offload.offload_grad='nvme'") -> GradSwapper:
    """Swap the stage-3 gradient shards of ``model`` (partitioned, shards on the host) to a file under
    ``root`` after each unit's reduce-scatter; returns the :class:`GradSwapper`. Call it once:
    :func:`grad_swapper` finds it again."""
    existing = grad_swapper(model)
    if existing is not None:
        return existing
    return GradSwapper(model, Path(root), rank=rank, purpose=purpose)


def grad_swapper(obj: Any) -> Optional[GradSwapper]:
    """The :class:`GradSwapper` installed on a model, or on one of its parameters; else None."""
    return getattr(obj, _ATTR, None) if obj is not None else None
