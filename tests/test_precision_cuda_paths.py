"""Precision's CUDA paths checked without a GPU (issue 14, items 1 and 2).

1. Stage 0's reduce-dtype communication hook against the semantics of NCCL futures.

An NCCL all-reduce's future completes when the collective is *enqueued*; a reader sees the
reduced values only after ``wait()`` on that future has made its stream wait on NCCL's
([Note: stream order of the reduce-dtype hook] in lightning_ampzero/precision/ddp.py). On CPU
(gloo) completion and readiness coincide, so the 2-rank tests cannot see a hook that reads
early. Here fake all-reduces give the hook futures with NCCL's contract: each completes late,
from another thread, and its reduced values reach the tensor only when ``wait()`` is called
on it (the stream dependency a CUDA reader gets). A hook that reads without waiting reads the
unreduced values.

2. The autocast device of "-mixed" comes from the strategy's root device, not from where the
parameters are (host memory under ``offload_param='cpu'``).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightning_ampzero.precision import ddp, plugin
from lightning_ampzero.precision.plugin import AmpZeroPrecision

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
WORLD = 2
DELAY_S = 0.2


class _NcclLikeFuture(torch.futures.Future):
    """Completes (callbacks may run) before its data is visible; ``wait()`` makes it visible."""

    def __init__(self, tensor: torch.Tensor, reduced: torch.Tensor) -> None:
        super().__init__()
        self.tensor, self.reduced = tensor, reduced
        self.waited = False

    def wait(self):  # type: ignore[override]
        if not self.waited:
            self.waited = True
            self.tensor.copy_(self.reduced)  # the reader's stream now runs after the all-reduce
        return super().wait()


class _FakeCollectives:
    """``dist.all_reduce(..., async_op=True)`` of a 2-rank group whose other rank sent ``other(t)``."""

    def __init__(self) -> None:
        self.futures: list[_NcclLikeFuture] = []
        self.threads: list[threading.Thread] = []

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        assert async_op
        # Rank 1 sent its own mean-share: a different value, so unreduced and reduced differ.
        reduced = tensor + _other_rank(tensor)
        future = _NcclLikeFuture(tensor, reduced)
        self.futures.append(future)

        def complete_late() -> None:
            time.sleep(DELAY_S)
            future.set_result([tensor])

        thread = threading.Thread(target=complete_late, daemon=True)
        thread.start()
        self.threads.append(thread)
        return SimpleNamespace(get_future=lambda: future)


def _other_rank(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, 0.375)


def _bucket(grads: list[torch.Tensor]):
    """A DDP GradBucket: one flat buffer; each gradient a view into it."""
    buffer = torch.cat([g.reshape(-1) for g in grads])
    views, offset = [], 0
    for g in grads:
        views.append(buffer[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    return SimpleNamespace(buffer=lambda: buffer, gradients=lambda: views, parameters=lambda: params), params


def _expected(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # As the hook computes it: divide by the world size, cast, sum with the other rank, cast back.
    send = grad.div(WORLD).to(dtype)
    return (send + _other_rank(send)).to(grad.dtype)


CASES = {
    # bucket gradients' reduce dtypes (None: the bucket's own dtype, reduced in place in the buffer)
    "whole bucket in its own dtype": [None, None],
    "whole bucket in bf16": [BF16, BF16],
    "mixed fp16 / own dtype": [F16, None],
}


@pytest.mark.parametrize("dtypes", list(CASES.values()), ids=list(CASES))
def test_the_hook_reads_each_all_reduce_only_after_waiting_on_it(monkeypatch, dtypes):
    fake = _FakeCollectives()
    monkeypatch.setattr(dist, "all_reduce", fake.all_reduce)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: WORLD)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    originals = [t.clone() for t in grads]
    bucket, params = _bucket(grads)
    state = ddp._ReduceState({id(p): d for p, d in zip(params, dtypes) if d is not None}, group=object())

    started = time.monotonic()
    future = ddp._reduce_in_dtypes(state, bucket)
    # No collective has completed yet: neither has the hook's result.
    assert not future.done()
    result = future.wait()
    assert time.monotonic() - started >= DELAY_S * 0.9
    for t in fake.threads:
        t.join()

    assert result is bucket.buffer()
    # The reduced values were read, not what the buffer held before the collectives finished ...
    for view, original, dtype in zip(bucket.gradients(), originals, dtypes):
        assert torch.equal(view, _expected(original, dtype or F32)), (
            f"gradient reduced in {dtype or 'the bucket dtype'}: not the all-reduced value; the hook read the"
            " collective's tensor without waiting on its future")
    # ... because every collective was waited on (on CUDA: the stream dependency).
    assert len(fake.futures) == len(set(dtypes))
    assert all(f.waited for f in fake.futures)


def test_a_failed_collective_fails_the_hooks_future(monkeypatch):
    """DDP must see the error (before the fix the callback ignored it and returned the unreduced buffer)."""

    def failing_all_reduce(tensor, op=None, group=None, async_op=False):
        future = torch.futures.Future()
        future.set_exception(RuntimeError("NCCL communicator was aborted"))
        return SimpleNamespace(get_future=lambda: future)

    monkeypatch.setattr(dist, "all_reduce", failing_all_reduce)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: WORLD)
    bucket, params = _bucket([torch.ones(4), torch.ones(2)])
    state = ddp._ReduceState({id(params[0]): BF16}, group=object())
    future = ddp._reduce_in_dtypes(state, bucket)
    with pytest.raises(RuntimeError, match="aborted"):
        future.wait()


# ---- 2. the autocast device --------------------------------------------------------------------
_AUTOCAST = torch.autocast


class _Autocasts:
    """Records the device type of every ``torch.autocast`` the plugin opens (CUDA's cannot open here)."""

    def __init__(self) -> None:
        self.device_types: list[str] = []

    def __call__(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        self.device_types.append(device_type)
        return _AUTOCAST("cpu", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_autocasts_on_the_root_device_when_parameters_live_on_the_host(monkeypatch, precision):
    checked = []
    monkeypatch.setattr(plugin, "check_device_support", lambda p, d: checked.append((p, d)))
    autocasts = _Autocasts()
    monkeypatch.setattr(torch, "autocast", autocasts)
    model = torch.nn.Linear(4, 4)  # parameters on the CPU: offload_param="cpu" under stage 3
    # What the strategy provides while a Trainer runs the model on cuda:0.
    model._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))
    p = AmpZeroPrecision(precision)
    p.connect(model, [], [])
    assert p.device == "cuda"
    assert checked == [(precision, "cuda")]
    with p.forward_context():
        pass
    assert autocasts.device_types == ["cuda"]


def test_without_a_trainer_the_parameters_name_the_device(monkeypatch):
    monkeypatch.setattr(plugin, "check_device_support", lambda p, d: None)
    p = AmpZeroPrecision("bf16-mixed")
    p.connect(torch.nn.Linear(4, 4), [], [])
    assert p.device == "cpu"
    # a strategy that does not know its devices yet (AmpZeroStrategy.root_device asserts) is no answer either
    model = torch.nn.Linear(4, 4)

    class _Unset:
        @property
        def root_device(self):
            raise AssertionError("parallel_devices is None")

    model._trainer = SimpleNamespace(strategy=_Unset())
    p = AmpZeroPrecision("bf16-mixed")
    p.connect(model, [], [])
    assert p.device == "cpu"
