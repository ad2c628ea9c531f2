"""Gloo's reduce-scatter and all-gather done through its all-reduce (issue 16; [Note: gloo
collectives through all-reduce] in lightning_ampzero/zero/comm.py): training is bit for bit the
same as with gloo's own collectives, the all-reduce path is really taken above the thresholds
and not below, and the benchmark's traffic counter reads it as the collective it stands for."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from _spawn import spawn


def _train(rank: int, world: int, stage: int, forced: bool, param_dtype: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.profiler import ProfilerActivity, profile

    from lightning_ampzero.config import ZeroConfig
    from lightning_ampzero.zero import comm
    from lightning_ampzero.zero.apply import apply_zero

    # forced: every collective above 0 elements goes through the all-reduce; else none does.
    comm.GLOO_REDUCE_SCATTER_MIN_NUMEL = comm.GLOO_ALL_GATHER_MIN_NUMEL = 0 if forced else 2**62
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 24)) for _ in range(3)],
                          nn.Linear(24, 7))
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype), reduce_dtype=torch.float32)
    apply_zero(model, init_device_mesh("cpu", (world,)),
               ZeroConfig(stage=stage, reduce_bucket_size=2000, param_persistence_threshold=0), policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    losses = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            loss = model(torch.randn(6, 24, generator=g)).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    names = {e.name for e in prof.events()}
    labels = sorted(n for n in names if n.startswith("ampzero::"))
    return {"losses": losses, "params": [p.to_local().detach().clone() for p in model.parameters()],
            "labels": labels, "native_rs": "c10d::_reduce_scatter_base_" in names,
            "backend": dist.get_backend()}


@pytest.mark.parametrize(("stage", "param_dtype"), [(2, "float32"), (3, "float32"), (3, "bfloat16")])
def test_collectives_through_all_reduce_train_bit_for_bit_as_gloos_own(stage, param_dtype):
    native = spawn(_train, 2, (stage, False, param_dtype), timeout=180)
    forced = spawn(_train, 2, (stage, True, param_dtype), timeout=180)
    for n, f in zip(native, forced):
        assert n["backend"] == "gloo"
        assert f["losses"] == n["losses"]
        assert all(torch.equal(a, b) for a, b in zip(f["params"], n["params"]))
        # The path was taken (the profiler labels of zero/comm.py), and only when forced.
        wire = "bfloat16" if param_dtype == "bfloat16" else "float32"
        assert f["labels"] == [f"ampzero::all_gather#torch.{wire}", "ampzero::reduce_scatter#torch.float32"]
        assert not f["native_rs"] and n["native_rs"] and n["labels"] == []


def test_the_traffic_counter_reads_the_all_reduce_as_what_it_stands_for(tmp_path):
    from benchmarks.suite.comm import parse_trace

    def event(name, ts, dur, dims=None, types=None):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": 1,
                "args": {"Input Dims": dims or [], "Input type": types or []}}

    events = [
        event("ampzero::reduce_scatter#torch.float32", 0, 100),
        event("c10d::allreduce_", 10, 50, [[[1000]]], ["TensorList"]),
        event("gloo:all_reduce", 12, 40, [[1000]], ["float"]),
        # an all-gather of 1000 bf16 elements, sent as 2000 uint8
        event("ampzero::all_gather#torch.bfloat16", 200, 100),
        event("c10d::allreduce_", 210, 50, [[[2000]]], ["TensorList"]),
        event("gloo:all_reduce", 212, 40, [[2000]], ["unsigned char"]),
        # a plain all-reduce (DDP's): 2n
        event("c10d::allreduce_", 400, 50, [[[500]]], ["TensorList"]),
        event("gloo:all_reduce", 412, 40, [[500]], ["float"]),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    r = parse_trace(str(path))
    assert r["by_kind"]["reduce_scatter"] == {"calls": 1, "elements": 1000, "bytes": 4000}
    assert r["by_kind"]["all_gather"] == {"calls": 1, "elements": 1000, "bytes": 2000}
    assert r["by_kind"]["all_reduce"] == {"calls": 1, "elements": 1000, "bytes": 4000}
    assert r["bytes_by_dtype"] == {"fp32": 8000, "bf16": 2000}
