"""A checkpoint asked for at an exception ([Note: a checkpoint at an exception] in checkpoint/at_exception.py)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lightning_ampzero.checkpoint.at_exception import SaveAtException
from lightning_ampzero.watchdog import Record

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _scripts import SCRIPTS, script_env  # noqa: E402
from _store import DictStore  # noqa: E402


def _agreement(store, rank, world, reports, **kw):
    return SaveAtException(store, rank, world, poll_s=0.01, report=reports.append, **kw)


def test_every_rank_at_the_save_saves():
    store, reports, results = DictStore(), [], {}

    def rank(r):
        time.sleep(0.05 * r)  # they come a little apart
        results[r] = _agreement(store, r, 3, reports, grace_s=5).agree()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: True, 1: True, 2: True} and reports == []


def test_a_rank_blocked_in_a_collective_is_not_waited_for_and_a_later_comer_skips_too():
    store, reports = DictStore(), []
    records = {0: Record(5, 3, "training_step"), 1: Record(5, 3, "backward", "all_reduce (called from x.py:1)")}
    alone = _agreement(store, 0, 2, reports, records=lambda: records, grace_s=60)
    began = time.monotonic()
    assert alone.agree() is False
    took = time.monotonic() - began
    # decided from the records (blocked for BLOCKED_S), long before the grace time
    assert 1.9 < took < 10, took
    assert len(reports) == 1 and "rank(s) 1 did not come to it (rank 1 is blocked in all_reduce" in reports[0]
    assert "all_reduce (called from x.py:1), in its step 3 (backward))" in reports[0]  # where the peer is
    assert reports[0].startswith("ampzero (rank 0): the checkpoint asked for at the exception")
    # rank 1's collective fails when rank 0 leaves; it comes to its own save and reads the decision
    late = _agreement(store, 1, 2, reports, records=lambda: records, grace_s=60)
    began = time.monotonic()
    assert late.agree() is False and time.monotonic() - began < 1
    assert "rank 0 ended on an error of its own while rank(s) 1 could not join its save" in reports[1]
    # a second save at the same exception (another OnExceptionCheckpoint) skips at once, on both
    assert alone.agree() is False and late.agree() is False and len(reports) == 4


def test_a_missing_rank_that_still_runs_is_waited_for_until_it_comes():
    store, reports, results = DictStore(), [], {}
    records = {0: Record(5, 3, "training_step"), 1: Record(5, 3, "training_step")}  # in no collective

    def later():
        time.sleep(3)  # longer than BLOCKED_S: running, not blocked, so not given up on
        results[1] = _agreement(store, 1, 2, reports, records=lambda: records, grace_s=60).agree()

    t = threading.Thread(target=later)
    t.start()
    results[0] = _agreement(store, 0, 2, reports, records=lambda: records, grace_s=60).agree()
    t.join()
    assert results == {0: True, 1: True} and reports == []


def test_without_records_the_grace_time_decides():
    store, reports = DictStore(), []
    began = time.monotonic()
    assert _agreement(store, 1, 2, reports, grace_s=0.5).agree() is False
    assert 0.5 <= time.monotonic() - began < 5
    assert "rank(s) 0 did not come to it (did not come within 0 s)" in reports[0] or "did not come within" in reports[0]


def test_a_store_that_is_gone_means_skip():
    class Gone(DictStore):
        def check(self, keys):
            raise RuntimeError("Connection reset by peer")

    reports = []
    assert _agreement(Gone(), 1, 2, reports).agree() is False
    assert "the process group's store is gone (RuntimeError: rank 0 has ended)" in reports[0]


def _run(args, log, timeout):
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, str(SCRIPTS / "exception_checkpoint.py"), *map(str, args)],
                                env=script_env({"OMP_NUM_THREADS": "1"}), stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
        began = time.monotonic()
        try:
            proc.wait(timeout=timeout)
        finally:
            try:
                import os

                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return proc.returncode, Path(log).read_text(), time.monotonic() - began


def test_one_rank_raising_alone_ends_the_run_at_once_with_the_reason_and_writes_nothing(tmp_path):
    """Before: the save's broadcast met the peer's reduce-scatter; the run hung until the hang
    detector (300 s) and no checkpoint was written, the peer's traceback naming a transport error."""
    ckpt = tmp_path / "ckpt"
    code, out, took = _run([2, "last", ckpt], tmp_path / "out.txt", timeout=150)
    assert code != 0 and "ValueError: a bad batch on rank 1" in out, out[-3000:]
    assert took < 90, (took, out[-3000:])
    assert not (ckpt / "on_exception.ckpt").exists()
    assert re.search(r"ampzero \(rank 1\): the checkpoint asked for at the exception .* was not written: rank\(s\) 0"
                     r" did not come to it \(rank 0 is blocked in ", out), out[-3000:]
    assert "ampzero (rank 0): the checkpoint asked for at the exception" in out, out[-3000:]
    # the peer's own report still names where it was in the step, not the save it skipped
    assert re.search(r"ampzero watchdog \(rank 0\): a collective failed in step 3, (training_step|backward), because a"
                     r" peer went away", out), out[-3000:]


def test_every_rank_raising_writes_the_checkpoint_and_resuming_from_it_trains_as_without_the_error(tmp_path):
    ckpt = tmp_path / "ckpt"
    code, clean, _ = _run([3, "none", tmp_path / "clean"], tmp_path / "clean.txt", timeout=150)
    assert code == 0, clean[-3000:]
    code, out, _ = _run([3, "all", ckpt], tmp_path / "raise.txt", timeout=150)
    assert code != 0 and "ValueError: a bad batch on rank 0" in out and "was not written" not in out, out[-3000:]
    assert (ckpt / "on_exception.ckpt" / ".metadata").is_file()
    code, resumed, _ = _run([3, "all", ckpt, "resume"], tmp_path / "resume.txt", timeout=150)
    assert code == 0, resumed[-3000:]
    assert "rank 0: started at step 3" in resumed and "rank 1: started at step 3" in resumed

    def digest(text):
        return set(re.findall(r"weights digest (\S+) at step 6", text))

    assert len(digest(clean)) == 1 and digest(resumed) == digest(clean), (digest(clean), digest(resumed))
