"""A natural fp16 overflow (issue 17): the skipped step leaves the run exactly as if that update had been left out.

2 CPU ranks under Lightning (tests/scripts/natural_overflow.py, its docstring says how the
overflow arises and how the reference run is built). ``16-mixed`` at DeepSpeed's default scale
2**16; one degenerate global batch (one token repeated) makes a few fp16 weight-gradient elements
overflow under autocast, nothing is injected. Each configuration runs twice: as is (the scaler
must skip the step) and as the reference that leaves that update out through LightningModule
hooks (``optimizer_step`` runs the closure only, ``lr_scheduler_step`` does nothing), with the
scaler never involved. Checked per configuration:

* the overflow is real and natural: non-finite gradient elements on that step only, few of them,
  every rank's decision the same, the scaler counts exactly one skipped step;
* the skipped step changes nothing, bit for bit: parameters, every optimizer state tensor (Adam's
  ``step``, the FP8 O2 moments and their scales), the offloaded master weights and moments (host
  memory or NVMe swap files); the step-interval scheduler does not advance (LR and ``last_epoch``);
* every loss of the run, and the final parameters, equal the reference's bit for bit. The scale is
  2**16 in both runs throughout (hysteresis 2 absorbs the one overflow, the window is longer than
  the run), so the two runs execute the same floating-point operations: no tolerance is needed.

Configurations are ``stage:clip:optim[:accumulate[:precision]]`` (the script's docstring). The
unmarked set touches each path once (stage 0's DDP comm hook with clipping; stage 1's fp16
reduce-scatter of the fp32 accumulation buffers with offload; the FP8 O2 optimizer; stage 3 with
NVMe offload and value clipping); ``slow`` runs the matrix of the acceptance: stages 0-3 x
clipping x offload, FP8 O2 at every stage, plus NVMe, accumulation and ``16-true``.
"""

from __future__ import annotations

import pytest

from _scripts import run_json

STEPS, OUTLIER = 7, 3
FAST = ["0:norm=0.5:adamw", "1:none:cpu:2", "2:norm=0.5:fp8o2", "3:value=0.01:nvme"]
SLOW = [
    # stage 0 has no optimizer offload (the config rejects it: there is no partition to offload)
    "0:none:adamw", "0:none:fp8o2", "0:norm=0.5:fp8o2",
    *[f"{stage}:{clip}:{optim}" for stage in (1, 2, 3) for clip in ("none", "norm=0.5")
      for optim in ("adamw", "cpu", "fp8o2") if f"{stage}:{clip}:{optim}" not in FAST],
    "1:norm=0.5:nvme", "2:none:nvme",
    "2:norm=0.5:adamw:2", "3:none:fp8o2:2",
    "0:none:adamw:1:16-true", "3:norm=0.5:adamw:1:16-true",
]
OPTIMIZER = {"adamw": "AdamW", "cpu": "OffloadedAdam", "nvme": "OffloadedAdam", "fp8o2": "Fp8AdamW"}
STATE_KEYS = {
    "adamw": ["exp_avg", "exp_avg_sq", "step"],
    "cpu": ["exp_avg", "exp_avg_sq", "step"],
    "nvme": ["exp_avg", "exp_avg_sq", "step"],
    "fp8o2": ["exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale", "step"],
}


def _run(tmp_path_factory, name: str, configs: list[str]) -> dict:
    tmp = tmp_path_factory.mktemp(name)
    return run_json("natural_overflow.py", tmp / "out.json", "--configs", ",".join(configs), "--steps", str(STEPS),
                    "--outlier", str(OUTLIER), "--tmp", str(tmp), timeout=900)


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    return _run(tmp_path_factory, "natural_fast", FAST)


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    return _run(tmp_path_factory, "natural_slow", SLOW)


