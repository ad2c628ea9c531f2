"""ZeRO-Infinity parameter offload (issue 15): stage-3 parameter shards in swap files.

* 2 CPU ranks, our own loop (tests/_spawn.py): swapped parameters train exactly as resident ones,
  on 2 ranks and on 1 (FSDP2 copies the shards in at another point there); the I/O per step is
  the estimator's; checkpoints read and write the real values; every failure of the swap file
  (disk full mid-step, deleted, truncated) stops the run with the file named.
* peak RSS (acceptance 3): falls with param_buffer_count / param_buffer_size, within 10% of the
  estimator's figure.
* Lightning (tests/scripts/offload.py, acceptance 1): 30 fp32 steps with parameters and optimizer
  on NVMe against no offload, and resume, with another nvme_path, from a checkpoint.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _scripts import run_json
from _spawn import spawn
from lightning_ampzero.config import AmpZeroConfig, OffloadConfig, ZeroConfig
from lightning_ampzero.offload import NvmeOffloadError

STEPS = 30


# ---- our own loop on spawned ranks --------------------------------------------------------------
def _blocks(width: int, depth: int, hidden: int) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)) for _ in range(depth)]
    return nn.Sequential(*layers, nn.Linear(width, 5))


def _setup(rank: int, world: int, root: str, *, swap: bool, width: int = 32, depth: int = 4, hidden: int = 64,
           unit: float = 3000, prefetch: float = 5000, opt: str = "nvme", param_buffer_count: int = 3,
           param_buffer_size: float = 3000, sub_group_size: float = 500, buffer_count: int = 6):
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ampzero.offload import OffloadedAdam
    from lightning_ampzero.offload.params import apply_param_offload
    from lightning_ampzero.zero.apply import apply_zero

    model = _blocks(width, depth, hidden)
    zero = ZeroConfig(stage=3, reduce_bucket_size=unit, allgather_bucket_size=unit, param_persistence_threshold=0,
                      prefetch_bucket_size=prefetch)
    apply_zero(model, init_device_mesh("cpu", (world,)), zero)
    swapper = None
    if swap:
        swapper = apply_param_offload(model, Path(root), buffer_count=param_buffer_count, buffer_size=param_buffer_size,
                                      io_threads=2, pin=False, rank=rank)
    extra = {"nvme_path": root} if opt == "nvme" else {}
    cfg = OffloadConfig(offload_optimizer=opt, sub_group_size=sub_group_size, buffer_count=buffer_count, **extra)
    opt = OffloadedAdam(torch.optim.AdamW(model.parameters(), lr=1e-2), cfg, nvme_dir=Path(root), rank=rank,
                        params=swapper)
    return model, opt, swapper, zero


def _step(model, opt, g: torch.Generator, width: int = 32, batch: int = 8) -> float:
    loss = model(torch.randn(batch, width, generator=g)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _local_params(model) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def _train(rank: int, world: int, root: str, swap: bool, steps: int) -> dict:
    model, opt, swapper, zero = _setup(rank, world, root, swap=swap)
    g = torch.Generator().manual_seed(rank)
    losses = [_step(model, opt, g)]
    store_io = opt.store.bytes_read, opt.store.bytes_written
    losses += [_step(model, opt, g) for _ in range(steps - 1)]
    out = {"losses": losses, "params": _local_params(model),
           # the optimizer's swap files per step (steps 2..n): its masters and moments, each way
           "opt_io": [(b - a) / (steps - 1) for a, b in zip(store_io, (opt.store.bytes_read, opt.store.bytes_written))]}
    if swapper is not None:
        from lightning_ampzero.estimate import model_size, nvme_traffic

        size = model_size(_blocks(32, 4, 64), zero)
        out.update(read=swapper.bytes_read, written=swapper.bytes_written, file_bytes=swapper.file_bytes,
                   numel=swapper.numel, segments=[len(u.segments) for u in swapper.units],
                   padded=[sum(e.nbytes for e in u.entries) for u in swapper.units],
                   peak_buffers=swapper.peak_buffers_in_use, buffer_count=swapper.buffer_count,
                   traffic=nvme_traffic(size, "params+optimizer=nvme", world, zero),
                   left=sorted(p.name for p in Path(root).iterdir()))
        swapper.unlink()
        out["left_after_unlink"] = sorted(p.name for p in Path(root).glob(f"ampzero-params-rank{rank}-*"))
        out["after_unlink"] = _step(model, opt, g)  # the model keeps working on the unlinked file
        swapper.remap()  # what a checkpoint or an export after fit runs: the file is reached by its descriptor
        out["after_remap"] = _step(model, opt, g)
    opt.close()
    return out


@pytest.mark.parametrize("world", [2, 1])
def test_swapped_parameters_train_exactly_as_resident_ones(world, tmp_path):
    steps = 6
    ref = spawn(_train, world, (str(tmp_path), False, steps), timeout=120)
    got = spawn(_train, world, (str(tmp_path), True, steps), timeout=120)
    for r, g in zip(ref, got):
        assert g["losses"] == r["losses"]  # bit for bit: same arithmetic, other memory
        assert all(torch.equal(a, b) for a, b in zip(g["params"], r["params"]))
        # A unit's shards are read for its forward all-gather and again for backward's (8 blocks'
        # Linear units + the root, every one resharded after forward), once each: what the
        # estimator counts, plus the padding FSDP2 adds to uneven shards; and once at setup, the
        # real elements the optimizer reads for its fp32 masters.
        per_step = 2 * sum(g["padded"])
        assert g["read"] == 4 * g["numel"] + steps * per_step
        est_read, est_written = g["traffic"]
        opt_bytes = 12 * sum(p.numel() for p in g["params"])
        # within the padding of uneven dim-0 splits (at most a row per parameter), which Ψ/N omits
        assert abs((est_read - opt_bytes) - per_step) <= 4 * 8 * world * 9
        # written: the initial shards (padded), then each step's update of the real elements
        assert g["written"] == sum(g["padded"]) + steps * 4 * g["numel"]
        assert g["opt_io"] == [opt_bytes, opt_bytes]  # every master and moment read and written once
        assert g["peak_buffers"] <= g["buffer_count"] == 3
        assert g["after_unlink"] > 0 and g["left_after_unlink"] == [] and g["after_remap"] > 0
    # The estimator's per-rank figures are Ψ/N formulas (ceil-divided): the mean over the ranks,
    # whose shards differ by FSDP2's dim-0 split of each parameter (here rank 0 holds 3 of the
    # head's 5 rows). Bytes written per step, parameters and optimizer, exactly that mean.
    numel = sum(g["numel"] for g in got)
    assert numel == sum(p.numel() for p in _blocks(32, 4, 64).parameters())  # each element on one rank
    measured = sum(4 * g["numel"] + g["opt_io"][1] for g in got) / world
    assert got[0]["traffic"][1] == pytest.approx(measured, abs=16)  # ceil(Ψ/N) rounding: < 1 element
    if world > 1:
        assert got[0]["numel"] != got[1]["numel"]  # the uneven split is really exercised
    assert any(name.startswith("ampzero-params-rank") for name in got[0]["left"])


def _checkpoint(rank: int, world: int, root: str) -> dict:
    """State dicts and DCP see the real values of swapped parameters, and a load writes them into the file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model, opt, swapper, _ = _setup(rank, world, root, swap=True)
    ref_model, ref_opt, _, _ = _setup(rank, world, root, swap=False)
    g, h = torch.Generator().manual_seed(rank), torch.Generator().manual_seed(rank)
    for _ in range(3):
        _step(model, opt, g)
        _step(ref_model, ref_opt, h)
    sd, ref_sd = get_model_state_dict(model), get_model_state_dict(ref_model)
    same_state = all(torch.equal(sd[k].to_local(), ref_sd[k].to_local()) for k in ref_sd)
    ckpt = Path(root) / "ckpt"
    dcp.save(sd, checkpoint_id=ckpt)
    swapper.remap()
    after_save = _step(model, opt, g), _step(ref_model, ref_opt, h)
    # Load the checkpoint back into the swapped model (written through the map into the file),
    # and into the reference; both continue alike.
    for m in (model, ref_model):
        state = get_model_state_dict(m)
        dcp.load(state, checkpoint_id=ckpt)
        set_model_state_dict(m, state)
    swapper.remap()
    opt.load_state_dict(opt.state_dict())  # masters re-read from the parameters (the file)
    ref_opt.load_state_dict(ref_opt.state_dict())
    after_load = [(_step(model, opt, g), _step(ref_model, ref_opt, h)) for _ in range(2)]
    return {"same_state": same_state, "after_save": after_save, "after_load": after_load}


