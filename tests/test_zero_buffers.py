"""BatchNorm running statistics at stages 1-3 as under DDP (stage 0, ``broadcast_buffers=True``).

2 CPU ranks (gloo), a small CNN with BatchNorm (one with ``momentum=None``: a cumulative average
that reads ``num_batches_tracked``), each rank its own batches. Stage 0 is torch DDP; stages 1,
2, 3 (and 3 with one conv block per unit) are ``apply_zero``, trained through a ``training_step``
that calls ``forward`` (as Lightning runs them, registered with ``register_root_method``).
Three steps, a step of two micro-batches (the first under ``no_sync``), then two evaluation
forwards (running statistics in use). Per rank: the same losses (training and evaluation) within
1e-5 relative and the same buffers after every phase as DDP, one broadcast per step where DDP
broadcasts; and without the broadcast, evaluation differs (the check can fail).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _spawn import spawn

STEPS = 3


class ConvBN(nn.Module):
    def __init__(self, cin: int, cout: int, momentum: "float | None" = 0.1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.bn = nn.BatchNorm2d(cout, momentum=momentum)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(ConvBN(3, 8), ConvBN(8, 8), ConvBN(8, 8, momentum=None))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))

    def training_step(self, x, y):
        return nn.functional.cross_entropy(self(x), y)


def _batch(step: int, rank: int, n: int = 6):
    gen = torch.Generator().manual_seed(100 * step + rank)
    # per-rank shift and scale: the ranks' statistics differ, as real data does
    x = torch.randn(n, 3, 6, 6, generator=gen) * (1 + rank) + rank
    return x, torch.randint(0, 4, (n,), generator=gen)


def _buffers(model):
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _run(model, rank, step_fn, no_sync):
    """Losses and buffers of each phase; ``step_fn(x, y)`` returns the loss."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"train": [], "buffers": []}
    for step in range(STEPS):
        loss = step_fn(*_batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["train"].append(loss.item())
        out["buffers"].append(_buffers(model))
    with no_sync():
        first = step_fn(*_batch(STEPS, rank))
        first.backward()
    second = step_fn(*_batch(STEPS + 1, rank))
    second.backward()
    opt.step()
    opt.zero_grad()
    out["train"] += [first.item(), second.item()]
    out["buffers"].append(_buffers(model))
    model.eval()
    with torch.no_grad():
        out["eval"] = [step_fn(*_batch(100 + i, rank)).item() for i in range(2)]
    out["buffers"].append(_buffers(model))
    return out


def _body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from lightning_ampzero.config import ZeroConfig
    from lightning_ampzero.zero.apply import apply_zero, no_sync, register_root_method
    from lightning_ampzero.zero.buffers import buffer_broadcast_of

    mesh = init_device_mesh("cpu", (world_size,))
    results = {}

    torch.manual_seed(0)
    ddp = DistributedDataParallel(CNN())  # broadcast_buffers=True, the default: stage 0
    results[0] = _run(ddp.module, rank, lambda x, y: nn.functional.cross_entropy(ddp(x), y), ddp.no_sync)

    for name, stage, bucket, broadcast in [(1, 1, 10**9, True), (2, 2, 10**9, True), (3, 3, 10**9, True),
                                           ("3-units", 3, 500, True), ("2-off", 2, 10**9, False)]:
        torch.manual_seed(0)
        model = CNN()
        apply_zero(model, mesh, ZeroConfig(stage=stage, reduce_bucket_size=bucket, param_persistence_threshold=0))
        register_root_method(model, "training_step")
        sync = buffer_broadcast_of(model)
        if not broadcast:
            sync.require_forward_sync, sync.exit = False, lambda: sync.__setattr__("_depth", sync._depth - 1)
        results[name] = _run(model, rank, model.training_step, lambda: no_sync(model, stage))
        results[name]["broadcasts"] = sync.broadcasts
        results[name]["bytes"] = sum(b.numel() * b.element_size() for b in model.buffers())
    return results


def _rel(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def test_running_statistics_as_under_ddp():
    results = spawn(_body, world_size=2, timeout=180)
    for rank, r in enumerate(results):
        ddp = r[0]
        for name in (1, 2, 3, "3-units"):
            got = r[name]
            assert _rel(got["train"], ddp["train"]) < 1e-5, (name, rank, got["train"], ddp["train"])
            assert _rel(got["eval"], ddp["eval"]) < 1e-5, (name, rank, got["eval"], ddp["eval"])
            for phase, (ours, theirs) in enumerate(zip(got["buffers"], ddp["buffers"])):
                assert ours.keys() == theirs.keys()
                for key in ours:
                    torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6,
                                               msg=f"stage {name} rank {rank} phase {phase} {key}")
            # DDP's schedule: before each of the 3 steps, before the first micro-batch of the
            # accumulated step (not the second: the first ran under no_sync), before the first
            # evaluation forward (the previous one trained), not the second (it ran without grad)
            assert got["broadcasts"] == 3 + 1 + 1, (name, got["broadcasts"])
        # without the broadcast each rank evaluates with its own statistics
        assert _rel(r["2-off"]["eval"], ddp["eval"]) > 1e-3 or rank == 0
    # after the evaluation forward every rank holds rank 0's statistics
    for key, value in results[0][2]["buffers"][-1].items():
        torch.testing.assert_close(results[1][2]["buffers"][-1][key], value)
    # the ranks' statistics do differ after a training forward (what makes the broadcast matter)
    assert not torch.equal(results[0][0]["buffers"][0]["features.0.bn.running_mean"],
                           results[1][0]["buffers"][0]["features.0.bn.running_mean"])


@pytest.mark.slow  # a Lightning script, 2 ranks, five fits: about 25 s
def test_running_statistics_through_lightning_as_stage_0(tmp_path):
    """The same through the Trainer at stages 1, 2 and 3 (the model built in ``__init__``): sanity-check
    validation, gradient accumulation (Lightning's block_backward_sync), validation during fit;
    every rank's training and validation losses and final buffers equal stage 0's."""
    from _scripts import run_json

    configs = ["0:0", "1:0", "2:0", "2:300", "3:300"]  # 300: a bucket of one conv block, the model in units
    results = run_json("units_bn.py", tmp_path / "bn.json", "--configs", ",".join(configs),
                       env={"OMP_NUM_THREADS": "1"}, timeout=300)
    for cfg in configs[1:]:
        for rank, (ours, ddp) in enumerate(zip(results[cfg], results["0:0"])):
            assert len(ours["val"]) == len(ddp["val"]) == 6  # sanity check + two validations
            assert _rel(ours["train"], ddp["train"]) < 1e-5, (cfg, rank)
            assert _rel(ours["val"], ddp["val"]) < 1e-5, (cfg, rank, ours["val"], ddp["val"])
            for key, value in ddp["buffers"].items():
                torch.testing.assert_close(torch.tensor(ours["buffers"][key]), torch.tensor(value), rtol=1e-5, atol=1e-6,
                                           msg=f"{cfg} rank {rank} {key}")
            # DDP's schedule: the first sanity-check forward; steps 2 and 4 (steps 1 and 3 come after a
            # validation, which ran without grad: DDP does not broadcast then either); the first
            # forward of each validation during fit
            assert ours["broadcasts"] == 5, ours["broadcasts"]
    # the ranks' data differ: evaluation on each rank's own slice gives different losses
    assert results["0:0"][0]["val"] != results["0:0"][1]["val"]


def test_checkpoint_holds_rank_0s_running_statistics_as_ddp(tmp_path):
    """[Note: replicated tensors saved from rank 0] in checkpoint/sharded.py: the checkpoint held rank
    1's statistics, so every rank resumed with them (and an export carried them)."""
    from _scripts import run_json

    out = run_json("bn_checkpoint.py", tmp_path / "bn.json", "--tmp", str(tmp_path), timeout=300)
    ddp = out["ddp"]
    assert ddp["0"]["end"] != ddp["1"]["end"]  # the ranks' statistics differ at the save: the check can fail
    assert ddp["0"]["resumed"] == ddp["1"]["resumed"] == ddp["0"]["end"]
    for stage in (0, 1, 3):
        assert out[f"stage{stage}"] == ddp, (stage, out[f"stage{stage}"])
