"""LR schedulers that do not step when the loss scaler skipped the optimizer step.

Lightning steps "step"-interval schedulers after every optimizer step it asked for, whether or
not the precision plugin's scaler skipped it, so under torch.amp.GradScaler a run with skipped
steps silently runs its schedule ahead of its updates (and torch warns "lr_scheduler.step()
before optimizer.step()" when the very first step is skipped). DeepSpeed steps its scheduler
only after a step that happened; so do we: the precision plugin wraps each step-interval
scheduler in :class:`SkipAwareScheduler` when it connects (``Precision.connect``, which exists
for precision plugins to wrap optimizers and schedulers), which asks the scaler whether the last
step was skipped.
"""

from __future__ import annotations

from typing import Any, Callable

_OWN = ("scheduler", "skipped", "skipped_calls")


class SkipAwareScheduler:
    """Wraps an LR scheduler: ``step()`` is a no-op while ``skipped()`` is true; all else is the scheduler's.

    ``isinstance`` sees the wrapped scheduler's class (as with ``unittest.mock``), and
    ``state_dict``/``load_state_dict`` are the scheduler's own, so checkpoints do not change.

    Attributes:
        scheduler: the wrapped scheduler.
        skipped: ``() -> bool``, whether the optimizer step this scheduler step follows was skipped.
        skipped_calls: how many ``step()`` calls were dropped.
    """

    def __init__(self, scheduler: Any, skipped: Callable[[], bool]) -> None:
        object.__setattr__(self, "scheduler", scheduler)
        object.__setattr__(self, "skipped", skipped)
        object.__setattr__(self, "skipped_calls", 0)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D105
        return type(self.scheduler)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        if self.skipped():
            object.__setattr__(self, "skipped_calls", self.skipped_calls + 1)
            return None
        return self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "scheduler"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.scheduler, name, value)

    def __repr__(self) -> str:
        return f"SkipAwareScheduler({self.scheduler!r})"
