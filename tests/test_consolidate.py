"""Issue 7, acceptance 3: the consolidated file loads into the unwrapped model and gives the same
outputs as the trained sharded model; consolidation memory is bounded by the largest tensor
(measured: peak RSS increase of the CLI process, reported by the CLI)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _scripts import ROOT, run_json, script_env
from lightning_ampzero.checkpoint.consolidate import load_consolidated
from lightning_ampzero.models.gpt import GPTConfig, GPTModule

MODEL = GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32)


def _cli(*args: str) -> subprocess.CompletedProcess:
    # Warnings shown, as a user's shell shows them (script_env silences them for training scripts).
    return subprocess.run([sys.executable, "-m", "lightning_ampzero.cli.consolidate", *args],
                          env=script_env({"PYTHONWARNINGS": None}), capture_output=True, text=True, timeout=300, cwd=ROOT)


def _outputs(state: dict) -> torch.Tensor:
    module = GPTModule(model=MODEL)
    module.configure_model()
    module.load_state_dict({k: v.float() for k, v in state.items()})
    x = torch.arange(2 * 32).reshape(2, 32) % 256
    with torch.no_grad():
        return module(x).float()[:, -1, :8]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("consolidate")
    out = run_json("reshard.py", tmp / "save.json", "--phase", "save", "--stage", "3", "--devices", "2",
                   "--ckpt-dir", str(tmp / "ck"), "--export", str(tmp))
    return tmp, out


def test_consolidated_checkpoint_reproduces_sharded_outputs(trained):
    tmp, out = trained
    final = next(c for c in out["ckpts"] if "epoch=1" in c)
    proc = _cli(final, str(tmp / "model.safetensors"))
    assert proc.returncode == 0, proc.stderr
    # torch's "torch.distributed is disabled ... assuming ... a single process", once per tensor
    assert "torch.distributed is disabled" not in proc.stderr
    state = load_consolidated(tmp / "model.safetensors")
    assert all(v.dtype == torch.float32 for v in state.values())
    assert torch.allclose(_outputs(state), torch.tensor(out["outputs"]), rtol=1e-5, atol=1e-5)


def test_live_export_16bit_and_sharded_files(trained):
    tmp, out = trained
    bf16 = load_consolidated(tmp / "live_bf16.safetensors")
    assert {v.dtype for v in bf16.values()} == {torch.bfloat16}
    fp32 = load_consolidated(tmp / "live_fp32")
    assert len(list((tmp / "live_fp32").glob("model-*.safetensors"))) > 1  # split by --max-shard-size
    ref = torch.tensor(out["outputs"])
    assert torch.allclose(_outputs(fp32), ref, rtol=1e-5, atol=1e-5)
    # bf16 weights: same outputs up to bf16 rounding, and clearly not identical (the cast happened)
    got = _outputs(bf16)
    assert torch.allclose(got, ref, atol=0.05) and not torch.equal(got, ref)


def test_the_file_format_follows_the_name_unless_given(trained, tmp_path):
    # save_consolidated("model.pt") wrote safetensors bytes, which torch.load refused (a new-user trial).
    from safetensors.torch import load_file

    from lightning_ampzero.checkpoint.consolidate import Entry, write_state

    tmp, _ = trained
    live = torch.load(tmp / "live_default.pt", weights_only=True)  # the live export's defaults: bf16, torch.save
    assert {v.dtype for v in live.values()} == {torch.bfloat16} and live.keys() == load_consolidated(
        tmp / "live_bf16.safetensors").keys()
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    entries = [Entry("w", (2, 3), torch.float32)]
    for name, loads in (("a.pt", torch.load), ("b.pth", torch.load), ("c.bin", torch.load),
                        ("d.safetensors", None), ("e", None)):
        (path,) = write_state(entries, lambda e: state[e.name], tmp_path / name)
        back = loads(path, weights_only=True) if loads else load_file(path)
        assert torch.equal(back["w"], state["w"]) and path.suffix == (Path(name).suffix or ".safetensors")
    with pytest.raises(ValueError, match=r"x.pt names a torch.save file but the format asked for is 'safetensors'"):
        write_state(entries, lambda e: state[e.name], tmp_path / "x.pt", fmt="safetensors")
    final = next(c for c in trained[1]["ckpts"] if "epoch=1" in c)
    proc = _cli(final, str(tmp_path / "cli.pt"))  # the CLI's default follows the name too
    assert proc.returncode == 0, proc.stderr
    assert torch.load(tmp_path / "cli.pt", weights_only=True).keys() == live.keys()
    bad = _cli(final, str(tmp_path / "cli.safetensors"), "--format", "pt")
    assert bad.returncode == 2 and "names a safetensors file but the format asked for is 'pt'" in bad.stderr


def test_a_lightning_checkpoint_file_that_load_from_checkpoint_loads(trained, tmp_path):
    # LightningModule.load_from_checkpoint(sharded directory) stops with IsADirectoryError.
    tmp, out = trained
    final = next(c for c in out["ckpts"] if "epoch=1" in c)
    proc = _cli(final, str(tmp_path / "model.ckpt"), "--format", "lightning")
    assert proc.returncode == 0, proc.stderr
    module = GPTModule.load_from_checkpoint(tmp_path / "model.ckpt", model=MODEL)
    x = torch.arange(2 * 32).reshape(2, 32) % 256
    with torch.no_grad():
        got = module(x).float()[:, -1, :8]
    assert torch.allclose(got, torch.tensor(out["outputs"]), rtol=1e-5, atol=1e-5)
    saved = torch.load(tmp_path / "model.ckpt", weights_only=False)
    assert saved["epoch"] == 1 and saved["global_step"] > 0 and "optimizer_states" not in saved
    bad = _cli(final, str(tmp_path / "x.ckpt"), "--format", "lightning", "--strip-prefix", "model.")
    assert bad.returncode == 2 and "--format lightning writes one file" in bad.stderr


def test_cli_strip_prefix_dtype_and_errors(trained, tmp_path):
    _, out = trained
    final = next(c for c in out["ckpts"] if "epoch=1" in c)
    proc = _cli(final, str(tmp_path / "inner.pt"), "--format", "pt", "--dtype", "fp16", "--strip-prefix", "model.")
    assert proc.returncode == 0, proc.stderr
    state = load_consolidated(tmp_path / "inner.pt")
    assert "wte.weight" in state and state["wte.weight"].dtype == torch.float16
    # An output folder that does not exist yet is made, in every format (safetensors stopped on
    # "No such file or directory", pt on torch's "Parent directory ... does not exist": a trial).
    for fmt, name in (("safetensors", "model.safetensors"), ("pt", "model.pt"), ("lightning", "model.ckpt")):
        target = tmp_path / f"new {fmt}" / "inner" / name
        made = _cli(final, str(target), "--format", fmt)
        assert made.returncode == 0 and target.is_file(), made.stderr
    bad = _cli(str(tmp_path / "missing.ckpt"), str(tmp_path / "x.safetensors"))
    assert bad.returncode == 2 and "missing.ckpt does not exist" in bad.stderr
    (tmp_path / "empty.ckpt").mkdir()
    bad = _cli(str(tmp_path / "empty.ckpt"), str(tmp_path / "x.safetensors"))
    assert bad.returncode == 2 and "not a sharded checkpoint" in bad.stderr


def _consolidate_synthetic(tmp_path, n_tensors: int) -> tuple[int, int]:
    ckpt = tmp_path / f"big{n_tensors}.ckpt"
    script = (
        "import torch, torch.distributed.checkpoint as dcp\n"
        f"sd = {{f'layer{{i}}.weight': torch.full((2048, 1024), float(i)) for i in range({n_tensors})}}\n"
        f"dcp.save({{'state_dict': sd}}, checkpoint_id={str(ckpt)!r}, no_dist=True)\n"
        f"torch.save({{}}, {str(ckpt / 'meta.pt')!r})\n"
    )
    subprocess.run([sys.executable, "-c", script], env=script_env(), check=True, timeout=300, capture_output=True)
    out = tmp_path / f"big{n_tensors}.safetensors"
    proc = _cli(str(ckpt), str(out))
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"bytes=(\d+) peak_rss_increase=(\d+)", proc.stdout)
    state = load_consolidated(out)
    assert len(state) == n_tensors and float(state[f"layer{n_tensors - 1}.weight"][0, 0]) == n_tensors - 1
    return int(m.group(1)), int(m.group(2))


def test_consolidation_memory_is_bounded_by_the_largest_tensor(tmp_path):
    """Checkpoints of 16 and 48 tensors of 8 MiB (128 vs 384 MiB): consolidation's peak RSS
    increase (measured by the CLI) does not grow with the model and stays far below it."""
    tensor = 2048 * 1024 * 4
    small_written, small_peak = _consolidate_synthetic(tmp_path, 16)
    big_written, big_peak = _consolidate_synthetic(tmp_path, 48)
    print(f"consolidation peak RSS increase: {small_peak / 2**20:.1f} MiB for {small_written / 2**20:.0f} MiB,"
          f" {big_peak / 2**20:.1f} MiB for {big_written / 2**20:.0f} MiB (tensors of {tensor / 2**20:.0f} MiB)")
    assert big_written >= 48 * tensor
    assert big_peak - small_peak < tensor, "peak memory grew with the number of tensors"
    assert big_peak < big_written / 3


def test_cli_errors_are_not_wrapped_into_the_middle_of_a_path(tmp_path):
    # rich wrapped the message at 80 columns: a long path came out split across lines.
    missing = tmp_path / ("a-directory-with-a-long-name-" * 6) / "missing.ckpt"
    bad = _cli(str(missing), str(tmp_path / "x.safetensors"))
    assert bad.returncode == 2
    # a path that is not there says so (it said "not a sharded checkpoint directory", a new-user trial)
    assert f"{missing} does not exist" in bad.stderr, bad.stderr


def test_0_dim_tensors_are_written_and_read_back(tmp_path):
    # A 0-dim tensor could not be viewed as bytes: consolidating a CLIP checkpoint (logit_scale) or any
    # BatchNorm (num_batches_tracked) stopped with "self.dim() cannot be 0 to view Float as Byte".
    from safetensors.torch import load_file

    from lightning_ampzero.checkpoint.consolidate import Entry, write_state

    state = {"logit_scale": torch.tensor(2.6592), "bn.num_batches_tracked": torch.tensor(7),
             "w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)}
    entries = [Entry(n, tuple(t.shape), t.dtype) for n, t in state.items()]
    (path,) = write_state(entries, lambda e: state[e.name], tmp_path / "out.safetensors")
    back = load_file(path)
    assert back.keys() == state.keys()
    assert all(back[n].shape == t.shape and back[n].dtype == t.dtype and torch.equal(back[n], t) for n, t in state.items())


def test_a_single_file_checkpoint_of_another_strategy_says_how_to_start_from_its_weights(tmp_path):
    from lightning_ampzero.checkpoint.sharded import _check_loadable

    ddp = tmp_path / "epoch=0-step=2.ckpt"
    torch.save({"state_dict": {}}, ddp)  # what Lightning's ddp writes: one file
    with pytest.raises(ValueError, match="It is a single file, as Lightning's other strategies write.*load them before"
                                         r" trainer\.fit"):
        _check_loadable(ddp)
    legacy = tmp_path / "legacy.ckpt"
    torch.save({"state_dict": {}}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError, match="It is a single file, as Lightning's other strategies write"):
        _check_loadable(legacy)
    # not a checkpoint at all (a trial's random bytes were told to torch.load them, which failed)
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(bytes(range(7, 256)) * 20)
    with pytest.raises(ValueError, match="It is not a checkpoint of any kind either: neither a torch.save file nor a"
                                         " safetensors file") as e:
        _check_loadable(garbage)
    assert "torch.load" not in str(e.value)


@pytest.mark.parametrize("stage", [2, 3])
def test_validate_reads_the_weights_of_a_single_file_checkpoint(tmp_path, stage):
    # trainer.validate(ckpt_path=<Lightning ddp's file>) was refused with advice about trainer.fit (a
    # new-user trial); Lightning's own strategies read the weights there.
    ddp = run_json("validate_file.py", tmp_path / "ddp.json", "--phase", "ddp", "--file", str(tmp_path / "ddp.ckpt"))
    got = run_json("validate_file.py", tmp_path / "az.json", "--phase", "ampzero", "--stage", str(stage),
                   "--file", str(tmp_path / "ddp.ckpt"))
    assert got["max_weight_diff"] == 0.0
    assert got["val_loss"] == pytest.approx(ddp["val_loss"], rel=1e-6)
    assert abs(got["val_loss_own_weights"] - ddp["val_loss"]) > 1e-3  # the load is what made them equal
