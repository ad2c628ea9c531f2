"""Where offloaded optimizer state lives: host memory (:class:`HostStore`) or NVMe files (:class:`NvmeStore`).

Both hold, per parameter group, three flat fp32 vectors (master weights, Adam's two moments)
and hand them to the optimizer one tile (``sub_group_size`` elements) at a time:

    for tile in store.tiles(group, wanted):   # tile.master / .exp_avg / .exp_avg_sq: flat views
        ...update the tile...
        store.done(tile)                      # NVMe: written back in the background
    store.flush()                             # every write finished (or the error raised)

[Note: NVMe pipeline] ``buffer_count`` host buffers hold one state tensor of one tile each, so
``buffer_count // 3`` tiles are in flight: while the optimizer updates tile t, the I/O threads
write tile t-1 back and read tiles t+1, ... into the free slots. Resident optimizer state is
the slots, ``slots * 3 * tile * 4`` bytes, however large the model: that bound is what
ZeRO-Infinity's NVMe offload is for. The swap files are scratch space, not checkpoints:
checkpoints go through ``state_dict()`` (memory-mapped views of the files, streamed by DCP).

[Note: failed writes] A failed write (disk full, I/O error) leaves a group partly updated. The
store then deletes its files and refuses further use, saying why: nothing half-written is
kept as if valid. Files are preallocated (``posix_fallocate``) at creation so that "out of
space" is normally found before the first step, not in the middle of one.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import warnings
import threading
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import torch
from torch import Tensor

STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")
_FP32 = 4
_SPACE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


class NvmeOffloadError(RuntimeError):
    """Raised when the NVMe swap files cannot be created, written or read."""


@dataclass
class Tile:
    group: int
    index: int
    start: int
    stop: int
    master: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    slot: int = -1

    def views(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.master, self.exp_avg, self.exp_avg_sq


def tile_ranges(total: int, tile: int) -> list[tuple[int, int]]:
    return [(a, min(a + tile, total)) for a in range(0, total, tile)]


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


class HostStore:
    """All state resident in host memory (``offload_optimizer="cpu"``); tiles are views."""

    kind = "cpu"

    def __init__(self, group_sizes: Sequence[int], tile: int, pin: bool) -> None:
        self.group_sizes = list(group_sizes)
        self.tile = tile
        self.flat = [
            {name: torch.zeros(n, dtype=torch.float32, pin_memory=pin) for name in STATE_NAMES}
            for n in self.group_sizes
        ]

    def tiles(self, group: int, wanted: Iterable[int]) -> Iterator[Tile]:
        ranges = tile_ranges(self.group_sizes[group], self.tile)
        flat = self.flat[group]
        for i in wanted:
            a, b = ranges[i]
            yield Tile(group, i, a, b, flat["master"][a:b], flat["exp_avg"][a:b], flat["exp_avg_sq"][a:b])

    def done(self, tile: Tile, event: object = None) -> None:
        # Nothing to wait for: the master tile is only written again by the next step, whose first
        # tile waits for the compute stream (and with it for these host-to-device copies).
        pass

    def flush(self) -> None:
        pass

    def full(self, group: int, name: str) -> Tensor:
        """The whole flat vector (for state_dict / load_state_dict)."""
        return self.flat[group][name]

    def resident_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for g in self.flat for t in g.values())

    def close(self) -> None:
        self.flat = []


# [Note: swap directories of dead processes] Each swapper's directory is named after its kind,
# rank, host and process id. A process killed by a signal (SIGKILL, the OOM killer) runs no
# finalizer, so its swap files stay: tens of GB on a drive, or RAM when nvme_path is tmpfs
# (offload_param="cpu" on a CPU accelerator swaps to /dev/shm), where they can make the next run
# run out of memory too. They are garbage by construction (checkpoints never point at swap files),
# so before creating its own directory a swapper removes those of processes of this host that no
# longer exist, and says what it freed. Directories of other hosts (a shared filesystem) and of
# live processes are never touched.
_SWAP_DIR = re.compile(r"^ampzero-(offload|params|grads)-rank(\d+)-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}"
                       r"(?P<claimed>\.removing-[0-9a-f]{8})?$")


def swap_dir_name(kind: str, rank: int) -> str:
    """A new swap directory's name: ``ampzero-<kind>-rank<r>-<host>-<pid>-<random>`` (see the note above)."""
    host = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"
    return f"ampzero-{kind}-rank{rank}-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def remove_dead_swap_dirs(path: Path) -> list[tuple[Path, int]]:
    """Remove the swap directories under ``path`` left by dead processes of this host; ``[(dir, bytes)]``."""
    host = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"
    removed = []
    try:
        entries = list(path.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _SWAP_DIR.match(entry.name)
        if m is None or m["host"] != host or not entry.is_dir() or _process_exists(int(m["pid"])):
            continue
        # The ranks of this host clean the same directories at once: each claims a directory by
        # renaming it (atomic; the others' renames then fail) and removes and counts only what it
        # claimed. Before, two ranks removed one directory together and both counted it (a trial: 2 +
        # 2 of 3). A claim cut short by a kill keeps the pattern, with the dead pid: cleaned next time.
        claimed = entry.with_name(f"{entry.name[:m.start('claimed')] if m['claimed'] else entry.name}"
                                  f".removing-{uuid.uuid4().hex[:8]}")
        try:
            entry.rename(claimed)
        except OSError:
            continue  # another rank claimed it first
        size = 0
        try:
            for f in claimed.rglob("*"):
                size += f.stat().st_blocks * 512 if f.is_file() else 0
        except OSError:
            pass  # a size is for the message only
        shutil.rmtree(claimed, ignore_errors=True)
        removed.append((entry, size))
    if removed:
        warnings.warn(
            f"offload: removed {len(removed)} swap director{'y' if len(removed) == 1 else 'ies'} of processes that no"
            f" longer exist ({_human(sum(b for _, b in removed))}, e.g. {str(removed[0][0])!r}): a run on this host was"
            " killed before it could delete its swap files. Nothing of a checkpoint lives there.",
            stacklevel=3,
        )
    return removed


def nvme_dir_problem(path: Path) -> Optional[str]:
    """What stops swap files from being made in ``path`` (missing, not a directory, not writable), or None.

    ``ampzero-train``'s pre-flight asks it too: a bad ``nvme_path`` failed in every worker, after the
    processes had started and built the model, with a traceback per rank (a new-user trial: 82 s).
    """
    if not path.exists():
        return (f"offload.nvme_path={str(path)!r} does not exist. Create the directory (on a local NVMe drive) or"
                " point nvme_path at an existing one.")
    if not path.is_dir():
        return f"offload.nvme_path={str(path)!r} is not a directory. Point nvme_path at a directory."
    probe = path / f".ampzero-write-probe-{uuid.uuid4().hex}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0")
    except OSError as e:
        return (f"offload.nvme_path={str(path)!r} is not writable by this process ({e.strerror}). Choose a directory"
                " this user can write, or fix its permissions.")
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return None


