"""Rank 0's SIGTERM stops every rank (asynchronous broadcast: sigterm.py), one batch after Lightning's check."""

from __future__ import annotations

import json

import pytest

from _scripts import run_script


@pytest.mark.parametrize("strategy, last", [("ampzero", 4), ("ddp", 3)])  # STOP_AT = 3
def test_sigterm_on_rank0_stops_every_rank(tmp_path, strategy, last):
    out = tmp_path / "ended"
    run_script("sigterm.py", "--strategy", strategy, "--out", str(out), timeout=300)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"ended.{rank}.json").read_text())
        # Lightning's ddp stops every rank before the next batch; ampzero one batch later.
        assert r["ended"] == "sigterm" and r["trained"] == list(range(last + 1)), (strategy, rank, r)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_real_sigterm_to_rank0_mid_backward_under_torchrun_stops_every_rank(tmp_path, stage):
    # [Note: a SIGTERM in the middle of a step] in sigterm.py: Lightning's handler broadcast from inside
    # the backward, against rank 1's reduce-scatters, and every rank hung until torchrun's SIGKILL.
    import sys

    from _scripts import free_port

    out = tmp_path / "ended"
    run_script("sigterm_in_backward.py", "--stage", str(stage), "--out", str(out), timeout=120,
               launcher=[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                         "--master_addr=127.0.0.1", f"--master_port={free_port()}"])
    for rank in (0, 1):
        r = json.loads((tmp_path / f"ended.{rank}.json").read_text())
        # the signal lands in batch 3; the next batch's all-reduce tells every rank, which stop after it
        assert r == {"trained": [0, 1, 2, 3, 4], "ended": "sigterm", "global_step": 5}, (stage, rank, r)
