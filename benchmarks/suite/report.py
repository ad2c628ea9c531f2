"""Aggregation over repetitions, ratios, targets, and the JSON / markdown / PNG outputs.

Per configuration (each repetition is one launch of worker.py running every configuration):

* step time: each rank times every step; a step's time is the slowest rank's (the ranks wait
  for each other at every collective, so the slowest one sets the pace). Per repetition the
  median of the timed steps; reported: the median over repetitions of those medians, with
  their min and max ("spread").
* ratios (ampzero / DeepSpeed, ampzero / raw FSDP2, ...): computed per repetition from the
  two medians of that repetition (same launch, minutes apart), then the median over
  repetitions with min and max.
* model states: the per-category peak over the samples of the profiled step, maximum over
  ranks, beside the formula (``lightning_ampzero.memory.zero_formula``).
* communication: elements and bytes per rank in the profiled step (comm.py), maximum over
  ranks, beside the formula (comm.formula_elements).
* parity: per-step losses (mean over ranks) against the reference system of the same
  precision group; max relative difference over all steps, and of the final loss.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Any, Optional

from .comm import formula_elements
from .configs import DIAGNOSTIC, BenchConfig

#: Reference of each precision group for the parity check.
PARITY_REFERENCE = {"32-true": "ddp/s0/32-true", "bf16-mixed": "ddp/s0/bf16-mixed", "bf16-true": "ddp/s0/bf16-mixed"}
#: Relative tolerance on per-step losses. fp32: reduction order only. bf16-mixed: autocast's
#: bf16 matmuls, where reduction order or a bf16 (vs fp32) gradient reduction flips roundings.
#: bf16-true (against the bf16-mixed reference): parameters and activations in bf16, and
#: DeepSpeed's bf16 mode differs from ampzero's bf16-true in where it rounds.
PARITY_TOL = {"32-true": 1e-4, "bf16-mixed": 2e-2, "bf16-true": 5e-2}
#: Issue 16's targets: ampzero within 5% of raw FSDP2 on the same units, stages 1-2 within 5% of
#: bare DDP (the same 2Ψ on the wire) and stage 3 within 30% (3Ψ), and every stage at most 0.85x
#: DeepSpeed's step time. Stage 0 is DDP: its "vs_fsdp2" ratio is against bare DDP.
TARGETS = {"vs_deepspeed": 0.85, "vs_fsdp2": 1.05, "vs_ddp": {1: 1.05, 2: 1.05, 3: 1.30}, "model_state": 0.05,
           "comm": 0.10}


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _spread(xs: list[float]) -> dict:
    return {"median": _median(xs), "min": min(xs) if xs else float("nan"), "max": max(xs) if xs else float("nan"),
            "n": len(xs)}


def environment(python: str) -> dict:
    """Machine, date and versions (of the interpreter that ran the workers)."""
    probe = ("import json, sys, torch, lightning, lightning_ampzero\n"
             "try:\n import deepspeed; ds = deepspeed.__version__\nexcept Exception: ds = None\n"
             "print(json.dumps({'python': sys.version.split()[0], 'torch': torch.__version__,"
             " 'lightning': lightning.__version__, 'lightning_ampzero': lightning_ampzero.__version__,"
             " 'deepspeed': ds}))")
    versions = json.loads(subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True,
                                         env={**os.environ, "PYTHONWARNINGS": "ignore"}).stdout.strip().splitlines()[-1])
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    except OSError:
        mem = 0
    root = Path(__file__).resolve().parents[2]
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "lightning_ampzero"],
                                capture_output=True, text=True).stdout.strip())
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem,
                    "load_average_at_start": os.getloadavg()},
        "versions": versions,
        "git_commit": commit + ("+local changes" if dirty else ""),
    }


# ---- aggregation -------------------------------------------------------------------------------
def _per_step_max(ranks: list[dict]) -> list[float]:
    return [max(ts) for ts in zip(*(r["step_s"] for r in ranks))]


def _per_step_cpu(ranks: list[dict]) -> list[float]:
    return [sum(ts) / len(ts) for ts in zip(*(r["cpu_s"] for r in ranks))]


def _mean_losses(ranks: list[dict]) -> list[float]:
    return [sum(ls) / len(ls) for ls in zip(*(r["losses"] for r in ranks))]


def _max_dict(ranks: list[dict], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in ranks:
        for k, v in (r.get(key) or {}).items():
            if isinstance(v, (int, float)):
                out[k] = max(out.get(k, 0), v)
    return out


def _model_state(cfg: BenchConfig, ranks: list[dict], numel: int, world: int, accumulate: int) -> Optional[dict]:
    from lightning_ampzero.memory import as_zero_categories, zero_formula

    raw = _max_dict(ranks, "model_state")
    if not raw:
        return None
    if cfg.system == "deepspeed":
        measured = {k: raw.get(k, 0) for k in ("params", "grads", "optimizer")}
        extra = {"buffers_virtual": raw.get("buffers", 0), "other": raw.get("other", 0),
                 "by_path": ranks[0].get("deepspeed_paths", {})}
    else:
        measured = as_zero_categories(raw, cfg.stage).as_dict()
        measured.pop("total")
        extra = {"raw": raw}
    measured["total"] = sum(measured.values())
    if cfg.precision == "bf16-true":  # the ZeRO paper's mixed-precision accounting (2 + 2 + 12)
        formula = zero_formula(numel, world, cfg.stage, param_bytes=2, grad_bytes=2)
    else:  # fp32 parameters and gradients (autocast keeps them fp32)
        formula = zero_formula(numel, world, cfg.stage)
    f = formula.as_dict()
    if cfg.stage == 1 and accumulate == 1 and cfg.system != "deepspeed":
        # The paper's stage 1 keeps full gradients; FSDP2's stage 1 keeps them only across the
        # micro-batches of an accumulation (zero/apply.py no_sync) and otherwise reduce-scatters
        # as stage 2 does, so without accumulation its gradients are the stage-2 shard.
        f["grads"] = formula.grads // world  # the stage-2 figure: the 1/N shard
        f["total"] = f["params"] + f["grads"] + f["optimizer"]
    ratio = {k: (measured[k] / f[k] if f[k] else float("nan")) for k in f}
    return {"measured": measured, "formula": f, "ratio": ratio, "offloaded": bool(cfg.offload), **extra}


def _model_flops_per_token(w: dict) -> float:
    """``6 N + 12 L T d`` of the workload's GPT (lightning_ampzero/flops.py), built on the meta device."""
    import torch

    from lightning_ampzero.flops import model_flops_per_token
    from lightning_ampzero.models.gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=w["vocab"], block_size=w["seq"], n_layer=w["n_layer"],
                              n_head=w["n_head"], n_embd=w["n_embd"]))
    return model_flops_per_token(model, w["seq"])


