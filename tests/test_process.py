"""exit_process: what a process wrote is flushed, the process group is destroyed, the code is kept."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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
