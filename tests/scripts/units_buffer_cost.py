"""What the buffer broadcast of stages 1-3 costs ([Note: buffer broadcast] in zero/buffers.py).

    OMP_NUM_THREADS=1 PYTHONPATH=.:tests python tests/scripts/units_buffer_cost.py

HF ResNet-50 (default ResNetConfig) on 2 CPU ranks (gloo): bytes and count of its persistent
buffers, milliseconds per broadcast, and one all-reduce of an fp32 gradient of all parameters
beside it (what DDP and stages 1-2 move per step, for scale). Prints one JSON line per rank.
"""

from __future__ import annotations

import json
import time

import torch

from _spawn import spawn


def _body(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from transformers import ResNetConfig, ResNetForImageClassification

    from lightning_ampzero.zero.buffers import BufferBroadcast

    torch.manual_seed(0)
    model = ResNetForImageClassification(ResNetConfig())
    sync = BufferBroadcast(model, dist.group.WORLD)
    for _ in range(3):
        sync.broadcast()
    start = time.perf_counter()
    for _ in range(20):
        sync.broadcast()
    broadcast_ms = (time.perf_counter() - start) / 20 * 1e3
    grads = torch.zeros(sum(p.numel() for p in model.parameters()))
    start = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(grads)
    return dict(rank=rank, params=grads.numel(), buffers=len(sync.entries),
                buffer_bytes=sum(m._buffers[n].numel() * m._buffers[n].element_size() for m, n in sync.entries),
                broadcast_ms=round(broadcast_ms, 2), grad_allreduce_ms=round((time.perf_counter() - start) / 3 * 1e3, 1))


if __name__ == "__main__":
    for result in spawn(_body, world_size=2, timeout=300):
        print(json.dumps(result))