def aggregate(reps: list[dict]) -> dict:
    """Records of all repetitions -> one entry per configuration, in first-seen order."""
    by_name: dict[str, list[dict]] = {}
    meta = reps[0]["meta"]
    for rep in reps:
        for rec in rep["records"]:
            by_name.setdefault(rec["config"], []).append(rec)
    w = meta["workload"]
    world = meta["world"]
    flops_per_token = _model_flops_per_token(w)
    peaks = [r["meta"].get("gemm_peak_flops") for r in reps if r["meta"].get("gemm_peak_flops")]
    out: dict[str, Any] = {}
    for name, recs in by_name.items():
        cfg = BenchConfig.from_name(name)
        entry: dict[str, Any] = {"system": cfg.system, "stage": cfg.stage, "precision": cfg.precision,
                                 "precision_label": cfg.precision_label, "offload": cfg.offload}
        failed = [r["ranks"][0] for r in recs if "error" in r["ranks"][0] or "skipped" in r["ranks"][0]]
        ok = [r for r in recs if "step_s" in r["ranks"][0]]
        if not ok:
            entry["status"] = "skipped" if "skipped" in failed[0] else "error"
            entry["message"] = failed[0].get("skipped") or failed[0].get("error")
            entry["traceback"] = failed[0].get("traceback")
            out[name] = entry
            continue
        entry["status"] = "ok" if len(ok) == len(recs) else "partial"
        per_rep = {r["rep"]: _median(_per_step_max(r["ranks"])) for r in ok}
        pooled = sorted(t for r in ok for t in _per_step_max(r["ranks"]))
        q = statistics.quantiles(pooled, n=4) if len(pooled) >= 2 else [pooled[0]] * 3
        first = ok[0]["ranks"]
        numel = first[0]["numel"]
        entry.update({
            "numel": numel,
            "step_ms": {**{k: 1e3 * v for k, v in _spread(list(per_rep.values())).items() if k != "n"},
                        "n_reps": len(per_rep), "per_rep": {str(k): 1e3 * v for k, v in per_rep.items()},
                        "pooled_p25": 1e3 * q[0], "pooled_p75": 1e3 * q[2], "n_steps": len(pooled)},
            "cpu_ms": {k: 1e3 * v for k, v in _spread([_median(_per_step_cpu(r["ranks"])) for r in ok]).items()
                       if k != "n"},
            "tokens_per_s": w["micro_batch"] * w["accumulate"] * world * w["seq"] / _median(list(per_rep.values())),
            "peak_rss": {"max_rank": _median([max(x["peak_rss"] for x in r["ranks"]) for r in ok]),
                         "per_rank": [_median([r["ranks"][i]["peak_rss"] for r in ok]) for i in range(world)]},
            "rss_growth": _median([max(x["peak_rss"] - x["rss_start"] for x in r["ranks"]) for r in ok]),
            "losses": _mean_losses(first),
            "losses_identical_across_reps": all(_mean_losses(r["ranks"]) == _mean_losses(first) for r in ok),
            "model_state": _model_state(cfg, first, numel, world, w["accumulate"]),
            "wall_s": _median([max(x["wall_s"] for x in r["ranks"]) for r in ok]),
            "raw": {"step_s": {str(r["rep"]): _per_step_max(r["ranks"]) for r in ok},
                    "cpu_s": {str(r["rep"]): _per_step_cpu(r["ranks"]) for r in ok}},
        })
        if peaks:
            # MFU: model FLOPs per second over the GEMM peak of all ranks (median over launches).
            key = "32-true" if cfg.precision == "32-true" else "bf16"
            entry["gemm_peak_flops"] = _median([p[key] for p in peaks])
            entry["mfu"] = entry["tokens_per_s"] * flops_per_token / entry["gemm_peak_flops"]
        comm = [x["comm"] for x in first if x.get("comm")]
        if comm:
            f = formula_elements(numel, cfg.stage, w["accumulate"])
            top = max(comm, key=lambda c: c["elements"])
            entry["comm"] = {**top, "formula_elements": f, "ratio": top["elements"] / f,
                             "ranks_equal": len({c["elements"] for c in comm}) == 1}
        if "offloaded" in first[0]:
            entry["offloaded"] = first[0]["offloaded"]
        out[name] = entry
    _parity(out)
    return {"configs": out, "ratios": _ratios(by_name), "targets": None, "model_flops_per_token": flops_per_token}