def test_state_dict_and_checkpoints_see_the_real_values(tmp_path):
    for r in spawn(_checkpoint, 2, (str(tmp_path),), timeout=120):
        assert r["same_state"]
        assert r["after_save"][0] == r["after_save"][1]
        assert all(a == b for a, b in r["after_load"]), r["after_load"]


def _failures(rank: int, world: int, root: str, fault: str) -> dict:
    import resource
    import signal

    model, opt, swapper, _ = _setup(rank, world, root, swap=True, opt="cpu" if fault == "full" else "nvme")
    g = torch.Generator().manual_seed(rank)
    _step(model, opt, g)
    path = str(swapper.path)
    if fault == "deleted":
        os.unlink(path)
    elif fault == "truncated":
        os.truncate(path, 4096)
    elif fault == "optimizer_file_deleted":
        os.unlink(next(opt.store.dir.glob("group0_master.swp")))
    out = {"path": path, "dir": str(swapper.dir)}
    errors = []
    for _ in range(2):  # the failure, then the refusal to go on
        try:
            if fault == "full":
                # Writes past the first 4 KiB of any file fail with EFBIG, as on a full disk.
                old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
                resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
                try:
                    _step(model, opt, g)
                finally:
                    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
                    signal.signal(signal.SIGXFSZ, old)
            else:
                _step(model, opt, g)
            errors.append("NO ERROR")
        except NvmeOffloadError as e:
            errors.append(str(e))
    out["errors"] = errors
    out["dir_left"] = os.path.exists(out["dir"])
    dist.barrier()
    return out


