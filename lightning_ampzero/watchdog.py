"""The hang detector: a run whose ranks stop making progress ends within seconds, naming who is missing.

[Note: hang detection]
A rank that stops (SIGSTOP, a deadlock, a stuck data loader, a swapped-out host) leaves its peers
blocked in their next collective until the process-group timeout (30 minutes by default), after
which gloo says "Application timeout caused pair closure" on the healthy ranks and nothing on the
culprit. A killed rank is seen within seconds ("Connection reset by peer"), but the message names a
host:port, not a rank.

Every rank runs a :class:`Watchdog` thread. The training loop only records where it is (step and
phase, :meth:`Watchdog.mark`: a few attribute writes, no I/O); the thread publishes that position
and a beat counter to the process group's key-value store once a second. A gloo or NCCL
collective releases the GIL while it waits, so the thread keeps beating while its rank is blocked
in a collective; a stopped process beats no more. When a rank's own position has not moved for
``watchdog_s`` seconds, its thread reads every rank's record twice, a few beats apart, and
decides:

* ranks whose beat did not move are not responding (stopped, killed, hung outside Python);
* among the ranks that respond, those at an earlier position than the others are the ones that
  did not arrive where the others wait (stuck before the collective the others are blocked in);
* if every rank is at the same position and responding, they are all blocked in the same place
  (a collective that never completes): that is said too.

It then prints one message (the step, each rank's phase and the collective it is blocked in,
read off its main thread's Python stack with the caller's file and line, and the missing ranks),
posts a verdict in the store so that every other live rank diagnoses at once from its own view,
waits (a few beats at most) until each responding rank has reported, and ends its process with
exit status :data:`HANG_EXIT_CODE`, rank 0 first (Lightning's launcher kills its parent process
when a child ends first). So the run ends on every live rank within ``watchdog_s`` plus a few
seconds, each printing its report; the rank that is behind but alive reports itself. Keep
``watchdog_s`` above the longest phase a rank can spend alone (a checkpoint save, a validation
epoch: the loop marks each batch), and below the process-group timeout (``ZeroConfig`` checks).

A rank that goes away (killed, e.g. by the OOM killer, or ended by an error) is seen by its peers
within a second or two, as a transport error in their next collective that names a host:port
("Connection reset by peer"). The callback's ``on_exception`` then names the rank: a rank that
ended on an error of its own first publishes it (its record's phase becomes ``exited:error`` with
the error's first line), and a peer that gets a transport error reads every rank's record twice,
a beat and a half apart (:meth:`Watchdog.explain_lost_peer`): ranks that stopped beating are gone,
ranks that published an error say which. The message is printed and added to the exception as a
note, so it is in the traceback the user reads. (Lightning's launcher checks its child processes
every 5 s and kills the whole run when one has ended; the strategy's launcher waits a few seconds
first, so that report is not cut short: [Note: a launcher that lets the live ranks report] in
strategy.py.)

The process group's own timeout stays as the last resort: it is what ends a collective stuck in a
process whose watchdog is itself stuck.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

#: Exit status of a process ended by the watchdog.
HANG_EXIT_CODE = 75

_PREFIX = "ampzero/watchdog/"
_EXITED = "exited:"
_ERROR = _EXITED + "error"
_VERDICT = "verdict"

#: What transports say when the peer at the other end of a collective has gone (gloo, NCCL, TCPStore).
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "pair closure",
              "remote process exited", "Connection refused", "NCCL communicator was aborted",
              "ncclRemoteError", "Socket Timeout", "recvValue failed", "failed to recv")

#: What each phase waits in when it blocks (for the message).
WAITS_IN = {
    "setup": "the setup collectives (process group, sharding, broadcast)",
    "training_step": "forward: the parameter all-gathers (stage 3) or the SIGTERM check",
    "backward": "backward: the gradient reduce-scatter / all-reduce",
    "optimizer_step": "the optimizer step: the overflow and gradient-norm all-reduces",
    "validation_step": "validation: the parameter all-gathers (stage 3) and metric syncs",
    "checkpoint": "a checkpoint save (torch.distributed.checkpoint's collectives)",
    "between_steps": "the next step's first collective (data loading, logging sync, callbacks)",
    "barrier": "a barrier",
}
_ORDER = {"setup": 0, "training_step": 1, "backward": 2, "optimizer_step": 3, "between_steps": 4,
          "validation_step": 5, "checkpoint": 6, "barrier": 7}


@dataclass(frozen=True)
class Record:
    """What a rank last published: its beat counter, where its loop was, and the collective its
    main thread was blocked in ("" when none)."""

    beat: int
    step: int
    phase: str
    waiting: str = ""

    @property
    def exited(self) -> bool:
        """Whether the rank has already ended on its own watchdog (it is not a culprit)."""
        return self.phase.startswith(_EXITED)

    @property
    def position(self) -> tuple[int, int]:
        return self.step, _ORDER.get(self.phase.removeprefix(_EXITED), 0)

    def encode(self) -> str:
        return f"{self.beat}|{self.step}|{self.phase}|{self.waiting}"

    @classmethod
    def decode(cls, text: str) -> "Record":
        beat, step, phase, waiting = text.split("|", 3)
        return cls(int(beat), int(step), phase, waiting)

    def describe(self) -> str:
        if self.phase == _ERROR:
            return f"step {self.step}, ended by an error of its own: {self.waiting}"
        where = f"step {self.step}, {self.phase.removeprefix(_EXITED)}"
        where = f"{where}, blocked in {self.waiting}" if self.waiting else f"{where}, in no collective"
        return f"{where} (since ended by its watchdog)" if self.exited else where


def diagnose(rank: int, before: dict[int, Record], after: dict[int, Record]) -> str:
    """The message for a hang seen by ``rank``: two reads of every rank's record, a few beats apart."""
    # A rank that already ended on its own watchdog is not silent; where it was still counts.
    silent = sorted(r for r in after if after[r].beat == before[r].beat and not after[r].exited)
    live = {r: rec for r, rec in after.items() if r not in silent}
    blocked = {r: rec for r, rec in live.items() if rec.waiting}
    # Responding ranks that are in no collective while others wait in one did not arrive; with
    # no collective seen anywhere, the ranks behind the others' loop position did not.
    if blocked:
        behind = sorted(r for r in live if r not in blocked)
    else:
        ahead = max((rec.position for rec in live.values()), default=None)
        behind = sorted(r for r, rec in live.items() if rec.position < ahead)  # type: ignore[operator]
    mine = after[rank]
    lines = [f"ampzero watchdog (rank {rank}): no progress for the watchdog time; this rank is in {mine.describe()}."]
    if silent:
        lines.append(f"Rank(s) {_ranks(silent)} not responding (stopped, killed, or hung outside Python): "
                     + "; ".join(f"rank {r} last seen in {after[r].describe()}" for r in silent) + ".")
    if behind:
        waits = sorted({rec.waiting for rec in blocked.values()})
        where = f"wait in {', '.join(waits)}" if waits else "are further on"
        lines.append(f"Rank(s) {_ranks(behind)} did not arrive where the others {where}: "
                     + "; ".join(f"rank {r} is in {live[r].describe()}" for r in behind) + ".")
        if rank in behind:
            lines.append(f"This rank ({rank}) is one of them: look at what it does in step {mine.step}, {mine.phase}.")
    places = {(rec.step, rec.phase.removeprefix(_EXITED)) for rec in live.values()}
    if not silent and not behind:
        calls = sorted({rec.waiting for rec in live.values()})
        if len(calls) > 1:
            lines.append("Every rank responds, but they are blocked in different collectives: "
                         + "; ".join(f"rank {r} in {rec.waiting}" for r, rec in sorted(live.items()))
                         + " (ranks that called different collectives never match).")
        elif len(places) > 1:
            lines.append(f"Every rank responds and is blocked in {calls[0]}, but from different places: "
                         + "; ".join(f"rank {r} in step {rec.step}, {rec.phase.removeprefix(_EXITED)}"
                                     for r, rec in sorted(live.items()))
                         + ". One collective reached from different code pairs calls that do not belong together:"
                         " look for code that runs on some ranks only (under `if trainer.is_global_zero`, in a"
                         " rank-zero-only callback).")
        else:
            lines.append(f"Every rank responds and is in {mine.describe()}: a collective that every rank entered is"
                         " not completing (the network, a peer process outside this run, or ranks that reached it"
                         " for different sharding units: at stages 1-3 every rank must run each unit's forward).")
    generating = sorted(r for r, rec in after.items() if rec.waiting.endswith(_IN_GENERATE))
    if generating and (len(generating) < len(after) or len(places) > 1):
        others = "the others do not" if len(generating) < len(after) else "not all from the same place"
        lines.append(f"Rank(s) {_ranks(generating)} wait in generate(), {others}: while the model is "
                     "sharded (stage 3, or stages 1-2 between a backward and the next forward) each forward needs "
                     "every rank. Call generate() on every rank and keep only rank 0's output, or generate where "
                     "evaluation has gathered the model (validation hooks, on_validation_epoch_end).")
    lines.append("Ending this process; every live rank does the same. Raise ZeroConfig.watchdog_s if a phase"
                 " legitimately takes longer, or 0 to turn the watchdog off.")
    return "\n".join(lines)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def is_peer_lost(error: BaseException) -> bool:
    """Whether ``error`` is a transport's report that the rank at the other end of a collective has gone."""
    seen = 0
    while error is not None and seen < 8:
        if any(marker in str(error) for marker in _PEER_LOST):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _process_state(pid: int) -> str:
    """"running", or how process ``pid`` (on this host) is not: "is gone", "has exited", "is stopped"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]  # the name in parentheses may hold spaces
    except FileNotFoundError:
        return "is gone (its process no longer exists)"
    except OSError:
        return "running"  # no /proc (not Linux): the beats decide
    if state in ("Z", "X"):
        return "has exited (its process is a zombie, not yet reaped by its launcher)"
    if state in ("T", "t"):
        return "is stopped (SIGSTOP or a debugger)"
    return "running"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


_C10D_FILES = ("distributed_c10d.py",)
_WRAPPER_FILES = ("c10d_logger.py", "functools.py", "contextlib.py")


def blocked_in(thread_id: int) -> str:
    """The torch.distributed collective thread ``thread_id`` is in right now, or "" (from its Python stack).

    A collective blocks in C++ with the GIL released; its Python caller (``all_reduce``,
    ``reduce_scatter_tensor``, ``all_gather_into_tensor``, ``barrier`` ...) stays on the stack,
    including when FSDP2 or DDP call it from an autograd hook during backward.
    """
    frame = sys._current_frames().get(thread_id)
    found, generating, ring = "", False, False
    while frame is not None:
        code = frame.f_code
        generating |= code.co_name == "generate" and f"{os.sep}transformers{os.sep}" in code.co_filename
        # Our reduce-scatter ring (zero/comm.py) waits on isend/irecv works, in no c10d function.
        ring |= code.co_name == "_run" and code.co_filename.endswith(_RING_FILE)
        if code.co_filename.endswith(_C10D_FILES) and not code.co_name.startswith("_"):
            # the outermost public c10d function is the collective called; name its caller too
            caller = frame.f_back
            while caller is not None and caller.f_code.co_filename.endswith(_WRAPPER_FILES):
                caller = caller.f_back
            where = f"{_short_path(caller.f_code.co_filename)}:{caller.f_lineno}" if caller is not None else "?"
            found = f"{code.co_name} (called from {where})"
        frame = frame.f_back
    found = found or ("the gradient reduce-scatter ring's sends and receives (lightning_ampzero/zero/comm.py)"
                      if ring else "")
    return f"{found}{_IN_GENERATE}" if found and generating else found


_RING_FILE = os.path.join("lightning_ampzero", "zero", "comm.py")
#: The folder that holds the lightning_ampzero package (a clone, or site-packages).
_PACKAGES_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _short_path(filename: str) -> str:
    """A frame's file named so that a reader can find it: from its package down
    (``lightning/fabric/utilities/distributed.py``, not ``distributed.py``: several packages have one),
    from the working directory for the user's own scripts, else the base name."""
    for installed in ("site-packages", "dist-packages"):
        _, found, tail = filename.rpartition(os.sep + installed + os.sep)
        if found:
            return tail
    if filename.startswith(_PACKAGES_ROOT + os.sep):
        return os.path.relpath(filename, _PACKAGES_ROOT)
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive
        return os.path.basename(filename)
    return os.path.basename(filename) if relative.startswith(os.pardir) else relative