def check_nvme_dir(path: Path, needed: int, what: str = "") -> None:
    """Errors a user can act on for an NVMe swap directory: missing, not a directory, not writable, too small.

    ``what`` names the swapped state in the out-of-space message (default: the optimizer's). Swap
    directories of dead processes are removed first ([Note: swap directories of dead processes]).
    """
    problem = nvme_dir_problem(path)
    if problem:
        raise NvmeOffloadError(problem)
    remove_dead_swap_dirs(path)
    free = shutil.disk_usage(path).free
    if needed > free:
        what = what or ("NVMe optimizer offload (12 bytes per parameter of this rank's partition: fp32 master +"
                        " Adam's two moments)")
        raise NvmeOffloadError(
            f"offload.nvme_path={str(path)!r} has {_human(free)} free but {what} needs {_human(needed)} for"
            " this rank. Free space, or choose a larger drive."
        )


def in_memory_filesystem(path: Path) -> bool:
    """Whether ``path`` is on tmpfs or ramfs (a swap file there is host memory, not a drive's space):
    the file system of the longest mount point above it in /proc/self/mounts; False where unknown."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return False
    target, best, kind = os.path.realpath(path), "", ""
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        # /proc/mounts escapes spaces in mount points as \040
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind in ("tmpfs", "ramfs")


def round_up(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to`` (swap-file layouts: alignment, pages)."""
    return (n + to - 1) // to * to


def pwrite_all(fd: int, src: Tensor, offset: int) -> int:
    """Write every byte of ``src`` at ``offset`` (``pwritev`` may write less than asked: loop); the byte count."""
    view = memoryview(src.contiguous().view(torch.uint8).numpy()).cast("B")
    done = 0
    while done < len(view):
        done += os.pwritev(fd, [view[done:]], offset + done)
    return len(view)


def pread_all(fd: int, dst: Tensor, offset: int, path: Path) -> int:
    """Fill contiguous ``dst`` from ``offset``; a short read (a truncated file) is an ``OSError`` naming ``path``."""
    view = memoryview(dst.view(torch.uint8).numpy()).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short read at byte {offset + done} of {path}: the file ends early")
        done += n
    return len(view)


