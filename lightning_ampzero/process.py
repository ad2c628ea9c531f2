"""``exit_process(code)``: end a training process without a racy interpreter shutdown.

[Note: exit without finalization]
When a process that ran collectives exits normally, CPython finalizes the interpreter while
torch's C++ threads are still alive (measured after a Lightning fit on gloo: gloo's run loops
and the TCPStore daemon still run after ``destroy_process_group()`` and ``gc.collect()``, as
objects that outlive the fit still reference the process group). If one of them releases a
tensor that has a Python object, it
must take the GIL; a thread that asks for the GIL after finalization began is ended with
``pthread_exit``, whose forced unwinding through a ``noexcept`` C++ frame aborts the whole
process: "terminate called without an active exception", exit status -6 (SIGABRT), after all
the work succeeded. It is a timing race (pytorch/pytorch#190489 tracks it upstream), rare on an
idle machine and common on a loaded one.

A process whose work is done therefore flushes what it owns (standard streams, logging
handlers), destroys the process group (local, no collective) and leaves with ``os._exit``: no
finalization, no race. The library's strategy cannot do this for a user's script (it would skip
the user's own exit handlers), so it only destroys the process group at exit; our own entry
points (``ampzero-train``'s workers, the test scripts) call this function.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def in_process_group() -> bool:
    """Whether this process has a default process group (never imports torch to find out)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def destroy_process_group() -> None:
    """Destroy the default process group if there is one: local, no collective."""
    if in_process_group():
        sys.modules["torch.distributed"].destroy_process_group()


def exit_process(code: int = 0) -> NoReturn:
    """Destroy the default process group if any, flush, and ``os._exit(code)``."""
    destroy_process_group()  # first: what it logs or prints is flushed below
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or detached stream has nothing left to lose
            pass
    os._exit(code)


def run_and_exit(main, *args, **kwargs) -> NoReturn:  # type: ignore[no-untyped-def]
    """``exit_process`` with ``main(*args, **kwargs)``'s exit status; an exception propagates.

    For a script's ``if __name__ == "__main__":`` block: success leaves through
    :func:`exit_process`, a failure keeps Python's traceback and exit status. The return value
    maps to a status as ``sys.exit`` maps its argument: None -> 0, an int -> itself, anything
    else (a message) -> printed to stderr, 1.
    """
    exit_process(exit_status(main(*args, **kwargs)))


def exit_status(code: object) -> int:
    """The exit status ``sys.exit(code)`` would give."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
