"""bf16-mixed on FSDP2: the ``lower_precision_safe_modules`` (listed; the default ``None`` sends their
gradients in fp32 on gloo, tested too) of a unit have no group of their own on gloo: their unit's
group sends their gradients in bf16 ([Note: one group, two wire dtypes] in zero/comm.py) and, at stage 3, gathers their parameters in bf16 ([Note: safe modules gathered in
the low dtype inside their unit's group]).

2 CPU ranks (gloo), the small GPT, stages 1-3, bare loop (autocast + AdamW) over ``apply_zero``:

* collectives per step, counted at the c10d dispatcher (every all-gather / reduce-scatter passes
  through it): one group per block, reduce-scattering its Linears' part in bf16 and the rest in
  fp32, against one group per Linear before; at stage 3 one all-gather of bf16 Linears and fp32
  LayerNorms (as bytes) per block and pass, the bytes counted;
* the same losses and final parameters, bit for bit, as the layout with one unit per Linear
  (each Linear gathered and reduced in bf16 by a group of its own), and losses within 1e-5 of DDP
  with the bf16 comm hook (the tolerance of test_precision.py's stage agreement);
* stage 3: explicit prefetch follows the order FSDP2 runs the groups in.
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


#: The safe modules named: their gradients go in bf16 on gloo too ([Note: the safe modules' gradients
#: on gloo] in precision/policy.py), which is what most of this file tests.
LISTED = ("Linear", "Conv1d", "Conv2d", "Conv3d")


def _plan(listed=True):
    from lightning_ampzero.config import PrecisionConfig
    from lightning_ampzero.precision.policy import dtype_plan

    return dtype_plan("bf16-mixed", PrecisionConfig(lower_precision_safe_modules=LISTED if listed else None))


def _policies(model, stage, listed=True):
    from lightning_ampzero.precision.policy import fsdp_policies

    return fsdp_policies(_plan(listed), model, stage)


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
            self.bytes: Counter = Counter()  # bytes of each collective's output, by op

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                out = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
                self.calls.append((func._opname.strip("_"), str(out.dtype).removeprefix("torch.")))
                self.bytes[func._opname.strip("_")] += out.numel() * out.element_size()
            return func(*args, **(kwargs or {}))

    return Collectives()


def _train(model, rank, record=False):
    """STEPS AdamW steps on this rank's batches; losses, the last step's collectives and their output bytes by op."""
    import torch.nn.functional as F

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, calls, nbytes = [], [], Counter()
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
        calls, nbytes = mode.calls, mode.bytes
    return losses, calls, nbytes


def _full(model):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _wire(state):
    """The wire dtype of a group's gradients: the policy's ``reduce_dtype``, or its ``comm_dtype`` where a
    custom reduce-scatter sends in that dtype (stage 1 safe modules, zero/comm.py), or "float32+bfloat16"
    for a group that sends its safe modules' part in bf16 and the rest in fp32 (MixedWireReduceScatter)."""
    from lightning_ampzero.zero.comm import MixedWireReduceScatter

    pol = state._mp_policy
    custom = state._fsdp_param_group._reduce_scatter_comm if state._fsdp_param_group is not None else None
    if isinstance(custom, MixedWireReduceScatter):
        low = {id(fp._module_info.module) in custom._low for fp in state._fsdp_param_group.fsdp_params}
        return "+".join(sorted({"float32" if not f else str(custom.dtype).removeprefix("torch.") for f in low}))
    return str(getattr(pol, "comm_dtype", None) or pol.reduce_dtype)