def _parity(configs: dict) -> None:
    for name, e in configs.items():
        if e.get("status") not in ("ok", "partial"):
            continue
        ref = configs.get(PARITY_REFERENCE[e["precision"]])
        if ref is e or ref is None or "losses" not in ref or len(ref["losses"]) != len(e["losses"]):
            continue
        rel = [abs(a - b) / abs(b) for a, b in zip(e["losses"], ref["losses"])]
        e["parity"] = {"reference": PARITY_REFERENCE[e["precision"]], "max_rel_diff": max(rel),
                       "final_rel_diff": rel[-1], "tolerance": PARITY_TOL[e["precision"]],
                       "ok": max(rel) <= PARITY_TOL[e["precision"]]}


def _rep_medians(recs: list[dict], cpu: bool = False) -> dict[int, float]:
    per_step = _per_step_cpu if cpu else _per_step_max
    return {r["rep"]: _median(per_step(r["ranks"])) for r in recs if "step_s" in r["ranks"][0]}


def _pair_ratio(by_name: dict, num: str, den: str) -> Optional[dict]:
    if num not in by_name or den not in by_name:
        return None
    a, b = _rep_medians(by_name[num]), _rep_medians(by_name[den])
    ratios = [a[r] / b[r] for r in sorted(set(a) & set(b))]
    if not ratios:
        return None
    ca, cb = _rep_medians(by_name[num], cpu=True), _rep_medians(by_name[den], cpu=True)
    cpu = [ca[r] / cb[r] for r in sorted(set(ca) & set(cb))]

    def fastest(name: str) -> float:
        return min(t for r in by_name[name] if "step_s" in r["ranks"][0] for t in _per_step_max(r["ranks"]))
    return {"numerator": num, "denominator": den, **_spread(ratios), "per_rep": ratios, "cpu": _spread(cpu),
            "fastest_step_ratio": fastest(num) / fastest(den)}


