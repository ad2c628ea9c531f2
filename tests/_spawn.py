"""Run a function on N CPU processes joined in a gloo process group, from inside pytest.

    from _spawn import spawn

    def _body(rank, world_size, x):      # module level: the children import it by name
        ...
        return something_picklable

    results = spawn(_body, world_size=2, args=(x,))   # [result of rank 0, result of rank 1]

Rendezvous is a FileStore in a fresh temporary directory (no port to collide on). A
child's exception is raised again in the parent with the child's traceback; a run that
exceeds ``timeout`` is terminated and raises ``TimeoutError``. Children are started with
the "spawn" method (never fork a process that has threads), so ``fn`` must be importable.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_ampzero.process import exit_process


def _child(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any],
    store_path: str,
    result_dir: str,
    backend: str,
    timeout: float,
) -> None:
    # Other work shares this machine: one intra-op thread per rank.
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
    )
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(result_dir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        dist.destroy_process_group()
        raise  # multiprocessing hands the traceback to the parent
    # Success leaves without interpreter finalization, which can abort a process that ran gloo
    # collectives: see [Note: exit without finalization] in lightning_ampzero/process.py.
    exit_process(0)


def spawn(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    *,
    timeout: float = 60.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results by rank."""
    with tempfile.TemporaryDirectory(prefix="ampzero_spawn_") as tmp:
        store_path = os.path.join(tmp, "store")
        context = mp.start_processes(
            _child,
            args=(fn, world_size, tuple(args), store_path, tmp, backend, timeout),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        # join() re-raises a child's exception (ProcessRaisedException, with its traceback)
        # and terminates the other children.
        while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.terminate()
                for process in context.processes:
                    process.join(5)
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"spawn({getattr(fn, '__name__', fn)}) did not finish within {timeout} s.")
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
