"""The regression guard of ``benchmarks/run.py --quick``: this run's ratios against the committed ones.

A ratio is ampzero's step time over another system's in the same launch (report.py), so the
comparison holds across machines and loads as far as same-launch ratios do. A step-time ratio
more than ``tolerance`` (15%) above the committed median is a regression; so is a loss-parity
target that was met and is not. Ratios present in only one of the two runs (DeepSpeed not
installed, a configuration added) are listed, not judged.
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
        row = {"ratio": key, "now": now, "baseline": then, "change": now / then - 1,
               "regressed": now > then * (1 + tolerance)}
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
    lines = [f"regression guard: {len(verdict['checked'])} ratios against {baseline_name}"
             f" (a regression: more than {tolerance:.0%} above the committed median)"]
    for row in verdict["checked"]:
        mark = "  REGRESSED" if row["regressed"] else ""
        lines.append(f"  {row['ratio']:48s} {row['now']:.3f} (was {row['baseline']:.3f}, {row['change']:+.1%}){mark}")
    for row in verdict["regressions"]:
        if row["change"] is None:
            lines.append(f"  {row['ratio']}: was met, now {row['now']:.3g}  REGRESSED")
    for row in verdict["unmatched"]:
        lines.append(f"  {row['ratio']}: only in {row['in']} (not compared)")
    lines.append(f"{len(verdict['regressions'])} regression(s)")
    return "\n".join(lines)
