"""Run the training scripts in tests/scripts/ in a subprocess (never Lightning multi-process in pytest);
and :func:`setup_warnings`, what one in-process, one-device Trainer warns over a fit and a validate."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


# What a launcher sets for its processes. An in-process Trainer run leaves some of them in the
# test process (Lightning sets MASTER_PORT, LOCAL_RANK and NODE_RANK there): a script must not
# inherit them, or it joins a rendezvous port that the test process still holds (EADDRINUSE).
LAUNCH_KEYS = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "RANK", "MASTER_PORT", "MASTER_ADDR")


def script_env(extra: Optional[dict[str, Optional[str]]] = None) -> dict[str, str]:
    """The test process's environment for a script, with ``extra`` set (a value of None removes the key)."""
    env = dict(os.environ)
    for key in LAUNCH_KEYS:
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(SCRIPTS), env.get("PYTHONPATH", "")])
    env["PYTHONWARNINGS"] = "ignore"
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(name: str, *args: str, timeout: float = 600, env: Optional[dict[str, Optional[str]]] = None,
               launcher: Optional[list[str]] = None) -> subprocess.CompletedProcess:
    cmd = [*(launcher or [sys.executable]), str(SCRIPTS / name), *args]
    proc = subprocess.run(cmd, env=script_env(env), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{_tail(proc.stdout, 3000)}\n"
                             f"{_tail(proc.stderr, 5000)}")
    return proc


def run_script_failing(name: str, *args: str, timeout: float = 300, why: str = "") -> subprocess.CompletedProcess:
    """Run a script of tests/scripts that must end with an error (its exit status is not 0); its output, for the checks."""
    proc = subprocess.run([sys.executable, str(SCRIPTS / name), *args], env=script_env(), capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode != 0, why or f"{name} was expected to fail:\n{_tail(proc.stdout, 3000)}"
    return proc


# Lightning's per-Trainer banners: they would fill the tail of a failed run's output that CI shows.
_NOISE = re.compile(r"^(GPU available|TPU available|💡 Tip|`Trainer\.fit` stopped|Initializing distributed|-{20,}|"
                    r"distributed_backend=|All distributed processes registered|\s*$)")


def _tail(text: str, limit: int) -> str:
    kept = [line for line in text.splitlines() if not _NOISE.match(line)]
    return "\n".join(kept)[-limit:]


def run_json(name: str, out: Path, *args: str, **kw: Any) -> Any:
    run_script(name, *args, "--out", str(out), **kw)
    return json.loads(out.read_text())


def max_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def setup_warnings(strategy: Any, needle: str, precision: str = "32-true") -> list[str]:
    """The warnings containing ``needle`` over ``fit`` then ``validate`` of a BoringModel with one
    in-process CPU Trainer: a setup note must appear once per strategy, not at each Trainer call."""
    import warnings

    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_steps=1,
                         limit_val_batches=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(BoringModel())
        trainer.validate(BoringModel(), verbose=False)
    return [str(w.message) for w in caught if needle in str(w.message)]
