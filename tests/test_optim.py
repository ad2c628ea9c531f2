"""adam_implementation: fused Adam(W) where torch has the kernels, with foreach's update rule."""

from __future__ import annotations

import torch

from lightning_ampzero.models.gpt import GPTConfig, GPTModule
from lightning_ampzero.optim import adam_implementation


def test_fused_on_cpu_foreach_elsewhere():
    cpu = [torch.zeros(2, requires_grad=True)]
    assert adam_implementation(cpu) == {"fused": True}
    assert adam_implementation([{"params": cpu}, {"params": [torch.zeros(1)]}]) == {"fused": True}
    assert adam_implementation([torch.zeros(2, device="meta")]) == {"foreach": True}  # no fused kernel there
    assert adam_implementation([]) == {"foreach": True}


def test_gpt_module_steps_with_the_fused_kernel_and_foreach_numerics():
    torch.manual_seed(0)
    module = GPTModule(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64), lr=1e-2)
    module.configure_model()
    opt = module.configure_optimizers()
    opt = opt["optimizer"] if isinstance(opt, dict) else opt
    assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)
    # The same steps with foreach, from the same start: the update rule is the same.
    params = [p for g in opt.param_groups for p in g["params"]]
    start = [p.detach().clone() for p in params]
    copies = iter(p.detach().clone().requires_grad_() for p in params)
    ref_groups = [{**g, "fused": None, "foreach": True, "params": [next(copies) for _ in g["params"]]}
                  for g in opt.param_groups]
    ref_opt = torch.optim.AdamW(ref_groups)
    reference = [p for g in ref_opt.param_groups for p in g["params"]]
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        for p, r in zip(params, reference):
            p.grad = torch.randn(p.shape, generator=g)
            r.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    for p, r, s in zip(params, reference, start):
        assert not torch.equal(p, s)  # it moved
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-7)