def _groups(model, root=False):
    """Each FSDP2 group (one fully_shard call): its modules' names and (param_dtype, wire dtype of its gradients)."""
    from torch.distributed.fsdp import FSDPModule

    states: dict[int, list] = {}
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule) and (m is not model or root):
            state = m._get_fsdp_state()
            states.setdefault(id(state), [[], (str(state._mp_policy.param_dtype), _wire(state))])[0].append(name)
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

    from lightning_ampzero.config import ZeroConfig
    from lightning_ampzero.precision.ddp import register_reduce_dtypes
    from lightning_ampzero.precision.policy import ddp_reduce_dtypes
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
    out["losses"], out["calls"], out["bytes"] = _train(grouped, rank)
    linear = {id(p) for m in per_module for p in m.parameters()}  # the Linears' parameters (fsdp_policies')
    out["numels"] = (sum(p.numel() for p in grouped.parameters() if id(p) in linear),
                     sum(p.numel() for p in grouped.parameters() if id(p) not in linear))
    out["params"] = _full(grouped)

    per_linear = _gpt()
    _per_linear_layout(per_linear, mesh, cfg, *_policies(per_linear, stage))
    out["per_linear_losses"], out["per_linear_calls"], _ = _train(per_linear, rank)
    out["per_linear_params"] = _full(per_linear)

    # All blocks in one unit (the default bucket, 5e8 elements): still one Linear group for them.
    whole = _gpt()
    root, per_module = _policies(whole, stage)
    apply_zero(whole, mesh, ZeroConfig(stage=stage, param_persistence_threshold=0), root, module_policies=per_module)
    out["whole_groups"] = _groups(whole)
    out["whole_root"] = _groups(whole, root=True)
    out["whole_losses"], out["whole_calls"], _ = _train(whole, rank)

    ref = _gpt()
    ddp = torch.nn.parallel.DistributedDataParallel(ref)
    register_reduce_dtypes(ddp, ddp_reduce_dtypes(_plan(), ref))
    out["ddp_losses"], _, _ = _train(ddp, rank)

    # lower_precision_safe_modules=None (the default): on gloo every gradient goes in fp32
    default = _gpt()
    root, per_module = _policies(default, stage, listed=False)
    apply_zero(default, mesh, cfg, root, module_policies=per_module)
    out["default_groups"] = _groups(default)
    out["default_losses"], out["default_calls"], out["default_bytes"] = _train(default, rank)
    out["default_params"] = _full(default)
    plain = _gpt()
    assert ddp_reduce_dtypes(_plan(listed=False), plain, gloo=True) == {}  # stage 0: no comm hook on gloo
    plain_ddp = torch.nn.parallel.DistributedDataParallel(plain)
    out["plain_ddp_losses"], _, _ = _train(plain_ddp, rank)
    out["plain_ddp_params"] = _full(plain)
    return out


@pytest.fixture(scope="module", params=[1, 2, 3])
def run(request):
    stage = request.param
    return stage, spawn(_body, world_size=2, args=(stage,), timeout=240)


LINEARS = ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")


@pytest.mark.slow  # the run fixture: 3 spawns of 2 ranks, about 40 s in all
def test_linears_of_a_unit_are_one_group(run):
    stage, results = run
    groups = results[0]["groups"]
    whole = results[0]["whole_groups"]
    # On gloo the Linears stay in their unit's group, which sends their gradients in bf16 and the
    # LayerNorms' in fp32 (the unit of ln_f and the head likewise); at stage 3 they also gather in
    # bf16 there ([Note: safe modules gathered in the low dtype inside their unit's group]).
    assert groups == sorted(
        [((f"blocks.{b}",), ("None", "bfloat16+float32")) for b in range(N_LAYER)]
        + [(("wte", "wpe"), ("None", "None")), (("ln_f", "head"), ("None", "bfloat16+float32"))]
    )
    if stage == 3:
        # the default bucket: the blocks are one unit (one group), as are ln_f and the head
        assert whole == sorted([(tuple(f"blocks.{b}" for b in range(N_LAYER)), ("None", "bfloat16+float32")),
                                (("wte", "wpe"), ("None", "None")), (("ln_f", "head"), ("None", "bfloat16+float32"))])
    else:
        # A model that fits one bucket is one unit, the root: one group, two wire dtypes.
        assert whole == []
        assert results[0]["whole_root"] == [(("",), ("None", "bfloat16+float32"))]


