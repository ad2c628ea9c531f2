"""The benchmark suite in one command: ampzero against DeepSpeed, raw FSDP2 and DDP, side by side.

    python benchmarks/run.py            # full CPU suite (about 6 minutes on 2 cores; 10 with --reps 5)
    python benchmarks/run.py --quick    # smaller model, fewer configurations (under 3 minutes), then
                                        # the regression guard: exit 1 when a ratio's wall and CPU time are both
                                        # >15% worse (or its wall time alone >30%) than the
                                        # committed results/cpu_quick.json
    python benchmarks/run.py --gpu      # single-GPU suite (needs CUDA; see benchmarks/suite/gpu.py)

Writes ``benchmarks/results/cpu.{json,md}``, ``cpu_summary.md`` and ``cpu_*.png`` (``cpu_quick*``
for --quick), stating machine, date and versions. What is measured and how: benchmarks/README.md.

DeepSpeed is a benchmark-only reference, never a dependency of lightning_ampzero: install the
``bench`` extra (``pip install -e '.[bench]'``) or point ``--python`` at an interpreter that has
it (e.g. a venv made with ``--system-site-packages``). Without it the DeepSpeed configurations
are skipped and the rest runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.suite import report  # noqa: E402
from benchmarks.suite.configs import SUITES, BenchConfig  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

NOTES = [
    "MFU: tokens/s x model FLOPs per token (6 N + 12 L T d, N without the embeddings: lightning_ampzero/flops.py)"
    " / the GEMM peak of all ranks, measured by every rank at once at the start of each launch with the"
    " threads the systems run with (fp32 for 32-true; the faster of bf16 and fp32 for the bf16 precisions);"
    " median over launches.",
    "Every configuration of a repetition runs in the same two torchrun processes, one after the other; the"
    " repetitions are separate launches. Within a repetition the configurations are grouped by (precision,"
    " stage) so that the systems compared run back to back; the order of systems in a group rotates from"
    " one repetition to the next and the order of groups reverses, so no system always runs first or last."
    " A discarded run of the first configuration primes each launch.",
    "Step time: wall time between the starts of consecutive optimizer steps (perf_counter), per rank; a"
    " step counts as the slowest rank's time. Bare loops start a step before fetching its first"
    " micro-batch; Lightning runs at on_train_batch_start of the step's first micro-batch, so Lightning's"
    " per-step bookkeeping is inside the measured time, as users pay it. Median over the timed steps per"
    " repetition; the table gives the median over repetitions [min-max]. tokens/s = global tokens per step"
    " / median step time.",
    "Ratios are computed per repetition (both medians from the same launch) and summarised as median"
    " [min-max] over repetitions. The machine is shared (jobs outside this VM may run at the same time), so"
    " only same-launch ratios are meaningful; absolute milliseconds drift with the load.",
    "Peak RSS: VmHWM per process, reset through /proc/self/clear_refs when the configuration starts and read"
    " when its profiled step starts (so: setup + warm-up + timed steps). Absolute values include the"
    " interpreter with torch, Lightning and DeepSpeed imported in every process alike; 'RSS growth' is"
    " the peak less the RSS at the configuration's start (after gc and malloc_trim).",
    "Model states (ampzero, raw FSDP2, DDP): lightning_ampzero.memory.measure_model_state (storages of"
    " parameters sharded and gathered, gradients, optimizer state, each storage once) sampled after every"
    " forward, after every backward and after the optimizer step of the profiled step; per-category peak,"
    " max over ranks, mapped to the formula's columns with as_zero_categories. Formula: zero_formula"
    " (fp32 parameters and gradients also under bf16-mixed, whose autocast keeps parameters fp32;"
    " bf16-true: the paper's 2+2+12 bytes).",
    "Model states (DeepSpeed): its tensors, found by walking the ZeRO optimizer object (attributes,"
    " lists, dicts), the wrapped torch optimizer's state, and the module's parameters (with .grad and,"
    " stage 3, ds_tensor), each storage once, classified by attribute path (fp32 partitions and optimizer"
    " state -> optimizer, gradient partitions and accumulators -> grads, module parameters -> params); the"
    " reduction buckets (ipg_buckets, allocated with torch.empty(reduce_bucket_size), mostly never"
    " written) are listed apart as virtual. The per-path breakdown is in the JSON (model_state.by_path).",
    "Communication: one profiled step per configuration (torch.profiler, record_shapes) and the c10d"
    " dispatcher ops in its trace (c10d::allreduce_, _allgather_base_, _reduce_scatter_base_, ...), which"
    " every collective passes through, Python or C++ (DDP's reducer) alike; a tensor list's dtype is read"
    " from the gloo work it started. ZeRO accounting per rank: all-reduce of n = 2n, reduce-scatter of an"
    " n-element input = n, all-gather of an n-element output = n. Formula per optimizer step with a"
    " micro-batches: DP and stage 1: 2Ψ; stage 2: (a+1)Ψ (a reduce-scatter per micro-batch + one"
    " all-gather); stage 3: 3aΨ (with a = 1: the paper's 2Ψ, 2Ψ, 2Ψ, 3Ψ). The bytes column shows the"
    " dtypes (bf16-mixed reduces Linear gradients in bf16).",
    "Parity: per-step losses (mean over micro-batches and ranks) against the bare DDP run of the same"
    " precision (bf16-true: against bare DDP bf16-mixed, with a looser tolerance); max relative difference"
    " over all steps. Losses are"
    " bit-identical across repetitions (checked: losses_identical_across_reps in the JSON).",
    "Equivalent configurations: the same AdamW (lr 3e-3, betas 0.9/0.95, weight decay 0.1 on matrices),"
    " no gradient clipping (DeepSpeed 0.19.8 defaults gradient_clipping to 1.0; set to 0), the same bucket"
    " sizes (reduce/all-gather 5e8, stage-3 prefetch 5e7 elements: both systems' defaults) and stage-3"
    " persistence threshold 0 for both (the default 1e5 would keep every unit of this small model"
    " gathered). DeepSpeed gets our AdamW as a client optimizer (zero_allow_untested_optimizer), and"
    " offload runs it on the host (zero_force_ds_cpu_optimizer false; no DeepSpeedCPUAdam build).",
]


def _order(configs: list[BenchConfig], rep: int) -> list[BenchConfig]:
    groups: dict[tuple, list[BenchConfig]] = {}
    for c in configs:
        groups.setdefault((c.precision, c.stage, c.offload or ""), []).append(c)
    blocks = list(groups.values())
    if rep % 2:
        blocks.reverse()
    out: list[BenchConfig] = []
    for block in blocks:
        k = rep % len(block)
        out += block[k:] + block[:k]
    return out


def _has_deepspeed(python: str) -> bool:
    probe = subprocess.run([python, "-c", "import deepspeed"], capture_output=True, env=_env())
    return probe.returncode == 0


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOBAL_RANK", "NODE_RANK"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["PYTHONWARNINGS"] = "ignore"
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_cpu(args: argparse.Namespace) -> list[Path]:
    suite = SUITES["quick" if args.quick else args.suite]()
    configs = list(suite.configs)
    if args.only:
        pattern = re.compile(args.only)
        configs = [c for c in configs if pattern.search(c.name)]
    skipped = []
    if not _has_deepspeed(args.python):
        skipped = [c.name for c in configs if c.system == "deepspeed"]
        configs = [c for c in configs if c.system != "deepspeed"]
        print(f"DeepSpeed is not importable by {args.python}: skipping {len(skipped)} configurations"
              " (pip install -e '.[bench]', or --python a venv that has it).", flush=True)
    if not configs:
        raise SystemExit("no configuration selected")
    reps = args.reps or suite.repetitions
    workload = json.loads(args.workload) if args.workload else {}
    stem = args.stem or {"full": "cpu", "quick": "cpu_quick"}.get(suite.name, f"cpu_{suite.name}")
    # The committed results this run is guarded against, read before this run overwrites them.
    guard_path = Path(args.guard) if args.guard else (Path(args.out) / f"{stem}.json" if suite.name == "quick" else None)
    baseline = json.loads(guard_path.read_text()) if guard_path is not None and guard_path.is_file() else None
    start = time.perf_counter()
    env_info = report.environment(args.python)
    rep_results, exit_warnings = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            order = _order(configs, rep)
            out = Path(tmp) / f"rep{rep}.json"
            cmd = [args.python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                   "-m", "benchmarks.suite.worker", "--suite", suite.name, "--rep", str(rep),
                   "--configs", ",".join(c.name for c in order), "--prime", order[0].name, "--out", str(out)]
            if workload:
                cmd += ["--workload", json.dumps(workload)]
            print(f"repetition {rep + 1}/{reps}: {len(order)} configurations", flush=True)
            proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
            tail: list[str] = []
            assert proc.stdout is not None
            for line in proc.stdout:
                tail = (tail + [line])[-60:]
                if line.startswith("[rep"):
                    print("  " + line.rstrip(), flush=True)
            try:
                proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise SystemExit(f"repetition {rep} exceeded {args.timeout} s")
            recorded = json.loads(out.read_text()) if out.exists() else None
            complete = recorded is not None and {r["config"] for r in recorded["records"]} >= {c.name for c in order}
            if not complete:
                raise SystemExit(f"repetition {rep} failed ({proc.returncode}):\n{''.join(tail)}")
            if proc.returncode != 0:
                # Every configuration ran and rank 0 wrote its records before the final barrier;
                # a worker then died during interpreter shutdown. Seen twice in 34 launches
                # (torch 2.13, "terminate called without an active exception" on one rank): the
                # measurements are whole, so they count, and the run says what happened.
                last = next((x.strip() for x in reversed(tail) if "terminate" in x or "Error" in x),
                            tail[-1].strip() if tail else "no output")
                exit_warnings.append(f"repetition {rep}: all configurations recorded, then a worker exited"
                                     f" with {proc.returncode} at shutdown ({last})")
                print(f"  warning: {exit_warnings[-1]}", flush=True)
            rep_results.append(recorded)
    result = report.aggregate(rep_results)
    numel = next((e["numel"] for e in result["configs"].values() if "numel" in e), 0)
    result.update({
        "suite": suite.name, "workload": rep_results[0]["meta"]["workload"], "numel": numel,
        "host_memory_set": rep_results[0]["meta"].get("host_memory_set"),
        "repetitions": reps, "environment": env_info, "skipped_without_deepspeed": skipped,
        "wall_s": time.perf_counter() - start, "notes": NOTES, "exit_warnings": exit_warnings,
        "command": " ".join(["python benchmarks/run.py", *map(shlex.quote, args.argv)]),
    })
    result["targets"] = report.targets(result)
    verdict = None
    if guard_path is not None and not args.no_guard:
        from benchmarks.suite import guard

        if baseline is None:
            print(f"regression guard: no baseline at {guard_path}; this run's results are the baseline from now on")
        else:
            verdict = guard.compare(result, baseline)
    regressed = bool(verdict and verdict["regressions"])
    if regressed and stem == guard_path.stem and Path(args.out).resolve() == guard_path.parent.resolve():
        stem += "_regressed"  # a regressed run never replaces the baseline it failed against
    written = report.write(result, Path(args.out), stem, with_plots=not args.no_plots)
    print(f"done in {result['wall_s']:.0f} s; wrote " + ", ".join(str(p.relative_to(ROOT)) if p.is_relative_to(ROOT)
                                                               else str(p) for p in written))
    print(report.summary_table(result))
    if verdict is not None:
        print(guard.render(verdict, str(guard_path)))
    if regressed:
        raise SystemExit(1)
    return written


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--gpu" in argv:  # the GPU suite has its own options (python benchmarks/run.py --gpu --help)
        from benchmarks.suite import gpu

        gpu.main([a for a in argv if a != "--gpu"])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the quick suite (under 3 minutes)")
    p.add_argument("--suite", default="full", choices=sorted(SUITES), help="suite (default full; --quick = quick)")
    p.add_argument("--reps", type=int, default=0, help="repetitions (default: the suite's)")
    p.add_argument("--only", default="", help="regex: run only the configurations whose name matches")
    p.add_argument("--workload", default="", help="JSON overrides of the suite's Workload fields")
    p.add_argument("--nproc", type=int, default=2, help="ranks (processes) per configuration")
    p.add_argument("--python", default=sys.executable, help="interpreter for the workers (must import torch,"
                   " lightning_ampzero, and deepspeed for its configurations)")
    p.add_argument("--out", default=str(RESULTS), help="output directory")
    p.add_argument("--stem", default="", help="output file name stem (default cpu / cpu_quick)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (no matplotlib needed)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per repetition")
    p.add_argument("--guard", default="", help="results JSON to guard against (default for --quick:"
                   " the committed results/cpu_quick.json); exit 1 when a ratio's wall and CPU time are both more than"
                   " 15%% worse, or its wall time alone more than 30%% (suite/guard.py)")
    p.add_argument("--no-guard", action="store_true", help="skip the regression guard")
    p.add_argument("--from-json", default="", help="rewrite the markdown and plots of an earlier run's JSON")
    p.add_argument("--gpu", action="store_true", help="run the single-GPU suite instead (benchmarks/suite/gpu.py;"
                   " its options: --dry-run, --only, --batch, --steps, ...)")
    args = p.parse_args(argv)
    args.argv = argv  # recorded in the results: which configurations, how many repetitions
    if args.from_json:
        path = Path(args.from_json)
        result = json.loads(path.read_text())
        result["targets"] = report.targets(result)
        for written in report.write(result, path.parent, path.stem, with_plots=not args.no_plots):
            print("wrote", written)
        return
    run_cpu(args)


if __name__ == "__main__":
    main()
