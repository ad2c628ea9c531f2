"""Unit tests (one process) of the ZeRO building blocks: wrap policy, bucketing, formulas, config."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_ampzero.config import AmpZeroConfig, ZeroConfig
from lightning_ampzero.memory import zero_formula
from lightning_ampzero.models.gpt import GPT, GPTConfig
from _spawn import spawn
from lightning_ampzero.zero.clip import clip_grad_norm_, clip_grad_value_
from lightning_ampzero.zero.materialize import built_outside_note, materialize_meta_
from lightning_ampzero.zero.units import find_blocks, group_units, leftover_modules, plan_units


def test_auto_wrap_finds_transformer_blocks_not_their_linears():
    model = GPT(GPTConfig(n_layer=3, n_embd=32, n_head=2))
    assert [n for n, _ in find_blocks(model, ())] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [[n for n, _ in r] for r in leftover_modules(model, find_blocks(model, ()))] == [["wte", "wpe"], ["ln_f", "head"]]


def test_auto_wrap_finds_repeated_sequentials_of_built_in_layers_not_their_layers():
    # Every nn.Sequential is one class, so by class alone such blocks had no composite kind and
    # their Linears became the blocks (compile and checkpointing then worked per layer).
    mlp = lambda: nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))  # noqa: E731
    model = nn.Sequential(nn.Linear(8, 16), nn.ModuleList([mlp() for _ in range(3)]), nn.Linear(16, 2))
    assert [n for n, _ in find_blocks(model, ())] == ["1.0", "1.1", "1.2"]
    convs = nn.Sequential(*[nn.Sequential(nn.Conv2d(3, 3, 3), nn.BatchNorm2d(3), nn.ReLU()) for _ in range(2)])
    assert [n for n, _ in find_blocks(convs, ())] == ["0", "1"]
    # Sequentials of different layouts are not repeats of one block; their repeated layers are.
    mixed = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    assert [n for n, _ in find_blocks(mixed, ())] == ["0.0", "1.0"]
    # A model made only of leaf layers keeps its leaves.
    flat = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert [n for n, _ in find_blocks(flat, ())] == ["0", "2"]


def test_wrap_modules_by_class_name_and_typo():
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2))
    assert [n for n, _ in find_blocks(model, ("CausalSelfAttention",))] == ["blocks.0.attn", "blocks.1.attn"]
    with pytest.raises(ValueError, match="Did you mean 'Block'"):
        find_blocks(model, ("Blok",))


def test_bucketing_groups_consecutive_blocks_up_to_the_bucket():
    blocks = [(f"b{i}", nn.Linear(10, 10)) for i in range(5)]  # 110 elements each
    assert [u.names for u in group_units(blocks, 220)] == [["b0", "b1"], ["b2", "b3"], ["b4"]]
    assert [u.names for u in group_units(blocks, 100)] == [["b0"], ["b1"], ["b2"], ["b3"], ["b4"]]
    assert [u.numel for u in group_units(blocks, 10**9)] == [550]


def test_a_unit_never_spans_two_networks_of_the_root():
    # [Note: one network per unit] in zero/units.py: a GAN's generator and discriminator.
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gen = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2))
            self.disc = nn.Sequential(nn.Linear(256, 32), nn.Tanh(), nn.Linear(32, 1))
            self.scale = nn.Linear(1, 1)  # a layer held by the root itself: no network

    pair = Pair()
    names = [u.names for u in plan_units(pair, (), 10**9, 3)]
    assert ["gen.ln_f", "gen.head"] in names  # before: one unit with disc.0 and disc.2
    assert ["disc.0", "disc.2", "scale"] in names  # a root's own layer still joins its neighbours
    assert not any({n.split(".")[0] for n in u} >= {"gen", "disc"} for u in names)
    # the blocks of two networks are not packed together either, whatever the bucket
    two = nn.Module()
    two.a, two.b = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2)), GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2))
    blocks = [u.names for u in plan_units(two, (), 10**9, 3) if u.names[0].split(".")[1] == "blocks"]
    assert blocks == [["a.blocks.0", "a.blocks.1"], ["b.blocks.0", "b.blocks.1"]]
    # a model written directly in the root keeps its runs as before
    gpt = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2))
    assert [u.names for u in plan_units(gpt, (), 10**9, 3)] == [["blocks.0", "blocks.1"], ["wte", "wpe"], ["ln_f", "head"]]


@pytest.mark.parametrize("stage,expected", [
    (0, (4, 4, 8)), (1, (4, 4, 12 / 4)), (2, (4, 4 / 4, 12 / 4)), (3, (4 / 4, 4 / 4, 8 / 4)),
])
def test_zero_formula_fp32_adam(stage, expected):
    psi, n = 1_000_000, 4
    f = zero_formula(psi, n, stage)
    assert (f.params, f.grads, f.optimizer) == tuple(int(e * psi) for e in expected)


def test_zero_formula_mixed_precision_matches_the_paper():
    """FACTS.md: baseline (2+2+K)Ψ; stage 1: 2Ψ+2Ψ+KΨ/N; stage 2: 2Ψ+(2+K)Ψ/N; stage 3: (2+2+K)Ψ/N, K=12."""
    psi, n, k = 7_500_000, 8, 12
    kw = dict(param_bytes=2, grad_bytes=2)
    assert zero_formula(psi, n, 0, **kw).total == (2 + 2 + k) * psi
    assert zero_formula(psi, n, 1, **kw).total == 2 * psi + 2 * psi + k * psi // n
    assert zero_formula(psi, n, 2, **kw).total == 2 * psi + (2 + k) * psi // n
    assert zero_formula(psi, n, 3, **kw).total == (2 + 2 + k) * psi // n


def test_clip_grad_norm_matches_torch_on_plain_tensors():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn_like(p) * 10
        q.grad = p.grad.clone()
    ours = clip_grad_norm_(a, 1.0)
    ref = torch.nn.utils.clip_grad_norm_(b, 1.0)
    assert torch.allclose(ours, ref)
    for p, q in zip(a, b):
        assert torch.allclose(p.grad, q.grad)
    assert ours > 1.0  # the case where clipping does something
    clip_grad_value_(a, 0.01)
    assert all(p.grad.abs().max() <= 0.01 for p in a)


def test_config_errors_name_the_field_and_allowed_values():
    with pytest.raises(ValueError, match=r"zero.stage=4 .*Allowed values"):
        ZeroConfig(stage=4)
    with pytest.raises(ValueError, match="Did you mean 'reduce_bucket_size'"):
        ZeroConfig.from_dict({"reduce_bucket_sise": 1})
    with pytest.raises(ValueError, match="whole number"):
        ZeroConfig(reduce_bucket_size=1.5)
    with pytest.raises(ValueError, match="needs zero.stage=3"):
        ZeroConfig(stage=2, hpz_partition_size=2)
    assert ZeroConfig(reduce_bucket_size=5e5).unit_size == 500_000
    assert AmpZeroConfig.from_dict({"zero": {"stage": 1}}).zero.stage == 1


def test_hpz_over_every_process_is_said_to_be_plain_stage_3():
    # A trial's hpz_partition_size=2 on 2 processes trained exactly as stage 3, with no word of it.
    from lightning_ampzero.zero.apply import hpz_note

    note = hpz_note(ZeroConfig(stage=3, hpz_partition_size=2), world_size=2)
    assert note is not None and "hpZ changes nothing here" in note and "processes per node" in note
    assert hpz_note(ZeroConfig(stage=3, hpz_partition_size=2), world_size=4) is None  # groups of 2: it acts
    assert hpz_note(ZeroConfig(stage=3), world_size=2) is None


def test_strategy_arguments_are_the_config_fields():
    from lightning_ampzero.strategy import AmpZeroStrategy

    s = AmpZeroStrategy(stage=3, reduce_bucket_size=5e6, hpz_partition_size=2)
    assert s.config.zero == ZeroConfig(stage=3, reduce_bucket_size=5e6, hpz_partition_size=2)
    with pytest.raises(TypeError, match="Did you mean 'prefetch_bucket_size'"):
        AmpZeroStrategy(prefetch_bucket_sise=1)
    with pytest.raises(ValueError, match="zero.stage=5"):
        AmpZeroStrategy(stage=5)


def test_find_unused_parameters_is_a_stage_0_setting_with_manual_optimization_as_default():
    with pytest.raises(ValueError, match="zero.find_unused_parameters=False is a stage-0 .DDP. setting, and"
                                         " zero.stage=2"):
        ZeroConfig(find_unused_parameters=False)
    with pytest.raises(ValueError, match="must be true, false or null, got 'yes'"):
        ZeroConfig(stage=0, find_unused_parameters="yes")
    from lightning_ampzero.strategy import AmpZeroStrategy

    assert AmpZeroStrategy(stage=0, find_unused_parameters=False).config.zero.find_unused_parameters is False
    found = spawn(_ddp_find_unused, world_size=1)[0]
    # the default follows the optimization (a GAN's backwards leave a network out); the setting wins
    assert found == {(None, True): False, (None, False): True, (False, False): False, (True, True): True}


def _ddp_find_unused(rank, world_size):
    import lightning.pytorch as pl

    from lightning_ampzero.strategy import AmpZeroStrategy

    found = {}
    for setting, automatic in ((None, True), (None, False), (False, False), (True, True)):
        module = pl.LightningModule()
        module.layer = nn.Linear(2, 2)
        module.automatic_optimization = automatic
        strategy = AmpZeroStrategy(stage=0, find_unused_parameters=setting, parallel_devices=[torch.device("cpu")])
        strategy._lightning_module = module
        found[(setting, automatic)] = strategy._wrap_ddp(module).find_unused_parameters
    return found


def test_stage3_notes_a_model_built_outside_the_sharded_context():
    # Accepted and sharded after the fact (issue 12); the note says what it cost.
    assert "configure_model" in built_outside_note(nn.Linear(4, 4), min_bytes=0)
    assert built_outside_note(nn.Linear(4, 4)) is None  # 80 bytes built whole: nothing worth saying
    with torch.device("meta"):
        meta = nn.Linear(4, 4)
    assert built_outside_note(meta) is None  # built on meta: nothing to say


def test_materialize_initialises_bottom_up():
    """A parent's own init must win over its children's defaults (GPT's deterministic init)."""
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2)
    eager = GPT(cfg)
    with torch.device("meta"):
        lazy = GPT(cfg)
    materialize_meta_(lazy, torch.device("cpu"))
    for (n, p), q in zip(eager.named_parameters(), lazy.parameters()):
        assert torch.equal(p, q), n


