"""The benchmark harness (benchmarks/run.py) on a tiny configuration: it runs, its JSON has the
documented schema, and the parity / formula columns are computed and hold for ampzero.

DeepSpeed is a benchmark-only extra: without it the harness skips its configurations (checked
here too); with it, the DeepSpeed run is checked like the others.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from _scripts import ROOT, script_env

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_benchmark_harness_smoke(tmp_path):
    # Guarded against a baseline where ampzero was 10x faster than raw FSDP2: the regression guard
    # must fail the run (exit 1) naming that ratio, and still write this run's results.
    baseline = tmp_path / "baseline" / "smoke.json"
    baseline.parent.mkdir()
    baseline.write_text(json.dumps({"ratios": {"ampzero/s2/32-true vs_fsdp2": {
        "config": "ampzero/s2/32-true", "kind": "vs_fsdp2", "median": 0.1}}}))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--suite", "smoke", "--out", str(tmp_path),
           "--stem", "smoke", "--timeout", "240", "--guard", str(baseline)]
    if not HAVE_MATPLOTLIB:
        cmd.append("--no-plots")
    proc = subprocess.run(cmd, env=script_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ampzero/s2/32-true vs_fsdp2" in proc.stdout and "REGRESSED" in proc.stdout
    assert "1 regression(s)" in proc.stdout
    result = json.loads((tmp_path / "smoke.json").read_text())

    # provenance: machine, date, versions
    env = result["environment"]
    assert env["date"] and env["machine"]["cores"] >= 1
    assert env["versions"]["torch"] and env["versions"]["lightning_ampzero"]
    assert result["workload"]["world"] == 2 and result["repetitions"] == 1

    configs = result["configs"]
    expected = {"ddp/s0/32-true", "ampzero/s2/32-true", "fsdp2/s2/32-true"}
    if HAVE_DEEPSPEED:
        expected.add("deepspeed/s2/32-true")
    else:
        assert result["skipped_without_deepspeed"] == ["deepspeed/s2/32-true"]
    assert set(configs) == expected
    w = result["workload"]
    for name, e in configs.items():
        assert e["status"] == "ok", (name, e.get("message"), e.get("traceback"))
        assert e["step_ms"]["min"] <= e["step_ms"]["median"] <= e["step_ms"]["max"]
        assert e["step_ms"]["n_steps"] == w["steps"]
        assert e["tokens_per_s"] > 0 and e["cpu_ms"]["median"] > 0
        assert 0 < e["mfu"] < 1 and e["gemm_peak_flops"] > 0
        assert e["mfu"] == e["tokens_per_s"] * result["model_flops_per_token"] / e["gemm_peak_flops"]
        assert e["peak_rss"]["max_rank"] > 0 and len(e["peak_rss"]["per_rank"]) == 2
        assert len(e["losses"]) == w["warmup"] + w["steps"] + 1
        assert e["numel"] == result["numel"]
        ms, comm = e["model_state"], e["comm"]
        assert set(ms["measured"]) == set(ms["formula"]) == {"params", "grads", "optimizer", "total"}
        assert comm["elements"] > 0 and comm["formula_elements"] > 0 and comm["calls"] > 0
        assert not comm["unparsed_ops"]
        if name != "ddp/s0/32-true":  # the parity reference itself
            assert e["parity"]["reference"] == "ddp/s0/32-true"
            assert e["parity"]["ok"], (name, e["parity"])

    # ampzero and raw FSDP2 (the same units) meet the formulas; DDP's all-reduce is 2 Ψ
    for name in ("ampzero/s2/32-true", "fsdp2/s2/32-true"):
        ms, comm = configs[name]["model_state"], configs[name]["comm"]
        for cat in ("params", "grads", "optimizer"):
            assert abs(ms["ratio"][cat] - 1) <= 0.05, (name, cat, ms)
        assert abs(comm["ratio"] - 1) <= 0.10, (name, comm)
    assert configs["ddp/s0/32-true"]["comm"]["elements"] == 2 * result["numel"]

    # ratios measured in the same run, and the targets computed from them
    ratio = result["ratios"]["ampzero/s2/32-true vs_fsdp2"]
    assert ratio["denominator"] == "fsdp2/s2/32-true" and len(ratio["per_rep"]) == 1 and ratio["median"] > 0
    assert ("ampzero/s2/32-true vs_deepspeed" in result["ratios"]) == HAVE_DEEPSPEED
    kinds = " ".join(t["target"] for t in result["targets"])
    assert "model-state bytes ampzero/s2/32-true" in kinds and "communicated elements ampzero/s2/32-true" in kinds
    assert "step time ampzero/s2/32-true / fsdp2" in kinds
    # issue 16's bar for stages 1-3 is bare DDP in the same launch, with its stage's limit
    to_ddp = result["ratios"]["ampzero/s2/32-true vs_ddp"]
    assert to_ddp["denominator"] == "ddp/s0/32-true" and to_ddp["median"] > 0
    row = next(t for t in result["targets"] if t["target"].startswith("step time ampzero/s2/32-true / ddp"))
    assert row["limit"] == 1.05 and row["met"] == (to_ddp["median"] <= 1.05)

    md = (tmp_path / "smoke.md").read_text()
    assert "## Targets" in md and "fsdp2/s2/32-true" in md and env["versions"]["torch"] in md
    assert (tmp_path / "smoke_summary.md").read_text().startswith("| stage |")
    if HAVE_MATPLOTLIB:
        assert (tmp_path / "smoke_step_time.png").stat().st_size > 0


def test_regression_guard_compares_same_launch_ratios():
    from benchmarks.suite import guard

    def ratios(**medians):
        return {"ratios": {f"{c} {k}": {"config": c, "kind": k, "median": m}
                           for (c, k), m in ((tuple(key.split("__")), v) for key, v in medians.items())}}

    base = ratios(**{"ampzero/s1/32-true__vs_fsdp2": 1.00, "ampzero/s2/32-true__vs_fsdp2": 1.20,
                     "ampzero/s3/32-true__vs_deepspeed": 1.0, "lightning_ddp/s0/32-true__vs_ddp": 1.0})
    now = ratios(**{"ampzero/s1/32-true__vs_fsdp2": 1.16, "ampzero/s2/32-true__vs_fsdp2": 1.30,
                    "lightning_ddp/s0/32-true__vs_ddp": 2.0})
    verdict = guard.compare(now, base)
    assert [r["ratio"] for r in verdict["regressions"]] == ["ampzero/s1/32-true vs_fsdp2"]  # +16% > 15%
    assert [r["ratio"] for r in verdict["checked"]] == ["ampzero/s1/32-true vs_fsdp2", "ampzero/s2/32-true vs_fsdp2"]
    assert verdict["unmatched"] == [{"ratio": "ampzero/s3/32-true vs_deepspeed", "in": "the baseline"}]
    # A loss-parity target met in the baseline and missed now is a regression too.
    base["targets"] = [{"target": "loss parity ampzero/s2/32-true vs ddp", "met": True, "value": 0, "limit": 1e-4}]
    now["targets"] = [{"target": "loss parity ampzero/s2/32-true vs ddp", "met": False, "value": 1e-3, "limit": 1e-4}]
    assert len(guard.compare(now, base)["regressions"]) == 2
    assert "2 regression(s)" in guard.render(guard.compare(now, base), "b.json")


def test_regression_guard_needs_wall_and_cpu_time_unless_wall_time_doubles_the_tolerance():
    from benchmarks.suite import guard

    def run(**pairs):  # name -> (wall-time median, CPU-time median)
        return {"ratios": {f"ampzero/{n}/32-true vs_ddp": {"config": f"ampzero/{n}/32-true", "kind": "vs_ddp",
                                                           "median": w, "cpu": {"median": c}}
                           for n, (w, c) in pairs.items()}}

    base = run(s1=(1.0, 1.0), s2=(1.0, 1.0), s3=(1.0, 1.0), s0=(1.0, 1.0))
    now = run(s1=(1.20, 1.02),   # wall time only, within twice the tolerance: another job's noise
              s2=(1.20, 1.20),   # both: more work per step
              s3=(1.31, 1.00),   # wall time alone, past twice the tolerance: more waiting
              s0=(1.10, 1.40))   # CPU time alone: not slower for the user
    verdict = guard.compare(now, base)
    assert sorted(r["ratio"] for r in verdict["regressions"]) == ["ampzero/s2/32-true vs_ddp",
                                                                   "ampzero/s3/32-true vs_ddp"]
    assert "CPU +20.0%" in guard.render(verdict, "b.json")


def test_flat_zero_prototype_computes_what_ddp_computes():
    # benchmarks/flat_zero_ceiling.py compares step times; they mean something only while the
    # prototype trains as DDP does: its losses over the run equal bare DDP's (and raw FSDP2's, and
    # those of torch's ZeroRedundancyOptimizer over DDP, whose groups the script rebuilds by hand).
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(ROOT / "benchmarks" / "flat_zero_ceiling.py"), "--reps", "1", "--steps", "3",
         "--systems", "ddp,fsdp2,flat,zro"],
        env=script_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if "loss max rel. diff from ddp" in line}
    assert set(rows) == {"ddp", "fsdp2", "flat", "zro"}, proc.stdout
    assert all(row.endswith("from ddp 0.0e+00") for row in rows.values()), proc.stdout
