"""exit_process: what a process wrote is flushed, the process group is destroyed, the code is kept."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from _scripts import ROOT, script_env

BODY = textwrap.dedent("""
    import logging, sys, tempfile, os
    import torch.distributed as dist
    from lightning_ampzero.process import exit_process, run_and_exit

    logging.basicConfig(filename=sys.argv[1], level=logging.INFO)
    logging.getLogger("t").info("logged before exit")
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    import atexit
    atexit.register(lambda: print("atexit ran", flush=True))  # os._exit skips it: no finalization
    sys.stdout.write("unflushed stdout")
    sys.stderr.write("unflushed stderr")
    if sys.argv[2] == "direct":
        exit_process(3)
    run_and_exit(lambda: {"code": 4, "message": "a message"}.get(sys.argv[2]))
""")


def _run(tmp_path, mode):
    log = tmp_path / f"{mode}.log"
    proc = subprocess.run([sys.executable, "-c", BODY, str(log), mode], env=script_env(), capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    return proc, log.read_text()


def test_exit_process_flushes_and_keeps_the_code(tmp_path):
    for mode, code in (("direct", 3), ("code", 4), ("none", 0)):
        proc, log = _run(tmp_path, mode)
        assert proc.returncode == code, (mode, proc.stderr[-2000:])
        assert proc.stdout == "unflushed stdout", mode  # flushed, and no finalization (atexit skipped)
        assert proc.stderr.endswith("unflushed stderr"), mode
        assert "logged before exit" in log, mode
    proc, _ = _run(tmp_path, "message")  # a non-int result exits 1 with the message, as sys.exit does
    assert proc.returncode == 1 and proc.stderr.endswith("unflushed stderra message\n"), proc.stderr[-500:]


C10D_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv")


@pytest.fixture(scope="module")
def user_script(tmp_path_factory) -> list[dict]:
    """tests/scripts/user_exit.py run as a user runs it: a plain script, nothing exported (issue 16)."""
    from _scripts import run_script

    out = tmp_path_factory.mktemp("user_script")
    run_script("user_exit.py", str(out / "threads-{rank}.json"), timeout=300, env={"OMP_NUM_THREADS": None})
    return [json.loads((out / f"threads-{rank}.json").read_text()) for rank in (0, 1)]


def test_a_user_script_exits_with_no_c10d_thread_left(user_script):
    """The strategy's exit hook frees the groups (stage 0's DDP and stage 3's FSDP2 hold them)."""
    for rank, seen in enumerate(user_script):
        # The check can fail: with the models alive, the threads still run before the hook...
        assert "pt_gloo_runloop" in seen["before_hook"], (rank, seen)
        # ...and the hook stops them before finalization, where they could abort the exit.
        assert not [t for t in seen["after_hook"] if t in C10D_THREADS], (rank, seen)


def test_each_rank_of_a_user_script_computes_with_its_share_of_the_cores(user_script):
    """As Lightning's ddp does: cores // processes per node threads, OMP_NUM_THREADS set for the
    libraries that read it. Rank 1 (started by rank 0's launcher, so its processes are "created
    externally") used to compute with every core of the machine: 2 ranks x 2 threads on 2 cores
    made a plain script's stage 0 1.6x slower than Lightning's ddp."""
    from lightning.fabric.utilities.distributed import _suggested_max_num_threads

    share = _suggested_max_num_threads(2)
    for rank, seen in enumerate(user_script):
        for stage in (0, 3):
            assert seen[f"threads_stage{stage}"] == [share, str(share)], (rank, stage, seen)


STUCK = textwrap.dedent("""
    import os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from lightning_ampzero.process import release_process_groups

    rank, path = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    if rank == 1:
        time.sleep(60)  # never joins rank 0's all-reduce
    else:
        dist.all_reduce(torch.ones(1), async_op=True)  # in flight on gloo's thread until the timeout
        start = time.monotonic()
        release_process_groups(timeout_s=2.0)
        print(f"released in {time.monotonic() - start:.2f}", flush=True)
        os._exit(0)
""")


def test_release_does_not_wait_for_a_collective_stuck_on_a_missing_peer(tmp_path):
    """A crashed or diverged peer must not hold a rank's exit for the process-group timeout."""
    store = str(tmp_path / "store")
    peer = subprocess.Popen([sys.executable, "-c", STUCK, "1", store], env=script_env(), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc = subprocess.run([sys.executable, "-c", STUCK, "0", store], env=script_env(), capture_output=True,
                              text=True, timeout=60, cwd=ROOT)
    finally:
        peer.kill()
        peer.wait()
    assert proc.returncode == 0, proc.stderr[-2000:]
    elapsed = float(proc.stdout.split("released in ")[1])
    assert 2.0 <= elapsed < 5.0, elapsed  # it waited its timeout for the stuck thread, and no longer


def test_exit_scan_reads_holders_without_their_deprecation_warnings():
    # The exit hook scans every object; torch.distributed.reduce_op warns (FutureWarning) on any
    # attribute access, which printed one warning per rank at the end of every user script.
    import warnings

    import torch.distributed as dist

    from lightning_ampzero.process import _held_by_us, _instance_dict

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _held_by_us(dist.reduce_op)
        assert "SUM" in _instance_dict(dist.reduce_op)
        assert _instance_dict(3) is None and not _held_by_us(3)


def test_exit_hook_scan_raises_no_deprecation_warning():
    # A user's script printed "FutureWarning: torch.distributed.reduce_op is deprecated" per rank at
    # exit: the scan's isinstance() read reduce_op.__class__ through its warning __getattribute__.
    code = ("import torch.distributed, torch.nn.parallel\n"
            "from lightning_ampzero.process import release_process_groups\n"
            "release_process_groups(timeout_s=1.0)\n")
    proc = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "reduce_op" not in proc.stderr, proc.stderr[-2000:]