@pytest.mark.parametrize("fault", ["full", "deleted", "truncated", "optimizer_file_deleted"])
def test_swap_file_failures_stop_the_run_naming_the_file(fault, tmp_path):
    for r in spawn(_failures, 2, (str(tmp_path), fault), timeout=120):
        first, second = r["errors"]
        if fault == "optimizer_file_deleted":
            assert "group0_master.swp was deleted while the job ran" in first and "has been deleted" in first
            continue
        assert r["path"] in first, first
        assert {"full": "out of space", "deleted": "was deleted while the job ran",
                "truncated": "was truncated to 4,096 bytes"}[fault] in first, first
        assert "Resume from the last checkpoint" in first and "Nothing else is lost" in first
        assert second == first  # refused from then on, with the same reason
        assert not r["dir_left"]  # nothing half-updated is kept as if valid


def _too_small(rank: int, world: int, root: str, count: int, size: float) -> str:
    try:
        _setup(rank, world, root, swap=True, param_buffer_count=count, param_buffer_size=size)
    except ValueError as e:
        return str(e)
    return "NO ERROR"


def test_buffers_too_small_are_refused_with_the_size_needed(tmp_path):
    # The largest shard on a rank is Linear(32, 64)'s weight: 32 x 64 / 2 = 1024 elements.
    msg = spawn(_too_small, 2, (str(tmp_path), 3, 1000), timeout=60)[0]
    assert "has 1,024 elements, more than offload.param_buffer_size=1,000" in msg and ">= 1,024" in msg
    # 1100 elements: each weight shard fits a buffer alone, so a block's unit needs 2 (and the root more).
    msg = spawn(_too_small, 2, (str(tmp_path), 1, 1100), timeout=60)[0]
    assert "needs 2 buffers" in msg and "param_buffer_count=1" in msg
    assert not list(tmp_path.glob("ampzero-params-*"))


