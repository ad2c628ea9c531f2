"""FP8 on a GPU: kernel check, Fp8Linear forward+backward against bf16, tokens/s of a GPT block stack.

A benchmark, not a test; it needs a CUDA GPU with FP8 (compute capability 8.9+: Ada, Hopper).
Written on a machine without one; the kernels and linear parts ran on one H100
(benchmarks/results/fp8_nvidia_h100_80gb_hbm3.md), the blocks part has not run yet.

1. ``kernels``: the Triton casts (fused amax+scale+cast, cast+transpose, row-wise) against the
   torch path, bit for bit, and their bandwidth (GB/s of input read + FP8 written).
2. ``linear``: median time of forward+backward of one layer, ``M`` tokens by square ``N x N``
   weights (4096, 6144, 8192 by default): bf16 ``nn.Linear`` (bf16 weights and input) against
   ``Fp8Linear`` (same bf16 weights, each recipe); speed-up = bf16 time / FP8 time (target 1.3x).
3. ``blocks``: training tokens/s of a stack of GPT blocks (``lightning_ampzero.models.gpt.Block``),
   bf16-mixed (autocast, fp32 weights) against the same with every Linear converted to FP8.

Usage::

    python benchmarks/bench_fp8.py [--sizes 4096,6144,8192] [--tokens 8192] [--recipes tensorwise,delayed,rowwise]
                                   [--target 1.3] [--layers 8 --width 4096 --seq 2048 --batch 4] [--compile]

Without such a GPU it prints why and exits with status 2. ``tests/test_gpu_fp8.py`` (``-m gpu``)
runs the ``linear`` part at 4096 and 8192 as a test (FP8 close to bf16, and not slower).

Writes ``benchmarks/results/fp8_<gpu>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from lightning_ampzero.config import Fp8Config  # noqa: E402
from lightning_ampzero.fp8 import convert_to_fp8, kernels  # noqa: E402
from lightning_ampzero.models.gpt import Block, GPTConfig  # noqa: E402


def _time_ms(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_kernels(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    out: dict = {"bit_exact": {}, "GBps": {}}
    x = (torch.randn(args.tokens, 8192, device="cuda") * torch.logspace(-6, 3, 8192, device="cuda")).bfloat16()
    scale = torch.tensor(0.37, device="cuda")
    for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
        a1, a2 = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
        q1, t1 = kernels.cast_transpose(x, scale, fmt, a1, backend="triton")
        q2, t2 = kernels.cast_transpose(x, scale, fmt, a2, backend="torch")
        r1, s1 = kernels.cast_rowwise(x, fmt, backend="triton")
        r2, s2 = kernels.cast_rowwise(x, fmt, backend="torch")
        out["bit_exact"][str(fmt)] = {
            "cast_transpose": torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))
            and torch.equal(t1.view(torch.uint8), t2.view(torch.uint8)) and torch.equal(a1, a2),
            "rowwise": torch.equal(s1, s2) and torch.equal(r1.view(torch.uint8), r2.view(torch.uint8)),
            "amax": torch.equal(kernels.amax(x, backend="triton"), kernels.amax(x, backend="torch")),
        }
    nbytes = x.numel() * (2 + 1)
    for backend in ("triton", "torch"):
        for name, fn in {
            "cast+amax": lambda: kernels.cast(x, scale, torch.float8_e4m3fn, torch.zeros(1, device="cuda"), backend=backend),
            "cast_transpose": lambda: kernels.cast_transpose(x, scale, torch.float8_e5m2, backend=backend),
            "rowwise": lambda: kernels.cast_rowwise(x, torch.float8_e4m3fn, backend=backend),
        }.items():
            ms = _time_ms(fn, args.iters, args.warmup)
            extra = 1 if name == "cast_transpose" else 0  # writes two FP8 copies
            out["GBps"][f"{name}/{backend}"] = round((nbytes + extra * x.numel()) / ms / 1e6, 1)
    return out


def _fwd_bwd(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    def step() -> None:
        y = layer(x)
        y.backward(grad)

    return step


def _outputs(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """y, grad_x and grad_W of one forward+backward (fresh gradients)."""
    x = x.detach().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = layer(x)
    y.backward(grad)
    return {"y": y.detach().float(), "grad_x": x.grad.float(), "grad_w": layer[0].weight.grad.float()}


def bench_linear(args: argparse.Namespace) -> list[dict]:
    """Forward+backward of one M x N x N layer: bf16 nn.Linear against Fp8Linear per recipe.

    Each row has the times, ``<recipe>_speedup`` (bf16 time / FP8 time; ``target_met`` against
    ``args.target``) and ``<recipe>_rel_err``: ||FP8 - bf16|| / ||bf16|| of y, grad_x and grad_W,
    so that a fast but wrong layer does not pass for a speed-up.
    """
    rows = []
    for n in args.sizes:
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(n, n, bias=False, device="cuda", dtype=torch.bfloat16))
        x = torch.randn(args.tokens, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(args.tokens, n, device="cuda", dtype=torch.bfloat16)
        reference = _outputs(base, x, grad)
        bf16_ms = _time_ms(_fwd_bwd(base, x, grad), args.iters, args.warmup)
        row = {"M": args.tokens, "N=K": n, "bf16_ms": round(bf16_ms, 3), "casts": kernels.kernel_backend(x).__name__}
        for recipe in args.recipes:
            fp8 = copy.deepcopy(base)
            convert_to_fp8(fp8, Fp8Config(recipe=recipe, min_features=0))
            got = _outputs(fp8, x, grad)
            row[f"{recipe}_rel_err"] = {k: round(float((got[k] - v).norm() / v.norm()), 4)
                                        for k, v in reference.items()}
            if args.compile:
                fp8 = torch.compile(fp8)
            ms = _time_ms(_fwd_bwd(fp8, x, grad), args.iters, args.warmup)
            row[f"{recipe}_ms"] = round(ms, 3)
            row[f"{recipe}_speedup"] = round(bf16_ms / ms, 3)
            row[f"{recipe}_target_met"] = bf16_ms / ms >= args.target
        rows.append(row)
        print(row, flush=True)
    return rows


def bench_blocks(args: argparse.Namespace) -> dict:
    cfg = GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=args.width // 128, block_size=args.seq,
                    vocab_size=256)
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = nn.Sequential(*[Block(cfg) for _ in range(cfg.n_layer)])
    x = torch.randn(args.batch, args.seq, args.width, device="cuda")
    out = {"layers": args.layers, "width": args.width, "seq": args.seq, "batch": args.batch}
    variants = {"bf16-mixed": base}
    for recipe in args.recipes:
        model = copy.deepcopy(base)
        convert_to_fp8(model, Fp8Config(recipe=recipe, min_features=0))
        variants[f"fp8-{recipe}"] = model
    for name, model in variants.items():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        step_model = torch.compile(model) if args.compile else model

        def step() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = step_model(x)
            y.float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        ms = _time_ms(step, max(3, args.iters // 4), args.warmup)
        out[f"{name}_tokens_per_s"] = round(args.batch * args.seq / (ms / 1e3))
        print(name, out[f"{name}_tokens_per_s"], "tokens/s", flush=True)
        step = opt = None  # type: ignore[assignment]  # free the optimizer state before the next variant
    base_tps = out["bf16-mixed_tokens_per_s"]
    for recipe in args.recipes:
        out[f"fp8-{recipe}_speedup"] = round(out[f"fp8-{recipe}_tokens_per_s"] / base_tps, 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description="FP8 on a CUDA GPU (compute capability 8.9+): kernels, one layer, a GPT block stack.")
    p.add_argument("--sizes", default="4096,6144,8192", help="linear: N = K of the square weights, comma-separated")
    p.add_argument("--tokens", type=int, default=8192, help="linear/kernels: M, the rows of the input")
    p.add_argument("--recipes", default="tensorwise,delayed,rowwise", help="FP8 recipes to compare with bf16")
    p.add_argument("--target", type=float, default=1.3, help="linear: the speed-up over bf16 a row must reach")
    p.add_argument("--layers", type=int, default=8, help="blocks: number of GPT blocks")
    p.add_argument("--width", type=int, default=4096, help="blocks: n_embd")
    p.add_argument("--seq", type=int, default=2048, help="blocks: sequence length")
    p.add_argument("--batch", type=int, default=4, help="blocks: sequences per step")
    p.add_argument("--iters", type=int, default=20, help="timed iterations (median reported)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations first")
    p.add_argument("--compile", action="store_true", help="torch.compile the FP8 modules / block stacks")
    p.add_argument("--parts", default="kernels,linear,blocks", help="which of kernels, linear, blocks to run")
    args = p.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.recipes = args.recipes.split(",")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        # Exit status 2, not a traceback: nothing to measure here. CPU CI covers the same code
        # paths by other means (tests/test_fp8_meta.py: CUDA's GEMM rules on meta tensors).
        print("bench_fp8.py needs a CUDA GPU with compute capability 8.9+ (FP8); none here, nothing measured.",
              file=sys.stderr)
        sys.exit(2)
    gpu = torch.cuda.get_device_name()
    results: dict = {"gpu": gpu, "torch": torch.__version__, "compile": args.compile}
    parts = args.parts.split(",")
    if "kernels" in parts:
        results["kernels"] = bench_kernels(args)
        print(results["kernels"], flush=True)
    if "linear" in parts:
        results["linear"] = bench_linear(args)
    if "blocks" in parts:
        results["blocks"] = bench_blocks(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"fp8_{gpu.replace(' ', '_').lower()}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    lines = [f"# FP8 on {gpu} (torch {torch.__version__}, compile={args.compile})", ""]
    if "linear" in results:
        keys = [k for k in results["linear"][0] if not k.endswith("_rel_err")]
        lines += [f"Forward+backward, speed-up target {args.target}x over bf16.", ""]
        lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in results["linear"]]
        lines += ["", "Relative error against bf16 (||fp8 - bf16|| / ||bf16||):", "```"]
        lines += [json.dumps({f"N={r['N=K']}": {k: v for k, v in r.items() if k.endswith("_rel_err")}})
                  for r in results["linear"]]
        lines += ["```"]
    if "blocks" in results:
        lines += ["", "```", json.dumps(results["blocks"], indent=2), "```"]
    if "kernels" in results:
        lines += ["", "```", json.dumps(results["kernels"], indent=2), "```"]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
