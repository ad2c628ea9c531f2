"""Stage 1 bf16-mixed: the safe modules' gradients accumulate in fp32 and travel in bf16.

Between micro-batches stage 1 skips the reduction (``no_sync``), and FSDP2 accumulates a group's
full gradients in its ``reduce_dtype``. With the Linear layers reducing in bf16 that summed them
in bf16; now they sum in fp32 and only the reduce-scatter casts to bf16 (zero/comm.py,
[Note: stage 1 accumulation dtype]), as in DeepSpeed. 2 CPU ranks (gloo), 4 micro-batches each
(under autocast each micro-batch's weight gradient is a bf16 value, so with two of them bf16 and
fp32 sums round alike). The expected shard is computed from an unsharded copy of the model: each
rank's fp32 sum of its micro-batch gradients, divided by the world size, cast to bf16, summed over ranks, and cast
back to fp32. Accumulating in bf16 gives other values in a large fraction of the elements
(checked too, so the test can tell the two apart).
"""

from __future__ import annotations

import copy

import pytest
import torch

from _spawn import spawn

pytestmark = pytest.mark.slow

MICRO_BATCHES = 4


def _micro_batch_grads(model, batch):
    import torch.nn.functional as F

    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(batch[:, :-1])
    F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).backward()


def _body(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ampzero.config import PrecisionConfig, ZeroConfig
    from lightning_ampzero.models.gpt import GPT, GPTConfig
    from lightning_ampzero.precision.policy import dtype_plan, fsdp_policies
    from lightning_ampzero.zero.apply import apply_zero, no_sync

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=8))
    ref = copy.deepcopy(model)
    # The safe modules named: their gradients go in bf16 on gloo too (the default sends them in fp32 there).
    listed = PrecisionConfig(lower_precision_safe_modules=["Linear", "Conv1d", "Conv2d", "Conv3d"])
    root, per_module = fsdp_policies(dtype_plan("bf16-mixed", listed), model, 1)
    apply_zero(model, init_device_mesh("cpu", (world,)), ZeroConfig(stage=1), root, module_policies=per_module)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 256, (2, 9), generator=gen) for _ in range(MICRO_BATCHES)]

    with no_sync(model, 1):
        for batch in batches[:-1]:
            _micro_batch_grads(model, batch)
    _micro_batch_grads(model, batches[-1])

    out = {}
    for name in ("blocks.0.mlp.0.weight", "blocks.1.attn.qkv.weight", "head.weight"):
        parts = []
        for batch in batches:  # this rank's micro-batch gradients, unsharded, fp32
            ref.zero_grad()
            _micro_batch_grads(ref, batch)
            parts.append(dict(ref.named_parameters())[name].grad.clone())
        fp32_sum, bf16_sum = sum(parts), parts[0].bfloat16()
        for part in parts[1:]:
            bf16_sum = bf16_sum + part.bfloat16()  # FSDP2's rule before: accumulate in reduce_dtype
        both = [torch.empty_like(fp32_sum) for _ in range(world)]
        dist.all_gather(both, fp32_sum)
        both_bf16 = [torch.empty_like(bf16_sum) for _ in range(world)]
        dist.all_gather(both_bf16, bf16_sum)
        grad = dict(model.named_parameters())[name].grad
        out[name] = dict(
            grad=grad.full_tensor(),
            fp32_acc=sum((g / world).bfloat16().float() for g in both).bfloat16().float(),
            bf16_acc=sum((g.float() / world).bfloat16().float() for g in both_bf16).bfloat16().float(),
        )
    return out


def test_stage1_safe_module_gradients_accumulate_in_fp32():
    for result in spawn(_body, world_size=2, timeout=180):
        for name, r in result.items():
            assert r["grad"].dtype == torch.float32, name
            assert torch.equal(r["grad"], r["fp32_acc"]), (name, (r["grad"] - r["fp32_acc"]).abs().max())
            # bf16 accumulation would be visibly different: the check above can tell them apart
            differ = (r["bf16_acc"] != r["fp32_acc"]).float().mean().item()
            assert differ > 0.01, (name, differ)
