"""NVMe optimizer offload in one process: resident memory measured, and every error path for real.

Run as a script (it changes process-wide limits: RLIMIT_FSIZE, SIGXFSZ). Writes JSON:

* ``resident``: peak RSS growth (VmHWM after resetting it through /proc/self/clear_refs) while
  an OffloadedAdam over one large parameter is created and steps, for ``cpu`` (the whole state
  becomes resident: the positive control) and ``nvme`` (bounded by buffer_count x tile).
* ``errors``: the message of each failure: missing / not-a-directory / unwritable path, out of
  space at creation (RLIMIT_FSIZE makes posix_fallocate fail with EFBIG), and a write failing in
  the middle of a step (the limit lowered after creation), plus what was left on disk.
"""

from __future__ import annotations

import argparse
import json
import resource
import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from lightning_ampzero.config import OffloadConfig
from lightning_ampzero.offload import NvmeOffloadError, OffloadedAdam
from lightning_ampzero.process import run_and_exit

NUMEL = 1 << 22  # 4M parameters: 48 MiB of fp32 master + Adam moments
TILE = 1 << 18
BUFFERS = 6


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def _model() -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(NUMEL))
    p.grad = torch.randn(NUMEL)
    return p, torch.optim.AdamW([p], lr=1e-3, foreach=True)


def _config(kind: str, path: str) -> OffloadConfig:
    extra = {"nvme_path": path} if kind == "nvme" else {}
    return OffloadConfig(offload_optimizer=kind, sub_group_size=TILE, buffer_count=BUFFERS, **extra)


def resident(kind: str, path: str) -> dict:
    p, inner = _model()
    torch.set_num_threads(1)
    _reset_peak()
    before = _status_kib("VmRSS")
    opt = OffloadedAdam(inner, _config(kind, path), nvme_dir=Path(path))
    opt.step()
    opt.step()
    grown = (_status_kib("VmHWM") - before) * 1024
    out = {"peak_rss_growth": grown, "resident_bytes": opt.store.resident_bytes(), "state_bytes": 12 * NUMEL,
           "bound": BUFFERS * TILE * 4}
    if kind == "nvme":
        out["bytes_read"] = opt.store.bytes_read
        out["bytes_written"] = opt.store.bytes_written
    opt.close()
    return out


@contextmanager
def file_size_limit(nbytes: int):
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)


def _expect_error(fn) -> str:
    try:
        fn()
    except NvmeOffloadError as e:
        return str(e)
    return "NO ERROR"


def errors(root: Path) -> dict:
    out: dict = {}
    new = lambda path: OffloadedAdam(_model()[1], _config("nvme", str(path)), nvme_dir=Path(path))  # noqa: E731
    out["missing"] = _expect_error(lambda: new(root / "does-not-exist"))
    (root / "a-file").write_text("x")
    out["not_a_directory"] = _expect_error(lambda: new(root / "a-file"))
    if Path("/sys").is_dir():  # not writable even by root (sysfs refuses new files)
        out["unwritable"] = _expect_error(lambda: new(Path("/sys")))

    space = root / "space"
    space.mkdir()
    with file_size_limit(1 << 20):
        out["full_at_creation"] = _expect_error(lambda: new(space))
    out["left_after_creation_failure"] = sorted(p.name for p in space.iterdir())

    mid = root / "mid"
    mid.mkdir()
    p, inner = _model()
    opt = OffloadedAdam(inner, _config("nvme", str(mid)), nvme_dir=mid)
    opt.step()
    with file_size_limit(NUMEL * 4 // 2):  # writes past the middle of each state file fail
        out["full_mid_step"] = _expect_error(opt.step)
    out["left_after_step_failure"] = sorted(p.name for p in mid.iterdir())
    out["step_after_failure"] = _expect_error(opt.step)
    out["state_dict_after_failure"] = _expect_error(opt.state_dict)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        result = {"resident": {"cpu": resident("cpu", d), "nvme": resident("nvme", d)}}
        result["errors"] = errors(Path(d))
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
