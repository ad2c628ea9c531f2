"""ZeroInit (zero/init.py): models built under it start from exactly the one-process weights, holding only a shard.

Every multi-rank case compares, bit for bit (``torch.equal``), the gathered parameters and the
buffers of the sharded model with the model one process builds with the same seed.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _scripts import run_json
from _spawn import spawn
from lightning_ampzero.zero.init import ZeroInit, take_local_shards

pytest.importorskip("transformers")


# ---- models ---------------------------------------------------------------------------------
def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=101))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=101, n_positions=64,
                                      bos_token_id=0, eos_token_id=0))


def _torch_transformer() -> nn.Module:
    return nn.Transformer(d_model=32, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64,
                          batch_first=True)


def _demo_transformer() -> nn.Module:
    from lightning.pytorch.demos import Transformer

    return Transformer(vocab_size=101, ninp=32, nhead=2, nhid=64, nlayers=2)


def _package_gpt() -> nn.Module:
    from lightning_ampzero.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=101))


class _Tricky(nn.Module):
    """Init code that reads and rewrites parameters after they were partitioned (tiny budget)."""

    def __init__(self) -> None:
        super().__init__()
        self.swapped = nn.Parameter(torch.zeros(4, 2))
        self.emb = nn.Embedding(7, 5, padding_idx=3)          # 7 rows: uneven chunks on 2 ranks
        self.one_row = nn.Parameter(torch.randn(1, 4))        # rank 1 holds an empty chunk
        self.lowp = nn.Module()                               # its own FSDP2 group: another dtype
        self.lowp.w = nn.Parameter(torch.randn(6, 3).to(torch.bfloat16))
        self.lin = nn.Linear(5, 6)
        self.clones = nn.ModuleList(copy.deepcopy(self.lin) for _ in range(2))  # registered without hooks
        self.head = nn.Linear(5, 7, bias=False)
        self.head.weight = self.emb.weight                   # tied after both were built
        with torch.no_grad():
            self.emb.weight.data[self.emb.padding_idx].zero_()   # partial write: needs the true value
            self.lin.bias.add_(self.one_row.sum())               # reads two partitioned parameters
            self.lowp.w.mul_(2)
        self.swapped.data = torch.arange(8.0).view(4, 2)      # `.data =` on a partitioned parameter
        self.register_buffer("scale", torch.linspace(0, 1, 5))  # buffers stay as built


def _cases() -> dict:
    return {"llama": _llama, "gpt2": _gpt2, "nn.Transformer": _torch_transformer,
            "demos.Transformer": _demo_transformer, "package GPT": _package_gpt, "tricky": _Tricky}


def _reference(build, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return build()


def _chunk(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    chunks = torch.chunk(full, world, dim=0)
    return chunks[rank] if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))


# ---- one process ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(_cases()))
def test_one_process_builds_the_same_model(name):
    build = _cases()[name]
    ref = _reference(build, 0)
    budget = 0 if name == "tricky" else 300  # far below every model: most parameters partitioned
    torch.manual_seed(0)
    with ZeroInit(max_live_numel=budget) as zi:
        model = build()
    assert zi.stats.partitions > 0
    assert all(p.is_meta for p in model.parameters())
    # Their init code only overwrites partitioned parameters whole (no gather needed), except the
    # tricky model's reads and the Transformers' deepcopy of a partitioned template layer.
    assert (zi.stats.gathers > 0) == (name in ("tricky", "nn.Transformer", "demos.Transformer")), zi.stats
    shards = take_local_shards(model)
    for n, p in ref.named_parameters(remove_duplicate=False):
        assert torch.equal(shards[n], p), n
    buffers = dict(model.named_buffers())
    for n, b in ref.named_buffers():
        assert not buffers[n].is_meta and torch.equal(buffers[n], b), n
    # The generator ends where one process's ends: the rest of the program draws the same numbers.
    ref_next = (_reference(build, 0), torch.rand(4))[1]
    torch.manual_seed(0)
    with ZeroInit(max_live_numel=budget):
        build()
    assert torch.equal(torch.rand(4), ref_next)


def test_context_is_exception_safe_and_nests():
    from torch.overrides import _get_current_function_mode_stack

    with pytest.raises(RuntimeError, match="boom"):
        with ZeroInit(max_live_numel=0):
            nn.Linear(4, 4)
            raise RuntimeError("boom")
    assert not _get_current_function_mode_stack()
    after = nn.Linear(4, 4)  # no hook left: built normally
    assert not after.weight.is_meta
    with ZeroInit(max_live_numel=0):
        with ZeroInit(max_live_numel=0) as inner:
            m = nn.Linear(4, 4)
        assert inner._nested is False and not m.weight.is_meta  # the outer context owns it
    assert m.weight.is_meta


def test_the_gpts_init_draws_on_the_cpu_whatever_the_default_device():
    """Lightning's ``init_module()`` on a GPU makes CUDA the default device; the main job's GPT
    drew from a CPU generator there and stopped (``Expected a 'cuda' device type for
    generator``). The draws stay on the CPU and give the values a plain call gives."""
    from lightning_ampzero.models.init import init_parameters_

    seen = []

    def rule(name, shape, gen):
        seen.append(torch.empty(0).device.type)
        return torch.randn(shape, generator=gen)

    model, want = nn.Linear(3, 2), nn.Linear(3, 2)
    init_parameters_(want, 0, rule)
    with torch.device("meta"):  # stands in for CUDA: a default device that is not the generator's
        init_parameters_(model, 0, rule)
    assert seen == ["cpu"] * 4
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), want.parameters()))


def test_metadata_needs_no_gather_and_fan_in_works():
    with ZeroInit(max_live_numel=0) as zi:
        lin = nn.Linear(8, 16)
        _ = nn.Linear(2, 2)  # lin's parameters are partitioned now
        w = lin.weight
        assert (w.shape, w.dim(), w.numel(), w.device.type, w.is_meta, w.dtype) == (
            (16, 8), 2, 128, "cpu", False, torch.float32)
        assert w.stride() == (8, 1) and w.is_contiguous()
        fan_in, _ = nn.init._calculate_fan_in_and_fan_out(w)
        assert fan_in == 8
        assert zi.stats.gathers == 0


def test_materialize_refuses_a_chunk_of_the_wrong_shape():
    from lightning_ampzero.zero.materialize import materialize_meta_

    with ZeroInit():
        model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6))
    shards = take_local_shards(model)
    shards["0.weight"] = torch.zeros(3, 4)
    with pytest.raises(RuntimeError, match=r"'0.weight'.*\(3, 4\).*\(6, 4\)"):
        materialize_meta_(model, torch.device("cpu"), shards)


# ---- two ranks ------------------------------------------------------------------------------
def _shard_and_compare(rank: int, world: int, runs: list[tuple[str, int]]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ampzero.config import ZeroConfig
    from lightning_ampzero.zero.apply import apply_zero
    from lightning_ampzero.zero.materialize import materialize_meta_

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, budget in runs:
        build = _cases()[name]
        ref = _reference(build, 1234)
        torch.manual_seed(1234)
        with ZeroInit(mesh.get_group(), max_live_numel=budget) as zi:
            model = build()
        after_build = torch.rand(3)
        assert torch.equal(after_build, (_reference(build, 1234), torch.rand(3))[1]), name
        shards = take_local_shards(model)
        for n, p in ref.named_parameters(remove_duplicate=False):
            assert torch.equal(shards[n], _chunk(p.data, world, rank)), (name, n)
        if name not in ("gpt2", "tricky"):  # tied parameters across units: the units helper's fix
            apply_zero(model, mesh, ZeroConfig(stage=3, reduce_bucket_size=1))
        else:
            from torch.distributed.fsdp import fully_shard

            if name == "tricky":
                fully_shard(model.lowp, mesh=mesh)
            fully_shard(model, mesh=mesh)
        materialize_meta_(model, torch.device("cpu"), shards)
        params = dict(model.named_parameters(remove_duplicate=False))
        for n, p in ref.named_parameters(remove_duplicate=False):
            got = params[n].full_tensor()
            assert got.dtype == p.dtype and torch.equal(got, p), (name, n)
        buffers = dict(model.named_buffers())
        for n, b in ref.named_buffers():
            assert torch.equal(buffers[n], b), (name, n)
        s = zi.stats
        out[name, budget] = {"gathers": s.gathers, "refills": s.refills, "partitions": s.partitions,
                     "peak_bytes": s.peak_bytes, "model_bytes": sum(p.numel() * p.element_size()
                                                                    for p in ref.parameters())}
    return out


def test_two_ranks_exact_after_sharding():
    # budget 200 elements: partitioned while being built; 10**9: only at exit; 0: at once
    runs = [(name, budget) for budget in (200, 10**9) for name in _cases()] + [("tricky", 0)]
    results = spawn(_shard_and_compare, world_size=2, args=(runs,), timeout=240)
    assert results[0].keys() == set(runs)
    # The tricky model reads partitioned parameters (gathered); the others only overwrite them whole.
    assert results[0]["tricky", 0]["gathers"] > 0


# ---- memory ---------------------------------------------------------------------------------
def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _measure_construction(rank: int, world: int, layers: int, width: int, budget: int, use_zero_init: bool) -> dict:
    import gc

    group = dist.group.WORLD
    torch.manual_seed(0)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    before = _rss_kib("VmRSS")
    if use_zero_init:
        with ZeroInit(group, max_live_numel=budget) as zi:
            model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
        stats = zi.stats
    else:
        model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
        stats = None
    peak = _rss_kib("VmHWM")
    out = {"peak_mib": (peak - before) / 1024, "tracked_peak_mib": stats.peak_bytes / 2**20 if stats else None,
           "shard_mib": (stats.shard_bytes / 2**20) if stats else None}
    if use_zero_init:
        # Then what setup() does: shard, and copy the chunks into FSDP2's shards.
        from torch.distributed.device_mesh import init_device_mesh

        from lightning_ampzero.config import ZeroConfig
        from lightning_ampzero.zero.apply import apply_zero
        from lightning_ampzero.zero.materialize import materialize_meta_

        shards = take_local_shards(model)
        apply_zero(model, init_device_mesh("cpu", (world,)), ZeroConfig(stage=3, reduce_bucket_size=1))
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _rss_kib("VmRSS")  # the chunks, and what sharding imported
        materialize_meta_(model, torch.device("cpu"), shards)
        out["materialize_peak_mib"] = (_rss_kib("VmHWM") - before) / 1024
        out["chunks_left"] = len(shards)
    dist.barrier()
    return out


def test_construction_peak_memory_stays_near_a_shard_plus_the_budget(monkeypatch):
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc to measure peak RSS")
    # Large tensors get their own mmap, so freed parameters leave the RSS at once (glibc would
    # otherwise raise its mmap threshold and keep them in the heap).
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    layers, width = 24, 1024                      # 24 x 4 MiB = 96 MiB of fp32 parameters
    budget = 2 * width * width                    # 8 MiB of full parameters
    model_mib, budget_mib, layer_mib = layers * width * width * 4 / 2**20, 8, 4
    sharded = spawn(_measure_construction, world_size=2, args=(layers, width, budget, True), timeout=120)
    whole = spawn(_measure_construction, world_size=2, args=(layers, width, budget, False), timeout=120)
    for r in sharded:
        # model / N + budget + the newest layer, plus allocator slack
        assert r["peak_mib"] < model_mib / 2 + budget_mib + layer_mib + 16, (r, whole)
        assert r["tracked_peak_mib"] <= model_mib / 2 + budget_mib + layer_mib
        # Materializing drops each chunk once copied, so it adds about one layer to the chunks it
        # started from, not a second shard (+48 MiB measured when every chunk was kept; +2 now).
        assert r["chunks_left"] == 0, r
        assert r["materialize_peak_mib"] < layer_mib + 16, (r, whole)
    assert all(w["peak_mib"] > 0.9 * model_mib for w in whole), whole
    print(f"construction peak per rank, {model_mib:.0f} MiB model on 2 ranks, {budget_mib} MiB budget:"
          f" ZeroInit {[round(r['peak_mib'], 1) for r in sharded]} MiB,"
          f" plain {[round(w['peak_mib'], 1) for w in whole]} MiB;"
          f" materialize peak {[round(r['materialize_peak_mib'], 1) for r in sharded]} MiB")


# ---- through the strategy (Lightning in a subprocess) -------------------------------------
def test_strategy_stage3_starts_from_the_one_process_model(tmp_path):
    out = run_json("zero_init_lightning.py", tmp_path / "out.json", timeout=600,
                   env={"OMP_NUM_THREADS": "1"})
    for case, result in out.items():
        assert result["mismatches"] == [], (case, result)
        assert result["checked"] > 0, case
    assert out["metric@init"]["note"] and out["llama@mixed"]["note"], out
    assert not out["llama"]["note"]
    assert not out["lazy"]["note"]  # a lazy layer materialized in configure_model() is not "built outside" it
    assert all(r["trained"] for r in out.values()), out
    # One process at stage 3: the same path without collectives.
    one = run_json("zero_init_lightning.py", tmp_path / "one.json", "--devices", "1", "--cases", "llama,metric",
                   timeout=300, env={"OMP_NUM_THREADS": "1"})
    assert all(r["mismatches"] == [] and r["checked"] > 0 and r["trained"] for r in one.values()), one
