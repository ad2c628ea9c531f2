"""bf16-mixed on FSDP2: the ``lower_precision_safe_modules`` of a unit share ONE low-precision group.

2 CPU ranks (gloo), the small GPT, stages 1-3, bare loop (autocast + AdamW) over ``apply_zero``:

* collectives per step, counted at the c10d dispatcher (every all-gather / reduce-scatter passes
  through it): 2 groups per block (its Linears, the rest) + the leftovers, against one group per
  Linear before; Linear gradients reduced (and under stage 3 gathered) in bf16, the rest in fp32;
* the same losses and final parameters, bit for bit, as the layout with one unit per Linear
  (the same arithmetic per element), and losses within 1e-5 of DDP with the bf16 comm hook (the
  tolerance of test_precision.py's stage agreement);
* stage 3: explicit prefetch covers the nested Linear groups, in the order FSDP2 runs the groups.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from _spawn import spawn

STEPS = 4
N_LAYER = 2
# Elements of one block of the GPT below (12,704): each block is a unit of its own.
ONE_BLOCK_PER_UNIT = 15_000


def _gpt():
    from lightning_ampzero.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(n_layer=N_LAYER, n_embd=32, n_head=2, block_size=8))


def _policies(model, stage):
    from lightning_ampzero.config import PrecisionConfig
    from lightning_ampzero.precision.policy import dtype_plan, fsdp_policies

    return fsdp_policies(dtype_plan("bf16-mixed", PrecisionConfig()), model, stage)


def _per_linear_layout(model, mesh, cfg, mp_policy, module_policies):
    """The layout before grouping: every module with a policy an FSDP2 unit of its own."""
    from torch.distributed.fsdp import fully_shard

    from lightning_ampzero.zero.comm import LowPrecisionReduceScatter
    from lightning_ampzero.zero.units import find_blocks, group_units, leftover_modules

    blocks = find_blocks(model, ())
    units = group_units(blocks, cfg.unit_size)
    for run in leftover_modules(model, blocks):
        units += group_units(run, cfg.unit_size)
    reshard = cfg.stage == 3
    for module, policy in module_policies.items():
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        if getattr(policy, "comm_dtype", None) is not None:  # stage 1: fp32 accumulation, low-dtype wire
            module.set_custom_reduce_scatter(LowPrecisionReduceScatter(policy.comm_dtype))
    for unit in units:
        rest = [m for m in unit.modules if m not in module_policies]
        if rest:
            fully_shard(rest[0] if len(rest) == 1 else rest, mesh=mesh, reshard_after_forward=reshard,
                        mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy)


def _collectives():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Collectives(TorchDispatchMode):
        """(c10d op, dtype of its output) of every collective run under it."""

        def __init__(self):
            super().__init__()
            self.calls: list[tuple[str, str]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                out = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
                self.calls.append((func._opname.strip("_"), str(out.dtype).removeprefix("torch.")))
            return func(*args, **(kwargs or {}))

    return Collectives()


def _train(model, rank, record=False):
    """STEPS AdamW steps on this rank's batches; losses and the last step's collectives."""
    import torch.nn.functional as F

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, calls = [], []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        idx = torch.randint(0, 256, (2, 9), generator=gen)
        mode = _collectives()
        with mode:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(idx[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        calls = mode.calls
    return losses, calls


def _full(model):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _groups(model):
    """Each FSDP2 group (one fully_shard call): its modules' names and (param_dtype, wire dtype of its gradients).

    The wire dtype is the policy's ``reduce_dtype``, or its ``comm_dtype`` where a custom
    reduce-scatter sends in that dtype (stage 1 safe modules, zero/comm.py)."""
    from torch.distributed.fsdp import FSDPModule

    states: dict[int, list] = {}
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule) and m is not model:
            state = m._get_fsdp_state()
            pol = state._mp_policy
            wire = getattr(pol, "comm_dtype", None) or pol.reduce_dtype
            states.setdefault(id(state), [[], (str(pol.param_dtype), str(wire))])[0].append(name)
    return sorted((tuple(names), dtypes) for names, dtypes in states.values())


def _prefetch_chains(model):
    """name of a group's first module -> names of the first modules of the groups it prefetches."""
    from torch.distributed.fsdp import FSDPModule

    first = {}
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule) and m is not model:
            first.setdefault(id(m._get_fsdp_state()), name)
    fwd, bwd = {}, {}
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule) and m is not model and first[id(m._get_fsdp_state())] == name:
            state = m._get_fsdp_state()
            fwd[name] = [first[id(s)] for s in state._states_to_forward_prefetch]
            bwd[name] = [first[id(s)] for s in state._states_to_backward_prefetch]
    return fwd, bwd


