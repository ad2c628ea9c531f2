"""Every Triton FP8 kernel under Triton's interpreter (CPU), bit for bit against the torch path.

``python tests/scripts/fp8_interpreter.py --out result.json`` (run by tests/test_fp8_interpreter.py).
A script, not a test module: ``TRITON_INTERPRET=1`` is read when ``@triton.jit`` runs, i.e. when
``fp8/kernels/_triton.py`` is imported, so it must be set in a process of its own (set in the
pytest process it would turn every kernel into an ``InterpretedFunction``, which
``test_triton_kernels_compile_for_sm90`` cannot compile).

[Note: interpreter FP8 conversion] The interpreter executes the kernels' Python (loads,
stores, atomics, reductions, ``div_rn``, the clamps with their NaN mode) with numpy, but
converts fp32 to FP8 with its own bit manipulation, ``triton.runtime.interpreter._convert_float``
(triton 3.9), which is wrong: it rounds half up on one guard bit (no ties-to-even), ORs a
mantissa carry into the exponent (126.74 -> 64 instead of 128 in E4M3) and flushes subnormals
(0.00133 -> 0). On a GPU that conversion is ``cvt.rn.satfinite`` (round to nearest even,
saturating; ``test_triton_kernels_compile_for_sm90`` checks the PTX). Here that one conversion,
fp32 -> E4M3/E5M2 with ``rtne``, is done by torch's ``.to()``, which rounds to nearest even with
subnormals. Torch does not saturate (E4M3 overflows to NaN, E5M2 to inf), but the kernels clamp
to the format's max before converting, so for every value they convert (finite within range, or
NaN) torch's result is the GPU's; the stand-in refuses anything else, so a kernel that stopped
clamping fails here instead of being hidden. Every other conversion stays the interpreter's.
``upstream_facts`` records what the replaced function does, so a triton upgrade that changes it
fails ``test_interpreter_conversion_is_still_the_one_replaced``.

What is compared, for fp32, bf16 and fp16 inputs, E4M3 and E5M2: ``amax``; ``cast`` with and
without amax recording (into an empty slot and into one holding a larger value);
``cast_transpose`` with recording; ``cast_rowwise`` along both dims. Outputs must have the same
dtype, shape, strides, the same NaN positions and the same bits everywhere else (NaN bits are
not compared: torch keeps a NaN's sign, ``cvt`` writes a canonical NaN). Also: NaN in an
Fp8Linear's input or output gradient, with every cast done by the interpreted kernels, must make
the loss scaler skip the step.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton's jit (see the docstring)

import argparse  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter as _interp  # noqa: E402

from fp8_interpreter_shared import CASES, differences, nan_reaches_scaler  # noqa: E402
from lightning_ampzero.fp8.kernels import FP8_MAX, _torch  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_TORCH_FP8 = {"fp8e4nv": E4M3, "fp8e5": E5M2}
#: fp32 inputs whose E4M3 conversion shows each known defect: a tie (1.0625: half up gives
#: 1.125, ties-to-even 1.0), a mantissa carry (126.74: 64 instead of 128), a subnormal
#: (0.00133: 0 instead of 2**-9).
PROBES = [1.0625, 126.74, 0.00133]


class TorchFp8Conversion:
    """Replaces ``_convert_float`` for fp32 -> E4M3/E5M2 with rtne (see [Note: interpreter FP8 conversion])."""

    def __init__(self, upstream: Callable[..., np.ndarray]) -> None:
        self.upstream = upstream
        self.calls: Counter[str] = Counter()

    def __call__(self, input: np.ndarray, input_dtype: Any, output_dtype: Any, rounding_mode: Any) -> np.ndarray:
        target = _TORCH_FP8.get(getattr(output_dtype, "name", None))
        if target is None or input_dtype != tl.float32:
            return self.upstream(input, input_dtype, output_dtype, rounding_mode)
        if rounding_mode != _interp._ir.ROUNDING_MODE.RTNE:
            raise AssertionError(f"a kernel converts to {output_dtype} with rounding {rounding_mode}, not rtne: the"
                                 " torch stand-in (round to nearest even) would not be what the GPU computes.")
        values = torch.from_numpy(np.array(input, dtype=np.float32))
        unclamped = values.isinf() | (values.abs() > FP8_MAX[target])
        if unclamped.any():
            raise AssertionError(f"a kernel converts {values[unclamped][:4].tolist()} to {target} without clamping:"
                                 " torch overflows there where cvt.rn.satfinite saturates. Clamp before converting.")
        self.calls[str(target)] += 1
        return values.to(target).view(torch.uint8).numpy().reshape(np.shape(input))


def _decode(codes: np.ndarray, fmt: torch.dtype) -> list[float]:
    return torch.from_numpy(np.array(codes, dtype=np.uint8)).view(fmt).float().tolist()


def upstream_facts(upstream: Callable[..., np.ndarray]) -> dict[str, Any]:
    """What the replaced conversion is and does on ``PROBES``, next to torch's answers."""
    probes = np.array(PROBES, dtype=np.float32)
    return {
        "module": upstream.__module__,
        "params": list(inspect.signature(upstream).parameters),
        "upstream_e4m3": _decode(upstream(probes, tl.float32, tl.float8e4nv, _interp._ir.ROUNDING_MODE.RTNE), E4M3),
        "torch_e4m3": torch.from_numpy(probes).to(E4M3).float().tolist(),
    }