#: Marks a collective called under transformers' generate() ([Note: generate() on some ranks]).
_IN_GENERATE = " in transformers' generate()"


def _print_report(message: str) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(2, (message + "\n").encode())  # one write: ranks sharing a terminal or log do not interleave


def trainer_interrupted(trainer: Any) -> bool:
    """Whether the trainer is ending on an exception: TrainerStatus.INTERRUPTED (compared by value,
    so lightning.pytorch's and pytorch_lightning's enums both count) is set before on_exception runs."""
    return getattr(getattr(getattr(trainer, "state", None), "status", None), "value", None) == "interrupted"


def _end_process() -> None:
    os._exit(HANG_EXIT_CODE)  # the main thread is blocked inside a collective: nothing else can end it


class Watchdog:
    """One rank's hang detector (see [Note: hang detection]).

    Args:
        store: the process group's key-value store (``set``/``get``/``check``), shared by all ranks.
        rank, world_size: this rank and how many there are.
        timeout_s: seconds without progress of this rank's own loop before it diagnoses a hang.
        poll_s: the publishing interval.
        report: called with the message (default: print it to stderr).
        end: called last (default: end the process with :data:`HANG_EXIT_CODE`).
    """

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float, *, poll_s: float = 1.0,
                 report: Callable[[str], None] = _print_report, end: Callable[[], None] = _end_process,
                 prefix: str = _PREFIX) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s, self.poll_s, self.report, self.end, self.prefix = timeout_s, poll_s, report, end, prefix
        self.step, self.phase = 0, "setup"
        self._moved = time.monotonic()
        self._main = threading.get_ident()  # the thread that runs the loop (the one that builds us)
        self._beat = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.cpu_s = 0.0

    def mark(self, step: int, phase: str) -> None:
        """The loop reached ``phase`` of ``step`` (main thread; no I/O)."""
        self.step, self.phase = step, phase
        self._moved = time.monotonic()

    def start(self) -> "Watchdog":
        self.store.set(self._id_key(self.rank), f"{socket.gethostname()}|{os.getpid()}")
        self._publish()  # every rank's key exists before anyone reads it
        self._thread = threading.Thread(target=self._run, name="ampzero-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.poll_s)
            self._thread = None

    def _key(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    def _publish(self, phase: Optional[str] = None) -> None:
        self._beat += 1
        record = Record(self._beat, self.step, phase or self.phase, blocked_in(self._main))
        self.store.set(self._key(self.rank), record.encode())

    def _read(self) -> dict[int, Record]:
        out = {}
        for r in range(self.world_size):
            if self.store.check([self._key(r)]):
                out[r] = Record.decode(self.store.get(self._key(r)).decode())
        return out

    def _run(self) -> None:
        store_lost_since: Optional[float] = None
        while not self._stop.wait(self.poll_s):
            self.cpu_s = time.thread_time()  # this thread's CPU time so far: the detector's cost (benchmarks)
            stuck = time.monotonic() - self._moved >= self.timeout_s
            try:
                self._publish()
                # A peer that diagnosed a hang ends the run: diagnose now too, from this rank's view.
                if not stuck and not self.store.check([self.prefix + _VERDICT]):
                    store_lost_since = None
                    continue
                before = self._read()
                # A few beats (still beating: a peer diagnosing at the same time must see this rank alive).
                for _ in range(3):
                    if self._stop.wait(self.poll_s):
                        return
                    self._publish()
                after = self._read()
            except Exception:  # noqa: BLE001 - the store is unreachable: its host ended, or shutdown
                if self._stop.is_set():
                    return
                store_lost_since = store_lost_since or time.monotonic()
                if stuck and time.monotonic() - store_lost_since > 3 * self.poll_s:
                    self._finish(f"ampzero watchdog (rank {self.rank}): no progress for the watchdog time in step"
                                 f" {self.step}, {self.phase}, and the process group's store is unreachable: the"
                                 " rank that hosts it (rank 0) has ended; its message names the missing ranks."
                                 " Ending this process.")
                    return
                continue
            if self._stop.is_set():
                return
            missing = {r: Record(0, -1, "never started") for r in range(self.world_size) if r not in after}
            before.update({r: rec for r, rec in missing.items() if r not in before})
            after.update(missing)
            message = diagnose(self.rank, before, after)
            self.report(message)
            try:
                # The others must not take this rank's exit for the hang, and must hear of it now.
                self._publish(_EXITED + self.phase)
                self.store.set(self.prefix + _VERDICT, str(self.rank))
                self._await_peers(silent=[r for r in after if after[r].beat == before[r].beat])
            except Exception:  # noqa: BLE001 - the store went first; the message is out already
                pass
            self.end()
            return

    def _await_peers(self, silent: list[int]) -> None:
        """Stay until every responding rank has reported too (bounded).

        A launcher that sees one rank end kills the others (Lightning's subprocess launcher does),
        and rank 0 hosts the store the others read: leaving first would cut their reports short.
        """
        deadline = time.monotonic() + 8 * self.poll_s
        while time.monotonic() < deadline:
            records = self._read()
            if all(r in silent or (r in records and records[r].exited) for r in range(self.world_size)):
                break
            if self._stop.wait(self.poll_s / 2):
                return
        # Rank 0 leaves first: Lightning's launcher runs it in the parent process, and a child that ends
        # first makes the launcher kill the parent (SIGKILL) before it has left with its own status.
        self._stop.wait(self.poll_s / 2 if self.rank == 0 else 2 * self.poll_s)

    def _finish(self, message: str) -> None:
        self.report(message)
        self.end()

    def publish_error(self, error: BaseException) -> None:
        """This rank is ending on ``error`` (its own): say so in its record, for the peers' reports."""
        text = " ".join(_first_line(error).split())[:200]
        self.stop()  # the thread must not overwrite the record with a beat
        self._beat += 1
        self.store.set(self._key(self.rank), Record(self._beat, self.step, _ERROR, text).encode())

    def explain_lost_peer(self) -> str:
        """Name the rank(s) whose loss broke this rank's collective (main thread, after the transport error).

        A peer on this host is checked at once by its process id (gone, a zombie, or stopped); when
        none is, every record is read twice a beat and a half apart (those that are gone stopped
        beating; this rank's thread keeps beating meanwhile). A peer that ended on its own error
        said so in its record. Quick matters: Lightning's launcher kills the whole run within 5 s
        of a child's end.
        """
        head = f"ampzero watchdog (rank {self.rank}): a collective failed in step {self.step}, {self.phase}, because a peer"
        try:
            before = self._read()
            pids = self._local_peers()
            gone = {r: state for r, pid in pids.items() if (state := _process_state(pid)) != "running"}
            after = before
            # (a killed process closes its sockets before its state changes: look again, unless a
            # peer has already said it ended on an error)
            if not gone and not any(rec.phase == _ERROR for rec in before.values()):
                time.sleep(1.5 * self.poll_s)
                after = self._read()
                gone = {r: state for r, pid in pids.items() if (state := _process_state(pid)) != "running"}
                gone.update({r: "not responding" for r in after if r != self.rank and r not in gone and r in before
                             and after[r].beat == before[r].beat and not after[r].exited})
        except Exception:  # noqa: BLE001 - the store is hosted by rank 0
            if self.rank == 0:
                return f"{head} went away, and this rank's own store could not be read."
            return (f"{head} went away: rank 0 (which hosts the process group's store) has ended, killed or by an"
                    " error; its log, or the system log for the OOM killer (dmesg), says why.")
        failed = sorted(r for r, rec in after.items() if rec.phase == _ERROR)
        gone = {r: state for r, state in gone.items() if r not in failed}
        gone.update({r: "never started" for r in range(self.world_size) if r not in after})
        lines = [f"{head} went away."]
        for r in failed:
            lines.append(f"Rank {r} ended on an error of its own in step {after[r].step}: {after[r].waiting} (its"
                         " traceback is in its own output).")
        if gone:
            lines.append("; ".join(f"Rank {r} {state}" + (self._last_seen(after[r]) if r in after else "")
                                   for r, state in sorted(gone.items()))
                         + ". It ended without an error of its own: stopped by a signal (Ctrl-C, kill, a scheduler's"
                         " cancel, the OOM killer) or crashed outside Python; its log, or the system log (dmesg),"
                         " says why.")
        if not failed and not gone:
            lines.append("Every other rank still responds: the connection itself failed (the network, or a peer"
                         " process outside this run).")
        lines.append("The transport's error names a host:port; the ranks above are where to look.")
        return "\n".join(lines)

    def _last_seen(self, record: Record) -> str:
        # A rank reports once a beat: one killed within a beat of its last report got further than it
        # says (a trial's rank killed in step 3 read "last seen in step 0, setup").
        if record.step < self.step:
            return (f", whose last report (one a beat, {self.poll_s:g} s) was from {record.describe()}: it got"
                    f" further since, as far as step {self.step} at least")
        return f", last seen in {record.describe()}"

    def _local_peers(self) -> dict[int, int]:
        """Process ids of the other ranks on this host (from their identity keys)."""
        host = socket.gethostname()
        out = {}
        for r in range(self.world_size):
            if r != self.rank and self.store.check([self._id_key(r)]):
                peer_host, pid = self.store.get(self._id_key(r)).decode().rsplit("|", 1)
                if peer_host == host:
                    out[r] = int(pid)
        return out

    def _id_key(self, rank: int) -> str:
        return f"{self.prefix}id/{rank}"


class WatchdogHooks:
    """Marks the training loop's phases on a :class:`Watchdog` (the hooks of :func:`watchdog_callback`).

    The marks are attribute writes on the main thread: the cost of the detector is its thread's
    one store write a second (benchmarks/bench_watchdog.py).
    """

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog

    def _mark(self, trainer: Any, phase: str) -> None:
        self.watchdog.mark(int(trainer.global_step), phase)

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        self._mark(trainer, "training_step")

    def on_before_backward(self, trainer: Any, *args: Any) -> None:
        self._mark(trainer, "backward")

    def on_before_optimizer_step(self, trainer: Any, *args: Any) -> None:
        self._mark(trainer, "optimizer_step")

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self._mark(trainer, "between_steps")

    def on_validation_batch_start(self, trainer: Any, *args: Any) -> None:
        self._mark(trainer, "validation_step")

    def on_validation_end(self, trainer: Any, *args: Any) -> None:
        self._mark(trainer, "between_steps")

    def on_save_checkpoint(self, trainer: Any, *args: Any) -> None:
        # A save at an exception (OnExceptionCheckpoint) leaves the mark where the error was.
        if not trainer_interrupted(trainer):
            self._mark(trainer, "checkpoint")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Name the rank a transport error is about, or tell the peers of this rank's own error."""
        if isinstance(exception, KeyboardInterrupt):
            return
        try:
            if is_peer_lost(exception):
                message = self.watchdog.explain_lost_peer()
                _print_report(message)
                if hasattr(exception, "add_note"):  # Python 3.11+: shown in the traceback itself
                    exception.add_note(message)
            else:
                self.watchdog.publish_error(exception)
        except Exception:  # noqa: BLE001 - the user's exception is what propagates, whatever happens here
            pass


_CALLBACK_CLASSES: dict[type, type] = {}


def watchdog_callback(trainer: Any, watchdog: Watchdog) -> WatchdogHooks:
    """A Callback of ``trainer``'s Lightning (``lightning.pytorch`` or ``pytorch_lightning``) marking ``watchdog``.

    Built on demand: this module is shared by both Lightnings and imports neither
    ([Note: the pytorch_lightning copies] in _compat.py).
    """
    package = "pytorch_lightning" if type(trainer).__module__.startswith("pytorch_lightning") else "lightning.pytorch"
    import importlib

    base = importlib.import_module(f"{package}.callbacks").Callback
    cls = _CALLBACK_CLASSES.get(base)
    if cls is None:
        cls = _CALLBACK_CLASSES[base] = type("WatchdogCallback", (WatchdogHooks, base), {})
    return cls(watchdog)


def start_watchdog(trainer: Any, timeout_s: float) -> Optional[WatchdogHooks]:
    """Start this rank's watchdog and add its callback to ``trainer`` (None: off, or nobody to wait for)."""
    import torch.distributed as dist

    if timeout_s <= 0 or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    watchdog = Watchdog(_get_default_store(), dist.get_rank(), dist.get_world_size(), timeout_s).start()
    callback = watchdog_callback(trainer, watchdog)
    trainer.callbacks.append(callback)
    return callback


def stop_watchdog(trainer: Any, callback: Optional[WatchdogHooks]) -> None:
    if callback is None:
        return
    callback.watchdog.stop()
    if callback in trainer.callbacks:
        trainer.callbacks.remove(callback)
