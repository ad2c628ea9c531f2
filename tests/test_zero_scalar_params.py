"""0-dim parameters at stages 1-3 ([Note: 0-dim parameters] in lightning_ampzero/zero/scalars.py).

FSDP2 refuses them ("fully_shard doesn't support scalar parameters"): a model holding a learnable
temperature (CLIP's ``logit_scale``) stopped at setup at every stage but 0 (a new-user trial). They
are now replicated and their gradients averaged as DDP averages them: the same steps as DDP,
with several units, gradient accumulation and clipping, bit for bit on 2 ranks.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _spawn import spawn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)])
        self.head = nn.Linear(16, 4)
        self.temperature = nn.Parameter(torch.tensor(0.7))  # CLIP's logit_scale, in miniature
        self.blocks[1].gate = nn.Parameter(torch.tensor(1.3))  # one inside a unit
        self.frozen = nn.Parameter(torch.tensor(2.0), requires_grad=False)

    def forward(self, x):
        h = self.blocks[0](x)
        h = self.blocks[1](h) * self.blocks[1].gate
        return self.head(self.blocks[2](h)) * self.temperature.exp() * self.frozen


class _count_all_reduces:
    """Counts ``dist.all_reduce`` calls until ``stop()`` (FSDP2 reduces by reduce-scatter, not all-reduce)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist, self.original, self.calls = dist, dist.all_reduce, 0

        def counted(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)

        dist.all_reduce = counted

    def stop(self) -> int:
        self.dist.all_reduce = self.original
        return self.calls


def _body(rank, world_size, stage, accumulate, clip):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from lightning_ampzero.config import ZeroConfig
    from lightning_ampzero.zero.apply import apply_zero, no_sync
    from lightning_ampzero.zero.clip import clip_grad_norm_

    out = {}
    for system in ("ddp", "zero"):
        torch.manual_seed(0)
        net = Net()
        if system == "ddp":
            model, sync_off = DistributedDataParallel(net), lambda: model.no_sync()
        else:
            # a unit per block: the gate's block is a group of its own
            cfg = ZeroConfig(stage=stage, reduce_bucket_size=300, param_persistence_threshold=0)
            apply_zero(net, init_device_mesh("cpu", (2,)), cfg)
            model, sync_off = net, lambda: no_sync(net, stage)
        opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=0.05)
        losses, all_reduces = [], []
        for step in range(4):
            for micro in range(accumulate):
                x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * rank + 10 * step + micro))
                loss = model(x).pow(2).mean() / accumulate
                calls = _count_all_reduces()
                if micro < accumulate - 1:
                    with sync_off():
                        loss.backward()
                else:
                    loss.backward()
                all_reduces.append(calls.stop())
                losses.append(loss.item())
            if clip and system == "ddp":
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            elif clip:
                clip_grad_norm_(net.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        out[system] = {"losses": losses,
                       "params": {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                                  for n, p in net.named_parameters()},
                       "scalar_is_plain": type(net.temperature) is nn.Parameter and net.temperature.dim() == 0,
                       "all_reduces": all_reduces}
    return out


@pytest.mark.parametrize("stage, accumulate, clip", [(1, 1, False), (2, 1, False), (3, 1, False), (1, 2, True),
                                                    (3, 2, True)])
def test_a_model_with_0_dim_parameters_trains_as_ddp(stage, accumulate, clip):
    for r in spawn(_body, world_size=2, args=(stage, accumulate, clip)):
        ddp, zero = r["ddp"], r["zero"]
        assert zero["scalar_is_plain"]  # replicated, not a DTensor
        # both trainable scalars' gradients in one all-reduce per backward (it was one each)
        assert zero["all_reduces"] == [1] * len(zero["losses"])
        diffs = {n: (zero["params"][n] - p).abs().max().item() for n, p in ddp["params"].items()}
        assert zero["params"]["temperature"] != 0.7 and zero["params"]["blocks.1.gate"] != 1.3  # they trained
        if accumulate == 1 and not clip:
            assert zero["losses"] == ddp["losses"]
            assert max(diffs.values()) == 0.0, diffs
        else:  # the norm and the micro-batches' sums are assembled in another order: rounding only
            assert max(abs(a - b) / abs(b) for a, b in zip(zero["losses"], ddp["losses"])) < 1e-5
            assert max(diffs.values()) < 1e-6, diffs


# ---- the other parameters FSDP2 refuses ([Note: parameters FSDP2 refuses]) ---------------------
def test_lazy_and_sparse_parameters_are_refused_with_what_to_do():
    from lightning_ampzero.zero.scalars import prepare_parameters_

    lazy = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"0\.weight, 0\.bias have no shape yet.*dummy batch"):
        prepare_parameters_(lazy)
    lazy(torch.zeros(1, 3))  # what the message says to do
    prepare_parameters_(lazy)
    sparse = nn.ModuleDict({"emb": nn.Embedding(10, 4, sparse=True), "bag": nn.EmbeddingBag(10, 4)})
    with pytest.raises(ValueError, match=r"^emb: sparse=True makes sparse gradients.*sparse=False.*stage 0"):
        prepare_parameters_(sparse)
    sparse["emb"].weight.requires_grad_(False)  # frozen (a pretrained table): no gradient to reduce, accepted
    prepare_parameters_(sparse)


def _non_contiguous_body(rank, world_size, stage):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from lightning_ampzero.config import ZeroConfig
    from lightning_ampzero.zero.apply import apply_zero

    def build():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
        net.to(memory_format=torch.channels_last)  # the conv weight: not contiguous
        net[3].weight = nn.Parameter(net[3].weight.detach().t().contiguous().t())  # a transposed layout
        return net

    out = {}
    for system in ("ddp", "zero"):
        net = build()
        kept = net[3].weight
        assert not net[0].weight.is_contiguous() and not kept.is_contiguous()
        if system == "ddp":
            model = DistributedDataParallel(net)
        else:  # FSDP2 raised "does not support non-contiguous parameters" here
            apply_zero(net, init_device_mesh("cpu", (2,)), ZeroConfig(stage=stage, reduce_bucket_size=1))
            model = net
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(10 * rank + step))
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        out[system] = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                       for n, p in net.named_parameters()}
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_non_contiguous_parameters_train_as_under_ddp(stage):
    for r in spawn(_non_contiguous_body, world_size=2, args=(stage,)):
        diffs = {n: (r["zero"][n] - p).abs().max().item() for n, p in r["ddp"].items()}
        # the other layout changes the GEMM's summation order only: rounding
        assert max(diffs.values()) < 1e-6, diffs
