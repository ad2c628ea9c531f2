"""Gradients of a low-precision gathered parameter summed in fp32 over its uses (stage 3, "-mixed").

[Note: a module used twice in one backward]
At stage 3 under "-mixed" the ``lower_precision_safe_modules`` (the Linears) gather their
parameters in the low dtype (precision/policy.py): autocast would cast them to it anyway, and the
all-gather moves half the bytes. Autograd sums the gradients a tensor receives from its uses in a
backward in that tensor's dtype, before they reach ``.grad``. Under DDP (and stages 0-2) the
parameter is fp32 and autocast casts it once per use, so each use's low gradient is cast back to
fp32 on its own and the uses are summed in fp32. At stage 3 the gathered parameter itself was the
low tensor, so a module called twice in one backward (a siamese encoder on two views, a GAN's
discriminator on real and fake in one loss, ALBERT's shared layers) had its gradients summed in
bf16: a new-user trial's GAN ended 2.1e-3 from Lightning's ``ddp`` in its weights after 8 steps,
and an encoder applied to two views 2.0e-3, where a module used once is equal bit for bit.

So each use of such a parameter goes through its own node (:class:`_OneUse`), which passes the
low tensor on in forward and in backward hands the use's gradient, cast to fp32, to a stand-in
fp32 leaf of the parameter's shape with no storage of its own (zero strides). Autograd sums the
uses there, in fp32 and in the order DDP's fp32 leaf sums them; a hook moves the sum into the
FSDPParam's ``unsharded_accumulated_grad``, which FSDP2 reduces in place of ``.grad`` (the path of
its own fp32 accumulation between micro-batches). A module used once gets its gradient cast to
fp32 as FSDP2 casts it for the reduce-scatter: the same values.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import nn


class _OneUse(torch.autograd.Function):
    """One use of a low-precision parameter: itself in forward; its gradient, in fp32, to ``proxy``."""

    @staticmethod
    def forward(ctx: Any, low: torch.Tensor, proxy: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return low.view_as(low)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:  # type: ignore[override]
        return None, grad.to(torch.float32)


def _uniform_then(post_backward: Any, group: Any) -> Any:
    """FSDP2 reduces a group's gradients in one dtype: a parameter of the group given a low ``.grad``
    by a use outside the hooked modules (a tied weight read directly) joins the others' sums."""

    def uniform_then_post_backward(*args: Any, **kwargs: Any) -> Any:
        dtypes = {fp.unsharded_accumulated_grad.dtype for fp in group.fsdp_params
                  if fp.unsharded_accumulated_grad is not None}
        if len(dtypes) == 1:
            (dtype,) = dtypes
            for fp in group.fsdp_params:
                param = getattr(fp, "_unsharded_param", None)
                if param is not None and param.grad is not None and fp.unsharded_accumulated_grad is None:
                    fp.unsharded_accumulated_grad, param.grad = param.grad.to(dtype), None
        return post_backward(*args, **kwargs)

    return uniform_then_post_backward


class _Uses:
    """The stand-in fp32 leaves of one model's low-precision gathered parameters, by FSDPParam."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._by_slot: Optional[dict[tuple[int, str], Any]] = None
        self._proxies: dict[int, torch.Tensor] = {}

    def fsdp_param(self, module: nn.Module, name: str) -> Any:
        if self._by_slot is None:  # after FSDP2's lazy init, which may re-create nothing but is when all exist
            from torch.distributed.fsdp import FSDPModule

            self._by_slot = {}
            for m in self.model.modules():
                if isinstance(m, FSDPModule):
                    group = m._get_fsdp_state()._fsdp_param_group
                    if group is not None and not getattr(group, "_ampzero_uniform", False):
                        group.post_backward = _uniform_then(group.post_backward, group)
                        group._ampzero_uniform = True
                    for fp in group.fsdp_params if group is not None else ():
                        info = fp._module_info
                        self._by_slot[(id(info.module), info.param_name)] = fp
                        for shared, shared_name in zip(info.shared_modules, info.shared_param_names):
                            self._by_slot[(id(shared), shared_name)] = fp
        return self._by_slot.get((id(module), name))

    def proxy(self, fp: Any, like: torch.Tensor) -> torch.Tensor:
        proxy = self._proxies.get(id(fp))
        if proxy is None or proxy.shape != like.shape or proxy.device != like.device:
            proxy = torch.empty_strided(like.shape, (0,) * like.dim(), dtype=torch.float32, device=like.device)
            proxy.requires_grad_(True)

            def into_fsdp(leaf: torch.Tensor, fp: Any = fp) -> None:
                grad, leaf.grad = leaf.grad, None
                # the dtype FSDP2 itself accumulates in between micro-batches: fp32 where the group
                # reduces in it (gloo), else the wire's (the sum is still made in fp32)
                dtype = fp.reduce_dtype or fp.orig_dtype
                if fp.unsharded_accumulated_grad is None:
                    fp.unsharded_accumulated_grad = grad.to(dtype, memory_format=torch.contiguous_format)
                else:
                    fp.unsharded_accumulated_grad += grad

            proxy.register_post_accumulate_grad_hook(into_fsdp)
            self._proxies[id(fp)] = proxy
        return proxy


def sum_uses_in_fp32(model: nn.Module, modules: Iterable[nn.Module]) -> None:
    """Route each use of ``modules``' own low-precision gathered parameters through :class:`_OneUse`
    ([Note: a module used twice in one backward]). ``modules``: the stage-3 safe modules gathered in
    the low dtype (and their submodules)."""
    uses = _Uses(model)

    def before(module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        swapped = {}
        for name, param in module._parameters.items():
            if param is None or not param.requires_grad or param.dtype == torch.float32:
                continue
            fp = uses.fsdp_param(module, name)
            if fp is None or param is not getattr(fp, "_unsharded_param", None) or fp.orig_dtype != torch.float32:
                continue
            swapped[name] = param
            # a plain tensor in the slot for this call only (nn.Module.__setattr__ wants a Parameter)
            module._parameters[name] = _OneUse.apply(param, uses.proxy(fp, param))  # type: ignore[assignment]
        if swapped:
            module.__dict__["_ampzero_uses_swapped"] = swapped

    def after(module: nn.Module, args: Any, output: Any) -> None:
        swapped = module.__dict__.pop("_ampzero_uses_swapped", None)
        for name, param in (swapped or {}).items():
            module._parameters[name] = param

    for module in modules:
        if any(p is not None for p in module._parameters.values()):
            module.register_forward_pre_hook(before)
            # before FSDP2's post-forward, which reshards (puts the sharded parameters in the slots);
            # always: an exception in forward must not leave the stand-in in the slot
            module.register_forward_hook(after, prepend=True, always_call=True)