def install() -> TorchFp8Conversion:
    upstream = getattr(_interp, "_convert_float", None)
    if upstream is None:
        raise AssertionError("triton.runtime.interpreter._convert_float is gone: find where this triton version"
                             " converts fp32 to fp8 in the interpreter and replace that (see the docstring).")
    substitute = TorchFp8Conversion(upstream)
    _interp._convert_float = substitute
    return substitute


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------

#: 1 row, 1 column, one 16x16 tile, non-multiples of 16, rows longer than the row-wise kernel's
#: 256-column block, more elements than one 4096-element block and several 64x64 tiles.
SHAPES = [(1, 1), (1, 37), (37, 1), (16, 16), (17, 33), (5, 300), (70, 130)]
#: Scaled by 1 these land on: ties (1.0625, 1.1875, 124, 248, 3 * 2**-10, 1.125 and 1.375 in
#: E5M2), carries into the next power of two (126.74, 7.9, 0.99), subnormals (0.00133, 2**-9,
#: 2**-10, 2**-16, 2**-17, 3 * 2**-17), saturation (447.9, 464, 500, 61440, 1e9), signed zeros.
CRAFTED = [1.0625, 1.1875, 124.0, 248.0, 3 * 2**-10, 1.125, 1.375, 126.74, 7.9, 0.99, 0.00133, 2**-9, 2**-10,
           2**-16, 2**-17, 3 * 2**-17, 447.9, 464.0, 500.0, 57343.0, 61440.0, 1e9, 0.0, -0.0, -1.0625, -126.74]


