"""Rank 0's SIGTERM reaches every rank without a blocking collective before each batch.

[Note: asynchronous SIGTERM broadcast]
Lightning 2.x (``_TrainingEpochLoop._broadcast_sigterm_tensor``) broadcasts rank 0's "received
SIGTERM" flag before every training batch, micro-batches included, and reads it with
``.item()``: a blocking collective, so every batch waits there for the slowest rank. Measured on
the CPU suite (benchmarks/results/cpu.md, diagnostic ``ampzero_nosigterm``): ampzero stage 2
fp32 took 0.89x the step time with the broadcast turned off. We keep what it is for (a SIGTERM
on rank 0, e.g. a SLURM preemption, stops every rank with Lightning's SIGTERMException) but
issue the broadcast asynchronously and read its flag one batch later: the stop comes one batch
later, and no batch waits on it. Every rank issues it at the same point of the same sequence of
collectives, so it matches across ranks like any other.

No barrier before raising, unlike Lightning's version: a rank reads the flag one batch after
rank 0 sent it, and rank 0 has by then stopped on its own flag (Lightning checks it after every
batch), so a barrier would wait for a rank that never comes.
"""

from __future__ import annotations

from typing import Any, Callable, Optional


class AsyncSigtermBroadcast:
    """A drop-in for the loop's ``_broadcast_sigterm_tensor``: call it before each training batch.

    Args:
        received: whether this process received SIGTERM (only rank 0's value is broadcast).
        device: where the one-element flag lives (the process group's device).
        exception: raised on every rank that reads rank 0's flag set (Lightning's SIGTERMException).
    """

    def __init__(self, received: Callable[[], bool], device: Any, exception: type[BaseException]) -> None:
        self._received = received
        self._device = device
        self._exception = exception
        self._pending: Optional[tuple[Any, Any]] = None

    def __call__(self) -> None:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if self._received() else 0], device=self._device)
        previous, self._pending = self._pending, None
        try:
            self._pending = (dist.broadcast(flag, src=0, async_op=True), flag)
        except Exception:  # as Lightning: a broadcast that cannot run means no SIGTERM
            pass
        if previous is None:
            return
        work, previous_flag = previous
        try:
            work.wait()
        except Exception:
            return
        if int(previous_flag.item()) == 1:
            raise self._exception()

    def forget(self) -> None:
        """End of the fit: drop the last broadcast unread (it completes on its own: every rank issued it)."""
        self._pending = None
