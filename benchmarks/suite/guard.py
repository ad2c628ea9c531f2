"""The regression guard of ``benchmarks/run.py --quick``: this run's ratios against the committed ones.

A ratio is ampzero's step time over another system's in the same launch (report.py), so the
comparison holds across machines and loads as far as same-launch ratios do. A step-time ratio
regressed when its wall-time median and its CPU-time median (process time per step, which
other jobs on a shared machine disturb less) are both more than ``tolerance`` (15%) above the
committed ones, or its wall-time median alone is more than twice that above (a regression in
waiting, which costs no CPU time); a baseline without CPU times is judged on wall time at 15%.
A loss-parity target that was met and is not is a regression too. Ratios present in only one
of the two runs (DeepSpeed not installed, a configuration added) are listed, not judged.

Why both: on this 2-core machine two launches of the same code moved the quick suite's
wall-time medians by up to 29% and its CPU-time medians by up to 12% (2026-11-25).
"""

from __future__ import annotations

from typing import Any

#: The step-time ratios that guard ampzero's speed (report.py's kinds; vs_fsdp2 at stage 0 is bare DDP).
GUARDED_KINDS = ("vs_fsdp2", "vs_ddp", "vs_deepspeed", "vs_lightning_ddp")
TOLERANCE = 0.15


def compare(result: dict[str, Any], baseline: dict[str, Any], tolerance: float = TOLERANCE) -> dict[str, list]:
    """``{"regressions": [...], "checked": [...], "unmatched": [...]}``, each row a dict."""
    rows, regressions, unmatched = [], [], []
    new, old = result.get("ratios", {}), baseline.get("ratios", {})
    for key in sorted(set(new) | set(old)):
        r = new.get(key) or old.get(key)
        if r["kind"] not in GUARDED_KINDS or not r["config"].startswith("ampzero/"):
            continue
        if key not in new or key not in old:
            unmatched.append({"ratio": key, "in": "this run" if key in new else "the baseline"})
            continue
        now, then = new[key]["median"], old[key]["median"]
        change = now / then - 1
        cpu_now, cpu_then = (new[key].get("cpu") or {}).get("median"), (old[key].get("cpu") or {}).get("median")
        cpu_change = cpu_now / cpu_then - 1 if cpu_now and cpu_then else None
        if cpu_change is None:
            regressed = change > tolerance
        else:
            regressed = (change > tolerance and cpu_change > tolerance) or change > 2 * tolerance
        row = {"ratio": key, "now": now, "baseline": then, "change": change, "cpu_change": cpu_change,
               "regressed": regressed}
        rows.append(row)
        if row["regressed"]:
            regressions.append(row)
    met_before = {t["target"] for t in baseline.get("targets") or [] if t.get("met") and "loss parity" in t["target"]}
    for t in result.get("targets") or []:
        if t["target"] in met_before and not t["met"]:
            regressions.append({"ratio": t["target"], "now": t["value"], "baseline": t["limit"], "change": None,
                                "regressed": True})
    return {"regressions": regressions, "checked": rows, "unmatched": unmatched}


def render(verdict: dict[str, list], baseline_name: str, tolerance: float = TOLERANCE) -> str:
    lines = [f"regression guard: {len(verdict['checked'])} ratios against {baseline_name} (a regression: wall and"
             f" CPU time both more than {tolerance:.0%} above the committed medians, or wall time {2 * tolerance:.0%})"]
    for row in verdict["checked"]:
        mark = "  REGRESSED" if row["regressed"] else ""
        cpu = "" if row.get("cpu_change") is None else f"; CPU {row['cpu_change']:+.1%}"
        lines.append(f"  {row['ratio']:48s} {row['now']:.3f} (was {row['baseline']:.3f}, {row['change']:+.1%}{cpu}){mark}")
    for row in verdict["regressions"]:
        if row["change"] is None:
            lines.append(f"  {row['ratio']}: was met, now {row['now']:.3g}  REGRESSED")
    for row in verdict["unmatched"]:
        lines.append(f"  {row['ratio']}: only in {row['in']} (not compared)")
    lines.append(f"{len(verdict['regressions'])} regression(s)")
    return "\n".join(lines)