def _execution_order(model):
    """The groups (first module's name) in the order one forward and one backward use them."""
    from unittest import mock

    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    seen: dict[str, list[str]] = {"forward": [], "backward": []}
    pre_forward, pre_backward = FSDPParamGroup.pre_forward, FSDPParamGroup.pre_backward

    def log(kind, group):
        name = group._module_fqn.split(", ")[0]
        if name not in seen[kind]:
            seen[kind].append(name)

    def on_forward(group, *args, **kwargs):
        log("forward", group)
        return pre_forward(group, *args, **kwargs)

    def on_backward(group, *args, **kwargs):
        log("backward", group)
        return pre_backward(group, *args, **kwargs)

    with mock.patch.object(FSDPParamGroup, "pre_forward", on_forward), \
            mock.patch.object(FSDPParamGroup, "pre_backward", on_backward):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.zeros(2, 8, dtype=torch.long))
        out.float().mean().backward()
    model.zero_grad(set_to_none=True)
    return seen["forward"], seen["backward"]


def _body(rank, world_size, stage):
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ampzero.config import PrecisionConfig, ZeroConfig
    from lightning_ampzero.precision.ddp import register_reduce_dtypes
    from lightning_ampzero.precision.policy import ddp_reduce_dtypes, dtype_plan
    from lightning_ampzero.zero.apply import apply_zero

    mesh = init_device_mesh("cpu", (world_size,))
    # One block per unit; stage 3 with one group of prefetch (every group prefetches the next one).
    cfg = ZeroConfig(stage=stage, reduce_bucket_size=ONE_BLOCK_PER_UNIT, param_persistence_threshold=0,
                     prefetch_bucket_size=1)
    out = {}

    grouped = _gpt()
    root, per_module = _policies(grouped, stage)
    apply_zero(grouped, mesh, cfg, root, module_policies=per_module)
    out["groups"] = _groups(grouped)
    out["prefetch"] = _prefetch_chains(grouped)
    out["order"] = _execution_order(grouped) if stage == 3 else None
    out["losses"], out["calls"] = _train(grouped, rank)
    out["params"] = _full(grouped)

    per_linear = _gpt()
    _per_linear_layout(per_linear, mesh, cfg, *_policies(per_linear, stage))
    out["per_linear_losses"], out["per_linear_calls"] = _train(per_linear, rank)
    out["per_linear_params"] = _full(per_linear)

    # All blocks in one unit (the default bucket, 5e8 elements): still one Linear group for them.
    whole = _gpt()
    root, per_module = _policies(whole, stage)
    apply_zero(whole, mesh, ZeroConfig(stage=stage, param_persistence_threshold=0), root, module_policies=per_module)
    out["whole_groups"] = _groups(whole)
    out["whole_losses"], out["whole_calls"] = _train(whole, rank)

    ref = _gpt()
    ddp = torch.nn.parallel.DistributedDataParallel(ref)
    register_reduce_dtypes(ddp, ddp_reduce_dtypes(dtype_plan("bf16-mixed", PrecisionConfig()), ref))
    out["ddp_losses"], _ = _train(ddp, rank)
    return out


@pytest.fixture(scope="module", params=[1, 2, 3])
def run(request):
    stage = request.param
    return stage, spawn(_body, world_size=2, args=(stage,), timeout=240)


LINEARS = ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")


@pytest.mark.slow  # the run fixture: 3 spawns of 2 ranks, about 40 s in all
def test_linears_of_a_unit_are_one_group(run):
    stage, results = run
    low = "torch.bfloat16" if stage == 3 else "None"
    groups = results[0]["groups"]
    expected = sorted(
        [(tuple(f"blocks.{b}.{n}" for n in LINEARS), (low, "torch.bfloat16")) for b in range(N_LAYER)]
        + [((f"blocks.{b}",), ("None", "None")) for b in range(N_LAYER)]
        + [(("wte", "wpe"), ("None", "None")), (("ln_f",), ("None", "None")), (("head",), (low, "torch.bfloat16"))]
    )
    assert groups == expected
    whole = results[0]["whole_groups"]
    linears = tuple(f"blocks.{b}.{n}" for b in range(N_LAYER) for n in LINEARS)
    if stage == 3:
        assert (linears, (low, "torch.bfloat16")) in whole
        assert (tuple(f"blocks.{b}" for b in range(N_LAYER)), ("None", "None")) in whole
        assert len(whole) == 5
    else:
        # Below stage 3 a model that fits one bucket is one unit: every Linear of the model (the
        # head too) is one low-precision group, the rest is the root: one group per dtype.
        assert whole == [(linears + ("head",), (low, "torch.bfloat16"))]  # in module order


