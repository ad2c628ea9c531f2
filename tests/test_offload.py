"""Optimizer offload to CPU and NVMe (ZeRO-Offload / ZeRO-Infinity), parameter offload.

* one process: OffloadedAdam against torch.optim.AdamW, state-dict layout and round trip;
* a subprocess (tests/scripts/offload_nvme.py): resident memory of NVMe offload measured as
  peak RSS, and every NVMe error path caused for real (missing path, full disk, failing write);
* 2 CPU ranks under Lightning (tests/scripts/offload.py): 30-step fp32 parity with no offload
  for stages 1-3, activation checkpointing inside FSDP2, and resume from checkpoints.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from _scripts import max_rel_diff, run_json
from lightning_ampzero.config import AmpZeroConfig, OffloadConfig
from lightning_ampzero.offload import NvmeOffloadError, OffloadedAdam
from lightning_ampzero.offload.setup import param_offload_policy, resolve_nvme_dir

STEPS = 30


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 8),
                               torch.nn.Linear(8, 8))  # the last layer gets no gradient (unused)


def _adamw(model: torch.nn.Module, cls=torch.optim.AdamW, **kw) -> torch.optim.Optimizer:
    decay = [model[0].weight, model[2].weight, model[3].weight]
    no_decay = [model[0].bias, model[2].bias, model[3].bias]
    return cls([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
               lr=1e-2, betas=(0.9, 0.95), **kw)


def _train(model, opt, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model[:3](torch.randn(4, 16, generator=g)).pow(2).mean().backward()
        opt.step()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _offloaded(model, kind: str, tmp_path: Path, cls=torch.optim.AdamW, tile: int = 100) -> OffloadedAdam:
    extra = {"nvme_path": str(tmp_path)} if kind == "nvme" else {}
    cfg = OffloadConfig(offload_optimizer=kind, sub_group_size=tile, buffer_count=6, **extra)
    return OffloadedAdam(_adamw(model, cls, foreach=True), cfg, nvme_dir=tmp_path)


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_matches_torch_adam(kind, cls, tmp_path):
    ref = _model()
    _train(ref, _adamw(ref, cls, foreach=True), 20)
    model = _model()
    opt = _offloaded(model, kind, tmp_path, cls)
    _train(model, opt, 20)
    assert torch.allclose(_flat(model), _flat(ref), rtol=0, atol=1e-6)
    # The unused layer was never stepped (no gradient), as in torch: no state, no weight decay.
    assert model[3].weight not in opt.state and torch.equal(model[3].weight, _model()[3].weight)
    assert len(opt.state) == 4
    if kind == "nvme":
        # Every tile holding a stepped parameter is read and written each step, 12 bytes per element
        # each way; here that is every tile (+ the initial write of the master weights).
        assert opt.store.group_sizes == [16 * 64 + 64 * 8 + 8 * 8, 64 + 8 + 8]
        assert opt.store.bytes_read == opt.store.bytes_written == (20 + 1) * 12 * sum(opt.store.group_sizes)
    opt.close()


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_state_dict_layout_and_round_trip(kind, tmp_path):
    ref_model = _model()
    ref = _adamw(ref_model, foreach=True)
    _train(ref_model, ref, 5)
    model = _model()
    opt = _offloaded(model, kind, tmp_path)
    _train(model, opt, 5)
    sd, ref_sd = opt.state_dict(), ref.state_dict()
    # Same layout as torch's optimizer: checkpoints interchange between offload and no offload.
    assert sd["param_groups"] == ref_sd["param_groups"]
    assert sd["state"].keys() == ref_sd["state"].keys()
    for k, st in sd["state"].items():
        assert st.keys() == ref_sd["state"][k].keys()
        for name, v in st.items():
            assert torch.allclose(v, ref_sd["state"][k][name], atol=1e-6), (k, name)
    saved = {k: {n: v.clone() for n, v in st.items()} for k, st in sd["state"].items()}
    params = [p.detach().clone() for p in model.parameters()]

    # Continue 5 steps; separately, resume into a fresh offloaded optimizer and do the same 5 steps.
    _train(model, opt, 5, seed=2)
    resumed = _model()
    with torch.no_grad():
        for p, v in zip(resumed.parameters(), params):
            p.copy_(v)
    opt2 = _offloaded(resumed, kind, tmp_path)
    opt2.load_state_dict({"state": saved, "param_groups": ref_sd["param_groups"]})
    _train(resumed, opt2, 5, seed=2)
    assert torch.equal(_flat(resumed), _flat(model))
    # The torch optimizer loads the offloaded state too.
    torch_opt = _adamw(resumed, foreach=True)
    torch_opt.load_state_dict(opt2.state_dict())
    assert torch.equal(torch_opt.state[resumed[0].weight]["exp_avg"], opt2.state[resumed[0].weight]["exp_avg"])
    opt.close()
    opt2.close()
    assert not list(tmp_path.glob("ampzero-offload-*")), "close() deletes the swap files"


def test_lr_scheduler_of_the_wrapped_optimizer_still_drives_it(tmp_path):
    model = _model()
    inner = _adamw(model, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 0.5 ** s)
    opt = OffloadedAdam(inner, OffloadConfig(offload_optimizer="cpu"))
    _train(model, opt, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-3)
    assert opt.state_dict()["param_groups"][0]["lr"] == pytest.approx(5e-3)
    opt.load_state_dict(opt.state_dict() | {"param_groups": [dict(g, lr=1.0) for g in opt.state_dict()["param_groups"]]})
    assert inner.param_groups[0]["lr"] == 1.0  # loaded in place: still the scheduler's dicts


def test_empty_local_shard_steps_like_torch():
    """Uneven sharding leaves some ranks an empty shard: it must still get (empty) state, as in torch,
    or loading a checkpoint on that rank misses it."""
    params = [torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(n))) for n in (10, 0, 3)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = OffloadedAdam(torch.optim.AdamW(params, lr=0.1), OffloadConfig(offload_optimizer="cpu", sub_group_size=4))
    ref_opt = torch.optim.AdamW(ref, lr=0.1, foreach=True)
    for _ in range(3):
        for p, q in zip(params, ref):
            p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
        opt.step()
        ref_opt.step()
    assert all(torch.allclose(p, q) for p, q in zip(params, ref))
    assert [float(opt.state[p]["step"]) for p in params] == [3.0, 3.0, 3.0]
    assert opt.state[params[1]]["exp_avg"].shape == (0,)


def test_unsupported_optimizers_are_refused():
    model = _model()
    with pytest.raises(ValueError, match="runs Adam/AdamW on the host.*SGD"):
        OffloadedAdam(torch.optim.SGD(model.parameters(), lr=0.1), OffloadConfig(offload_optimizer="cpu"))
    with pytest.raises(ValueError, match="amsgrad=True"):
        OffloadedAdam(torch.optim.AdamW(model.parameters(), amsgrad=True), OffloadConfig(offload_optimizer="cpu"))


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_closed_optimizer_says_why_it_has_no_state(kind, tmp_path):
    # The strategy closes it at teardown (end of fit): a checkpoint saved after fit() must say so,
    # not fail on an emptied store.
    model = _model()
    opt = _offloaded(model, kind, tmp_path)
    _train(model, opt, steps=1)
    assert opt.state_dict()["state"]
    opt.close()
    for call in (opt.state_dict, opt.step):
        with pytest.raises(RuntimeError, match="after close.*Save the checkpoint during fit"):
            call()


def test_nvme_resident_memory_and_errors(tmp_path):
    r = run_json("offload_nvme.py", tmp_path / "nvme.json", timeout=300)
    cpu, nvme = r["resident"]["cpu"], r["resident"]["nvme"]
    # NVMe: the buffers are all that is resident, buffer_count x tile x 4 bytes, measured as the
    # growth of the process's peak RSS over creation and two steps of 4M parameters (48 MiB of state).
    assert nvme["resident_bytes"] == nvme["bound"] == 6 * (1 << 18) * 4
    assert nvme["peak_rss_growth"] <= nvme["bound"] + (2 << 20)
    assert nvme["bytes_read"] == nvme["bytes_written"] == 3 * nvme["state_bytes"]  # init + 2 steps
    # Positive control: the same measurement sees CPU offload's whole state become resident.
    assert cpu["peak_rss_growth"] >= cpu["state_bytes"]

    e = r["errors"]
    assert "does not exist" in e["missing"]
    assert "is not a directory" in e["not_a_directory"]
    if "unwritable" in e:
        assert "is not writable" in e["unwritable"]
    assert "out of space" in e["full_at_creation"] and "Nothing was left behind" in e["full_at_creation"]
    assert e["left_after_creation_failure"] == []
    for key in ("full_mid_step", "step_after_failure", "state_dict_after_failure"):
        assert "out of space" in e[key] and "has been deleted" in e[key], key
    assert e["left_after_step_failure"] == []


def test_lightning_parity_stages_1_to_3_and_activation_checkpointing(tmp_path):
    """30 fp32 steps on 2 ranks: offload cpu / nvme vs none per stage; AC variants vs none. And the
    composition with the precision plugin (fp16 loss scaling, bf16 autocast) against the same
    precision without offload: a looser bound, since the fused host AdamW differs from torch's
    foreach AdamW in the last bit, which low-precision forwards amplify."""
    configs = [f"{s}:{o}:none" for s in (1, 2, 3) for o in ("none", "cpu", "nvme")]
    configs += ["3:none:cpu", "2:none:selective", "1:none:full"]
    mixed = ["2:none:none:16-mixed", "2:cpu:none:16-mixed", "3:none:none:bf16-mixed", "3:nvme:none:bf16-mixed"]
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    r = run_json("offload.py", tmp_path / "parity.json", "--mode", "parity", "--configs", ",".join(configs + mixed),
                 "--steps", str(STEPS), "--nvme-dir", str(nvme), timeout=600)
    assert r.pop("_leftover_swap_dirs") == []  # teardown deleted every rank's swap files
    for cfg in configs:
        stage, offload, ac = cfg.split(":")
        losses, report = r[cfg]["losses"], r[cfg]["report"]
        reference = r[f"{stage}:none:none"]["losses"]
        assert len(losses) == STEPS
        assert max_rel_diff(losses, reference) <= 1e-5, cfg
        if offload != "none":
            assert report["offloaded"] and report["optimizer_state_on_param_device"] == 0
            assert report["state_bytes"] > 0
        if offload == "nvme":
            assert report["resident_bytes"] == 6 * 20000 * 4 < report["state_bytes"]
            assert report["bytes_read"] > STEPS * report["state_bytes"]
            assert len(report["files"]) == 6  # 2 parameter groups x (master, exp_avg, exp_avg_sq)
        if ac == "cpu":
            per_rank_micro = 4 * 32 * 64 * 4
            assert report["ac_packed_bytes_by_device"] == {"cpu": STEPS * 2 * per_rank_micro}
    assert r["3:none:none"]["losses"][-1] < r["3:none:none"]["losses"][0] - 0.5  # it trains
    for ref, off in zip(mixed[::2], mixed[1::2]):
        assert r[off]["report"]["offloaded"] and r[off]["report"]["skipped_steps"] == r[ref]["report"]["skipped_steps"]
        assert max_rel_diff(r[off]["losses"], r[ref]["losses"]) <= 1e-4, off


def test_lightning_resume_continues_the_trajectory(tmp_path):
    """Checkpoint after epoch 0, resume in a new Trainer: epoch 1 repeats the uninterrupted losses.
    ``none:cpu``: a checkpoint written without offload resumes with it (same state-dict layout)."""
    configs = ["1:cpu:cpu", "3:nvme:nvme", "2:none:cpu"]
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    r = run_json("offload.py", tmp_path / "resume.json", "--mode", "resume", "--configs", ",".join(configs),
                 "--nvme-dir", str(nvme), timeout=600)
    assert r.pop("_leftover_swap_dirs") == []
    for cfg in configs:
        n = r[cfg]["steps_per_epoch"]
        full, resumed = r[cfg]["full"], r[cfg]["resumed"]
        assert len(resumed) == n
        assert max_rel_diff(resumed, full[n:]) <= 1e-6, cfg


@pytest.mark.parametrize(("data", "match"), [
    ({"offload": {"offload_optimizer": "disk"}}, "Allowed values: 'none', 'cpu', 'nvme'"),
    ({"offload": {"offload_param": "nvme"}, "zero": {"stage": 3}}, "needs offload_optimizer='cpu' or 'nvme'"),
    ({"offload": {"nvme_path": "/tmp"}}, "only 'nvme' uses it"),
    ({"offload": {"offload_optimizer": "nvme", "buffer_count": 2}}, "buffer_count must be >= 3"),
    ({"offload": {"offload_optimizer": "cpu"}, "zero": {"stage": 0}}, "needs zero.stage 1, 2 or 3"),
    ({"offload": {"offload_param": "cpu"}, "zero": {"stage": 2}}, "needs zero.stage=3"),
    ({"offload": {"ofload_optimizer": "cpu"}}, "Did you mean 'offload_optimizer'"),
])
def test_config_validation(data, match):
    with pytest.raises(ValueError, match=match):
        AmpZeroConfig.from_dict(data)


def test_strategy_arguments_and_registered_names():
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_ampzero.strategy import AmpZeroStrategy

    s = AmpZeroStrategy(stage=3, offload_optimizer="nvme", nvme_path="/tmp", offload_param="cpu")
    assert s.config.offload == OffloadConfig(offload_optimizer="nvme", nvme_path="/tmp", offload_param="cpu")
    # Cross-field checks see the final values (stage and offload given together).
    assert AmpZeroStrategy(config=AmpZeroConfig.from_dict({"zero": {"stage": 3}, "offload": {"offload_param": "cpu"}}),
                           stage=2, offload_param="none").config.zero.stage == 2
    with pytest.raises(TypeError, match="Did you mean 'offload_optimizer'"):
        AmpZeroStrategy(offload_optimiser="cpu")
    expected = {
        "ampzero_stage_2_offload": (2, "cpu", "none"),
        "ampzero_stage_3_offload": (3, "cpu", "cpu"),
        "ampzero_stage_3_offload_nvme": (3, "nvme", "nvme"),
    }
    for name, (stage, opt, param) in expected.items():
        cfg = StrategyRegistry.get(name).config
        assert (cfg.zero.stage, cfg.offload.offload_optimizer, cfg.offload.offload_param) == (stage, opt, param)


def test_parameter_offload_policy(tmp_path):
    from torch.distributed.fsdp import CPUOffloadPolicy

    cfg = OffloadConfig(offload_param="cpu")
    said = []
    # accelerator="cpu": no FSDP2 policy (it would pin); the shards are swapped instead, to tmpfs,
    # with the warning given there (offload/setup.py swap_parameters, tests/test_param_offload.py)
    assert param_offload_policy(cfg, torch.device("cpu"), said.append) is None and said == []
    policy = param_offload_policy(OffloadConfig(offload_param="cpu", pin_memory=False), torch.device("cuda", 0), said.append)
    assert isinstance(policy, CPUOffloadPolicy) and policy.pin_memory is False
    assert param_offload_policy(OffloadConfig(), torch.device("cuda", 0), said.append) is None
    # NVMe directory: nvme_path, or a directory under default_root_dir with a warning.
    assert resolve_nvme_dir(OffloadConfig(), str(tmp_path), said.append) == (None, None)
    path, made = resolve_nvme_dir(OffloadConfig(offload_optimizer="nvme"), str(tmp_path), said.append)
    assert path == made == tmp_path / "ampzero_nvme" and path.is_dir() and "without offload.nvme_path" in said[-1]
    assert "swapping optimizer state to" in said[-1]
    both = OffloadConfig(offload_optimizer="cpu", offload_param="nvme")
    assert resolve_nvme_dir(both, str(tmp_path), said.append) == (path, None) and "swapping parameters to" in said[-1]


def test_pinning_only_with_an_accelerator(tmp_path):
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pinning on a CPU-only machine would fail, not warn
        opt = OffloadedAdam(_adamw(model), OffloadConfig(offload_optimizer="cpu", pin_memory=True))
    assert not opt._pin
    assert not any(t.is_pinned() for t in opt.store.flat[0].values())


def test_missing_nvme_dir_is_an_error():
    with pytest.raises(NvmeOffloadError, match="does not exist"):
        OffloadedAdam(_adamw(_model()), OffloadConfig(offload_optimizer="nvme", nvme_path="/nonexistent/x"),
                      nvme_dir=Path("/nonexistent/x"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: state on the host, parameters on the GPU")
@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_cuda_offloaded_state_is_on_the_host(kind, tmp_path):
    def train(model, opt):
        g = torch.Generator("cuda").manual_seed(1)
        for _ in range(10):
            opt.zero_grad()
            model[:3](torch.randn(4, 16, device="cuda", generator=g)).pow(2).mean().backward()
            opt.step()

    ref = _model().cuda()
    train(ref, _adamw(ref, foreach=True))
    model = _model().cuda()
    opt = _offloaded(model, kind, tmp_path)
    before = torch.cuda.memory_allocated()
    train(model, opt)
    assert torch.allclose(_flat(model), _flat(ref), atol=1e-5)
    assert opt._pin
    assert all(v.device.type == "cpu" for st in opt.state_dict()["state"].values() for v in st.values())
    # Device memory added by training: the gradients (4 bytes/parameter), no optimizer state (8 more).
    assert torch.cuda.memory_allocated() - before < 8 * sum(p.numel() for p in model.parameters())
    opt.close()


def test_swap_files_of_a_killed_run_are_removed_by_the_next(tmp_path):
    # [Note: swap directories of dead processes] in offload/store.py: a SIGKILLed rank leaves its
    # swap files (RAM, when nvme_path is tmpfs); the next swapper on the host removes them and says so.
    import os
    import signal
    import subprocess
    import sys

    from lightning_ampzero.offload.store import swap_dir_name

    # A run killed while it holds NVMe optimizer state: its swap directory stays behind.
    code = ("import sys, time, torch\n"
            "from lightning_ampzero.offload import OffloadedAdam\n"
            "from lightning_ampzero.config import OffloadConfig\n"
            "m = torch.nn.Linear(64, 64)\n"
            "opt = OffloadedAdam(torch.optim.AdamW(m.parameters()), OffloadConfig(offload_optimizer='nvme',"
            " nvme_path=sys.argv[1]), nvme_dir=sys.argv[1])\n"
            "print('ready', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    dead = sorted(p.name for p in tmp_path.glob("ampzero-offload-*"))
    assert len(dead) == 1 and f"-{proc.pid}-" in dead[0], dead
    # Directories of a live process and of another host must stay.
    live = tmp_path / swap_dir_name("params", 0)
    other_host = tmp_path / f"ampzero-grads-rank0-elsewhere-{proc.pid}-0123abcd"
    for d in (live, other_host):
        d.mkdir()
        (d / "x.swp").write_bytes(b"\0" * 4096)
    model = torch.nn.Linear(8, 8)
    with pytest.warns(UserWarning, match="removed 1 swap directory of processes that no longer exist"):
        opt = OffloadedAdam(torch.optim.AdamW(model.parameters()),
                            OffloadConfig(offload_optimizer="nvme", nvme_path=str(tmp_path)), nvme_dir=tmp_path)
    assert not (tmp_path / dead[0]).exists()
    assert live.exists() and other_host.exists()
    opt.close()
    assert os.path.exists(other_host / "x.swp")


def test_ranks_cleaning_the_same_dead_directories_at_once_count_each_once(tmp_path, monkeypatch):
    # Two ranks of a host clean the same dead directories: here the other rank runs its whole cleanup
    # while this one is between its checks of the first directory. Each directory is removed once and
    # counted once over both (a trial's two warnings said 2 + 2 for 3 directories).
    import subprocess
    import sys

    from lightning_ampzero.offload import store

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = store._SWAP_DIR.match(store.swap_dir_name("params", 1))["host"]
    entries = [tmp_path / f"ampzero-params-rank{r}-{host}-{dead.pid}-0123abc{r}" for r in range(3)]
    for entry in entries:
        entry.mkdir()
        (entry / "x.swp").write_bytes(b"\0" * 4096)
    exists, other = store._process_exists, []

    def other_rank_meanwhile(pid):
        if not other:
            monkeypatch.setattr(store, "_process_exists", exists)
            with pytest.warns(UserWarning):
                other.extend(store.remove_dead_swap_dirs(tmp_path))
        return exists(pid)

    monkeypatch.setattr(store, "_process_exists", other_rank_meanwhile)
    mine = store.remove_dead_swap_dirs(tmp_path)
    assert len(mine) + len(other) == 3
    assert sorted(p for p, _ in mine + other) == entries
    assert list(tmp_path.iterdir()) == []


def test_a_dead_swap_directory_another_rank_removes_meanwhile_is_no_error(tmp_path, monkeypatch):
    # Ranks of one host clean the same dead directories at once; one rank's rglob met a directory
    # the other had just removed, and its FileNotFoundError ended the setup (a CI run). (Each rank
    # now walks only what it claimed; a walk that fails still ends nothing.)
    import shutil
    import subprocess
    import sys

    from lightning_ampzero.offload import store

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = store._SWAP_DIR.match(store.swap_dir_name("params", 1))["host"]
    entry = tmp_path / f"ampzero-params-rank1-{host}-{dead.pid}-0123abcd"
    entry.mkdir()
    (entry / "x.swp").write_bytes(b"\0" * 4096)
    walk = Path.rglob

    def removed_meanwhile(self, pattern):
        for found in walk(self, pattern):
            shutil.rmtree(entry)  # the other rank, between two steps of this walk
            yield found
            raise FileNotFoundError(2, "No such file or directory", str(entry))

    monkeypatch.setattr(Path, "rglob", removed_meanwhile)
    with pytest.warns(UserWarning, match="removed 1 swap directory of processes that no longer exist"):
        store.remove_dead_swap_dirs(tmp_path)
    assert not entry.exists()


def test_offload_refuses_a_finetuning_callback_at_setup_and_names_frozen_parameters_it_holds():
    # [Note: what the offloaded optimizer holds] in offload/setup.py (new-user trials with LoRA): a
    # BackboneFinetuning fit stopped at its unfreezing epoch on add_param_group; the frozen parameters
    # in the optimizer cost 12 bytes per element of host memory, silently.
    from lightning.pytorch.callbacks import BackboneFinetuning, LearningRateMonitor

    from lightning_ampzero.offload.setup import close_optimizers, wrap_optimizers

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model[0].requires_grad_(False)
    cfg = OffloadConfig(offload_optimizer="cpu")
    with pytest.raises(ValueError, match=r"BackboneFinetuning adds parameter groups.*requires_grad_\(True\) in a callback"):
        wrap_optimizers([torch.optim.AdamW(model[1].parameters())], cfg, nvme_dir=None, rank=0,
                        callbacks=[LearningRateMonitor(), BackboneFinetuning()])
    said: list[str] = []
    wrapped = wrap_optimizers([torch.optim.AdamW(model.parameters())], cfg, nvme_dir=None, rank=0,
                              callbacks=[LearningRateMonitor()], warn=said.append)
    assert len(said) == 1 and "holds 72 elements of frozen parameters" in said[0] and "(0.8 KiB of host memory" in said[0], said
    close_optimizers(wrapped)
    said.clear()
    told: list[str] = []
    wrapped = wrap_optimizers([torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)], cfg,
                              nvme_dir=None, rank=0, warn=said.append, info=told.append)
    assert said == []  # only the trainable ones: nothing to say
    # but the swap itself is said (a new-user trial found trainer.optimizers holding another class, unannounced)
    assert len(told) == 1 and "trainer.optimizers holds OffloadedAdam(AdamW" in told[0] and "your AdamW" in told[0], told
    assert "your AdamW on the host and runs its step on the host" in told[0], told
    assert wrap_optimizers(wrapped, cfg, nvme_dir=None, rank=0, info=told.append) == wrapped and len(told) == 1
    close_optimizers(wrapped)


class _AdamBoring(BoringModel):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize(("own_folder", "new_root"), [(False, False), (False, True), (True, False)])
def test_nvme_folder_after_fit(tmp_path, own_folder, new_root):
    """A plain Trainer run of the NVMe preset leaves no empty ``ampzero_nvme/`` behind (a new-user trial
    found one in the working directory), nor the ``default_root_dir`` made for it (another trial found
    that), and a folder the user named or that was there stays, whatever it holds."""
    import lightning.pytorch as pl

    from lightning_ampzero.strategy import AmpZeroStrategy

    mine = tmp_path / "mine"
    mine.mkdir()
    root = tmp_path / "runs" / "exp1" if new_root else tmp_path
    strategy = (AmpZeroStrategy(stage=3, offload_optimizer="nvme", offload_param="nvme", nvme_path=str(mine))
                if own_folder else "ampzero_stage_3_offload_nvme")
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, default_root_dir=root,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_AdamBoring())
    assert trainer.global_step == 2
    assert not (root / "ampzero_nvme").exists() and not (tmp_path / "runs").exists()
    assert tmp_path.is_dir()
    assert mine.is_dir() and list(mine.iterdir()) == []


def test_a_swap_file_one_rank_cannot_create_is_said_on_every_rank(tmp_path):
    # [Note: a swap setup that fails on one rank] in offload/setup.py: two ranks sharing a drive too
    # small for both, and the rank that failed second was the only one told why; the other met a
    # closed connection in its next collective (gloo's and the TCP store's stack dumps, a trial).
    import json

    from _scripts import run_script

    run_script("swap_fails_on_one_rank.py", "--out", str(tmp_path / "said"), "--nvme", str(tmp_path), "--rank", "1",
               timeout=300)
    said = [json.loads((tmp_path / f"said.{rank}.json").read_text()) for rank in (0, 1)]
    errors = [s["error"] for s in said]
    assert errors[0] == errors[1], errors  # the same words on both ranks
    assert errors[0]["type"] == "NvmeOffloadError"
    assert errors[0]["message"].startswith("rank 1 could not set up its swap files: offload.offload_param='nvme':"
                                           " creating the swap file"), errors[0]
    assert "out of space" in errors[0]["message"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("ampzero-")]  # no swap directory left behind


def test_a_swap_setup_decided_together_names_the_failing_rank_and_the_shared_drive():
    from lightning_ampzero.offload.setup import set_up_together
    from lightning_ampzero.offload.store import NvmeOffloadError

    space = "offload.nvme_path='/x' has 36.0 KiB free but the optimizer needs 489.0 KiB for this rank."
    # This rank succeeded and rank 1 ran out of space: this rank raises rank 1's message, and the
    # note that the node's ranks share the drive (the free space was what the others left).
    with pytest.raises(NvmeOffloadError) as caught:
        set_up_together(lambda: "made", gather=lambda mine: [mine, space], ranks_on_node=2)
    assert str(caught.value).startswith(f"rank 1 could not set up its swap files: {space} The 2 ranks of a node")
    # Every rank succeeded: the step's result.
    assert set_up_together(lambda: "made", gather=lambda mine: [mine, None], ranks_on_node=2) == "made"

    # One process: its own exception, unchanged.
    def fails():
        raise NvmeOffloadError(space)

    with pytest.raises(NvmeOffloadError) as caught:
        set_up_together(fails, gather=None, ranks_on_node=1)
    assert str(caught.value) == space
    # An error of another kind (a config's, the same on every rank) keeps its type on the rank it came from.
    def refused():
        raise ValueError("a config problem")

    with pytest.raises(ValueError, match="a config problem"):
        set_up_together(refused, gather=lambda mine: [mine, mine], ranks_on_node=2)
