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