@pytest.mark.slow  # the run fixture: 3 spawns of 2 ranks, about 40 s in all
def test_collectives_per_step_one_group_per_block_and_their_dtypes(run):
    stage, results = run
    passes = 2 if stage == 3 else 1  # stage 3 gathers again for backward
    for r in results:
        got = Counter(r["calls"])
        # one unit per Linear before: 4 per block + the head
        assert len(r["per_linear_calls"]) == (passes + 1) * (5 * N_LAYER + 3)
        # One group per block (its Linears' gradients in bf16, the rest in fp32), wte+wpe (fp32) and
        # ln_f+head (both): one all-gather each (two at stage 3), one reduce-scatter per wire dtype.
        # At stage 3 the groups with Linears gather bf16 and fp32 parameters in one all-gather, as bytes.
        mixed_gather = "uint8" if stage == 3 else "float32"
        want = Counter({("allgather_base", mixed_gather): passes * (N_LAYER + 1),
                        ("reduce_scatter_base", "bfloat16"): N_LAYER + 1,
                        ("reduce_scatter_base", "float32"): N_LAYER + 2})
        want[("allgather_base", "float32")] += passes  # wte+wpe
        assert got == want, (stage, got)
        linear, rest = r["numels"]
        # the bytes gathered: the Linears' in bf16 at stage 3, everything else in fp32 (2 ranks' shards)
        assert r["bytes"]["allgather_base"] == passes * ((2 if stage == 3 else 4) * linear + 4 * rest)
        if stage == 3:
            # the model in one bucket: the blocks, wte+wpe and ln_f+head, each gathered twice
            assert Counter(r["whole_calls"]) == Counter({("allgather_base", "uint8"): 4, ("allgather_base", "float32"): 2,
                                                         ("reduce_scatter_base", "bfloat16"): 2,
                                                         ("reduce_scatter_base", "float32"): 3})
            continue
        # the model in one bucket: the root alone, one all-gather and a reduce-scatter per dtype
        assert Counter(r["whole_calls"]) == Counter({("allgather_base", "float32"): 1,
                                                     ("reduce_scatter_base", "bfloat16"): 1,
                                                     ("reduce_scatter_base", "float32"): 1})


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
def test_default_safe_modules_on_gloo_reduce_in_fp32_bit_for_bit_as_ddp(run):
    # [Note: the safe modules' gradients on gloo] in precision/policy.py: with the default None the
    # Linears' gradients go in fp32 with the rest of their unit's (no bf16 in any reduce-scatter), so
    # the run is DDP's (fp32 all-reduce) bit for bit; stage 3 still gathers the Linears in bf16
    # (the same bits reach autocast's matmuls), so its all-gathers move fewer bytes than in fp32.
    stage, results = run
    for r in results:
        assert r["default_losses"] == r["plain_ddp_losses"]
        for name, p in r["default_params"].items():
            assert torch.equal(p, r["plain_ddp_params"][name]), name
        assert r["default_losses"] != r["ddp_losses"]  # the listed Linears' bf16 wire rounds: a different run
        reduced = {dtype for op, dtype in r["default_calls"] if op == "reduce_scatter_base"}
        assert reduced == {"float32"}, reduced
        assert all(wire == "None" for _, (_, wire) in r["default_groups"]), r["default_groups"]
        linears, rest = r["numels"]
        gathered = r["default_bytes"]["allgather_base"]
        # the Linears' shards gathered in 2 bytes (stage 3: twice a step, forward and backward)
        assert gathered == (2 if stage == 3 else 1) * ((linears * 2 + rest * 4) if stage == 3 else (linears + rest) * 4)


@pytest.mark.slow  # the run fixture: 3 spawns of 2 ranks, about 40 s in all
def test_stage3_prefetch_follows_execution_order(run):
    stage, results = run
    if stage != 3:
        pytest.skip("explicit prefetch is a stage-3 setting")
    fwd, bwd = results[0]["prefetch"]
    # one group ahead (prefetch_bucket_size=1); one group per block, its Linears inside it
    order = ["wte"] + [f"blocks.{b}" for b in range(N_LAYER)] + ["ln_f"]
    assert fwd == {a: [b] for a, b in zip(order, order[1:])} | {"ln_f": []}
    back = order[::-1]
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

    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = _gpt()
    root, per_module = _policies(model, 3)
    # The Linears as groups of their own (plain policies: on gloo fsdp_policies' CommDtypePolicy would
    # keep them in their block's group), so that small groups sit between large ones in the chain.
    low = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, cast_forward_inputs=True)
    per_module = {m: low for m in per_module}
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


