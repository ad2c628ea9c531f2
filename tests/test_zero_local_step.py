"""The optimizer step on local shards ([Note: the optimizer step on local shards] in zero/local_step.py).

Each optimizer of ``ELEMENTWISE``, with the options that change its kernels, steps two copies of
an FSDP2-sharded model on 2 ranks from the same weights and gradients: one on the DTensors, one
inside ``on_local_shards``. Parameters and every state tensor must be equal bit for bit after each
step, the state must be DTensors laid out as their parameters (what checkpoints read), and the
local step must really have run on plain tensors. Uneven shapes give padded and empty shards.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _spawn import spawn

CASES = [
    ("AdamW", {}),
    ("AdamW", {"foreach": True}),
    ("AdamW", {"fused": True}),
    ("Adam", {"amsgrad": True, "weight_decay": 0.1}),
    ("SGD", {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("SGD", {"momentum": 0.9, "foreach": True}),
    ("Adagrad", {"lr_decay": 0.01}),
    ("Adamax", {}),
    ("NAdam", {"decoupled_weight_decay": True, "weight_decay": 0.01}),
    ("RAdam", {}),
    ("RMSprop", {"centered": True, "momentum": 0.5}),
    ("Adadelta", {}),
]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)  # 11 rows over 2 ranks: a padded shard
        self.a = nn.Linear(6, 7)
        self.b = nn.Linear(7, 1)  # 1 row: rank 1's weight shard is empty

    def forward(self, x):
        return self.b(torch.tanh(self.a(self.emb(x)))).sum()


def _sharded(mesh, fp8_all_gather=False):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = Net()
    if fp8_all_gather:  # FP8 needs multiples of 16; the Linear weights' local shards become Fp8AllGatherWeight
        from lightning_ampzero.config import Fp8Config
        from lightning_ampzero.fp8 import convert_to_fp8

        net.emb, net.a, net.b = nn.Embedding(11, 16), nn.Linear(16, 32), nn.Linear(32, 16)
        convert_to_fp8(net, Fp8Config(recipe="tensorwise", min_features=0, msamp="O1"), fp8_all_gather=True)
    fully_shard(net.a, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _step_both(nets, opts, step, rank, inside_local=lambda: None):
    """One step of both copies on the same batch: ``opts[0]`` on the DTensors, ``opts[1]`` inside
    ``on_local_shards`` (``inside_local`` runs there first); gradients zeroed afterwards."""
    from lightning_ampzero.zero.local_step import on_local_shards

    x = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(10 * step + rank))
    for net in nets:
        net(x).backward()
    opts[0].step()
    with on_local_shards(opts[1]):
        inside_local()
        opts[1].step()
    for opt in opts:
        opt.zero_grad()


def _body(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_ampzero.zero.local_step import steps_on_local_shards

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for name, kwargs in CASES:
        nets = [_sharded(mesh), _sharded(mesh)]
        opts = [getattr(torch.optim, name)(n.parameters(), lr=0.05, **kwargs) for n in nets]
        eligible = steps_on_local_shards(opts[1])
        local_types, equal, layout = set(), True, True
        for step in range(3):
            _step_both(nets, opts, step, rank, lambda: local_types.update(
                type(p) for g in opts[1].param_groups for p in g["params"]))
            for p, q in zip(nets[0].parameters(), nets[1].parameters()):
                equal &= torch.equal(p.to_local(), q.to_local())
                s, t = opts[0].state[p], opts[1].state[q]
                equal &= sorted(s) == sorted(t)
                for key in s:
                    if isinstance(s[key], DTensor):
                        layout &= (isinstance(t[key], DTensor) and t[key].placements == p.placements
                                   and t[key].shape == p.shape)
                        equal &= torch.equal(s[key].to_local(), t[key].to_local())
                    else:
                        layout &= not isinstance(t[key], DTensor)
                        equal &= torch.equal(torch.as_tensor(s[key]), torch.as_tensor(t[key]))
        out[name + str(sorted(kwargs.items()))] = {"eligible": eligible, "equal": equal, "layout": layout,
                                                   "plain": DTensor not in local_types and bool(local_types)}
    dist.barrier()
    return out


def test_local_step_is_the_dtensor_step_bit_for_bit():
    for r in spawn(_body, world_size=2, timeout=180):
        for case, res in r.items():
            assert res["eligible"], case
            assert res["plain"], f"{case}: the step did not run on plain tensors"
            assert res["equal"], f"{case}: parameters or state differ from the DTensor step"
            assert res["layout"], f"{case}: state not laid out as the parameters"


def _foreach_default_body(rank, world_size, fp8_all_gather):
    import torch.optim.adam as adam_module
    import torch.optim.optimizer as optimizer_module
    from torch.distributed.device_mesh import init_device_mesh

    # Where foreach kernels are supported (CUDA), torch resolves ``foreach=None`` to foreach for
    # DTensors as for plain tensors, but to the for-loop for a local tensor of another type (the FP8
    # all-gather's weight wrapper); CPU is made such a device here to see that the local step runs
    # what the DTensor step runs.
    optimizer_module._get_foreach_kernels_supported_devices = lambda: ["cuda", "cpu"]
    calls = []
    for impl in ("_single_tensor_adam", "_multi_tensor_adam"):
        def record(*args, _impl=getattr(adam_module, impl), _name=impl, **kwargs):
            calls.append(_name)
            return _impl(*args, **kwargs)
        setattr(adam_module, impl, record)
    mesh = init_device_mesh("cpu", (world_size,))
    nets = [_sharded(mesh, fp8_all_gather), _sharded(mesh, fp8_all_gather)]
    opts = [torch.optim.AdamW(n.parameters(), lr=0.05) for n in nets]
    wrapped = {type(p.to_local()).__name__ for p in nets[1].parameters()}
    impls, equal = [], True
    for step in range(2):
        _step_both(nets, opts, step, rank)
        impls.append(calls[-2:])
        equal &= all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(*(n.parameters() for n in nets)))
    return {"impls": impls, "equal": equal, "foreach": [g["foreach"] for g in opts[1].param_groups],
            "wrapped": "Fp8AllGatherWeight" in wrapped}


@pytest.mark.parametrize("fp8_all_gather", [False, True], ids=["plain", "fp8-all-gather"])
def test_foreach_none_resolves_as_for_the_dtensors(fp8_all_gather):
    for r in spawn(_foreach_default_body, world_size=2, timeout=120, args=(fp8_all_gather,)):
        assert r["wrapped"] == fp8_all_gather
        # both steps ran torch's foreach AdamW (the DTensor step's choice on such a device), with the same bits
        assert r["impls"] == [["_multi_tensor_adam", "_multi_tensor_adam"]] * 2
        assert r["equal"]
        assert r["foreach"] == [None]  # the user's setting, as it was


def _refusals_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ampzero.zero.local_step import steps_on_local_shards

    net = _sharded(init_device_mesh("cpu", (world_size,)))
    net(torch.zeros(2, 3, dtype=torch.long)).backward()

    class MyAdamW(torch.optim.AdamW):  # may compute norms over whole tensors: not ours to judge
        pass

    hooked = torch.optim.AdamW(net.parameters())
    hooked.register_step_pre_hook(lambda opt, args, kwargs: None)
    plain = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    return {"adamw": steps_on_local_shards(torch.optim.AdamW(net.parameters())),
            "subclass": steps_on_local_shards(MyAdamW(net.parameters())),
            "hooked": steps_on_local_shards(hooked),
            "lbfgs": steps_on_local_shards(torch.optim.LBFGS(net.parameters())),
            "differentiable": steps_on_local_shards(torch.optim.SGD(net.parameters(), lr=0.1, differentiable=True)),
            # Adam turns foreach off for a tensor lr after resolving it: not pinned, kept on the DTensors
            "tensor_lr": steps_on_local_shards(torch.optim.AdamW(net.parameters(), lr=torch.tensor(1e-3))),
            "no_dtensor": steps_on_local_shards(plain)}


def test_what_stays_on_dtensors():
    for r in spawn(_refusals_body, world_size=2, timeout=120):
        assert r == {"adamw": True, "subclass": False, "hooked": False, "lbfgs": False, "differentiable": False,
                     "tensor_lr": False, "no_dtensor": False}


@pytest.mark.parametrize("stage", [1, 3])
def test_lightning_fit_matches_ddp_with_the_default_adamw(stage, tmp_path):
    """Through the precision plugin: a plain Trainer, ``torch.optim.AdamW`` at its CPU default, 5 steps."""
    from _scripts import run_script

    runs = {}
    for strategy in ("ddp", f"ampzero_stage_{stage}"):
        run_script("local_step_fit.py", strategy, "--out", str(tmp_path / strategy), timeout=300)
        runs[strategy] = torch.load(tmp_path / strategy)
    ours = runs[f"ampzero_stage_{stage}"]
    assert ours["local_steps"] == 5  # every step on plain tensors (on the DTensors before: 0)
    assert {k: (v - ours["state"][k]).abs().max().item() for k, v in runs["ddp"]["state"].items()} == {
        k: 0.0 for k in runs["ddp"]["state"]}
