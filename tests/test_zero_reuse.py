"""Stage 3 ``max_reuse_distance`` (DeepSpeed's ``stage3_max_reuse_distance``): the last groups of the
forward stay gathered for their backward ([Note: reuse distance] in lightning_ampzero/zero/units.py).

Same numerics as re-gathering them (bit for bit), fewer all-gathers, counted at the c10d dispatcher.
"""

from __future__ import annotations

import pytest
import torch

from _spawn import spawn
from lightning_ampzero.config import ZeroConfig
from lightning_ampzero.zero.units import kept_for_reuse

DISTANCES = (0, 1, 1e9)


def _body(rank, world_size):
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ampzero.models.gpt import GPT, GPTConfig
    from lightning_ampzero.zero.apply import apply_zero
    from test_zero_lowp_units import _collectives

    out = {}
    for distance in DISTANCES:
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=4, n_embd=32, n_head=2, block_size=16, vocab_size=64))
        # one block per unit, nothing persistent: 6 groups (wte+wpe, 4 blocks, ln_f+head) and the root
        cfg = ZeroConfig(stage=3, reduce_bucket_size=2e4, param_persistence_threshold=0, max_reuse_distance=distance)
        units = apply_zero(model, init_device_mesh("cpu", (2,)), cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, gathers = [], []
        for step in range(3):
            idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
            mode = _collectives()
            with mode:
                loss = F.cross_entropy(model(idx).view(-1, 64), idx.view(-1))
                loss.backward()
            gathers.append(sum(1 for op, _ in mode.calls if op == "allgather_base"))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        params = {n: p.full_tensor() for n, p in model.named_parameters()}
        out[distance] = {"losses": losses, "gathers": gathers, "params": params,
                         "groups": sum(1 for u in units[:-1] if u.numel)}
    return out


@pytest.fixture(scope="module")
def runs():
    return spawn(_body, world_size=2)


def test_keeping_units_for_reuse_changes_no_bit(runs):
    for r in runs:
        base = r[0]
        for distance in DISTANCES[1:]:
            assert r[distance]["losses"] == base["losses"]
            assert all(torch.equal(r[distance]["params"][n], p) for n, p in base["params"].items())


def test_kept_units_are_not_gathered_again_for_backward(runs):
    for r in runs:
        groups = r[0]["groups"]
        assert groups == 6
        assert r[0]["gathers"] == [2 * groups] * 3  # every group: forward, and again for backward
        assert r[1]["gathers"] == [2 * groups - 1] * 3  # the last of the forward (distance 0) is kept
        assert r[1e9]["gathers"] == [groups] * 3  # DeepSpeed's default: none gathered twice


def test_reuse_distance_counts_the_gathers_in_between():
    # from the last group back: kept while the elements gathered in between stay under the distance
    assert kept_for_reuse([100] * 4, 0, 0) == [False] * 4
    assert kept_for_reuse([100] * 4, 1, 0) == [False, False, False, True]
    assert kept_for_reuse([100] * 4, 150, 0) == [False, False, True, True]  # 0, then 100 in between
    assert kept_for_reuse([100] * 4, 250, 0) == [False, True, True, True]
    # a persistent group stays gathered anyway and is not counted
    assert kept_for_reuse([100, 100, 5, 100], 150, 10) == [False, True, False, True]
    with pytest.raises(ValueError, match="max_reuse_distance"):
        ZeroConfig(stage=3, max_reuse_distance=-1)
