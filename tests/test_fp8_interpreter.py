"""The Triton FP8 kernels, executed on CPU by Triton's interpreter, against the torch path bit for bit.

One subprocess (tests/scripts/fp8_interpreter.py, about 20 s) runs every kernel of
``fp8/kernels/_triton.py`` under ``TRITON_INTERPRET=1`` with the interpreter's fp32 -> fp8
conversion done by torch ([Note: interpreter FP8 conversion] in that script says why that
stands for the GPU's ``cvt.rn.satfinite``). These tests read its report.
"""

from __future__ import annotations

import pytest

from _scripts import run_json

pytest.importorskip("triton")

#: What the interpreter's own conversion gives for the script's PROBES (1.0625, 126.74, 0.00133)
#: in E4M3 with rtne, and what round-to-nearest-even gives (torch, and cvt.rn on a GPU).
UPSTREAM_WRONG = [1.125, 64.0, 0.0]
CORRECT = [1.0, 128.0, 2.0**-9]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_json("fp8_interpreter.py", tmp_path_factory.mktemp("fp8_interpreter") / "report.json", timeout=300)


def test_interpreted_kernels_match_torch_path_bit_for_bit(report):
    """amax, cast (with and without recording), cast_transpose, cast_rowwise (both dims): no difference."""
    assert report["mismatches"] == [], "\n".join(report["mismatches"][:20])
    # 3 input dtypes x 14 inputs x (amax + 2 formats x (2 scales x 8 cast checks + 2 dims x 2 rowwise checks)).
    assert report["checks"] == 3 * 14 * (1 + 2 * (2 * 8 + 2 * 2))
    # The inputs reached every regime of the conversion, in both formats (counted on the outputs).
    for fmt, seen in report["coverage"].items():
        for regime in ("ties", "rounded up to a power of two", "subnormal outputs", "zeros", "saturated",
                       "NaN outputs"):
            assert seen.get(regime, 0) > 0, f"{fmt}: no {regime} among the compared casts"


def test_interpreter_conversion_is_still_the_one_replaced(report):
    """Fails when a triton upgrade changes the function the harness replaces: then re-check the harness.

    If upstream fixed its rounding, the stand-in may no longer be needed (drop it and see whether
    the comparison still passes); if it moved or changed its signature, the harness must replace
    the new one, or the interpreter's wrong conversion would be compared against torch's.
    """
    upstream = report["upstream"]
    assert upstream["module"] == "triton.runtime.interpreter"
    assert upstream["params"] == ["input", "input_dtype", "output_dtype", "rounding_mode"], upstream["params"]
    assert upstream["upstream_e4m3"] == UPSTREAM_WRONG, (
        f"triton's interpreter now converts {upstream['upstream_e4m3']} (was {UPSTREAM_WRONG}, correct:"
        f" {CORRECT}): re-evaluate the torch stand-in in tests/scripts/fp8_interpreter.py.")
    assert upstream["torch_e4m3"] == CORRECT
    # The stand-in was reached for both formats: the kernels' conversions really went through it.
    assert set(report["substitute_calls"]) == {"torch.float8_e4m3fn", "torch.float8_e5m2"}
    assert min(report["substitute_calls"].values()) > 100, report["substitute_calls"]


def test_nan_reaches_loss_scaler_through_interpreted_kernels(report):
    """An Fp8Linear whose casts all run in the Triton kernels: a NaN in input or gradient skips the step."""
    layers = report["nan_layers"]
    assert layers["triton_kernel_calls"] > 0
    assert len(layers["results"]) == 6
    for case, result in layers["results"].items():
        assert result["found_inf"] and result["skipped"] == 1 and result["weight_unchanged"], (case, result)
        assert result["forward_finite"] == case.endswith("grad"), (case, result)
