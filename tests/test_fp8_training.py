"""Acceptance: the small GPT trains with FP8 on 2 CPU ranks under ZeRO stage 3 through Lightning.

One launch of tests/scripts/fp8.py (a subprocess: never Lightning multi-process inside pytest),
100 steps per configuration, same seed and data, Trainer(precision="bf16-mixed"):

* tensorwise and delayed FP8 reach a step-100 loss within 3% of bf16-mixed;
* O1's FP8 weight all-gather trains bit-identically to tensorwise FP8 without it, and with
  Fp8Linear among the "-mixed" safe modules its gradients are reduced in bf16;
* O2 keeps 3 bytes of optimizer state per parameter element (+12 per tensor) on every rank,
  against AdamW's 8 (+4).
"""

from __future__ import annotations

import pytest

from _scripts import run_json

CONFIGS = ["bf16", "tensorwise", "delayed", "tensorwise_o1", "tensorwise_o1_bf16_reduce", "delayed_o2"]


@pytest.mark.slow
def test_gpt_trains_with_fp8_on_two_ranks_under_stage_3(tmp_path):
    r = run_json("fp8.py", tmp_path / "fp8.json", "--configs", ",".join(CONFIGS), "--steps", "100",
                 "--stage", "3", "--precision", "bf16-mixed")
    base = r["bf16"]["losses"]
    assert r["bf16"]["fp8_layers"] == 0 and len(base) == 100
    for name in CONFIGS[1:]:
        losses = r[name]["losses"]
        assert len(losses) == 100 and r[name]["fp8_layers"] == 9  # every Linear of the 2-layer GPT
        assert losses[-1] < 0.6 * losses[0], name  # it learns
        assert abs(losses[-1] - base[-1]) / base[-1] < 0.03, (name, losses[-1], base[-1])
    assert r["tensorwise_o1"]["losses"] == r["tensorwise"]["losses"]
    assert "Fp8AllGatherWeight" in r["tensorwise_o1"]["local_tensor_types"]
    assert "Fp8AllGatherWeight" not in r["tensorwise"]["local_tensor_types"]
    assert r["tensorwise_o1_bf16_reduce"]["fp8_unit_reduce_dtypes"] == ["torch.bfloat16"]
    for rank in r["delayed_o2"]["ranks"]:
        total, elements, tensors = rank["bytes"]
        assert rank["optimizer"] == "Fp8AdamW" and total == 3 * elements + 12 * tensors
    for rank in r["delayed"]["ranks"]:
        total, elements, tensors = rank["bytes"]
        assert rank["optimizer"] == "AdamW" and total == 8 * elements + 4 * tensors
