"""A checkpoint asked for at an exception, when only some ranks ended on it.

[Note: a checkpoint at an exception]
Lightning calls every callback's ``on_exception`` on the rank that raised, and
``OnExceptionCheckpoint`` (or a user's own ``trainer.save_checkpoint`` there) saves. A sharded
checkpoint is collective: every rank writes its shards, and the save begins with a broadcast of
the path. When every rank raised (the same bug on each, Ctrl-C in a terminal) every rank comes to
the save and it works. When one rank raised alone (a bad sample on that rank), its peers are
blocked in the step's collective that it left: the save's broadcast met theirs, and the run hung
until the hang detector ended it (``watchdog_s``, 300 s by default), with no checkpoint and a
transport error inside the peers' own save. (Lightning's ``ddp`` writes its one-file checkpoint
from rank 0 and then hangs in the save's barrier until the process-group timeout, 30 minutes.)

So a save at an exception first agrees, through the process group's key-value store (which needs
no collective), whether every rank is there. Each rank posts that it has come and waits until
every rank has (the save then runs as usual), or until it can tell that the missing ranks will not
come: the hang detector's records say they are blocked in a collective (for two beats: a collective
without this rank cannot complete) or have ended, or :data:`GRACE_S` has passed. The first rank to
decide writes the decision with compare-and-set, so every rank acts on the same one, a rank that
comes later as well; and "skip" stands for every later save at the exception of this run. A skipped
save writes nothing (no partial directory), says why on its rank, and lets the exception end the
run: the failing rank's exit breaks its peers' collective at once, they reach their own save at the
exception, read the decision and skip too. The checkpoint to resume from is the last one written
before the error (``ModelCheckpoint(every_n_train_steps=...)`` keeps a recent one).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from lightning_ampzero.watchdog import _print_report, trainer_interrupted

#: Longest wait for the other ranks when their hang-detector records cannot tell (the detector
#: is off). Ranks that all raised come within a second or two of each other.
GRACE_S = 30.0
#: How long a missing rank must be seen blocked in a collective before it is taken as not coming.
BLOCKED_S = 2.0
_PREFIX = "ampzero/save_at_exception/"
_SKIP_ALL = _PREFIX + "skip"


class SaveAtException:
    """Decides, once per save at an exception, whether every rank takes part ([Note: a checkpoint at an exception]).

    ``records`` reads the hang detector's records of every rank (``Watchdog._read``), or is None
    when the detector is off. ``store`` is the process group's store (``set``, ``get``, ``check``,
    ``compare_set``).
    """

    def __init__(self, store: Any, rank: int, world_size: int, *, records: Optional[Callable[[], dict]] = None,
                 grace_s: float = GRACE_S, poll_s: float = 0.2, report: Optional[Callable[[str], None]] = None) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.records, self.grace_s, self.poll_s = records, grace_s, poll_s
        self.report = report or _print_report
        self._count = 0  # saves at the exception so far on this rank; every rank counts the same ones

    def agree(self) -> bool:
        """Whether this save goes ahead (every rank is in it). Prints why not on this rank."""
        n, self._count = self._count, self._count + 1
        decision_key = f"{_PREFIX}{n}/decision"
        try:
            if self.store.check([_SKIP_ALL]):
                return self._skipped(self.store.get(_SKIP_ALL).decode())
            self.store.set(f"{_PREFIX}{n}/{self.rank}", "1")
            deadline = time.monotonic() + self.grace_s
            blocked_since: dict[int, float] = {}
            while True:
                if self.store.check([decision_key]):
                    return self._outcome(self.store.get(decision_key).decode())
                missing = [r for r in range(self.world_size) if not self.store.check([f"{_PREFIX}{n}/{r}"])]
                if not missing:
                    return self._outcome(self.store.compare_set(decision_key, "", "save").decode())
                why = self._not_coming(missing, blocked_since)
                if why is None and time.monotonic() >= deadline:
                    why = f"did not come within {self.grace_s:.0f} s"
                if why is not None:
                    value = f"skip|{self.rank}|{','.join(map(str, missing))}|{why}"
                    decided = self.store.compare_set(decision_key, "", value).decode()
                    if decided.startswith("skip"):
                        self.store.set(_SKIP_ALL, decided)
                    return self._outcome(decided)
                time.sleep(self.poll_s)
        except Exception as error:  # noqa: BLE001 - the store is hosted by rank 0's process, which may have ended
            return self._skipped(f"skip|?|?|the process group's store is gone ({type(error).__name__}: rank 0 has"
                                 " ended)")

    def _not_coming(self, missing: list[int], blocked_since: dict[int, float]) -> Optional[str]:
        """Why the missing ranks will not come, when their records say so for every one of them."""
        if self.records is None:
            return None
        records, now = self.records(), time.monotonic()
        reasons = []
        for r in missing:
            record = records.get(r)
            if record is None:
                return None
            if record.exited:
                reasons.append(f"rank {r} has ended")
            elif record.waiting:
                blocked_since.setdefault(r, now)
                if now - blocked_since[r] < BLOCKED_S:
                    return None
                reasons.append(f"rank {r} is blocked in {record.waiting}, in its step {record.step} ({record.phase})")
            else:
                blocked_since.pop(r, None)
                return None  # still running: it may yet come (the same error, a step later)
        return "; ".join(reasons)

    def _outcome(self, decision: str) -> bool:
        return True if decision == "save" else self._skipped(decision)

    def _skipped(self, decision: str) -> bool:
        _, decider, missing, why = (decision.split("|", 3) + ["", "", ""])[:4]
        if decider == str(self.rank):
            who = (f"rank(s) {missing} did not come to it ({why}): a collective there waits for this rank, which"
                   " left the loop on its error")
        elif decider == "?":
            who = why
        else:
            who = (f"rank {decider} ended on an error of its own while rank(s) {missing} could not join its save"
                   f" ({why})")
        self.report(
            f"ampzero (rank {self.rank}): the checkpoint asked for at the exception (OnExceptionCheckpoint, or"
            f" trainer.save_checkpoint in on_exception) was not written: {who}. A sharded checkpoint needs every"
            " rank, and only some ranks ended on the error. Resume from the last checkpoint written before it"
            " (ModelCheckpoint(every_n_train_steps=...) keeps a recent one), after fixing the error in the"
            " traceback; nothing was written for this save.")
        return False


class ExceptionSaveGate:
    """The strategy's side: one agreement per save at an exception, kept until the save's barrier.

    The strategy asks :meth:`skip` at the start of each collective part of a save (the model's and
    optimizers' state dicts, the write, the barrier after it); outside an exception, or on one
    process, it answers False at once and costs nothing.
    """

    def __init__(self) -> None:
        self._agreement: Optional[SaveAtException] = None
        self._go: Optional[bool] = None

    def skip(self, strategy: Any) -> bool:
        trainer = getattr(strategy.lightning_module, "_trainer", None)
        if strategy.world_size < 2 or trainer is None or not trainer_interrupted(trainer):
            return False
        if self._go is None:
            if self._agreement is None:
                from torch.distributed.distributed_c10d import _get_default_store

                watchdog = strategy._watchdog[1] if strategy._watchdog is not None else None
                self._agreement = SaveAtException(
                    _get_default_store(), strategy.global_rank, strategy.world_size,
                    records=watchdog.watchdog._read if watchdog is not None else None)
            self._go = self._agreement.agree()
        return not self._go

    def end_save(self) -> None:
        """The save is over (its barrier): the next save at the exception agrees afresh."""
        self._go = None