def test_the_note_on_units_merged_by_a_shared_parameter_names_the_parameter():
    # It read "0.0, 0.2, 2.0, 2.2 share a parameter": modules that hold none of it were named as sharing it.
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)) for _ in range(3)])
    model[2][2].weight = model[0][0].weight
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        units = plan_units(model, (), 100, 3)
    assert ["0", "2"] in [u.names for u in units]  # the blocks are the inner Sequentials
    (message,) = [str(w.message) for w in caught]
    assert message.startswith("0.0.weight and 2.2.weight are one parameter, so the units holding them (0, 2)")


def test_stage0_keeps_ddps_bucket_at_the_default_and_takes_a_set_one():
    # The default (5e8 elements, for stage 1-2 units) made one DDP bucket of any model: no all-reduce
    # started before backward ended ([stage0_bucket_mb] in config.py).
    caps = spawn(_ddp_bucket_caps, world_size=1)[0]
    assert caps == {"default": 25 * 2**20, "set": int(1e6 * 4)}


def _ddp_bucket_caps(rank, world_size):
    import lightning.pytorch as pl

    from lightning_ampzero.strategy import AmpZeroStrategy

    caps = {}
    for name, kw in (("default", {}), ("set", {"reduce_bucket_size": 1e6})):
        module = pl.LightningModule()
        module.layer = nn.Linear(2, 2)
        strategy = AmpZeroStrategy(stage=0, parallel_devices=[torch.device("cpu")], **kw)
        strategy._lightning_module = module
        caps[name] = strategy._wrap_ddp(module).bucket_bytes_cap
    return caps
