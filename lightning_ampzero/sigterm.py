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

[Note: a SIGTERM in the middle of a step]
Lightning's SIGTERM handler also broadcasts, blocking, from inside the handler, which Python runs
wherever the main thread is when the signal lands. Under DDP that is after the C++ backward; at
stages 1-3 the backward runs Python hooks, so the broadcast came in the middle of it while the other
ranks were in its reduce-scatters: the collectives no longer matched and every rank hung until
torchrun's SIGKILL or the watchdog (a new-user trial: ``kill -TERM`` of rank 0 under torchrun).
:func:`sigterm_notifier` replaces the handler with one that issues no collective: it notes the
signal (and, as Lightning's, passes it to the launcher's children), and the next batch's
broadcast (:class:`AsyncSigtermBroadcast`, made by an all-reduce of every rank's flag, so a
SIGTERM to any rank counts) tells every rank, which all stop at the same batch. Lightning's
end-of-batch check reads ``trainer.received_sigterm``, which the notifier leaves unset: it would
stop the signalled rank alone, one batch before the others. The flag is set when every rank stops.
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

    def __init__(self, received: Callable[[], bool], device: Any, exception: type[BaseException],
                 on_stop: Callable[[], None] = lambda: None) -> None:
        self._received = received
        self._device = device
        self._exception = exception
        self._on_stop = on_stop
        self._pending: Optional[tuple[Any, Any]] = None

    def __call__(self) -> None:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if self._received() else 0], device=self._device)
        previous, self._pending = self._pending, None
        try:
            # every rank's flag ([Note: a SIGTERM in the middle of a step]): a SIGTERM to any rank counts
            self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
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
            self._on_stop()
            raise self._exception()

    def forget(self) -> None:
        """End of the fit: drop the last broadcast unread (it completes on its own: every rank issued it)."""
        self._pending = None


def sigterm_notifier(connector: Any, local_rank: int) -> Callable[[int, Any], None]:
    """Lightning's SIGTERM handler without its collective ([Note: a SIGTERM in the middle of a step]).

    Sets ``connector._ampzero_sigterm``; the strategy's :class:`AsyncSigtermBroadcast` reads it.
    """
    from lightning.pytorch.utilities.rank_zero import rank_prefixed_message, rank_zero_info

    def notify(signum: int, frame: Any) -> None:
        rank_zero_info(rank_prefixed_message(f"Received SIGTERM: {signum}; every rank stops after the next batch.",
                                             local_rank))
        if not getattr(connector, "_ampzero_sigterm", False):
            launcher = connector.trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)
        connector._ampzero_sigterm = True

    return notify