def _ratios(by_name: dict) -> dict:
    """ampzero against each other system at the same stage and precision (and the brief's pairing
    of ampzero bf16-mixed with DeepSpeed's bf16 mode); Lightning's own ddp against bare DDP."""
    out: dict[str, dict] = {}
    for name in by_name:
        cfg = BenchConfig.from_name(name)
        if not cfg.system.startswith("ampzero"):
            continue
        suffix = name.split("/", 1)[1]
        pairs = {"vs_deepspeed": f"deepspeed/{suffix}", "vs_fsdp2": f"fsdp2/{suffix}"}
        if cfg.stage == 0 and not cfg.offload:
            pairs["vs_fsdp2"] = f"ddp/{suffix}"  # stage 0 is DDP: the bare engine it builds on
            if cfg.system == "ampzero":
                pairs["vs_lightning_ddp"] = f"lightning_ddp/{suffix}"
        elif cfg.system == "ampzero" and not cfg.offload:
            pairs["vs_ddp"] = f"ddp/s0/{cfg.precision}"  # the bar of stages 1-3: DDP's step time
        if cfg.system in DIAGNOSTIC:
            pairs["vs_ampzero"] = f"ampzero/{suffix}"
        if cfg.system in ("ampzero_fp32reduce", "ampzero_reuse", "ampzero_lowwire"):
            del pairs["vs_fsdp2"]  # raw FSDP2 here has ampzero's default units and resharding, not these
        if cfg.precision == "bf16-mixed":
            pairs["vs_deepspeed_bf16_mode"] = f"deepspeed/s{cfg.stage}/bf16-true"
        for key, den in pairs.items():
            r = _pair_ratio(by_name, name, den)
            if r is not None:
                out[f"{name} {key}"] = {"config": name, "kind": key, **r}
    for p in ("32-true", "bf16-mixed"):
        r = _pair_ratio(by_name, f"lightning_ddp/s0/{p}", f"ddp/s0/{p}")
        if r is not None:
            out[f"lightning_ddp/s0/{p} vs_ddp"] = {"config": f"lightning_ddp/s0/{p}", "kind": "vs_ddp", **r}
    return out