def swap_file_problem(fd: int, path: Path, file_bytes: int, *, unlinked: bool, label: str) -> Optional[str]:
    """What is wrong with an open swap file (deleted or truncated under the job, checked by ``fstat``), or None."""
    st = os.fstat(fd)
    if st.st_nlink == 0 and not unlinked:
        return f"the {label} {path} was deleted while the job ran"
    if st.st_size < file_bytes:
        return f"the {label} {path} was truncated to {st.st_size:,} bytes while the job ran (it holds {file_bytes:,})"
    return None


def failure_reason(e: "BaseException | str", path: Path) -> str:
    """A swap file's failure in words: a message as is, a full drive by name, else the error and the file."""
    if isinstance(e, str):
        return e
    if isinstance(e, OSError) and e.errno in _SPACE_ERRNOS:
        return f"out of space writing {path}"
    return f"{e} ({path})"


def create_swap_file(root: Path, kind: str, rank: int, nbytes: int, *, purpose: str, what: str) -> tuple[Path, Path, int]:
    """This rank's new swap directory under ``root`` with one file of ``nbytes``: ``(dir, file, fd)``.

    The file is preallocated (``posix_fallocate``) so that a drive too small fails here, at setup,
    not in the middle of a step; if that fails the directory is removed and the error names the
    file, the size and the reason. ``what`` names the swapped state (e.g. "this rank's parameter
    shards") in the free-space check's message.
    """
    check_nvme_dir(root, nbytes, what=f"{purpose} ({what})")
    directory = root / swap_dir_name(kind, rank)
    directory.mkdir()
    path = directory / f"{kind}.swp"
    fd = -1
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if fd >= 0:
            os.close(fd)
        shutil.rmtree(directory, ignore_errors=True)
        why = "out of space" if e.errno in _SPACE_ERRNOS else e.strerror
        raise NvmeOffloadError(
            f"{purpose}: creating the swap file {path} for {what} ({_human(nbytes)}) failed: {why}. Nothing was"
            " left behind. Free space or choose another nvme_path."
        ) from e
    return directory, path, fd