def _stage2_layouts_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_ampzero.config import PrecisionConfig, ZeroConfig
    from lightning_ampzero.precision.plugin import AmpZeroPrecision
    from lightning_ampzero.zero.apply import apply_zero

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for layout in ("fsdp2", "one_group"):
        model = _gpt()
        root, per_module = _policies(model, 2)
        if layout == "fsdp2":  # what stage 2 does off gloo: the Linears a group of their own, FSDP2's bf16 reduce
            per_module = {m: MixedPrecisionPolicy(reduce_dtype=torch.bfloat16, cast_forward_inputs=True)
                          for m in per_module}
        apply_zero(model, mesh, ZeroConfig(stage=2, param_persistence_threshold=0), root, module_policies=per_module)
        losses, calls, _ = _train(model, rank)
        out[layout] = {"groups": _groups(model, root=True), "losses": losses, "params": _full(model),
                       "calls": Counter(calls)}
    # what the strategy asks for
    _, chosen = AmpZeroPrecision("bf16-mixed", PrecisionConfig(lower_precision_safe_modules=LISTED)).fsdp_policies(_gpt(), 2)
    out["plugin_comm_dtypes"] = sorted({str(getattr(p, "comm_dtype", None)) for p in chosen.values()})
    return out


def test_stage2_on_gloo_keeps_the_linears_in_the_model_group_with_the_bits_of_fsdp2s_bf16_groups():
    # Off gloo stage 2 gives the Linears a group of their own that FSDP2 reduce-scatters in bf16.
    # On gloo they stay in the model's group and MixedWireReduceScatter sends their part in bf16:
    # one group and its hooks less, the same arithmetic per element. With 2 ranks the division by
    # the world size is exact, so rounding before or after it gives the same bits.
    results = spawn(_stage2_layouts_body, world_size=2, timeout=240)
    for r in results:
        fsdp2, one = r["fsdp2"], r["one_group"]
        assert fsdp2["losses"] == one["losses"]
        for name, p in fsdp2["params"].items():
            assert torch.equal(p, one["params"][name]), name
        assert one["groups"] == [(("",), ("None", "bfloat16+float32"))]
        assert len(fsdp2["groups"]) == 2  # the Linears' bf16 group and the root
        assert sum(one["calls"].values()) == 3 and sum(fsdp2["calls"].values()) == 4
        assert r["plugin_comm_dtypes"] == ["torch.bfloat16"]


class _StubMesh:
    ndim = 1

    def get_group(self, mesh_dim=None):
        return None


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_mesh_decides_how_the_safe_modules_gradients_travel(monkeypatch, backend, stage):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_ampzero.config import ZeroConfig
    from lightning_ampzero.zero import apply
    from lightning_ampzero.zero.comm import CommDtypePolicy

    monkeypatch.setattr(apply.dist, "get_backend", lambda group=None: backend)
    model = _gpt()
    root, per_module = _policies(model, stage)
    before = dict(per_module)
    wire = apply._wire_dtypes(_StubMesh(), ZeroConfig(stage=stage), root, per_module)
    own_group = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, cast_forward_inputs=True)
    if backend == "gloo":  # in their unit's group, sent (and at stage 3 gathered) in bf16
        assert set(wire) == set(before) and set(wire.values()) == {torch.bfloat16} and per_module == {}
        if stage == 3:  # parameters offloaded to the host: a bf16 group of their own, as off gloo
            offloaded = dict(before)
            assert apply._wire_dtypes(_StubMesh(), ZeroConfig(stage=3), root, offloaded, offload=True) == {}
            assert set(offloaded) == set(before) and set(offloaded.values()) == {own_group}
    elif stage == 3:  # a bf16 group of their own (they gather in bf16)
        assert wire == {} and set(per_module) == set(before) and set(per_module.values()) == {own_group}
    elif stage == 1:  # a group of their own, accumulated in fp32, cast for the wire (LowPrecisionReduceScatter)
        assert wire == {} and per_module == before
        assert {type(p) for p in per_module.values()} == {CommDtypePolicy}
    else:  # FSDP2's own bf16 reduce-scatter
        assert wire == {}
        assert set(per_module.values()) == {MixedPrecisionPolicy(reduce_dtype=torch.bfloat16, cast_forward_inputs=True)}


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_by_default_the_safe_modules_gradients_go_in_fp32_on_gloo_only(monkeypatch, backend, stage):
    # [Note: the safe modules' gradients on gloo]: lower_precision_safe_modules=None.
    from lightning_ampzero.config import ZeroConfig
    from lightning_ampzero.zero import apply

    monkeypatch.setattr(apply.dist, "get_backend", lambda group=None: backend)
    model = _gpt()
    root, per_module = _policies(model, stage, listed=False)
    listed_root, listed = _policies(_gpt(), stage)
    assert {type(p) for p in per_module.values()} == {type(p) for p in listed.values()}  # the plugin asks the same
    names = {id(m): n for n, m in model.named_modules()}
    before = {names[id(m)] for m in per_module}
    wire = apply._wire_dtypes(_StubMesh(), ZeroConfig(stage=stage), root, per_module)
    expected = apply._wire_dtypes(_StubMesh(), ZeroConfig(stage=stage), listed_root, listed)
    if backend == "nccl":  # as if listed
        assert wire == {} == expected and {names[id(m)] for m in per_module} == before
    elif stage == 3:  # gathered in bf16 inside their unit's group, reduced with its fp32 gradients
        assert per_module == {} and {names[id(m)] for m in wire} == before and set(wire.values()) == {torch.float32}
        offloaded = dict(_policies(model, 3, listed=False)[1])  # parameters on the host: all fp32
        assert apply._wire_dtypes(_StubMesh(), ZeroConfig(stage=3), root, offloaded, offload=True) == {}
        assert offloaded == {}
    else:  # plain members of their unit's group
        assert wire == {} and per_module == {}


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
@pytest.mark.parametrize("listed", [False, True])
def test_stage0_registers_the_bf16_comm_hook_off_gloo_or_when_listed(monkeypatch, backend, listed):
    # [Note: the safe modules' gradients on gloo]: the plugin reads the DDP group's backend.
    from lightning_ampzero.config import PrecisionConfig
    from lightning_ampzero.precision.plugin import AmpZeroPrecision

    hooks = []

    class FakeDDP:
        module = _gpt()
        process_group = object()

        def register_comm_hook(self, state, hook):
            hooks.append(state)

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend)
    plugin = AmpZeroPrecision("bf16-mixed", PrecisionConfig(lower_precision_safe_modules=LISTED if listed else None))
    plugin.setup_ddp(FakeDDP())
    assert len(hooks) == (1 if listed or backend == "nccl" else 0)


