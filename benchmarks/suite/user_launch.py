"""Run a benchmark's worker as a user's plain ``python script.py`` (bench_user_launch.py, bench_hf_gpt2.py).

Issue 16 found ampzero's ranks oversubscribing the cores only when launched with nothing exported,
which the pinned suite never saw; these benchmarks therefore start each strategy as its own command
with the variables a launcher or a shell profile may have left removed, so what the strategy sets
(threads, allocator) is all that applies.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Set by launchers (torchrun, a parent Lightning run) or by hand; a user's script starts without them.
NOT_INHERITED = ("OMP_NUM_THREADS", "LOCAL_RANK", "RANK", "WORLD_SIZE")


def run_as_user(script: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``python script args...`` from the repository root, with the package importable and nothing else set."""
    env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, script, *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