class NvmeStore:
    """State in files under ``root`` (one per group and state), tiles read into ``buffer_count`` host buffers."""

    kind = "nvme"

    def __init__(self, root: Path, group_sizes: Sequence[int], tile: int, buffer_count: int, io_threads: int,
                 pin: bool, *, rank: int = 0) -> None:
        self.group_sizes = list(group_sizes)
        self.tile = max(1, min(tile, max(self.group_sizes, default=1)))
        self.slots = buffer_count // len(STATE_NAMES)
        needed = sum(self.group_sizes) * _FP32 * len(STATE_NAMES)
        root = Path(root)
        check_nvme_dir(root, needed)
        self.dir = root / swap_dir_name("offload", rank)
        self.dir.mkdir()
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        self._broken: Optional[str] = None
        self._fds: list[dict[str, int]] = []
        try:
            for g, n in enumerate(self.group_sizes):
                fds = {}
                for name in STATE_NAMES:
                    p = self.dir / f"group{g}_{name}.swp"
                    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                    fds[name] = fd
                    if n:
                        os.posix_fallocate(fd, 0, n * _FP32)  # zeros: the moments start at 0
                self._fds.append(fds)
        except OSError as e:
            self._close_fds()
            shutil.rmtree(self.dir, ignore_errors=True)
            why = "out of space" if e.errno in _SPACE_ERRNOS else e.strerror
            raise NvmeOffloadError(
                f"offload.nvme_path={str(root)!r}: creating the swap files ({_human(needed)}) failed: {why}. Nothing"
                " was left behind. Free space or choose another nvme_path."
            ) from e
        # Slot buffers: [master | exp_avg | exp_avg_sq] of one tile each.
        self.buffers = [torch.empty(len(STATE_NAMES), self.tile, dtype=torch.float32, pin_memory=pin)
                        for _ in range(self.slots)]
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="ampzero-nvme")
        self._writes: list[Optional[Future]] = [None] * self.slots
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_written = 0
        self.peak_slots_in_use = 0
        self._in_use = 0
        self._maps: dict[tuple[int, str], Tensor] = {}

    # ---- raw I/O (runs on the I/O threads; os.preadv / os.pwritev release the GIL) ------------
    def _io(self, write: bool, group: int, start: int, stop: int, slot: int) -> None:
        n = stop - start
        buf = self.buffers[slot]
        for k, name in enumerate(STATE_NAMES):
            fd = self._fds[group][name]
            view = memoryview(buf[k, :n].numpy()).cast("B")
            offset = start * _FP32
            done = 0
            while done < len(view):
                if write:
                    m = os.pwritev(fd, [view[done:]], offset + done)
                else:
                    m = os.preadv(fd, [view[done:]], offset + done)
                if m <= 0:
                    raise OSError(errno.EIO, f"short {'write' if write else 'read'} on {self.dir}/group{group}_{name}.swp")
                done += m
        with self._lock:
            if write:
                self.bytes_written += n * _FP32 * len(STATE_NAMES)
            else:
                self.bytes_read += n * _FP32 * len(STATE_NAMES)

    def _fail(self, what: str, e: BaseException) -> NvmeOffloadError:
        why = "out of space" if isinstance(e, OSError) and e.errno in _SPACE_ERRNOS else str(e)
        self._broken = (
            f"NVMe optimizer offload: {what} under {self.dir.parent} failed ({why}). The optimizer state on NVMe was"
            " partly updated, so it has been deleted (nothing half-written is kept). Resume from the last checkpoint"
            " after freeing space, or choose another nvme_path."
        )
        self.close()
        return NvmeOffloadError(self._broken)

    def _check(self) -> None:
        if self._broken is not None:
            raise NvmeOffloadError(self._broken)

    def _check_files(self, group: int) -> None:
        """A swap file deleted or truncated under the running job ([Note: failed writes]): refuse, naming it.

        An open file that was deleted still reads (its name is gone, not its data), so the check is
        ``fstat``'s link count, once per group and step; a truncated one would read short (zeros).
        """
        n = self.group_sizes[group] * _FP32
        for name, fd in self._fds[group].items():
            st = os.fstat(fd)
            path = self.dir / f"group{group}_{name}.swp"
            if st.st_nlink == 0:
                raise self._fail("reading optimizer state", OSError(errno.ENOENT, f"{path} was deleted while the job ran"))
            if st.st_size < n:
                raise self._fail("reading optimizer state",
                                 OSError(errno.EIO, f"{path} was truncated to {st.st_size:,} bytes (it holds {n:,})"))

    def _wait_slot(self, slot: int) -> None:
        fut = self._writes[slot]
        if fut is not None:
            self._writes[slot] = None
            try:
                fut.result()
            except Exception as e:  # noqa: BLE001 - any failed write invalidates the state
                raise self._fail("writing optimizer state", e) from e

    # ---- the tile protocol ---------------------------------------------------------------------
    def tiles(self, group: int, wanted: Iterable[int]) -> Iterator[Tile]:
        self._check()
        self._check_files(group)
        self._maps.clear()  # checkpoint views must not outlive a step that rewrites the files
        ranges = tile_ranges(self.group_sizes[group], self.tile)
        wanted = list(wanted)
        reads: dict[int, Future] = {}

        def start(j: int) -> None:
            slot = j % self.slots
            self._wait_slot(slot)  # the slot's previous tile must be on disk before it is overwritten
            a, b = ranges[wanted[j]]
            reads[j] = self._pool.submit(self._io, False, group, a, b, slot)

        for j in range(min(self.slots, len(wanted))):
            start(j)
        for j, i in enumerate(wanted):
            slot = j % self.slots
            try:
                reads.pop(j).result()
            except Exception as e:  # noqa: BLE001
                raise self._fail("reading optimizer state", e) from e
            a, b = ranges[i]
            n = b - a
            buf = self.buffers[slot]
            self._in_use += 1
            self.peak_slots_in_use = max(self.peak_slots_in_use, self._in_use)
            yield Tile(group, i, a, b, buf[0, :n], buf[1, :n], buf[2, :n], slot)
            if j + self.slots < len(wanted):
                start(j + self.slots)

    def done(self, tile: Tile, event: object = None) -> None:
        def write() -> None:
            if event is not None:
                event.synchronize()  # type: ignore[attr-defined]  # H2D copies from the slot finished
            self._io(True, tile.group, tile.start, tile.stop, tile.slot)

        self._in_use -= 1
        self._writes[tile.slot] = self._pool.submit(write)

    def flush(self) -> None:
        for slot in range(self.slots):
            self._wait_slot(slot)

    def full(self, group: int, name: str) -> Tensor:
        """A memory-mapped view of a whole state vector (pages are read on demand, written through)."""
        self._check()
        self.flush()
        key = (group, name)
        if key not in self._maps:
            n = self.group_sizes[group]
            if n == 0:
                self._maps[key] = torch.zeros(0)
            else:
                path = self.dir / f"group{group}_{name}.swp"
                self._maps[key] = torch.from_file(str(path), shared=True, size=n, dtype=torch.float32)
        return self._maps[key]


    def resident_bytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for b in self.buffers)

    def _close_fds(self) -> None:
        for fds in self._fds:
            for fd in fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fds = []

    def close(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self._maps = {}
        self._close_fds()
        self._finalizer()