@pytest.mark.slow  # the run fixture: 3 spawns of 2 ranks, about 40 s in all
def test_collectives_per_step_two_per_block_and_their_dtypes(run):
    stage, results = run
    passes = 2 if stage == 3 else 1  # stage 3 gathers again for backward
    linear_groups, fp32_groups = N_LAYER + 1, N_LAYER + 2  # + head / + wte,wpe and ln_f
    gather_low = "bfloat16" if stage == 3 else "float32"
    for r in results:
        got = Counter(r["calls"])
        want = Counter({("allgather_base", gather_low): passes * linear_groups,
                        ("reduce_scatter_base", "bfloat16"): linear_groups,
                        ("reduce_scatter_base", "float32"): fp32_groups})
        want[("allgather_base", "float32")] += passes * fp32_groups
        assert got == want, (stage, got)
        assert len(r["calls"]) == (passes + 1) * (linear_groups + fp32_groups)
        # one unit per Linear before: 4 per block + the head
        assert len(r["per_linear_calls"]) == (passes + 1) * (5 * N_LAYER + 3)
        # the model in one bucket: at stage 3 the blocks' Linears, their LayerNorms, wte+wpe,
        # ln_f, head; below it all Linears and the root, one group per dtype (DeepSpeed's buckets)
        assert len(r["whole_calls"]) == (passes + 1) * (5 if stage == 3 else 2)


@pytest.mark.slow  # the run fixture: 3 spawns of 2 ranks, about 40 s in all
def test_same_numerics_as_one_unit_per_linear_and_as_ddp(run):
    _, results = run
    for r in results:
        assert r["losses"] == r["per_linear_losses"] == r["whole_losses"]
        assert r["losses"][-1] < r["losses"][0]  # it trains
        for name, p in r["params"].items():
            assert torch.equal(p, r["per_linear_params"][name]), name
        rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], r["ddp_losses"]))
        assert rel < 1e-5, rel


@pytest.mark.slow  # the run fixture: 3 spawns of 2 ranks, about 40 s in all
def test_stage3_prefetch_follows_execution_order(run):
    stage, results = run
    if stage != 3:
        pytest.skip("explicit prefetch is a stage-3 setting")
    fwd, bwd = results[0]["prefetch"]
    # one group ahead (prefetch_bucket_size=1); a block's own group before its Linears in both passes
    order = ["wte"] + [g for b in range(N_LAYER) for g in (f"blocks.{b}", f"blocks.{b}.attn.qkv")] + ["ln_f", "head"]
    assert fwd == {a: [b] for a, b in zip(order, order[1:])} | {"head": []}
    back = ["head", "ln_f"] + [g for b in reversed(range(N_LAYER)) for g in (f"blocks.{b}", f"blocks.{b}.attn.qkv")]
    back += ["wte"]
    assert bwd == {a: [b] for a, b in zip(back, back[1:])} | {"wte": []}
    # the orders FSDP2 itself ran the groups in (pre-forward, pre-backward hooks)
    assert results[0]["order"] == (order, back)


# ---------------------------------------------------------------------------------------------
# Which modules make a group (one process: no sharding)
# ---------------------------------------------------------------------------------------------


def _groups_of(unit_modules, policies):
    from torch import nn

    from lightning_ampzero.zero.apply import _policy_groups
    from lightning_ampzero.zero.units import Unit

    root = nn.ModuleList(unit_modules)
    names = {id(m): n for n, m in root.named_modules()}
    unit = Unit(list(unit_modules), [names[id(m)] for m in unit_modules], 0)
    return [(g.names, policy) for g, policy in _policy_groups(unit, policies, names)]


def test_policy_groups_per_unit_nested_and_innermost_first():
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    half = MixedPrecisionPolicy(reduce_dtype=torch.float16)
    model = _gpt()
    _, per_module = _policies(model, 2)
    # the Linears of two blocks in one unit: one group, in module order
    assert _groups_of([model.blocks[0], model.blocks[1]], per_module) == [
        ([f"{b}.{n}" for b in (0, 1) for n in LINEARS], next(iter(per_module.values())))]
    # equal policies (not the same object) make one group; a module inside another of the group is covered
    mlp = nn.Sequential(nn.Linear(2, 2), nn.GELU(), nn.Linear(2, 2))
    other = nn.Linear(2, 2)
    assert _groups_of([mlp, other], {mlp: low, mlp[0]: low, other: MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)}) \
        == [(["0", "1"], low)]
    # a group inside a module of another group is sharded first (bottom-up)
    assert _groups_of([mlp], {mlp: half, mlp[2]: low}) == [(["0.2"], low), (["0"], half)]
    # nested both ways: no bottom-up order exists
    a, b = nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="different policies inside each other"):
        _groups_of([a, b], {a: low, a[0]: half, b: half, b[0]: low})