# ---- peak RSS against the estimator (acceptance 3) ----------------------------------------------
RSS_WIDTH, RSS_HIDDEN, RSS_DEPTH, RSS_TILE = 1024, 2048, 8, 1 << 18


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _rss(rank: int, world: int, root: str, swap: bool, count: int, size: float) -> dict:
    from lightning_ampzero.estimate import estimate, model_size

    # One block (a Sequential of two Linears) per unit; the head is a unit of its own, not
    # packed into the last block's (which would need a third buffer).
    unit = 2 * RSS_WIDTH * RSS_HIDDEN + RSS_WIDTH + RSS_HIDDEN
    # The baseline is taken after one step of a small model with the same settings: the first
    # fully_shard and step import and initialise about 100 MiB of libraries (measured: torch's
    # compile stack, gloo's buffers), which are no part of the model's memory.
    warm_model, warm_opt, _, _ = _setup(rank, world, root, swap=swap)
    _step(warm_model, warm_opt, torch.Generator().manual_seed(rank))
    warm_opt.close()
    del warm_model, warm_opt
    gc.collect()
    dist.barrier()
    before = _status_kib("VmRSS")
    model, opt, swapper, zero = _setup(rank, world, root, swap=swap, width=RSS_WIDTH, depth=RSS_DEPTH,
                                       hidden=RSS_HIDDEN, unit=unit, prefetch=unit, param_buffer_count=count,
                                       param_buffer_size=size, sub_group_size=RSS_TILE, buffer_count=3)
    g = torch.Generator().manual_seed(rank)
    _step(model, opt, g, RSS_WIDTH, 4)  # records the all-gather order
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: set-up's transients excluded
    for _ in range(2):
        _step(model, opt, g, RSS_WIDTH, 4)
    peak = _status_kib("VmHWM")
    # offload_grad="none": this loop keeps gradients in memory (tests/test_grad_offload.py swaps them)
    cfg = OffloadConfig(offload_optimizer="nvme", offload_param="nvme" if swap else "none", buffer_count=3,
                        sub_group_size=RSS_TILE, offload_grad="none",
                        **({"param_buffer_count": count, "param_buffer_size": size} if swap else {}))
    size_ = model_size(_blocks(RSS_WIDTH, RSS_DEPTH, RSS_HIDDEN), zero)
    est = estimate(size_, 3, "params+optimizer=nvme" if swap else "optimizer=nvme", gpus_per_node=world, zero=zero,
                   buffers=cfg)
    # accelerator="cpu": the "GPU" figures are host memory too (cpu is per node: world ranks). The
    # estimator's host copy of the fp32 gradient shard that the offloaded step reads (a copy from
    # the accelerator) is, on this accelerator, the gradient shard it already counts in gpu_grads
    # (with parameters offloaded gpu_grads is 0 and the host copy is the only one).
    figure = est.gpu + est.cpu // world - est.gpu_grads
    out = {"grown": (peak - before) * 1024, "estimate": figure, "working": est.gpu_working,
           "pool": swapper.resident_bytes() if swapper else 0}
    opt.close()
    dist.barrier()
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to measure peak RSS")
def test_peak_rss_falls_with_the_buffers_within_10_percent_of_the_estimate(monkeypatch, tmp_path):
    # Large tensors get their own mmap, so freed memory leaves the RSS at once (glibc would
    # otherwise raise its mmap threshold and keep freed blocks in the heap).
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 16))
    shard = (2 * RSS_WIDTH * RSS_HIDDEN + RSS_WIDTH + RSS_HIDDEN) // 2  # one block's shard per rank
    configs = [("resident", False, 5, 1e8), ("8 x unit", True, 8, shard), ("2 x unit", True, 2, shard),
               ("2 x half unit", True, 2, shard // 2 + RSS_WIDTH)]
    results = {}
    for name, swap, count, size in configs:
        results[name] = spawn(_rss, 2, (str(tmp_path), swap, count, size), timeout=300)
    lines = []
    for name, ranks in results.items():
        for r in ranks:
            lines.append(f"{name}: grew {r['grown'] / 2**20:.1f} MiB, estimate {r['estimate'] / 2**20:.1f} MiB")
            assert abs(r["grown"] - r["estimate"]) <= 0.1 * r["estimate"], lines
    print("\n".join(lines))
    grown = [max(r["grown"] for r in results[name]) for name, *_ in configs]
    # Parameters swapped with buffers for the whole shard cost what resident parameters cost;
    # every smaller pool costs less, by about what it saves.
    assert grown[1] > grown[2] > grown[3] and grown[0] > grown[2]
    saved = results["8 x unit"][0]["pool"] - results["2 x unit"][0]["pool"]
    assert grown[1] - grown[2] == pytest.approx(saved, rel=0.25)


# ---- Lightning (acceptance 1) --------------------------------------------------------------------
def test_lightning_infinity_parity_with_no_offload(tmp_path):
    """30 fp32 steps on 2 ranks, stage 3: parameters and optimizer state on NVMe against no offload,
    and ``offload_param='cpu'`` on this CPU accelerator (tmpfs)."""
    configs = ["3:none:none", "3:nvme:none", "3:infinity:none", "3:tmpfs:none"]
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    r = run_json("offload.py", tmp_path / "parity.json", "--mode", "parity", "--configs", ",".join(configs),
                 "--steps", str(STEPS), "--nvme-dir", str(nvme), timeout=600)
    assert r.pop("_leftover_swap_dirs") == []  # teardown removed every rank's swap files
    reference = r["3:none:none"]["losses"]
    assert reference[-1] < reference[0] - 0.5  # it trains
    for cfg in ("3:infinity:none", "3:tmpfs:none"):
        losses, report = r[cfg]["losses"], r[cfg]["report"]
        assert len(losses) == STEPS
        assert max(abs(a - b) for a, b in zip(losses, reference)) <= 1e-6, cfg
        params = report["params"]
        assert params["steps"] == STEPS and params["segments"] > params["units"]  # a unit spanning buffers
        assert params["peak_buffers_in_use"] <= params["buffer_count"] == (4 if cfg == "3:infinity:none" else 5)
        # every shard read at least once per step, written once per step (and once at setup)
        assert params["bytes_read"] >= STEPS * 4 * params["numel"]
        assert (STEPS + 1) * 4 * params["numel"] <= params["bytes_written"] <= (STEPS + 1) * params["file_bytes"]
    # Parameters on NVMe change nothing in the arithmetic of the optimizer on NVMe.
    assert r["3:infinity:none"]["losses"] == r["3:nvme:none"]["losses"]
    assert r["3:tmpfs:none"]["report"]["params"]["file"].startswith("/dev/shm/")


def test_lightning_infinity_resume_continues_the_trajectory(tmp_path):
    """Checkpoint after epoch 0, resume in a new Trainer swapping to another directory: epoch 1
    repeats the uninterrupted losses. ``infinity:none``: the checkpoint holds the values, not the
    swap files; ``none:infinity``: a checkpoint without offload resumes with it."""
    configs = ["3:infinity:infinity", "3:infinity:none", "3:none:infinity"]
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    r = run_json("offload.py", tmp_path / "resume.json", "--mode", "resume", "--configs", ",".join(configs),
                 "--nvme-dir", str(nvme), timeout=600)
    assert r.pop("_leftover_swap_dirs") == []
    for cfg in configs:
        n = r[cfg]["steps_per_epoch"]
        assert r[cfg]["resumed"] == r[cfg]["full"][n:], cfg


# ---- configuration -------------------------------------------------------------------------------
@pytest.mark.parametrize(("data", "match"), [
    ({"offload": {"offload_param": "nvme"}, "zero": {"stage": 3}}, "needs offload_optimizer='cpu' or 'nvme'"),
    ({"offload": {"offload_param": "nvme", "offload_optimizer": "cpu"}, "zero": {"stage": 2}}, "needs zero.stage=3"),
    ({"offload": {"param_buffer_count": 2}}, "only swapped parameters use it"),
    ({"offload": {"offload_param": "nvme", "offload_optimizer": "cpu", "param_buffer_size": 0}},
     "param_buffer_size must be >= 1"),
    ({"offload": {"offload_optimizer": "cpu", "nvme_path": "/tmp"}}, "neither .* is 'nvme'"),
])
def test_config_validation(data, match):
    with pytest.raises(ValueError, match=match):
        AmpZeroConfig.from_dict(data)


def test_config_accepts_parameters_on_nvme():
    cfg = AmpZeroConfig.from_dict({"zero": {"stage": 3}, "offload": {
        "offload_param": "nvme", "offload_optimizer": "cpu", "nvme_path": "/tmp", "param_buffer_count": 2,
        "param_buffer_size": 1e6}})
    assert (cfg.offload.param_buffer_count, cfg.offload.param_buffer_size, cfg.offload.nvme_path) == (2, 1e6, "/tmp")


def test_policy_and_swapping_per_accelerator():
    from torch.distributed.fsdp import CPUOffloadPolicy

    from lightning_ampzero.offload.setup import param_init_device, param_offload_policy, swaps_parameters

    nvme = OffloadConfig(offload_param="nvme", offload_optimizer="nvme")
    cpu = OffloadConfig(offload_param="cpu", offload_optimizer="cpu")
    cuda, host = torch.device("cuda", 0), torch.device("cpu")
    assert swaps_parameters(nvme, cuda) and swaps_parameters(nvme, host) and swaps_parameters(cpu, host)
    assert not swaps_parameters(cpu, cuda)
    # On an accelerator NVMe shards go through host memory (FSDP2's CPU offload), unpinned by FSDP2:
    # pinning would copy whole shards when a checkpoint loads; our buffers are pinned instead.
    policy = param_offload_policy(nvme, cuda, print)
    assert isinstance(policy, CPUOffloadPolicy) and policy.pin_memory is False
    assert param_offload_policy(cpu, cuda, print).pin_memory is True
    assert param_offload_policy(nvme, host, print) is None and param_offload_policy(cpu, host, print) is None
    assert param_init_device(nvme, cuda) == host and param_init_device(nvme, host) == host


# ---- the scale benchmark (acceptance 2), on a tiny model ------------------------------------------
@pytest.mark.slow
def test_infinity_benchmark_smoke(tmp_path):
    """benchmarks/bench_infinity.py end to end on a tiny GPT: it trains (the loss falls on its fixed
    batch), and its measured swap-file bytes per step are the estimator's (rank 0 holds the
    ceil-divided rows, so it is at least the estimate and within a row per parameter of it)."""
    import json
    import subprocess
    import sys

    from _scripts import ROOT, script_env

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_infinity.py"), "--nvme-dir", str(nvme), "--n-layer", "2",
           "--n-embd", "64", "--n-head", "4", "--steps", "4", "--lr", "3e-3", "--disk-probe", str(16 << 20),
           "--sub-group-size", "20000", "--out", str(out)]
    proc = subprocess.run(cmd, env=script_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.with_suffix(".json").read_text())
    losses = r["losses"]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert len(r["io_per_step_rank0"]) == 3  # steps 2..4
    for step in r["io_per_step_rank0"]:
        for key in ("read", "written"):
            est = r["estimate_io_per_rank"][key]
            assert est <= step[key] <= est * 1.02, (key, step, est)
    assert r["io_lower_bound_s"] > 0 and r["compute_lower_bound_s"] > 0
    assert all(peak > before for peak, before in zip(r["peak_rss_per_rank_GiB"], r["rss_before_model_GiB"]))
    assert list(nvme.iterdir()) == []  # the swap files were deleted at teardown
    assert out.with_suffix(".md").read_text().startswith("# ZeRO-Infinity on CPU")
