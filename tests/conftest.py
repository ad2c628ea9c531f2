"""Keeps each test from leaking a launch into the next.

An in-process ``Trainer`` with a distributed strategy (ours or Lightning's) sets MASTER_PORT,
MASTER_ADDR, LOCAL_RANK and NODE_RANK in ``os.environ`` and leaves the default process group
open, its TCPStore listening on MASTER_PORT. A later test that starts a training command inherits
that port and fails with EADDRINUSE (CI failed so on every ``ampzero-train`` test), or a later
in-process test silently reuses a group built for another run. So each test gets the launch
variables it started with, and a group it opened is closed.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from _scripts import LAUNCH_KEYS


@pytest.fixture(autouse=True)
def _no_launch_leaks():
    before = {key: os.environ.get(key) for key in LAUNCH_KEYS}
    had_group = dist.is_available() and dist.is_initialized()
    yield
    if not had_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