def _inputs(dtype: torch.dtype, gen: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    cases = []
    for m, n in SHAPES:
        # Magnitudes over 9 decades: small elements scale into the formats' subnormals.
        x = torch.randn(m, n, generator=gen) * torch.logspace(-6, 3, n).reshape(1, n)
        if m > 2 and n > 2:
            x[1] = 0.0  # an all-zero row and column: the amax floor (EPS) in row-wise scaling
            x[:, 1] = 0.0
        cases.append((f"{m}x{n}", x.to(dtype)))
    base = torch.randn(48, 20, generator=gen) * 3
    cases.append(("20x48 transposed view", base.to(dtype).t()))
    crafted = torch.tensor(CRAFTED)
    cases.append(("crafted row", crafted.reshape(1, -1).to(dtype)))
    cases.append(("crafted column", crafted.reshape(-1, 1).to(dtype)))
    special = torch.randn(17, 33, generator=gen) * 10
    inf, nan = float("inf"), float("nan")
    for name, values in (("+inf", {(3, 4): inf}), ("-inf", {(0, 32): -inf}), ("nan", {(5, 6): nan}),
                         ("nan and inf", {(2, 2): nan, (9, 1): inf})):
        x = special.clone()
        for position, value in values.items():
            x[position] = value
        cases.append((f"17x33 with {name}", x.to(dtype)))
    return cases


# ------------------------------------------------------------------------------------------------
# Comparison and coverage
# ------------------------------------------------------------------------------------------------


def coverage(y: torch.Tensor, q: torch.Tensor) -> Counter[str]:
    """What the reference cast ``q`` of the fp32 products ``y = x * scale`` exercised."""
    fmt = q.dtype
    y, qf = y.double().flatten(), q.float().double().flatten()
    codes = q.contiguous().view(torch.uint8).flatten().int()
    exp_mask = 0x78 if fmt == E4M3 else 0x7C
    finite = qf.isfinite() & y.isfinite()
    fmax = FP8_MAX[fmt]
    inexact = finite & (qf != y) & (y.abs() <= fmax)
    mirror = (2 * y - qf)[inexact]  # the other neighbour exactly when y is halfway between two values
    tie = (mirror.float().to(fmt).double() == mirror) & (mirror != qf[inexact])
    power_of_two = (qf.abs() > 0) & ((codes & (0x7F & ~exp_mask)) == 0) & ((codes & exp_mask) != 0)
    return Counter({
        "ties": int(tie.sum()),
        "rounded up to a power of two": int((inexact & power_of_two & (y.abs() < qf.abs())).sum()),
        "subnormal outputs": int((((codes & exp_mask) == 0) & ((codes & 0x7F) != 0)).sum()),
        "zeros": int((qf == 0).sum()),
        "saturated": int((finite & (y.abs() > fmax)).sum()),
        "NaN outputs": int(qf.isnan().sum()),
    })


def compare_all() -> dict[str, Any]:
    from lightning_ampzero.fp8.kernels import _triton

    gen = torch.Generator().manual_seed(0)
    mismatches: list[str] = []
    covered: dict[str, Counter[str]] = {str(E4M3): Counter(), str(E5M2): Counter()}
    checks = 0

    def check(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        nonlocal checks
        checks += 1
        diff = differences(got, want)
        if diff:
            mismatches.append(f"{what}: {diff}")

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for name, x in _inputs(dtype, gen):
            where = f"{dtype} {name}"
            check(f"amax {where}", _triton.amax(x), _torch.amax(x))
            for fmt in (E4M3, E5M2):
                dyn = FP8_MAX[fmt] / _torch.amax(x).clamp(min=1e-12)
                for scale_name, scale in (("dynamic scale", dyn), ("scale 1", torch.tensor(1.0))):
                    w = f"{where} {fmt} {scale_name}"
                    check(f"cast {w}", _triton.cast(x, scale, fmt), _torch.cast(x, scale, fmt))
                    for start in (0.0, 1e30):  # recording into an empty slot and one holding more
                        s1, s2 = torch.tensor([start]), torch.tensor([start])
                        q1, q2 = _triton.cast(x, scale, fmt, s1), _torch.cast(x, scale, fmt, s2)
                        check(f"cast+amax {w} slot {start}", q1, q2)
                        check(f"cast+amax slot {w} slot {start}", s1, s2)
                    s1, s2 = torch.zeros(1), torch.zeros(1)
                    q1, t1 = _triton.cast_transpose(x, scale, fmt, s1)
                    q2, t2 = _torch.cast_transpose(x, scale, fmt, s2)
                    check(f"cast_transpose {w}", q1, q2)
                    check(f"cast_transpose transposed {w}", t1, t2)
                    check(f"cast_transpose slot {w}", s1, s2)
                    y = (x.float() * scale.float()).flatten()
                    covered[str(fmt)].update(coverage(y, q2))
                for dim in (-1, 0):
                    (q1, r1), (q2, r2) = _triton.cast_rowwise(x, fmt, dim), _torch.cast_rowwise(x, fmt, dim)
                    check(f"cast_rowwise dim={dim} {where} {fmt}", q1, q2)
                    check(f"cast_rowwise scale dim={dim} {where} {fmt}", r1, r2)
                    covered[str(fmt)].update(coverage((x.float() * r2).flatten(), q2))
    return {"checks": checks, "mismatches": mismatches, "coverage": {k: dict(v) for k, v in covered.items()}}


# ------------------------------------------------------------------------------------------------
# NaN through an Fp8Linear to the loss scaler, with every cast done by the interpreted kernels
# ------------------------------------------------------------------------------------------------


def nan_through_layers() -> dict[str, Any]:
    from lightning_ampzero.fp8 import kernels
    from lightning_ampzero.fp8.kernels import _triton

    calls = 0
    real = kernels.kernel_backend

    def triton_everywhere(t: torch.Tensor, backend: Any = None) -> Any:
        nonlocal calls
        calls += 1
        return _triton

    kernels.kernel_backend = triton_everywhere  # CPU tensors normally take the torch path
    try:
        results = {f"{recipe} {where}": nan_reaches_scaler(recipe, where) for recipe, where in CASES}
    finally:
        kernels.kernel_backend = real
    return {"results": results, "triton_kernel_calls": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    substitute = install()
    result: dict[str, Any] = {"upstream": upstream_facts(substitute.upstream)}
    result.update(compare_all())
    result["nan_layers"] = nan_through_layers()
    result["substitute_calls"] = dict(substitute.calls)
    result["seconds"] = time.perf_counter() - start
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
