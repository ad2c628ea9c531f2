"""Precision on CUDA (``-m gpu``; skipped without a GPU): issue 14, items 1 and 2, on the device.

* Stage 0, "bf16-true", 2 GPUs with NCCL: DDP with the plugin's reduce-dtype hook ends every
  step with the parameters of a reference that all-reduces each gradient by hand, synchronously,
  in the same dtype. The hook's results are read in stream order (item 1); a hook that read before
  NCCL had finished would leave the parameters apart, most likely with the large gradients
  used here (tens of MB per all-reduce). The same comparison runs on 2 gloo ranks in CI (``slow``),
  so the reference is known to do the hook's arithmetic to the bit.
* "bf16-mixed" with ``offload_param='cpu'``: the parameter shards are in host memory, and the
  GPU's matrix products still run in bf16 (item 2: autocast on the strategy's device, not on
  the parameters').
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _scripts import run_script
from _spawn import spawn
from lightning_ampzero.precision.plugin import AmpZeroPrecision

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL between them)")


def _model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                         nn.Linear(width, width), nn.LayerNorm(width))


def _stage0_bf16_true_body(rank: int, world_size: int, width: int, steps: int, device_type: str) -> list[bool]:
    from lightning_ampzero.precision.ddp import cast_parameters_in_forward

    on_cuda = device_type == "cuda"
    if on_cuda:
        torch.cuda.set_device(rank)
    device = torch.device(device_type, rank) if on_cuda else torch.device("cpu")
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    batches = [torch.randn(64, width, generator=gen).to(device) for _ in range(steps)]
    plugin = AmpZeroPrecision("bf16-true")

    model = plugin.convert_module(_model(width).to(device))
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[rank] if on_cuda else None, bucket_cap_mb=25)
    plugin.setup_ddp(ddp)  # what the strategy does at stage 0: bf16 compute copies, bf16 reduce hook
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    ref = _model(width).to(device)
    cast_parameters_in_forward(ref, torch.bfloat16)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    same = []
    for x in batches:
        ddp(x.bfloat16()).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        ref(x.bfloat16()).float().square().mean().backward()
        for p in ref.parameters():  # the hook's arithmetic: divide, cast, sum, cast back
            g = p.grad.div(world_size).bfloat16()
            dist.all_reduce(g)
            p.grad.copy_(g)
        ref_opt.step()
        ref_opt.zero_grad()
        if on_cuda:
            torch.cuda.synchronize()
        same.append(all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters())))
    return same


@cuda
@two_gpus
@pytest.mark.gpu
def test_stage0_bf16_true_matches_a_synchronous_reference_on_two_gpus():
    results = spawn(_stage0_bf16_true_body, world_size=2, args=(4096, 5, "cuda"), timeout=300, backend="nccl")
    assert results == [[True] * 5] * 2, results


@pytest.mark.slow
def test_the_stage0_reference_is_exact_on_cpu():
    """The GPU test's comparison, on 2 gloo ranks: the reference does the hook's arithmetic to the bit.

    So on a GPU only a hook that reads before NCCL has finished can make it fail.
    """
    results = spawn(_stage0_bf16_true_body, world_size=2, args=(64, 5, "cpu"), timeout=120)
    assert results == [[True] * 5] * 2, results


@cuda
@pytest.mark.gpu
def test_mixed_autocasts_on_cuda_while_the_parameters_are_on_the_host():
    model = nn.Linear(64, 64)  # host memory, as offload_param='cpu' leaves the shards
    model._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))
    plugin = AmpZeroPrecision("bf16-mixed")
    plugin.connect(model, [], [])
    assert plugin.device == "cuda"
    with plugin.forward_context():
        y = torch.randn(8, 64, device="cuda") @ torch.randn(64, 64, device="cuda")
    assert y.dtype == torch.bfloat16


@cuda
@pytest.mark.gpu
@pytest.mark.slow
def test_ampzero_train_with_parameter_offload_computes_in_bf16_on_the_gpu(tmp_path):
    out = tmp_path / "dtypes.json"
    run_script("matmul_dtypes.py", str(out), str(tmp_path / "job"), "precision=bf16-mixed", "strategy=zero3_offload",
               "trainer=gpu", "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
               "model=gpt_tiny", timeout=600)
    seen = json.loads(out.read_text())
    products = {k: v for k, v in seen.items() if k.split(":")[0] in ("mm", "addmm", "bmm", "baddbmm")}
    assert sum(products.values()) > 0, seen
    assert all(key.endswith(":torch.bfloat16") for key in products), seen