class _Branchy(torch.nn.Module):
    """Linears (safe) and LayerNorms (fp32) in one unit; one Linear used on odd steps only, one frozen."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.ln = torch.nn.LayerNorm(32)
        self.sometimes = torch.nn.Linear(32, 32)
        self.frozen = torch.nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.b = torch.nn.Linear(32, 8)

    def forward(self, x, odd):
        h = self.ln(self.a(x))
        if odd:
            h = h + self.sometimes(h)
        return self.b(torch.relu(self.frozen(h)))


def _branchy_body(rank, world_size, stage):
    from unittest import mock

    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ampzero.config import ZeroConfig
    from lightning_ampzero.precision.policy import fsdp_policies
    from lightning_ampzero.zero import apply

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for layout in ("two_groups", "one_group"):
        torch.manual_seed(0)
        model = _Branchy()
        root, per_module = fsdp_policies(_plan(), model, stage)
        wire = apply._wire_dtypes if layout == "one_group" else (lambda *a, **k: {})
        with mock.patch.object(apply, "_wire_dtypes", wire):
            apply.apply_zero(model, mesh, ZeroConfig(stage=stage), root, module_policies=per_module)
        losses = _train_small(model, rank, 16, 4, lambda x, step: model(x, step % 2 == 1))
        out[layout] = {"losses": losses, "params": _full(model), "groups": _groups(model, root=True)}
    return out


def _train_small(model, rank, features, steps, forward):
    """``steps`` AdamW steps of a bf16-autocast squared-output loss on this rank's inputs; the losses."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(steps):
        x = torch.randn(4, features, generator=torch.Generator().manual_seed(10 * step + rank))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = forward(x, step).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stage", [1, 2])
def test_one_group_two_wire_dtypes_with_unused_and_frozen_parameters(stage):
    # Steps without the branch pack fewer gradients (FSDP2 packs only those that exist), and the
    # frozen Linear never has one: the layout MixedWireReduceScatter reads must follow.
    for r in spawn(_branchy_body, world_size=2, args=(stage,), timeout=180):
        assert r["one_group"]["groups"] == [(("",), ("None", "bfloat16+float32"))]
        assert len(r["two_groups"]["groups"]) == 2
        assert r["one_group"]["losses"] == r["two_groups"]["losses"]
        for name, p in r["two_groups"]["params"].items():
            assert torch.equal(p, r["one_group"]["params"][name]), name