def check(cfg: str, result: dict) -> None:
    stage, clip, optim, *rest = cfg.split(":")
    accumulate = int(rest[0]) if rest else 1
    nat, ref = result["natural"], result["reference"]
    assert nat["optimizer"] == ref["optimizer"] == OPTIMIZER[optim]
    assert nat["outlier"] == OUTLIER * accumulate and nat["leave_out"] == (OUTLIER + 1) * accumulate - 1
    scale = 2.0 ** 16 * accumulate
    decisions = []
    for rank, rows in enumerate(nat["rows"]):
        assert len(rows) == STEPS
        for i, row in enumerate(rows):
            skipped = i == OUTLIER
            where = f"{cfg} rank {rank} step {i}"
            # the overflow: on this step only, natural (few elements of few parameters), seen by the scaler
            assert row["last_step_skipped"] == skipped, where
            assert row["skipped_steps"] == row["overflows"] == (1 if i >= OUTLIER else 0), where
            assert row["scale"] == scale, where  # hysteresis absorbed the overflow: no halving, no doubling
            if skipped:
                # (a rank's shard may hold none of the infs: the other rank's overflow skips it too)
                assert row["nonfinite"] < row["grad_elements"] / 1000, (where, row["nonfinite"])
                assert row["params_all_finite"] > len(row["params_with_nonfinite"]), where
            else:
                assert row["nonfinite"] == 0 and row["params_with_nonfinite"] == [], where
            # the skipped step changes nothing, bit for bit; every other step changes everything
            assert row["params_unchanged"] == skipped, where
            assert row["opt_state_unchanged"] == skipped, where
            assert row["state_keys"] == STATE_KEYS[optim], where
            if optim in ("cpu", "nvme"):
                assert row["store_tensors"] == 6 and row["store_unchanged"] == skipped, where  # 2 groups x 3
            else:
                assert row["store_tensors"] == 0
            # the step-interval scheduler does not advance on the skipped step
            assert row["scheduler_last_epoch"] == (i + 1 if i < OUTLIER else i), where
            if clip.startswith("norm=") and not skipped:
                assert row["grad_norm"] > float(clip.split("=")[1]), where  # the clipping is active
        assert rows[OUTLIER]["lr"] == rows[OUTLIER - 1]["lr"] != rows[OUTLIER + 1]["lr"]
        decisions.append([(r["last_step_skipped"], r["scale"], r["lr"], r["scheduler_last_epoch"]) for r in rows])
    assert all(d == decisions[0] for d in decisions), "the ranks decided differently"
    # the overflow was seen in the gradients (on one rank's shard or on both)
    assert sum(rows[OUTLIER]["nonfinite"] for rows in nat["rows"]) > 0
    # the reference: its scaler never skipped; same schedule; same losses and weights, bit for bit
    for rows, ref_rows in zip(nat["rows"], ref["rows"]):
        assert [r["skipped_steps"] for r in ref_rows] == [0.0] * STEPS
        assert [(r["lr"], r["scheduler_last_epoch"]) for r in ref_rows] == [(r["lr"], r["scheduler_last_epoch"])
                                                                          for r in rows]
    for rank, (losses, ref_losses) in enumerate(zip(nat["losses"], ref["losses"])):
        assert len(losses) == STEPS * accumulate
        assert all(abs(x) < 100 for x in losses), losses  # finite: the overflow is in the gradients only
        assert losses == ref_losses, (cfg, rank, losses, ref_losses)
    assert nat["digest"] == ref["digest"]


@pytest.mark.parametrize("cfg", FAST)
def test_natural_overflow_is_the_step_left_out(fast, cfg):
    check(cfg, fast[cfg])


@pytest.mark.slow
@pytest.mark.parametrize("cfg", SLOW)
def test_natural_overflow_is_the_step_left_out_matrix(slow, cfg):
    check(cfg, slow[cfg])


def test_the_matrix_covers_the_acceptance():
    """Issue 17, acceptance 2: stages 0-3, with and without clipping, with and without offload, FP8 O2."""
    configs = [c.split(":") for c in FAST + SLOW]
    assert len(set(FAST + SLOW)) == len(FAST + SLOW)
    for stage in "0123":
        mine = [c for c in configs if c[0] == stage]
        assert {c[1] != "none" for c in mine} == {True, False}, stage
        assert any(c[2] == "fp8o2" for c in mine), stage
        if stage != "0":
            assert {c[2] in ("cpu", "nvme") for c in mine} == {True, False}, stage
            assert {(c[1] != "none", c[2] in ("cpu", "nvme")) for c in mine} == {(a, b) for a in (0, 1) for b in (0, 1)}