def targets(result: dict) -> list[dict]:
    """Each target with its measured value and how far it is (positive margin = met)."""
    rows: list[dict] = []
    for key, r in result["ratios"].items():
        kind = r["kind"]
        if kind in ("vs_deepspeed", "vs_fsdp2", "vs_ddp") and r["config"].startswith("ampzero/"):
            limit = TARGETS[kind][BenchConfig.from_name(r["config"]).stage] if kind == "vs_ddp" else TARGETS[kind]
            rows.append({"target": f"step time {r['config']} / {r['denominator'].split('/')[0]} <= {limit:.2f}x",
                         "value": r["median"], "spread": [r["min"], r["max"]], "limit": limit,
                         "met": r["median"] <= limit, "margin": limit - r["median"]})
    for name, e in result["configs"].items():
        if e["system"] != "ampzero" or e.get("status") not in ("ok", "partial"):
            continue
        ms = e.get("model_state")
        if ms and not e.get("offload") and e["precision"] != "bf16-true":
            worst = max(("params", "grads", "optimizer", "total"), key=lambda k: abs(ms["ratio"][k] - 1))
            dev = ms["ratio"][worst] - 1
            rows.append({"target": f"model-state bytes {name} within 5% of formula (worst: {worst})",
                         "value": ms["ratio"][worst], "limit": 1 + TARGETS["model_state"],
                         "met": abs(dev) <= TARGETS["model_state"], "margin": TARGETS["model_state"] - abs(dev)})
        c = e.get("comm")
        if c:
            dev = c["ratio"] - 1
            rows.append({"target": f"communicated elements {name} within 10% of formula", "value": c["ratio"],
                         "limit": 1 + TARGETS["comm"], "met": abs(dev) <= TARGETS["comm"],
                         "margin": TARGETS["comm"] - abs(dev)})
    for name, e in result["configs"].items():
        p = e.get("parity")
        if p:
            rows.append({"target": f"loss parity {name} vs {p['reference']} (rel. <= {p['tolerance']:g})",
                         "value": p["max_rel_diff"], "limit": p["tolerance"], "met": p["ok"],
                         "margin": p["tolerance"] - p["max_rel_diff"]})
    return rows


# ---- outputs -----------------------------------------------------------------------------------
def _mib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1%}"


def _f(x: float, nd: int = 2) -> str:
    return f"{x:.{nd}f}"


def _allocator_line(result: dict) -> str:
    mb = result["workload"].get("host_memory_cache_mb")  # absent before the setting existed
    if not mb or result.get("host_memory_set") is False:  # False: not glibc
        return "- Host allocator: the C library's defaults for every system."
    return (f"- Host allocator: glibc malloc keeps up to {mb} MiB of freed memory, set for every system"
            " (ampzero's `host_memory_cache_mb`; the systems share the worker processes).")


