"""The hang detector's decisions ([Note: hang detection] in lightning_ampzero/watchdog.py)."""

from __future__ import annotations

import threading
import time

from lightning_ampzero.watchdog import Record, Watchdog, diagnose


class DictStore:
    """The three calls the watchdog makes of a c10d store, over a dict shared by threads."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def set(self, key: str, value: str) -> None:
        with self.lock:
            self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        with self.lock:
            return self.data[key]

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(k in self.data for k in keys)


def test_a_stopped_rank_is_named_as_not_responding():
    before = {0: Record(10, 7, "backward", "reduce_scatter_tensor"), 1: Record(9, 7, "training_step"),
              2: Record(12, 7, "backward", "reduce_scatter_tensor")}
    after = {0: Record(14, 7, "backward", "reduce_scatter_tensor"), 1: Record(9, 7, "training_step"),
             2: Record(16, 7, "backward", "reduce_scatter_tensor")}
    message = diagnose(0, before, after)
    assert "this rank is in step 7, backward, blocked in reduce_scatter_tensor" in message
    assert "Rank(s) 1 not responding (stopped, killed, or hung outside Python): rank 1 last seen in step 7," \
           " training_step, in no collective" in message
    assert "did not arrive" not in message


def test_a_rank_stuck_before_the_collective_is_named_and_knows_it():
    before = {0: Record(10, 7, "training_step", "all_gather_into_tensor"), 1: Record(9, 7, "training_step"),
              2: Record(12, 7, "training_step", "all_gather_into_tensor")}
    after = {0: Record(14, 7, "training_step", "all_gather_into_tensor"), 1: Record(13, 7, "training_step"),
             2: Record(16, 7, "training_step", "all_gather_into_tensor")}
    seen_by_0 = diagnose(0, before, after)
    assert "Rank(s) 1 did not arrive where the others wait in all_gather_into_tensor: rank 1 is in step 7," \
           " training_step, in no collective" in seen_by_0
    assert "not responding" not in seen_by_0 and "This rank" not in seen_by_0
    assert "This rank (1) is one of them" in diagnose(1, before, after)


def test_without_a_visible_collective_the_rank_behind_is_named():
    # DDP reduces in C++ (no Python frame): the loop positions tell who is behind.
    before = {0: Record(10, 7, "backward"), 1: Record(9, 7, "training_step")}
    after = {0: Record(14, 7, "backward"), 1: Record(13, 7, "training_step")}
    assert "Rank(s) 1 did not arrive where the others are further on" in diagnose(0, before, after)


def test_every_rank_in_the_same_or_in_different_collectives():
    before = {0: Record(1, 3, "optimizer_step", "all_reduce"), 1: Record(1, 3, "optimizer_step", "all_reduce")}
    after = {0: Record(4, 3, "optimizer_step", "all_reduce"), 1: Record(4, 3, "optimizer_step", "all_reduce")}
    assert "Every rank responds and is in step 3, optimizer_step, blocked in all_reduce" in diagnose(1, before, after)
    after[1] = Record(4, 3, "optimizer_step", "broadcast")
    assert "blocked in different collectives: rank 0 in all_reduce; rank 1 in broadcast" in diagnose(1, before, after)


def test_blocked_in_reads_the_collective_off_a_threads_stack():
    from lightning_ampzero.watchdog import blocked_in

    assert blocked_in(threading.get_ident()) == ""  # this thread is in no collective


def _fleet(store, world, timeout_s, poll_s=0.05):
    hangs: dict[int, str] = {}
    dogs = [Watchdog(store, r, world, timeout_s, poll_s=poll_s, report=lambda m, r=r: hangs.setdefault(r, m),
                     end=lambda: None)
            for r in range(world)]
    for d in dogs:
        d.start()
    return dogs, hangs


def test_progress_keeps_the_watchdog_quiet_and_a_stop_ends_it_within_the_watchdog_time():
    store = DictStore()
    dogs, hangs = _fleet(store, 3, timeout_s=0.5)
    for step in range(8):  # steady progress, slower than a poll, faster than the timeout
        for d in dogs:
            d.mark(step, "training_step")
        time.sleep(0.1)
    assert hangs == {}
    # rank 2 stops beating (as a SIGSTOPped process would); 0 and 1 wait in backward of step 8
    dogs[2]._stop.set()
    for d in dogs[:2]:
        d.mark(8, "backward")
    start = time.monotonic()
    while len(hangs) < 2 and time.monotonic() - start < 5:
        time.sleep(0.02)
    elapsed = time.monotonic() - start
    for d in dogs:
        d.stop()
    assert sorted(hangs) == [0, 1] and elapsed < 0.5 + 1.0, (hangs, elapsed)
    for rank in (0, 1):
        assert "Rank(s) 2 not responding (stopped, killed, or hung outside Python): rank 2 last seen in step 7," \
               " training_step, in no collective" in hangs[rank]


# ---------------------------------------------------------------------------------------
# A user's Trainer script: a rank stopped or stuck mid-step ends the run on every live rank
# ---------------------------------------------------------------------------------------

import os  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _scripts import SCRIPTS, script_env  # noqa: E402

WATCHDOG_S = 6.0


@pytest.mark.parametrize(("devices", "mode"), [(2, "stop"), (3, "stop"), (2, "stuck"), (3, "stuck")])
def test_a_stopped_or_stuck_rank_ends_the_run_naming_it(tmp_path, devices, mode):
    from lightning_ampzero.watchdog import HANG_EXIT_CODE

    pids, log = tmp_path / "pid", tmp_path / "out.txt"
    with open(log, "w") as sink:  # a file, not a pipe: a stopped rank would hold a pipe open
        proc = subprocess.Popen([sys.executable, str(SCRIPTS / "hang.py"), str(devices), mode, str(WATCHDOG_S),
                                 str(pids)], env=script_env({"OMP_NUM_THREADS": "1"}), stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=240)  # rank 0, which Lightning's launcher runs in this process
            ended = time.time()
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the stopped rank (and anything left) goes with its session
            proc.wait()
    out = log.read_text()
    culprit = devices - 1
    began = re.search(rf"rank {culprit}: {mode} at ([0-9.]+)", out)
    assert began, out[-3000:]
    assert proc.returncode == HANG_EXIT_CODE, (proc.returncode, out[-3000:])
    # within the watchdog time plus its diagnosis (3 beats) and a margin for a loaded machine
    assert ended - float(began.group(1)) < WATCHDOG_S + 15, (ended - float(began.group(1)), out[-3000:])
    for rank in range(devices - 1):
        report = out[out.index(f"ampzero watchdog (rank {rank})"):]
        assert "this rank is in step 3, training_step, blocked in " in report
        if mode == "stop":
            # last seen up to a beat (1 s) before it stopped: these steps take milliseconds
            assert re.search(rf"Rank\(s\) {culprit} not responding .*: rank {culprit} last seen in step \d+,", report)
        else:
            assert f"Rank(s) {culprit} did not arrive where the others wait in " in report
            assert f"rank {culprit} is in step 3, training_step, in no collective" in report
    if mode == "stuck":
        assert f"This rank ({culprit}) is one of them" in out  # the stuck rank reports itself, and ends


def test_a_culprit_that_already_ended_on_its_own_watchdog_is_still_named():
    # The stuck rank sees its own progress stop too, and may end first: where it was still counts.
    before = {0: Record(10, 3, "training_step", "barrier"), 1: Record(9, 3, "training_step")}
    after = {0: Record(14, 3, "training_step", "barrier"), 1: Record(10, 3, "exited:training_step")}
    message = diagnose(0, before, after)
    assert "Rank(s) 1 did not arrive where the others wait in barrier: rank 1 is in step 3, training_step, in no" \
           " collective (since ended by its watchdog)" in message
    assert "not responding" not in message
