"""The hang detector's decisions ([Note: hang detection] in lightning_ampzero/watchdog.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from _store import DictStore

from lightning_ampzero.watchdog import Record, Watchdog, diagnose


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
    assert "every rank must run each unit's forward" in diagnose(1, before, after)  # experts as units, skipped
    after[1] = Record(4, 3, "optimizer_step", "broadcast")
    assert "blocked in different collectives: rank 0 in all_reduce; rank 1 in broadcast" in diagnose(1, before, after)


def test_a_rank_waiting_in_generate_alone_is_told_where_to_generate():
    # Rank 0 alone runs transformers' generate() inside training_step at stage 3: all-gathers that
    # only rank 0 entered (outside the step methods apply.OUTSIDE_STEP raises first).
    gen = "all_gather_single (called from comm.py:364) in transformers' generate()"
    before = {0: Record(1, 2, "training_step", gen), 1: Record(1, 2, "training_step", "all_gather_single")}
    after = {0: Record(4, 2, "training_step", gen), 1: Record(4, 2, "training_step", "all_gather_single")}
    message = diagnose(1, before, after)
    assert "Rank(s) 0 wait in generate(), the others do not" in message
    assert "on_validation_epoch_end" in message
    before[1], after[1] = Record(1, 2, "training_step", gen), Record(4, 2, "training_step", gen)
    assert "wait in generate()" not in diagnose(1, before, after)  # every rank in one generate()
    # Rank 0 generating in on_train_epoch_end, rank 1 in training_step: one collective, two places.
    before[0], after[0] = Record(1, 2, "between_steps", gen), Record(4, 2, "between_steps", gen)
    message = diagnose(1, before, after)
    assert "but from different places: rank 0 in step 2, between_steps; rank 1 in step 2, training_step" in message
    assert "Rank(s) 0, 1 wait in generate(), not all from the same place" in message


def test_blocked_in_reads_the_collective_off_a_threads_stack():
    from lightning_ampzero.watchdog import blocked_in

    assert blocked_in(threading.get_ident()) == ""  # this thread is in no collective


def test_the_caller_of_a_collective_is_named_from_its_package_down(tmp_path, monkeypatch):
    # "blocked in barrier (called from distributed.py:213)" did not say which package's
    # distributed.py (a trial): Lightning's, torch's and ampzero's all have files of that name.
    import os

    from lightning_ampzero import watchdog

    site = os.path.join(os.sep, "venv", "lib", "python3.11", "site-packages")
    assert watchdog._short_path(os.path.join(site, "lightning", "fabric", "utilities", "distributed.py")) \
        == os.path.join("lightning", "fabric", "utilities", "distributed.py")
    assert watchdog._short_path(watchdog.__file__) == os.path.join("lightning_ampzero", "watchdog.py")
    monkeypatch.chdir(tmp_path)
    assert watchdog._short_path(str(tmp_path / "scripts" / "train.py")) == os.path.join("scripts", "train.py")
    assert watchdog._short_path(os.path.join(os.sep, "elsewhere", "train.py")) == "train.py"


def test_blocked_in_names_a_wait_in_the_reduce_scatter_ring():
    # The ring (zero/comm.py) waits on isend/irecv works: no c10d function is on the stack. A
    # hang there said "in no collective" (a trial: experts as units of their own, one skipped).
    from lightning_ampzero.watchdog import blocked_in
    from lightning_ampzero.zero import comm

    release, entered = threading.Event(), threading.Event()

    class Work:
        def wait(self):
            entered.set()
            release.wait(30)

    thread = threading.Thread(target=comm._run, args=(iter([[Work()]]),))
    thread.start()
    try:
        assert entered.wait(10)
        assert "reduce-scatter ring" in blocked_in(thread.ident)
    finally:
        release.set()
        thread.join()


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
# A rank that went away: the transport's error names a host:port, the watchdog the rank
# ---------------------------------------------------------------------------------------

def test_transport_errors_that_mean_a_lost_peer():
    from lightning_ampzero.watchdog import is_peer_lost

    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:29106: Connection reset by peer.")
    assert is_peer_lost(gloo)
    try:
        try:
            raise gloo
        except RuntimeError as inner:
            raise ValueError("wrapped by a library") from inner
    except ValueError as outer:
        assert is_peer_lost(outer)  # found through the chain
    assert not is_peer_lost(ValueError("a bad batch"))


def _identify(store, dogs, hosts_pids):
    """Give each watchdog of a DictStore fleet the host and process id ``hosts_pids[rank]``."""
    for d in dogs:
        host, pid = hosts_pids[d.rank]
        store.set(d._id_key(d.rank), f"{host}|{pid}")


def test_a_peer_that_ended_on_its_own_error_is_named_with_it():
    import socket

    store = DictStore()
    dogs, _ = _fleet(store, 3, timeout_s=60)
    _identify(store, dogs, {r: (socket.gethostname(), os.getpid()) for r in range(3)})
    dogs[2].mark(5, "training_step")
    dogs[2].publish_error(ValueError("a bad batch on rank 2\nmore detail"))
    dogs[0].mark(5, "backward")
    message = dogs[0].explain_lost_peer()
    for d in dogs:
        d.stop()
    assert "a collective failed in step 5, backward, because a peer went away" in message
    assert "Rank 2 ended on an error of its own in step 5: ValueError: a bad batch on rank 2 (its traceback" in message
    assert "Rank 1" not in message  # it responds


def test_a_killed_peer_on_this_host_is_seen_at_once_and_one_elsewhere_by_its_beats():
    import socket

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its process id no longer exists
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    while _state(zombie.pid) != "Z":
        time.sleep(0.01)
    store = DictStore()
    dogs, _ = _fleet(store, 4, timeout_s=60)
    here = socket.gethostname()
    _identify(store, dogs, {0: (here, os.getpid()), 1: (here, dead.pid), 2: (here, zombie.pid), 3: ("elsewhere", 1)})
    start = time.monotonic()
    message = dogs[0].explain_lost_peer()
    assert time.monotonic() - start < 0.05  # a local peer is gone: no beats to wait for
    assert "Rank 1 is gone (its process no longer exists)" in message
    assert "Rank 2 has exited (its process is a zombie" in message
    # not only the OOM killer: a Ctrl-C that reached that rank first looks the same from here
    assert "ended without an error of its own: stopped by a signal (Ctrl-C, kill" in message
    zombie.wait()
    # Only a remote peer is in question: its beats decide (rank 3 stops beating, like a killed one).
    _identify(store, dogs, {0: (here, os.getpid()), 1: (here, os.getpid()), 2: (here, os.getpid()),
                            3: ("elsewhere", 1)})
    dogs[3]._stop.set()
    time.sleep(0.1)
    message = dogs[0].explain_lost_peer()
    # This rank is in step 3: rank 3's last report (one a beat) is older than where it got to
    dogs[0].mark(3, "training_step")
    later = dogs[0].explain_lost_peer()
    for d in dogs:
        d.stop()
    assert "Rank 3 not responding, last seen in step 0, setup" in message
    assert "Rank 1" not in message and "Rank 2" not in message
    assert ("Rank 3 not responding, whose last report (one a beat, 0.05 s) was from step 0, setup, in no collective:"
            " it got further since, as far as step 3 at least") in later, later


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


# ---------------------------------------------------------------------------------------
# A user's Trainer script: a rank stopped or stuck mid-step ends the run on every live rank
# ---------------------------------------------------------------------------------------

import re  # noqa: E402
import signal  # noqa: E402
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


@pytest.mark.parametrize(("devices", "mode"), [(2, "kill"), (3, "kill"), (2, "raise")])
def test_a_rank_that_went_away_is_named_by_every_live_rank(tmp_path, devices, mode):
    """A plain Trainer script: rank ``devices - 1`` is killed (SIGKILL) or raises in step 3. Its peers
    get gloo's "Connection reset/closed by peer [host]:port" at once; each names the rank, in the
    traceback too (a note on the exception), before Lightning's launcher ends the run."""
    pids, log = tmp_path / "pid", tmp_path / "out.txt"
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, str(SCRIPTS / "hang.py"), str(devices), mode, "60", str(pids)],
                                env=script_env({"OMP_NUM_THREADS": "1"}), stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=240)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # anything left (Lightning's launcher usually took all)
            except ProcessLookupError:
                pass
            proc.wait()
    out = log.read_text()
    culprit = devices - 1
    assert re.search(rf"rank {culprit}: {mode} at ", out), out[-3000:]
    assert proc.returncode != 0
    for rank in range(devices - 1):
        head = f"ampzero watchdog (rank {rank}): a collective failed in step 3, training_step, because a peer went away."
        assert head in out, out[-3000:]
        report = out[out.index(head):]
        if mode == "kill":
            assert re.search(rf"Rank {culprit} (is gone|has exited) \(its process", report), report[:1000]
        else:
            assert f"Rank {culprit} ended on an error of its own in step 3: ValueError: a bad batch on rank {culprit}" \
                in report
        assert f"[rank{rank}]: {head}" in out  # the note, in the traceback Lightning prints


def test_a_culprit_that_already_ended_on_its_own_watchdog_is_still_named():
    # The stuck rank sees its own progress stop too, and may end first: where it was still counts.
    before = {0: Record(10, 3, "training_step", "barrier"), 1: Record(9, 3, "training_step")}
    after = {0: Record(14, 3, "training_step", "barrier"), 1: Record(10, 3, "exited:training_step")}
    message = diagnose(0, before, after)
    assert "Rank(s) 1 did not arrive where the others wait in barrier: rank 1 is in step 3, training_step, in no" \
           " collective (since ended by its watchdog)" in message
    assert "not responding" not in message
