"""What one rank measures during one configuration's run.

Every system calls the same hooks at the same points of its loop (the bare loops directly, the
Lightning runs from a Callback), so the figures mean the same thing for all of them:

* ``step_start(i)`` at the start of optimizer step ``i`` (before its first micro-batch is
  fetched in the bare loops; Lightning's ``on_train_batch_start`` of the step's first
  micro-batch). A step's time is the gap to the next step's start, so it includes everything
  the system does per step (data, forward, backward, communication, optimizer, bookkeeping).
* ``sample()`` after each forward, after each backward and at the end of the step: model
  states (parameters, gradients, optimizer) are sampled only during the last, profiled step.
* ``step_end(i)``: stops the profiler after the last step.

CPU time per step (``time.process_time``: all threads of the process, gloo's included) is
recorded beside wall time: on a shared machine it does not count the time a rank waits for a
core, so it shows each system's own cost when the load of other jobs blurs wall time.

Peak RSS: ``VmHWM`` of the process, reset (``/proc/self/clear_refs``) when the configuration
starts and read when the profiled step starts, so it covers setup, warm-up and timed steps.
All configurations of a repetition run in the same two processes (see worker.py), so the
RSS at the start (``rss_start``) includes the interpreter, torch, Lightning and DeepSpeed
and whatever the allocator kept from earlier configurations; ``peak_rss_growth`` (peak less
start) is the part this configuration added.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch


def status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def release_free_memory() -> None:
    """Give memory the allocator keeps back to the OS, so the next configuration starts low."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


def reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


class Meter:
    """Hooks of one run on one rank; ``result()`` returns this rank's raw figures."""

    def __init__(self, total_steps: int, accumulate: int, sampler: Optional[Callable[[], dict]] = None) -> None:
        self.total_steps = total_steps
        self.measure_step = total_steps - 1
        self.accumulate = accumulate
        self.sampler = sampler  # () -> {"category": bytes}, set once the system is built
        self.starts: list[float] = []
        self.cpu_starts: list[float] = []
        self.losses: list[float] = []
        self.peaks: dict[str, int] = {}
        self.samples = 0
        self.profile: Any = None
        self.trace_path: Optional[str] = None
        self.rss_start_kib = status_kib("VmRSS")
        reset_peak_rss()
        self.peak_rss_kib = 0
        self.profile_enabled = True

    # -- hooks -----------------------------------------------------------------------------
    def step_start(self, i: int) -> None:
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())
        if i == self.measure_step:
            self.peak_rss_kib = status_kib("VmHWM")
            if self.profile_enabled:
                from torch.profiler import ProfilerActivity, profile

                self.profile = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
                self.profile.__enter__()

    def sample(self) -> None:
        if len(self.starts) - 1 != self.measure_step or self.sampler is None:
            return
        for k, v in self.sampler().items():
            self.peaks[k] = max(self.peaks.get(k, 0), int(v))
        self.samples += 1

    def record_loss(self, loss: torch.Tensor) -> None:
        self.losses.append(float(loss.detach().float()))

    def step_end(self, i: int) -> None:
        if i == self.measure_step and self.profile is not None:
            self.profile.__exit__(None, None, None)
            fd, self.trace_path = tempfile.mkstemp(prefix="ampzero_bench_", suffix=".json")
            os.close(fd)
            self.profile.export_chrome_trace(self.trace_path)
            self.profile = None

    # -- result ----------------------------------------------------------------------------
    def step_times(self, warmup: int) -> list[float]:
        """Seconds per timed step: gaps between starts of steps warmup .. measure_step."""
        return [b - a for a, b in zip(self.starts[warmup:], self.starts[warmup + 1:])]

    def step_cpu_times(self, warmup: int) -> list[float]:
        """CPU seconds this process (all its threads) used per timed step."""
        return [b - a for a, b in zip(self.cpu_starts[warmup:], self.cpu_starts[warmup + 1:])]

    def step_losses(self) -> list[float]:
        """Mean loss of each optimizer step on this rank (micro-batch losses averaged)."""
        a = self.accumulate
        return [sum(self.losses[i:i + a]) / a for i in range(0, len(self.losses) - a + 1, a)]