def _reload_body(rank, world_size):
    """Parameters replaced by ``load_state_dict(assign=True)`` keep their wire dtype (decided by module)."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ampzero.config import ZeroConfig
    from lightning_ampzero.precision.policy import fsdp_policies
    from lightning_ampzero.zero.apply import apply_zero

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for reload in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
        root, per_module = fsdp_policies(_plan(), model, 2)
        apply_zero(model, mesh, ZeroConfig(stage=2), root, module_policies=per_module)
        before = [id(p) for p in model.parameters()]
        if reload:
            model.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()}, assign=True)
            out["replaced"] = sum(id(p) != b for p, b in zip(model.parameters(), before))
        losses = _train_small(model, rank, 8, 3, lambda x, step: model(x))
        out[reload] = {"losses": losses, "params": _full(model), "groups": _groups(model, root=True)}
    return out


def test_wire_dtypes_survive_parameters_replaced_by_load_state_dict_assign():
    for r in spawn(_reload_body, world_size=2, timeout=120):
        assert r["replaced"] == 6  # FSDP2 made new parameter objects
        assert r[True]["groups"] == r[False]["groups"] == [(("",), ("None", "bfloat16+float32"))]
        assert r[True]["losses"] == r[False]["losses"]
        for name, p in r[False]["params"].items():
            assert torch.equal(p, r[True]["params"][name]), name


def _autocast_off_body(rank, world_size, stage, subclass):
    import types
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ampzero.config import ZeroConfig
    from lightning_ampzero.zero.apply import apply_zero

    model = _gpt()
    dtypes = []

    def mlp_forward(mlp, x):  # the block's output projection kept out of autocast, as a model may ask
        h = mlp[1](mlp[0](x))
        with torch.autocast("cpu", enabled=False):
            out = mlp[2](h.float())
        dtypes.append(str(out.dtype))
        return out

    model.blocks[0].mlp.forward = types.MethodType(mlp_forward, model.blocks[0].mlp)
    if subclass:  # the way out the warning gives: a class the safe list does not name
        class FullPrecisionLinear(torch.nn.Linear):
            pass

        model.blocks[0].mlp[2].__class__ = FullPrecisionLinear
    root, per_module = _policies(model, stage)
    apply_zero(model, init_device_mesh("cpu", (world_size,)),
               ZeroConfig(stage=stage, reduce_bucket_size=ONE_BLOCK_PER_UNIT, param_persistence_threshold=0),
               root, module_policies=per_module)
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(rank))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(tokens).float().sum().backward()
    return dtypes, [(str(w.message), w.filename) for w in caught if "torch.autocast disabled" in str(w.message)]


@pytest.mark.parametrize("stage,subclass", [(2, False), (3, False), (3, True)])
def test_a_safe_linear_run_with_autocast_off_at_stage3_says_it_computed_in_bf16(stage, subclass):
    # [Note: a safe module run with autocast off] in precision/policy.py. Before: bf16 at stage 3, silently.
    for rank, (dtypes, warned) in enumerate(spawn(_autocast_off_body, world_size=2, args=(stage, subclass),
                                                  timeout=120)):
        if stage == 2 or subclass:  # gathered in fp32: the fp32 DDP computes, and nothing to say
            assert dtypes == ["torch.float32"] * 2 and warned == []
        else:
            assert dtypes == ["torch.bfloat16"] * 2
            assert len(warned) == (1 if rank == 0 else 0)  # once, not per call; rank 0 speaks for the ranks
            if warned:
                message, filename = warned[0]
                assert message.startswith("blocks.0.mlp.2 (Linear) ran with torch.autocast disabled")
                assert "class FullPrecisionLinear(nn.Linear)" in message
                assert filename == __file__  # the line that called the Linear, in mlp_forward above


def test_a_module_used_twice_in_one_backward_sums_its_gradients_in_fp32_at_stage_3(tmp_path):
    # [Note: a module used twice in one backward] in zero/uses.py: stage 3 gathers the Linears in
    # bf16 under bf16-mixed, and autograd summed their two uses' gradients in bf16. A new-user trial's
    # GAN (D on real and fake in one loss) ended 2.1e-3 from ddp in its weights, a siamese encoder 2.0e-3.
    from _scripts import run_json

    out = run_json("two_uses.py", tmp_path / "two_uses.json", "--stages", "2,3", timeout=600)
    assert set(out) == {f"{name}_vs_ddp_{stage}" for name in ("siamese", "gan") for stage in (2, 3)}
    assert all(value == 0.0 for value in out.values()), out
