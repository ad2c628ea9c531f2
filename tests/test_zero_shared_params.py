"""Tied / shared parameters and parameters held by non-leaf modules, at stages 1, 2 and 3.

2 CPU ranks (gloo), bare loop (AdamW) over ``apply_zero``, against the same model trained in one
process on both ranks' batches: per-step losses within 1e-5 relative and the same parameters
after training, for

* a GPT-2 style tie (the head's weight is the token embedding's: leftover modules in different runs),
* a tie between two blocks (Linear weights: the low-precision groups of "-mixed" too),
* a parameter used by a module inside a repeated block and by a leftover module,
* a parameter the root holds that a leftover module also holds,

every model also holding parameters in non-leaf modules (``Embeddings.pos`` beside its child
Embedding, as a ViT's ``cls_token``; ``Body.scale`` above the blocks), at stage 1 and 2 with the
default bucket (the model is one unit), stage 2 with a bucket of one block (units), stage 3 with
both. Every parameter is sharded in exactly one FSDP2 group (counted), and a plan that would
shard one in two groups is refused in setup, naming the parameter.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _spawn import spawn
from lightning_ampzero.zero.groups import module_param_groups

V, D, T, N_BLOCKS, STEPS = 64, 32, 8, 3, 3
ONE_BLOCK = 5_000  # elements: a Block below is 4,256
TIES = ("head", "blocks", "block_leftover", "root")
CONFIGS = ((1, 10**9), (2, 10**9), (2, ONE_BLOCK), (3, ONE_BLOCK), (3, 10**9))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class Embeddings(nn.Module):
    """Holds a parameter and has a child (a ViT's ViTEmbeddings: cls_token, position_embeddings, a Conv2d)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.randn(T, D) * 0.02)

    def forward(self, idx):
        return self.tok(idx) + self.pos[: idx.shape[1]]


class Body(nn.Module):
    """Holds a parameter and the blocks: its unit is sharded after theirs and holds ``scale`` only."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(D))
        self.blocks = nn.ModuleList(Block() for _ in range(N_BLOCKS))

    def forward(self, x):
        x = x * self.scale
        for block in self.blocks:
            x = block(x)
        return x


class LM(nn.Module):
    def __init__(self, tie: str) -> None:
        super().__init__()
        self.emb = Embeddings()
        self.body = Body()
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.out_bias = nn.Parameter(torch.zeros(V))  # the root's own parameter
        self.extra = nn.ParameterDict({"shift": nn.Parameter(torch.zeros(D))})  # no forward: the root reads it
        nn.init.normal_(self.emb.tok.weight, std=0.02)  # GPT-2's init: no saturated softmax
        if tie == "head":  # GPT-2, OPT
            self.head.weight = self.emb.tok.weight
        elif tie == "blocks":  # two blocks' Linears
            self.body.blocks[2].fc1.weight = self.body.blocks[0].fc1.weight
        elif tie == "block_leftover":  # a module inside a repeated block and a leftover module
            self.ln_f.weight = self.body.blocks[1].ln.weight
        elif tie == "root":  # the root and a leftover module
            self.gain = self.ln_f.weight
        else:
            raise ValueError(tie)

    def forward(self, idx):
        h = self.ln_f(self.body(self.emb(idx) + self.extra["shift"]))
        if hasattr(self, "gain"):
            h = h * self.gain
        return self.head(h) + self.out_bias


def _batch(step: int, rank: int):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, V, (4, T + 1), generator=gen)


def _loss(model, idx):
    import torch.nn.functional as F

    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, V), idx[:, 1:].reshape(-1))


def _build(tie: str) -> LM:
    torch.manual_seed(0)
    return LM(tie)


def _reference(tie: str, world_size: int, autocast: bool = False):
    """One process, both ranks' batches in one: losses and final parameters."""
    model = _build(tie)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        idx = torch.cat([_batch(step, r) for r in range(world_size)])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = _loss(model, idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _group_sizes(model):
    """Parameters per FSDP2 group (each group once)."""
    from torch.distributed.fsdp import FSDPModule

    sizes = {}
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for group in module_param_groups(m):
                sizes[id(group)] = len(group.fsdp_params)
    return list(sizes.values())


def _train_sharded(rank, world_size, mesh, tie, stage, bucket, precision=None):
    import torch.distributed as dist

    from lightning_ampzero.config import PrecisionConfig, ZeroConfig
    from lightning_ampzero.precision.policy import dtype_plan, fsdp_policies
    from lightning_ampzero.zero.apply import apply_zero

    model = _build(tie)
    n_params = len(list(model.parameters()))  # shared parameters once
    cfg = ZeroConfig(stage=stage, reduce_bucket_size=bucket, param_persistence_threshold=0)
    policies = {}
    if precision is not None:
        root, policies = fsdp_policies(dtype_plan(precision, PrecisionConfig()), model, stage)
        units = apply_zero(model, mesh, cfg, root, module_policies=policies)
    else:
        units = apply_zero(model, mesh, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision is not None):
            loss = _loss(model, _batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return dict(losses=losses, params=params, units=[u.names for u in units[:-1]],
                groups=_group_sizes(model), n_params=n_params, policy_groups=len(policies))


def _body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for tie in TIES:
        out[tie, "ref"] = _reference(tie, world_size) if rank == 0 else None
        for stage, bucket in CONFIGS:
            out[tie, stage, bucket] = _train_sharded(rank, world_size, mesh, tie, stage, bucket)
    for tie in ("head", "blocks"):
        out[tie, "ref-bf16"] = _reference(tie, world_size, autocast=True) if rank == 0 else None
        for stage in (2, 3):
            out[tie, stage, "bf16"] = _train_sharded(rank, world_size, mesh, tie, stage, ONE_BLOCK, "bf16-mixed")
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_body, world_size=2, timeout=300)


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("tie", TIES)
def test_shared_parameters_train_as_in_one_process(results, tie):
    ref_losses, ref_params = results[0][tie, "ref"]
    for stage, bucket in CONFIGS:
        for r in results:
            got = r[tie, stage, bucket]
            assert _rel(got["losses"], ref_losses) < 1e-5, (tie, stage, bucket, got["losses"], ref_losses)
            assert got["params"].keys() == ref_params.keys()
            for name, p in got["params"].items():
                torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-6, msg=f"{tie} {stage} {name}")
            # every parameter sharded in exactly one group (FSDP2 dedups inside a group)
            assert sum(got["groups"]) == got["n_params"], (tie, stage, bucket, got["groups"])
    initial = dict(_build(tie).named_parameters())
    assert all(not torch.equal(p, initial[n]) for n, p in ref_params.items())  # every parameter trained


def test_units_of_each_tie(results):
    """The tied modules are one unit; a non-leaf module stands for its subtree (no overlapping list
    group), and one with blocks below it is sharded after them (the order of the plan)."""
    from lightning_ampzero.zero.units import plan_units

    def plan(tie):
        return [u.names for u in plan_units(_build(tie), (), ONE_BLOCK, 3)]

    blocks = [[f"body.blocks.{i}"] for i in range(N_BLOCKS)]
    # the head's run (ln_f, head) is tied to the embedding's
    assert plan("head") == blocks + [["emb", "ln_f", "head"], ["body"]]
    assert plan("blocks") == [["body.blocks.0", "body.blocks.2"], ["body.blocks.1"], ["emb"], ["ln_f", "head"], ["body"]]
    assert plan("block_leftover") == [["body.blocks.0"], ["body.blocks.1", "ln_f", "head"], ["body.blocks.2"], ["emb"],
                                      ["body"]]
    # ln_f shares its weight with the root (``gain``): its unit is left to the root
    assert plan("root") == blocks + [["emb"], ["body"]]
    # what apply_zero sharded (in module order), and below stage 3 a model that fits the bucket is one unit
    assert results[0]["head", 3, ONE_BLOCK]["units"] == [["emb", "ln_f", "head"], ["body"], *blocks]
    assert results[0]["head", 2, 10**9]["units"] == []


@pytest.mark.parametrize("tie", ("head", "blocks"))
def test_bf16_mixed_keeps_ties_in_one_group(results, tie):
    """The Linear groups of "-mixed" never split a tie: the head tied to the embedding stays with it,
    two tied Linears of two blocks are one low-precision group of the merged unit."""
    ref_losses, _ = results[0][tie, "ref-bf16"]
    for stage in (2, 3):
        for r in results:
            got = r[tie, stage, "bf16"]
            assert sum(got["groups"]) == got["n_params"]
            assert got["policy_groups"] > 0
            # bf16 reductions of the Linear gradients against one process's fp32 gradients
            assert _rel(got["losses"], ref_losses) < 1e-3, (stage, got["losses"], ref_losses)


def _refuse_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_ampzero.config import ZeroConfig
    from lightning_ampzero.zero.apply import apply_zero

    model = _build("head")
    low = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    try:  # a policy group of its own for the head, whose weight the embedding holds
        apply_zero(model, init_device_mesh("cpu", (world_size,)), ZeroConfig(stage=3), module_policies={model.head: low})
    except ValueError as e:
        return str(e)
    return None


def test_a_parameter_in_two_groups_is_refused_in_setup():
    message = spawn(_refuse_body, world_size=2)[0]
    assert message is not None
    assert "'emb.tok.weight' is the same tensor as 'head.weight'" in message
    assert "['head']" in message  # the head's policy group
    assert "same module policy" in message


def test_plan_is_bottom_up_and_merges_shared_parameters():
    """One process: the plan alone, for the HF models whose failures this fixes."""
    transformers = pytest.importorskip("transformers")
    from lightning_ampzero.zero.units import plan_units

    def names(model, bucket=1_000):
        return [u.names for u in plan_units(model, (), bucket, 3)]

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64,
                                                                n_positions=32))
    assert ["transformer.wte", "lm_head"] in names(gpt2)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32,
                                                                       num_layers=2, num_heads=2))
    assert ["shared", "encoder.embed_tokens", "decoder.embed_tokens", "lm_head"] in names(t5)
    vit = transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, image_size=8, patch_size=4,
        num_labels=3))
    assert ["vit.embeddings"] in names(vit)  # cls_token, position_embeddings and the patch Conv2d: one unit
    for model in (gpt2, t5, vit):
        units = plan_units(model, (), 1_000, 3)
        tops = [m for u in units for m in u.modules]
        assert len({id(m) for m in tops}) == len(tops)
        numel = sum(p.numel() for p in model.parameters())
        assert sum(u.numel for u in units) <= numel