def _persistent_body(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ampzero.config import ZeroConfig
    from lightning_ampzero.zero.apply import apply_zero

    model = _gpt()
    root, per_module = _policies(model, 3)
    # The blocks' fp32 rest (2 LayerNorms, 128 elements) and ln_f (64) fall under the threshold and
    # stay gathered; the Linear groups (~12.5k elements), wte+wpe and head are resharded.
    cfg = ZeroConfig(stage=3, reduce_bucket_size=ONE_BLOCK_PER_UNIT, param_persistence_threshold=1_000,
                     prefetch_bucket_size=1)
    apply_zero(model, init_device_mesh("cpu", (world,)), cfg, root, module_policies=per_module)
    fwd, bwd = _prefetch_chains(model)
    return dict(fwd=fwd, bwd=bwd)


@pytest.mark.slow
def test_stage3_prefetch_skips_groups_that_stay_gathered():
    """A persistent group takes no slot in the prefetch chain: each resharded group prefetches the
    next resharded one (with it in the chain, a Linear group would be prefetched only by its own
    block's LayerNorm group, which runs just before it: no overlap)."""
    r = spawn(_persistent_body, world_size=2, timeout=120)[0]
    persistent = {f"blocks.{b}": [] for b in range(N_LAYER)} | {"ln_f": []}
    order = ["wte"] + [f"blocks.{b}.attn.qkv" for b in range(N_LAYER)] + ["head"]
    assert r["fwd"] == {a: [b] for a, b in zip(order, order[1:])} | {"head": []} | persistent
    back = order[::-1]
    assert r["bwd"] == {a: [b] for a, b in zip(back, back[1:])} | {"wte": []} | persistent


def _stage2_wire_cast_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ampzero.config import PrecisionConfig, ZeroConfig
    from lightning_ampzero.precision.plugin import AmpZeroPrecision
    from lightning_ampzero.precision.policy import dtype_plan, fsdp_policies
    from lightning_ampzero.zero.apply import apply_zero

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for cast in (False, True):
        model = _gpt()
        root, per_module = fsdp_policies(dtype_plan("bf16-mixed", PrecisionConfig()), model, 2, cast_on_wire=cast)
        apply_zero(model, mesh, ZeroConfig(stage=2, param_persistence_threshold=0), root, module_policies=per_module)
        losses, calls = _train(model, rank)
        out[cast] = {"groups": _groups(model), "losses": losses, "params": _full(model),
                     "fsdp_reduce": sorted({str(p.reduce_dtype) for p in per_module.values()}),
                     "calls": sorted(Counter(calls).items())}
    # what the strategy asks for on this gloo group
    _, chosen = AmpZeroPrecision("bf16-mixed").fsdp_policies(_gpt(), 2)
    out["plugin_comm_dtypes"] = sorted({str(getattr(p, "comm_dtype", None)) for p in chosen.values()})
    return out


def test_stage2_on_gloo_packs_in_fp32_and_casts_for_the_wire_with_the_same_bits():
    # FSDP2's own bf16 packing (torch._chunk_cat into a bf16 buffer) costs 3x a copy and a cast
    # on CPU; on gloo stage 2 packs in fp32 and LowPrecisionReduceScatter casts. With 2 ranks the
    # division by the world size is exact, so rounding before or after it gives the same bits.
    results = spawn(_stage2_wire_cast_body, world_size=2, timeout=240)
    for r in results:
        fsdp2_path, wire_cast = r[False], r[True]
        assert fsdp2_path["groups"] == wire_cast["groups"]  # same groups, bf16 on the wire for the Linears
        assert fsdp2_path["fsdp_reduce"] == ["torch.bfloat16"] and wire_cast["fsdp_reduce"] == ["None"]
        assert fsdp2_path["calls"] == wire_cast["calls"]
        assert fsdp2_path["losses"] == wire_cast["losses"]
        for name, p in fsdp2_path["params"].items():
            assert torch.equal(p, wire_cast["params"][name]), name
        assert r["plugin_comm_dtypes"] == ["torch.bfloat16"]