def markdown(result: dict) -> str:
    env, suite, w = result["environment"], result["suite"], result["workload"]
    v, m = env["versions"], env["machine"]
    lines = [
        f"# CPU benchmark: ampzero vs DeepSpeed, raw FSDP2 and DDP ({suite} suite)",
        "",
        f"- Date: {env['date']}; git {env['git_commit']}",
        f"- Command: `{result.get('command', 'python benchmarks/run.py')}` ({len(result['configs'])} configurations)",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memory_bytes'] / 2**30:.0f} GiB, {m['platform']};"
        f" load average at start {', '.join(f'{x:.1f}' for x in m['load_average_at_start'])} (shared machine:"
        " jobs outside this VM may run at the same time)",
        f"- Versions: python {v['python']}, torch {v['torch']}, lightning {v['lightning']}, deepspeed"
        f" {v['deepspeed'] or 'not installed'}, lightning_ampzero {v['lightning_ampzero']}",
        f"- Workload: GPT {w['n_layer']} layers x {w['n_embd']} wide, {w['n_head']} heads, vocab {w['vocab']},"
        f" {result['numel']:,} parameters; {w['world']} ranks (gloo, 1 thread each); micro-batch"
        f" {w['micro_batch']} x {w['seq']} tokens, {w['accumulate']} micro-batches per step, global batch"
        f" {w['micro_batch'] * w['accumulate'] * w['world']} sequences; AdamW; {w['warmup']} warm-up +"
        f" {w['steps']} timed steps + 1 profiled step per configuration; {result['repetitions']} repetitions"
        " (one launch each, configurations interleaved, order rotated per repetition).",
        _allocator_line(result),
        "",
        "## Targets",
        "",
        "| target | measured | met |",
        "|---|---|---|",
    ]
    for t in result["targets"]:
        val = f"{t['value']:.3g}" if "loss parity" in t["target"] else f"{t['value']:.3f}"
        if "spread" in t:
            val += f" [{t['spread'][0]:.3f}-{t['spread'][1]:.3f}]"
        lines.append(f"| {t['target']} | {val} | {'yes' if t['met'] else '**no**'} |")
    lines += ["", "## Step-time ratios", "",
              "Per repetition, from the two medians of the same launch; median [min-max] over repetitions."
              " CPU: the same ratio of CPU time per step (process_time, mean over ranks), which the load of"
              " other jobs on the machine disturbs less than wall time. Fastest steps: the ratio of the two"
              " fastest steps over all repetitions (interference only adds time, so the fastest step is the"
              " least disturbed estimate).", "",
              "| config | compared with | wall-time ratio | CPU-time ratio | fastest steps |", "|---|---|---|---|---|"]
    kinds = {"vs_deepspeed": "DeepSpeed, same stage and precision", "vs_fsdp2": "raw FSDP2, same units (s0: bare DDP)",
             "vs_deepspeed_bf16_mode": "DeepSpeed bf16 mode, same stage", "vs_lightning_ddp": "Lightning's ddp strategy",
             "vs_ampzero": "ampzero (the same without the diagnostic change)", "vs_ddp": "bare DDP"}
    order = {k: i for i, k in enumerate(kinds)}
    for r in sorted(result["ratios"].values(), key=lambda r: (not r["config"].startswith("ampzero/"),
                                                            r["config"], order.get(r["kind"], 99))):
        c = r["cpu"]
        lines.append(f"| {r['config']} | {kinds.get(r['kind'], r['kind'])} ({r['denominator']}) |"
                     f" {r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}] | {c['median']:.3f} [{c['min']:.3f}-{c['max']:.3f}] |"
                     f" {r['fastest_step_ratio']:.3f} |")
    lines += ["", "## Per configuration", "",
              "step ms: median over repetitions of the per-repetition median [min-max]; RSS: peak per rank"
              " (max over ranks) and growth over the configuration's start; model states and communication"
              " per rank in the profiled step, measured / formula; loss: final step, mean over ranks.", "",
              "| config | precision | step ms | CPU ms | tokens/s | MFU | peak RSS MiB | RSS growth MiB | model states MiB (meas. / formula) |"
              " comm elements / formula | comm MiB (by dtype) | calls | final loss | parity (max rel. diff) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in result["configs"].items():
        if e.get("status") not in ("ok", "partial"):
            lines.append(f"| {name} | {e['precision_label']} | {e['status']}: {str(e.get('message'))[:80]} |"
                         + " |" * 11)
            continue
        s = e["step_ms"]
        ms = e.get("model_state")
        ms_txt = f"{_mib(ms['measured']['total'])} / {_mib(ms['formula']['total'])}" if ms else "-"
        if ms and e.get("offload"):
            ms_txt += " (optimizer offloaded)"
        c = e.get("comm")
        c_txt = f"{c['ratio']:.3f}" if c else "-"
        c_mib = (f"{_mib(c['bytes'])} (" + ", ".join(f"{k} {_mib(b)}" for k, b in c["bytes_by_dtype"].items() if b)
                 + ")") if c else "-"
        par = e.get("parity")
        par_txt = f"{par['max_rel_diff']:.1e}" + ("" if par["ok"] else " **over tol.**") if par else "-"
        lines.append(
            f"| {name} | {e['precision_label']} | {s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}] |"
            f" {e['cpu_ms']['median']:.1f} | {e['tokens_per_s']:.0f} | {_pct(e.get('mfu'))} | {_mib(e['peak_rss']['max_rank'])} | {_mib(e['rss_growth'])} | {ms_txt} |"
            f" {c_txt} | {c_mib} | {c['calls'] if c else '-'} | {e['losses'][-1]:.5f} | {par_txt} |")
    lines += ["", "## Model states per rank by category (MiB, measured / formula)", "",
              "| config | params | grads | optimizer (+ fp32 master) | DeepSpeed buckets (virtual) |", "|---|---|---|---|---|"]
    for name, e in result["configs"].items():
        ms = e.get("model_state")
        if not ms:
            continue
        cells = [f"{_mib(ms['measured'][k])} / {_mib(ms['formula'][k])}" for k in ("params", "grads", "optimizer")]
        lines.append(f"| {name} | {' | '.join(cells)} | {_mib(ms.get('buffers_virtual')) if e['system'] == 'deepspeed' else '-'} |")
    lines += ["", "## How each figure is measured", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def summary_table(result: dict) -> str:
    """The short table for the project README: ratios and targets per stage."""
    ratios = {(r["config"], r["kind"]): r for r in result["ratios"].values()}
    cfgs = result["configs"]
    lines = ["| stage | precision | ampzero ms/step | / DDP | / DeepSpeed | / raw FSDP2 | model states / formula |"
             " comm / formula | loss rel. diff |", "|---|---|---|---|---|---|---|---|---|"]
    for p in ("32-true", "bf16-mixed"):
        for s in range(4):
            name = f"ampzero/s{s}/{p}"
            e = cfgs.get(name)
            if not e or e.get("status") not in ("ok", "partial"):
                continue

            def rat(kind: str) -> str:
                r = ratios.get((name, kind))
                return f"{r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]" if r else "-"
            ms = e.get("model_state")
            cells = [str(s), p, f"{e['step_ms']['median']:.0f}", rat("vs_fsdp2" if s == 0 else "vs_ddp"),
                     rat("vs_deepspeed"), "-" if s == 0 else rat("vs_fsdp2"),
                     f"{ms['ratio']['total']:.3f}" if ms else "-",
                     f"{e['comm']['ratio']:.3f}" if e.get("comm") else "-",
                     f"{e['parity']['max_rel_diff']:.1e}" if e.get("parity") else "-"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plots(result: dict, out_dir: Path, stem: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfgs = result["configs"]
    colors = {"ampzero": "#1f77b4", "fsdp2": "#2ca02c", "deepspeed": "#d62728", "ddp": "#7f7f7f",
              "lightning_ddp": "#bcbd22", "ampzero_fp32reduce": "#9467bd", "ampzero_reuse": "#17becf",
              "ampzero_lowwire": "#ff7f0e"}
    precisions = [p for p in ("32-true", "bf16-mixed", "bf16-true") if any(e["precision"] == p for e in cfgs.values())]
    paths = []

    fig, axes = plt.subplots(1, len(precisions), figsize=(5.5 * len(precisions), 4), squeeze=False)
    for ax, p in zip(axes[0], precisions):
        systems = [s for s in colors if any(e["system"] == s and e["precision"] == p for e in cfgs.values())]
        width = 0.8 / max(1, len(systems))
        for i, sysname in enumerate(systems):
            xs, ys, lo, hi = [], [], [], []
            for s in range(4):
                e = cfgs.get(f"{sysname}/s{s}/{p}")
                if e and e.get("status") in ("ok", "partial"):
                    xs.append(s + (i - (len(systems) - 1) / 2) * width)
                    ys.append(e["step_ms"]["median"])
                    lo.append(e["step_ms"]["median"] - e["step_ms"]["min"])
                    hi.append(e["step_ms"]["max"] - e["step_ms"]["median"])
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=sysname, color=colors[sysname])
        ax.set_xticks(range(4), [f"stage {s}" for s in range(4)])
        label = "bf16-true (DeepSpeed: bf16 mode)" if p == "bf16-true" else p
        ax.set_title(f"{label}: step time (ms)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / f"{stem}_step_time.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4))
    series = [("ampzero", "vs_deepspeed", "ampzero / DeepSpeed (target 0.85)", "#d62728"),
              ("ampzero", "vs_fsdp2", "ampzero / raw FSDP2 (s0: bare DDP)", "#2ca02c"),
              ("ampzero", "vs_ddp", "ampzero / bare DDP (target 1.05, s3 1.3)", "#7f7f7f"),
              ("ampzero_fp32reduce", "vs_deepspeed", "ampzero, no safe modules (diagnostic) / DeepSpeed",
               "#9467bd")]
    labels = [f"s{s} {p}" for p in precisions for s in range(4)]
    for k, (system, kind, text, color) in enumerate(series):
        xs, ys, lo, hi = [], [], [], []
        for j, p in enumerate(precisions):
            for s in range(4):
                r = next((r for r in result["ratios"].values()
                          if r["config"] == f"{system}/s{s}/{p}" and r["kind"] == kind), None)
                if r:
                    xs.append(j * 4 + s + (k - 1.5) * 0.2)
                    ys.append(r["median"])
                    lo.append(r["median"] - r["min"])
                    hi.append(r["max"] - r["median"])
        if xs:
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", color=color, label=text, capsize=3)
    ax.axhline(TARGETS["vs_deepspeed"], color="#d62728", lw=0.8, ls="--")
    ax.axhline(TARGETS["vs_fsdp2"], color="#2ca02c", lw=0.8, ls=":")
    ax.axhline(TARGETS["vs_ddp"][3], color="#7f7f7f", lw=0.8, ls=":")
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("step-time ratio (lower is better)")
    ax.set_title("ampzero step time relative to DeepSpeed, raw FSDP2 and DDP (median, min-max over repetitions)")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    paths.append(out_dir / f"{stem}_ratios.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for sysname, marker in (("ampzero", "o"), ("deepspeed", "s"), ("fsdp2", "^")):
        xs, ms_y, cm_y = [], [], []
        for s in range(4):
            e = cfgs.get(f"{sysname}/s{s}/32-true")
            if e and e.get("model_state"):
                xs.append(s)
                ms_y.append(e["model_state"]["ratio"]["total"])
                cm_y.append(e["comm"]["ratio"] if e.get("comm") else float("nan"))
        axes[0].plot(xs, ms_y, marker, label=sysname, color=colors[sysname])
        axes[1].plot(xs, cm_y, marker, label=sysname, color=colors[sysname])
    for ax, title, tol in ((axes[0], "model-state bytes / ZeRO formula (fp32)", 0.05),
                           (axes[1], "communicated elements / formula (fp32)", 0.10)):
        ax.axhspan(1 - tol, 1 + tol, color="#dddddd")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(4), [f"stage {s}" for s in range(4)])
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / f"{stem}_memory_comm.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write(result: dict, out_dir: Path, stem: str, with_plots: bool = True) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / f"{stem}.json", out_dir / f"{stem}.md", out_dir / f"{stem}_summary.md"]
    written[0].write_text(json.dumps(result, indent=1, default=float) + "\n")
    written[1].write_text(markdown(result))
    written[2].write_text(summary_table(result))
    if with_plots:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            # Noticed after the run, not before it: the results above are kept either way.
            print("matplotlib is not installed: no plots (pip install matplotlib, then --from-json"
                  f" {written[0]} redraws them)", flush=True)
        else:
            written += plots(result, out_dir, stem)
    return written
