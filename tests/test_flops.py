"""Model FLOP utilisation (issue 16): model FLOPs per token, the GEMM peak, and the step-time
breakdown of ``run.profile_steps`` measured on a loop whose GEMM FLOPs are known by hand."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from lightning_ampzero.cli.profile import CATEGORIES, breakdown
from lightning_ampzero.flops import compute_dtype, gemm_peak_flops, model_flops_per_token, precision_peak_flops
from lightning_ampzero.models.gpt import GPT, GPTConfig


def test_model_flops_per_token_is_palms_formula():
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
    model = GPT(cfg)
    numel = sum(p.numel() for p in model.parameters())
    embeddings = cfg.vocab_size * cfg.n_embd + cfg.block_size * cfg.n_embd
    expected = 6 * (numel - embeddings) + 12 * cfg.n_layer * 64 * cfg.n_embd
    assert model_flops_per_token(model, 64) == expected
    # A head tied to the token embedding does model work: its matmul is counted.
    model.head.weight = model.wte.weight
    tied_numel = sum(p.numel() for p in model.parameters())
    assert model_flops_per_token(model, 64) == 6 * (tied_numel - cfg.block_size * cfg.n_embd) + \
        12 * cfg.n_layer * 64 * cfg.n_embd
    # No embeddings, no blocks (an MLP): 6 N.
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16))
    assert model_flops_per_token(mlp, 10) == 6 * sum(p.numel() for p in mlp.parameters())


def test_gemm_peak_is_a_measured_rate(monkeypatch):
    start = time.perf_counter()
    peak = gemm_peak_flops(n=256, seconds=0.2)
    assert time.perf_counter() - start < 5
    assert 1e8 < peak < 1e14  # FLOP/s of one CPU process: more than a toy, less than a GPU
    assert compute_dtype("bf16-mixed") is torch.bfloat16 and compute_dtype("16-true") is torch.float16
    assert compute_dtype("32-true") is torch.float32
    # A low precision's bar is the faster of its GEMM and fp32's (fp16 on a CPU without fp16 units
    # is far slower than fp32). Checked on fixed rates: two timings of a loaded machine (the suite
    # beside other jobs) once put a measured fp16 bar below half a later fp32 measurement.
    import lightning_ampzero.flops as flops

    rates = {torch.float32: 93e9, torch.float16: 1e9, torch.bfloat16: 250e9}
    monkeypatch.setattr(flops, "gemm_peak_flops", lambda dtype=torch.float32, device="cpu": rates[dtype])
    assert precision_peak_flops("16-mixed") == 93e9 and precision_peak_flops("16-true") == 93e9
    assert precision_peak_flops("bf16-mixed") == 250e9 and precision_peak_flops("32-true") == 93e9


def test_breakdown_of_a_step_with_the_closure_inside_the_optimizer_step():
    """As Lightning runs it: forward and backward inside ``optimizer.step(closure)``. The update is
    counted as optimizer, the matmuls as gemm, with exactly the FLOPs of 3 Linear layers."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    batch, width = 32, 64
    model = nn.Sequential(nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width))
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.randn(batch, width)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    opt.step(closure)  # warm-up: state allocated
    steps = 4
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            opt.step(closure)
        wall = time.perf_counter() - start
    result = breakdown(prof.events(), wall, steps)
    parts = result["seconds_per_step"]
    assert list(parts) == list(CATEGORIES)
    assert sum(parts.values()) == pytest.approx(result["step_s"], rel=1e-6)
    assert parts["gemm"] > 0 and parts["optimizer"] > 0 and parts["other ops"] > 0
    assert parts["communication"] == 0 and parts["attention"] == 0
    # The update (AdamW's foreach kernels) is the optimizer's, not "other ops", although the label
    # Optimizer.step also covers the closure's forward and backward.
    update = sum(e.self_cpu_time_total for e in prof.events() if e.name.startswith("aten::_foreach")) / 1e6 / steps
    assert update > 0 and parts["optimizer"] >= update
    # Forward: 3 GEMMs; backward: 3 weight gradients + 2 input gradients (x needs none).
    assert result["gemm_flops_per_step"] == 8 * 2 * batch * width * width
