"""Issue 12, item 2: Hugging Face weights in (streamed shard by shard) and out (a save_pretrained directory).

Invariants measured:
- after loading on 2 ranks every parameter's full tensor equals the file's bit for bit, and each
  rank read exactly the bytes of its own rows (counted from what ``get_slice`` returned), about
  half the model, never a whole sharded tensor;
- peak RSS of a rank during the load (VmHWM, reset just before) stays within
  (its shard + the largest tensor + 16 MiB);
- an export after training loads with ``AutoModelForCausalLM.from_pretrained`` and gives the
  logits of the trained parameters gathered into one process within 1e-6;
- missing / unexpected keys are errors naming them; tied weights absent from the file are not.

Checkpoints are made here with ``save_pretrained`` from tiny configs: nothing is downloaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from _scripts import ROOT, run_json, script_env  # noqa: E402
from _spawn import spawn  # noqa: E402

import lightning_ampzero.hf as hf  # noqa: E402

# vocab 131: the embedding's rows split unevenly (66 + 65), as FSDP2's torch.chunk layout does
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=131)
# Large enough for RSS to see (about 54 MiB in fp32: two 16 MiB embeddings, 11 MiB per layer).
MEDIUM = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=8192)
RSS_CONSTANT = 16 * 2**20  # the stated constant of the memory bound (allocator and page rounding)


def _config(tie: bool = False, **kw):
    return transformers.LlamaConfig(**{**TINY, **kw}, tie_word_embeddings=tie)


def _save(path: Path, config, seed: int = 0, **kw) -> Path:
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(str(path), **kw)
    return path


def _file_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def _logits(model: nn.Module, vocab: int = 131) -> torch.Tensor:
    x = torch.arange(2 * 16).reshape(2, 16) * 7 % vocab
    model.eval()
    with torch.no_grad():
        return model(x).logits


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    return {
        "single": _save(tmp / "single", _config()),
        "sharded": _save(tmp / "sharded", _config(), max_shard_size="20KB"),
        "tied": _save(tmp / "tied", _config(tie=True), max_shard_size="20KB"),
    }


# ---- one process --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["single", "sharded", "tied"])
def test_loads_bit_for_bit_once(ckpts, kind):
    path = ckpts[kind]
    assert (path / "model.safetensors.index.json").is_file() == (kind != "single")
    torch.manual_seed(123)  # other initial weights than the file's
    holder = nn.Module()
    holder.inner = nn.Module()
    holder.inner.model = hf.from_pretrained(transformers.AutoModelForCausalLM, path)
    # in the mode transformers' own from_pretrained gives (eval: dropout off), as a drop-in must
    assert holder.inner.model.training is transformers.AutoModelForCausalLM.from_pretrained(path).training is False
    [stats] = hf.load_pending_pretrained(holder)  # found at any depth
    assert stats.model == "inner.model"
    file = _file_state(path)
    state = holder.inner.model.state_dict()
    for key, value in file.items():
        assert torch.equal(state[key], value), key
    if kind == "tied":
        assert "lm_head.weight" not in file  # save_pretrained drops the tied copy; loading it is fine
        assert holder.inner.model.lm_head.weight is holder.inner.model.model.embed_tokens.weight
    assert stats.bytes_read == sum(v.numel() * v.element_size() for v in file.values())
    assert hf.load_pending_pretrained(holder) == []  # loaded once: a later setup keeps trained weights


def test_fp8_delayed_buffers_converted_in_before_loading_are_not_missing_weights(ckpts):
    # The strategy converts to FP8 before pending pretrained weights load; the delayed recipe's
    # buffers (amax history, scale) were then "not in the checkpoint" and the load refused (a trial).
    from lightning_ampzero.config import Fp8Config
    from lightning_ampzero.fp8 import convert_to_fp8
    from lightning_ampzero.fp8.linear import Fp8Linear

    path = ckpts["single"]
    torch.manual_seed(123)
    holder = nn.Module()
    holder.model = hf.from_pretrained(transformers.AutoModelForCausalLM, path)
    convert_to_fp8(holder, Fp8Config(recipe="delayed", min_features=0))
    assert any(isinstance(m, Fp8Linear) and "fp8_amax_history" in m._buffers for m in holder.modules())
    hf.load_pending_pretrained(holder)
    state = holder.model.state_dict()
    for key, value in _file_state(path).items():
        assert torch.equal(state[key], value), key


def test_a_model_whose_pretrained_weights_were_never_loaded_refuses_its_forward(ckpts):
    # Under Lightning's ddp nothing loads them, and the model trained from random weights silently (a trial).
    model = hf.from_pretrained(transformers.AutoModelForCausalLM, ckpts["single"])
    x = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"were never loaded into this LlamaForCausalLM.*load_pending_pretrained"):
        model(x)
    hf.load_pending_pretrained(model)
    assert model(x).logits.shape == (1, 4, TINY["vocab_size"])
    assert not model._forward_pre_hooks  # nothing left behind once loaded


def test_dtype_cast_and_base_model_prefix(ckpts, tmp_path):
    # A checkpoint of the base model (keys without 'model.') into the head model, as from_pretrained does.
    torch.manual_seed(0)
    base = transformers.LlamaModel(_config())
    base.save_pretrained(str(tmp_path / "base"))
    model = hf.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "base", strict=False, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match=r"1 parameters/buffers are not in the checkpoint: \['lm_head.weight'\]"):
        hf.load_pending_pretrained(model)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(model.model.embed_tokens.weight, base.embed_tokens.weight.to(torch.bfloat16))
    strict = hf.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "base")
    with pytest.raises(RuntimeError, match=r"1 parameters/buffers are not in the checkpoint: \['lm_head.weight'\]"):
        hf.load_pending_pretrained(strict)


def test_unexpected_keys_and_bad_paths_are_named(ckpts, tmp_path):
    from safetensors.torch import save_file

    state = _file_state(ckpts["single"])
    state["model.layers.0.extra.weight"] = torch.zeros(3)
    del state["model.norm.weight"]
    (tmp_path / "odd").mkdir()
    save_file(state, str(tmp_path / "odd" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "odd" / "config.json").write_text((ckpts["single"] / "config.json").read_text())
    model = hf.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "odd")
    named = r"\['model.norm.weight'\].*match no parameter.*\['model.layers.0.extra.weight'\]"
    with pytest.raises(RuntimeError, match=named):
        hf.load_pending_pretrained(model)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="pickled weights"):
        hf.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "bin")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "nowhere")


@pytest.mark.parametrize("kind", ["single", "tied"])
def test_export_loads_with_from_pretrained(ckpts, tmp_path, kind):
    model = hf.from_pretrained(transformers.LlamaForCausalLM, ckpts[kind])
    hf.load_pending_pretrained(model)
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)  # "trained"
    files = hf.save_pretrained(model, tmp_path / "out", max_shard_size="30KB")
    assert len(files) > 1 and (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert ("lm_head.weight" in _file_state(tmp_path / "out")) == (kind != "tied")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] == (kind == "tied")
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert torch.equal(_logits(again), _logits(model))
    # a second export into the same directory, unsplit, leaves no stale shard behind
    hf.save_pretrained(model, tmp_path / "out", dtype="bf16")
    assert sorted(p.name for p in (tmp_path / "out").glob("model*")) == ["model.safetensors"]
    assert {v.dtype for v in _file_state(tmp_path / "out").values()} == {torch.bfloat16}


def test_gpt2_tied_export_matches_save_pretrained(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0,
                                     eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(str(tmp_path / "gpt2"))
    model = hf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path / "gpt2")
    hf.load_pending_pretrained(model)
    hf.save_pretrained(model, tmp_path / "out")
    ours, theirs = _file_state(tmp_path / "out"), _file_state(tmp_path / "gpt2")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_peft_lora_model_loads_base_weights(ckpts, tmp_path):
    peft = pytest.importorskip("peft")
    model = hf.from_pretrained(transformers.LlamaForCausalLM, ckpts["single"])
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    lora_b = model.model.layers[0].self_attn.q_proj.lora_B.default.weight.clone()
    [stats] = hf.load_pending_pretrained(wrapped)  # adapters are new parameters: not missing
    file = _file_state(ckpts["single"])
    assert stats.tensors == len(file)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert torch.equal(q_proj.base_layer.weight, file["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(model.model.layers[0].self_attn.q_proj.lora_B.default.weight, lora_b)  # left as built
    # the base model with adapters inside, merged: not supported; the peft model: its adapters, as peft saves them
    with pytest.raises(NotImplementedError, match="8 peft adapter tensors.*save_pretrained\\(the peft model"):
        hf.save_pretrained(model, tmp_path / "out")
    names = [p.name for p in hf.save_pretrained(wrapped, tmp_path / "adapter")]
    assert "adapter_model.safetensors" in names and "adapter_config.json" in names


def test_transformers_is_optional():
    # transformers made unimportable: the hf API and the CLI still import (transformers is imported on use).
    # (lightning.pytorch itself imports transformers through torchmetrics when it is installed.)
    code = ("import sys; sys.modules['transformers'] = None;"
            " import lightning_ampzero.hf, lightning_ampzero.hf.export, lightning_ampzero.cli.consolidate")
    assert subprocess.run([sys.executable, "-c", code], env=script_env(), cwd=ROOT, timeout=120).returncode == 0


# ---- two ranks, FSDP2 ---------------------------------------------------------------------------
@contextmanager
def _params_on_meta():
    """Parameters on meta, buffers real (accelerate's init_empty_weights(include_buffers=False))."""
    original = nn.Module.register_parameter

    def register(self, name, param):
        original(self, name, param)
        if param is not None and not param.is_meta:  # a meta one is already ours (e.g. re-registered by a tie)
            p = self._parameters[name]
            self._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _build_sharded(path: Path):
    """What strategy ampzero does at stage 3: build without the whole model, shard, materialise the shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with _params_on_meta():
        model = hf.from_pretrained(transformers.LlamaForCausalLM, path)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    rss_before = _status_bytes("VmRSS")
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    model.to_empty(device="cpu")  # allocates this rank's shards only
    for n, b in model.named_buffers():
        b.copy_(buffers[n])
    holder = nn.Module()
    holder.model = model
    return holder, rss_before


def _expected_local_bytes(path: Path, rank: int, world: int) -> int:
    from lightning_ampzero.hf.files import CheckpointFiles

    total = 0
    for info in CheckpointFiles(path).tensors.values():
        rows = torch.empty(info.shape[0], device="meta").chunk(world)  # FSDP2's dim-0 layout
        n_rows = rows[rank].shape[0] if rank < len(rows) else 0
        total += info.nbytes // info.shape[0] * n_rows
    return total


def _load_train_export_body(rank, world_size, path, out):
    path, out = Path(path), Path(out)
    holder, _ = _build_sharded(path)
    [stats] = hf.load_pending_pretrained(holder)
    model = holder.model
    file = _file_state(path)
    exact = all(torch.equal(p.full_tensor(), file[n]) for n, p in model.named_parameters())
    # a few steps of training, same data on both ranks
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, 128, (2, 16), generator=gen)
        loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    hf.save_pretrained(model, out, max_shard_size="40KB")
    trained = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    sharded_logits = _logits(model)
    return {"stats": stats, "exact": exact, "expected_local": _expected_local_bytes(path, rank, world_size),
            "trained": trained if rank == 0 else None, "sharded_logits": sharded_logits}


@pytest.mark.parametrize("kind", ["sharded", "tied"])
def test_two_ranks_load_shards_train_export(ckpts, tmp_path, kind):
    results = spawn(_load_train_export_body, world_size=2, args=(str(ckpts[kind]), str(tmp_path / "out")), timeout=180)
    total = sum(v.numel() * v.element_size() for v in _file_state(ckpts[kind]).values())
    for r in results:
        stats = r["stats"]
        assert r["exact"]
        # each rank read exactly its own rows (fp32 file into fp32 params): half the model, give or take rows
        assert stats.bytes_read == stats.local_bytes == r["expected_local"]
        assert stats.bytes_read < 0.6 * total
    assert sum(r["stats"].bytes_read for r in results) == total
    # the export, reloaded by transformers, is the trained model: same logits as the gathered parameters
    reference = transformers.LlamaForCausalLM(_config(tie=kind == "tied"))
    reference.load_state_dict(results[0]["trained"], strict=False)
    assert all(torch.equal(p, results[0]["trained"][n]) for n, p in reference.named_parameters())
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert (_logits(exported) - _logits(reference)).abs().max().item() <= 1e-6
    # the class the user wrote, not fully_shard's FSDPLlamaForCausalLM (ampzero-consolidate builds architectures[0])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (results[0]["sharded_logits"] - _logits(reference)).abs().max().item() <= 1e-5


def _memory_body(rank, world_size, path):
    import gc

    path = Path(path)
    holder, rss_before_materialise = _build_sharded(path)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # restart the peak-RSS mark (VmHWM) here
    rss_before_load = _status_bytes("VmRSS")
    [stats] = hf.load_pending_pretrained(holder)
    peak = _status_bytes("VmHWM")
    return {"stats": stats, "load_increase": peak - rss_before_load,
            "peak_over_unmaterialised": peak - rss_before_materialise,
            "expected_local": _expected_local_bytes(path, rank, world_size)}


@pytest.mark.parametrize("shards", [None, pytest.param("20MB", marks=pytest.mark.slow)])
def test_load_memory_is_bounded_by_shard_plus_one_tensor(tmp_path, shards):
    kw = {"max_shard_size": shards} if shards else {}
    path = _save(tmp_path / "medium", _config(**MEDIUM), **kw)
    results = spawn(_memory_body, world_size=2, args=(str(path),), timeout=180)
    for r in results:
        stats = r["stats"]
        assert stats.bytes_read == stats.local_bytes == r["expected_local"]
        assert stats.largest_read <= stats.largest_tensor // 2  # a sharded tensor is never read whole
        # Peak RSS from before the shard was allocated (to_empty only reserves: the load's writes make the
        # shard resident, so the load's own increase includes the shard): shard + largest tensor + constant.
        assert r["peak_over_unmaterialised"] <= stats.local_bytes + stats.largest_tensor + RSS_CONSTANT, r
        assert r["load_increase"] <= stats.local_bytes + stats.largest_tensor + RSS_CONSTANT, r
    print({k: v for k, v in results[0].items() if k != "stats"}, results[0]["stats"])


# ---- Lightning, 2 processes (a script in a subprocess) and the consolidation CLI -------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightning_ampzero.cli.consolidate", *args],
                          env=script_env({"OMP_NUM_THREADS": "1"}), capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def _lightning_roundtrip(ckpts, tmp_path, stage: int, kind: str = "sharded") -> None:
    out = run_json("hf_roundtrip.py", tmp_path / "result.json", "--model-dir", str(ckpts[kind]),
                   "--work-dir", str(tmp_path), "--stage", str(stage), "--steps", "10",
                   env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert out["loaded_exact"] == [True, True]
    if stage == 0:  # DDP: whole parameters on every rank, transformers' own save_pretrained works
        assert out["own_save_pretrained"] == ["wrote", "wrote"], out["own_save_pretrained"]
    else:  # sharded: it says what to call instead of failing inside torch
        for message in out["own_save_pretrained"]:
            assert message.startswith("RuntimeError: LlamaForCausalLM.save_pretrained() cannot write this model")
            assert f"ZeRO stage {stage}" in message
            assert "lightning_ampzero.hf.save_pretrained(model, out_dir)" in message
    total = sum(v.numel() * v.element_size() for v in _file_state(ckpts[kind]).values())
    for load in out["load"]:
        if not load:
            continue  # loaded by the strategy itself: measured in the spawn tests above
        assert load["bytes_read"] == load["local_bytes"] and load["bytes_read"] < (0.6 * total if stage else total + 1)
        # the shard is resident before the load (built partitioned): the load adds about one slice
        assert load["increase"] <= load["largest_tensor"] + RSS_CONSTANT, load
    assert len(out["losses"]) == 10 and out["losses"][-1] < out["losses"][0]
    trained = torch.load(tmp_path / "trained.pt", weights_only=True)
    reference = transformers.LlamaForCausalLM(_config(tie=kind == "tied"))
    reference.load_state_dict(trained)
    ref_logits = _logits(reference)
    live = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"))
    assert (_logits(live) - ref_logits).abs().max().item() <= 1e-6
    # the same directory from the sharded checkpoint written at the end of training, by the CLI
    proc = _cli(out["ckpt"], str(tmp_path / "from_ckpt"), "--hf-config", str(ckpts[kind]), "--max-shard-size", "40KB")
    assert proc.returncode == 0, proc.stderr
    from_ckpt = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "from_ckpt"))
    assert (_logits(from_ckpt) - ref_logits).abs().max().item() <= 1e-6
    assert (tmp_path / "from_ckpt" / "model.safetensors.index.json").is_file()
    # an explicit prefix and a cast: bf16 files, and the config says so
    proc = _cli(out["ckpt"], str(tmp_path / "bf16"), "--hf-config", str(ckpts[kind]), "--strip-prefix", "model.",
                "--dtype", "bf16")
    assert proc.returncode == 0, proc.stderr
    assert {v.dtype for v in _file_state(tmp_path / "bf16").values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_lightning_round_trip_stages_0_2(ckpts, tmp_path, stage):
    _lightning_roundtrip(ckpts, tmp_path, stage)


def test_lightning_round_trip_stage_3(ckpts, tmp_path):
    """Acceptance 2: load at stage 3 on 2 ranks, train 10 steps, export, reload: logits within 1e-6."""
    _lightning_roundtrip(ckpts, tmp_path, 3)


@pytest.mark.slow
def test_lightning_round_trip_stage_3_tied(ckpts, tmp_path):
    _lightning_roundtrip(ckpts, tmp_path, 3, "tied")


def test_cli_hf_export_errors(ckpts, tmp_path):
    proc = _cli(str(tmp_path / "missing.ckpt"), str(tmp_path / "x"), "--hf-config", str(ckpts["single"]))
    assert proc.returncode == 2 and "missing.ckpt does not exist" in " ".join(proc.stderr.split())


def _save_on_rank_zero_only(rank: int, world: int, root: str) -> str:
    import lightning_ampzero.checkpoint.consolidate as consolidate

    consolidate.ARRIVAL_TIMEOUT_S = 2.0
    model = transformers.LlamaForCausalLM(_config())
    if rank != 0:
        return "did not call"  # as under `if trainer.is_global_zero:`
    try:
        hf.save_pretrained(model, Path(root) / "out")
    except RuntimeError as e:
        return str(e)
    return "saved"


def test_save_pretrained_on_rank_zero_alone_is_a_clear_error_not_a_hang(tmp_path):
    # [Note: an export called on rank zero alone]: it hung in its first collective, with no message.
    said, other = spawn(_save_on_rank_zero_only, world_size=2, args=(str(tmp_path),), timeout=120)
    assert other == "did not call"
    assert said.startswith("save_pretrained is collective: every rank must call it") and "rank(s) [1]" in said
    assert "not under `if trainer.is_global_zero:`" in said


def _lora_saved_at_stage(rank: int, world: int, root: str, stage: int) -> dict:
    from peft import LoraConfig, PeftModel, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ampzero.config import ZeroConfig
    from lightning_ampzero.zero.apply import apply_zero

    torch.manual_seed(0)
    model = get_peft_model(transformers.LlamaForCausalLM(_config()), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    apply_zero(model, init_device_mesh("cpu", (world,)), ZeroConfig(stage=stage, reduce_bucket_size=2e4))
    hf.refuse_own_save_pretrained(model, stage)  # as the strategy does: the export below must still write
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randint(0, 131, (2, 8), generator=torch.Generator().manual_seed(rank))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    trained = {n: p.full_tensor().clone() for n, p in model.named_parameters() if p.requires_grad}
    paths = hf.save_pretrained(model, Path(root) / "adapter")
    try:
        model.save_pretrained(Path(root) / f"own_{rank}")  # peft's own: [Note: save_pretrained of a sharded model]
        own = "wrote"
    except RuntimeError as e:
        own = str(e)
    if rank != 0:
        return {"paths": paths, "own": own}
    torch.manual_seed(0)
    reloaded = PeftModel.from_pretrained(transformers.LlamaForCausalLM(_config()), str(Path(root) / "adapter"))
    got = dict(reloaded.named_parameters())
    return {"paths": [p.name for p in paths], "own": own,
            "diff": max((got[n] - t).abs().max().item() for n, t in trained.items()),
            "moved": max((t - got_init).abs().max().item() for t, got_init in zip(
                trained.values(), [dict(get_peft_model(transformers.LlamaForCausalLM(_config()),
                                   LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).named_parameters())[n]
                                   for n in trained]))}


@pytest.mark.parametrize("stage", [2, 3])
def test_save_pretrained_writes_a_sharded_peft_models_adapters_as_peft_does(tmp_path, stage):
    # [Note: adapters of a sharded peft model]: peft's own save_pretrained stopped on the shards.
    pytest.importorskip("peft")
    zero, other = spawn(_lora_saved_at_stage, world_size=2, args=(str(tmp_path), stage), timeout=300)
    assert other["paths"] == []
    for own in (zero["own"], other["own"]):
        assert own.startswith("PeftModel.save_pretrained() cannot write this model"), own
    assert "adapter_model.safetensors" in zero["paths"] and "adapter_config.json" in zero["paths"]
    assert zero["diff"] == 0.0 and zero["moved"] > 0  # the trained adapters, not the initial ones


# ---- a model that transformers converts on save (MoE experts) -----------------------------------
def _moe(seed: int = 0):
    torch.manual_seed(seed)
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=1, max_position_embeddings=64, tie_word_embeddings=True))


def _moe_train_export_body(rank, world_size, root):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_ampzero.checkpoint.sharded import save_sharded

    root = Path(root)
    model = _moe()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randint(0, 128, (2, 16), generator=gen)
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    hf.refuse_own_save_pretrained(model, 3)  # as the strategy does
    import warnings

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        hf.save_pretrained(model, root / "live", max_shard_size="60KB")
    # the checkpoint the strategy writes: the LightningModule's state under "state_dict", ``self.model``
    state = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}
    save_sharded(root / "moe.ckpt", state, {"global_step": 2}, is_global_zero=rank == 0, barrier=dist.barrier)
    trained = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    return {"trained": trained if rank == 0 else None, "said": [str(w.message) for w in said]}


def test_moe_export_converts_on_save_live_and_from_checkpoint(tmp_path):
    """[Note: a model that transformers converts on save]: every way out refused transformers 5's MoE
    models (a new-user trial); now both write what the model's own save_pretrained writes, and
    from_pretrained loads the trained weights bit for bit."""
    zero, _ = spawn(_moe_train_export_body, world_size=2, args=(str(tmp_path),), timeout=240)
    assert any("transformers weight converters" in s and "exported whole" in s for s in zero["said"]), zero["said"]
    reference = _moe()
    reference.load_state_dict(zero["trained"], strict=False)
    reference.tie_weights()
    assert all(torch.equal(p, zero["trained"][n]) for n, p in reference.named_parameters())
    assert not torch.equal(reference.model.layers[0].mlp.experts.gate_up_proj, _moe().model.layers[0].mlp.experts.gate_up_proj)
    files = _file_state(tmp_path / "live")
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in files  # per expert, as transformers writes it
    assert (tmp_path / "live" / "model.safetensors.index.json").is_file()  # max_shard_size honoured
    # the same directory from the checkpoint, by the CLI
    _moe().save_pretrained(str(tmp_path / "config"))
    proc = _cli(str(tmp_path / "moe.ckpt"), str(tmp_path / "from_ckpt"), "--hf-config", str(tmp_path / "config"))
    assert proc.returncode == 0, proc.stderr
    for out in ("live", "from_ckpt"):
        back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / out))
        assert type(back).__name__ == "Qwen2MoeForCausalLM"
        loaded = dict(back.named_parameters())
        assert all(torch.equal(loaded[n], p) for n, p in reference.named_parameters()), out
        assert (_logits(back) - _logits(reference)).abs().max().item() == 0.0


def test_exporting_a_peft_checkpoint_names_peft_and_the_route_that_works(tmp_path):
    """A new-user trial: a LoRA fit's checkpoint given to --hf-config met only "Check --hf-config, --hf-class
    and --strip-prefix". It now says it holds a peft model, and the route it gives merges to the trained weights."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    def lora():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1)
        return get_peft_model(transformers.LlamaForCausalLM(config),
                              LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))

    trained = lora()
    with torch.no_grad():  # adapters that change the merged weights (peft starts lora_B at zero)
        for name, p in trained.named_parameters():
            if "lora_B" in name:
                p.normal_()
    trained.get_base_model().config.save_pretrained(tmp_path / "config")
    state = {"model." + k: v.contiguous() for k, v in trained.state_dict().items()}
    torch.save(state, tmp_path / "state.pt")
    ckpt = tmp_path / "lora.ckpt"
    script = ("import torch, torch.distributed.checkpoint as dcp\n"
              f"dcp.save({{'state_dict': torch.load({str(tmp_path / 'state.pt')!r})}}, checkpoint_id={str(ckpt)!r},"
              " no_dist=True)\n"
              f"torch.save({{}}, {str(ckpt / 'meta.pt')!r})\n")
    subprocess.run([sys.executable, "-c", script], env=script_env(), check=True, timeout=300, capture_output=True)
    proc = _cli(str(ckpt), str(tmp_path / "out"), "--hf-config", str(tmp_path / "config"), "--hf-class",
                "LlamaForCausalLM")
    assert proc.returncode == 2 and "holds a peft model (LoRA adapters beside the base layers" in proc.stderr, proc.stderr
    assert "--strip-prefix <the attribute holding the peft model, e.g. model.> --dtype fp32" in proc.stderr
    # the route the message gives
    proc = _cli(str(ckpt), str(tmp_path / "peft.safetensors"), "--strip-prefix", "model.", "--dtype", "fp32")
    assert proc.returncode == 0, proc.stderr
    rebuilt = lora()
    rebuilt.load_state_dict(load_file(tmp_path / "peft.safetensors"), strict=True)
    merged, expected = rebuilt.merge_and_unload(), trained.merge_and_unload()
    assert all(torch.equal(a, b) for a, b in zip(merged.state_dict().values(), expected.state_dict().values()))
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight, lora().get_base_model()
                           .model.layers[0].self_attn.q_proj.weight)  # the adapters were merged in
