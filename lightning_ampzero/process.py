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

Two defences, one for each kind of process:

- Our own entry points (``ampzero-train``'s workers, the test scripts) flush what they own
  (standard streams, logging handlers), destroy the process group (local, no collective) and
  leave with ``os._exit`` (:func:`exit_process`): no finalization, no race.
- A user's script must keep its exit status and its own exit handlers, so the strategy registers
  :func:`release_process_groups` with ``atexit`` instead. ``destroy_process_group()`` alone does
  not stop the threads: the groups stay referenced by the DeviceMesh's group registry (itself
  kept alive by DTensor's sharding caches), by FSDP2's mesh infos and by DDP's C++ reducer, all
  of which outlive the fit in a script that keeps its model. Dropping those references frees the
  groups while the interpreter is still whole (atexit handlers run before finalization); a
  group's destructor lets go of the GIL, drains its queue and joins its threads. CI saw the abort
  in a user-style example script that exited normally (tests/test_process.py checks that no
  c10d thread is left after the hook, for the holders of each stage).
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


def collective_device(group: object = None, fallback: object = None) -> "torch.device":
    """Where a tensor must live for ``group``'s backend (the default group for None) to reduce it.

    NCCL reduces CUDA tensors only ("No backend type associated with device type cpu"), gloo
    CPU ones best; small bookkeeping tensors (flags, norms, counts) are made or moved there.
    Without a process group, or with another backend: ``fallback`` (default: the CPU).
    """
    import torch

    if in_process_group():
        backend = str(sys.modules["torch.distributed"].get_backend(group))
        if backend == "gloo":
            return torch.device("cpu")
        if "nccl" in backend:
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if fallback is None else torch.device(fallback)


# Classes whose instances may hold a process group as a plain attribute (FSDP2's mesh infos,
# our communication hooks' states): their group attributes are dropped at exit.
_HOLDER_MODULES = ("torch.distributed.", "lightning_ampzero.")


def _instance_dict(obj: object) -> "dict | None":
    """``obj.__dict__`` read past the object's own ``__getattribute__``, or None.

    Some holders' classes override it: ``torch.distributed.reduce_op`` warns (FutureWarning,
    deprecated) on every attribute access, which printed one warning per rank at the exit of every
    user script when the hook's scan asked for its ``__dict__``.
    """
    try:
        found = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return None
    return found if isinstance(found, dict) else None


def _held_by_us(obj: object) -> bool:
    module = vars(type(obj)).get("__module__")  # some extension types have none, or a descriptor
    return isinstance(module, str) and module.startswith(_HOLDER_MODULES) and _instance_dict(obj) is not None


# How long the exit hook waits for the groups' threads to stop. They stop at once unless a
# collective is still in flight (a peer that crashed or diverged), which would otherwise hold
# the exit for the whole process-group timeout.
RELEASE_TIMEOUT_S = 10.0


def release_process_groups(timeout_s: float = RELEASE_TIMEOUT_S) -> None:
    """At exit: destroy the default group and drop what keeps the groups (and their threads) alive.

    For an ``atexit`` hook only: it makes every DeviceMesh, FSDP2-sharded module and
    DistributedDataParallel module in the process unusable for communication. Local, no
    collective; a no-op in a process that never imported torch.distributed.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return
    import gc
    import threading

    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn.parallel import DistributedDataParallel

    # Every group, held here until the end so that the last reference drops where we choose.
    groups: list = list(sys.modules["torch.distributed.distributed_c10d"]._world.pg_map)
    destroy_process_group()
    group_type = dist.ProcessGroup
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads obj.__class__ through the object's own
        # __getattribute__, and torch.distributed.reduce_op warns on every attribute read.
        cls = type(obj)
        if issubclass(cls, DeviceMesh):
            # A dict of strings to groups is not tracked by the collector: clear it by its owner.
            registry = getattr(obj, "_pg_registry", {})
            groups.extend(registry.values())
            registry.clear()
        elif issubclass(cls, DistributedDataParallel):
            for name in ("reducer", "logger", "process_group"):  # the C++ reducer holds the group
                obj.__dict__.pop(name, None)
        elif _held_by_us(obj):
            attrs = _instance_dict(obj) or {}
            for name in [k for k, v in attrs.items() if isinstance(v, group_type)]:
                groups.append(attrs[name])
                attrs[name] = None
    gc.collect()  # the fit's reference cycles (Trainer <-> strategy <-> module) hold groups too
    # The destructors run on a helper thread (they let go of the GIL): a group's destructor joins
    # its threads, which waits for a collective still in flight; past timeout_s the exit goes on
    # as it would have without this hook.
    releaser = threading.Thread(target=groups.clear, name="ampzero-release-groups", daemon=True)
    releaser.start()
    releaser.join(timeout_s)


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
