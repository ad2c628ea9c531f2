"""FP8 weight all-gather under FSDP2 (ZeRO stages 1-3): ``msamp`` O1/O2.

FSDP2 lets a parameter's local tensor decide what is all-gathered: if it defines
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, FSDP2 gathers what the first returns and
builds the unsharded parameter with the second. :class:`Fp8AllGatherWeight` is that local
tensor for an Fp8Linear weight: a thin wrapper around the fp32 master shard (the optimizer,
clipping, initialisation and checkpoints see its fp32 data through ``__torch_dispatch__``).

[Note: FP8 all-gather]
* pre-all-gather: each rank takes the amax of its shard, one all-reduce (MAX) over the shard
  group makes it the whole weight's amax, and the shard is cast to E4M3 with
  ``scale = 448 / amax`` (current scaling: a weight is exactly known when it is gathered,
  whatever the recipe for activations). It travels as ``uint8`` (gloo and NCCL have no FP8
  dtype; FSDP2 also uses a uint8 buffer when a unit mixes dtypes): 1 byte per element instead
  of 2 (bf16) or 4 (fp32).
* post-all-gather: the unsharded parameter is a :class:`Fp8GatheredWeight` holding the FP8
  data and the scale; Fp8Linear's GEMMs use them directly, with no second cast. Any other op
  on it sees the dequantized weight. Its gradient is an ordinary high-precision tensor, which
  FSDP2 reduce-scatters as usual. When FSDP2 re-gathers into the same parameter (backward,
  next step) only the scale is updated in place; the data lands in the same storage.
* The shard is re-cast on every gather (backward re-gathers under ZeRO-3 give bit-identical
  data: same shard, same amax).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from torch.utils._pytree import tree_map_only

from lightning_ampzero.fp8 import kernels
from lightning_ampzero.fp8.scaling import scale_from_amax

aten = torch.ops.aten

# Ops whose result is (a view of, or a new tensor like) the wrapped weight and must stay wrapped,
# so FSDP2's sharding (chunk/narrow/view/new_zeros/copy_), materialization (empty_like) and
# device moves keep the all-gather extension. Everything else returns plain tensors.
_KEEP_WRAPPED = {
    aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default, aten.as_strided.default,
    aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.narrow.default,
    aten.select.int, aten.t.default, aten.transpose.int, aten.clone.default, aten._to_copy.default,
    aten.empty_like.default, aten.new_zeros.default, aten.new_empty.default, aten.new_empty_strided.default,
    aten._pin_memory.default,
}


class Fp8AllGatherWeight(torch.Tensor):
    """A high-precision weight (shard) that FSDP2 all-gathers in FP8; see [Note: FP8 all-gather]."""

    _tensor: Tensor
    _fp8_dtype: torch.dtype

    @staticmethod
    def __new__(cls, tensor: Tensor, fp8_dtype: torch.dtype) -> "Fp8AllGatherWeight":
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
            layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: Tensor, fp8_dtype: torch.dtype) -> None:
        self._tensor = tensor
        self._fp8_dtype = fp8_dtype

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Fp8AllGatherWeight({self._tensor!r}, fp8_dtype={self._fp8_dtype})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_tensor"], {"fp8_dtype": self._fp8_dtype}

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Tensor], meta: Any, outer_size: Any, outer_stride: Any) -> "Fp8AllGatherWeight":
        return Fp8AllGatherWeight(inner["_tensor"], meta["fp8_dtype"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        fp8_dtype = next(a._fp8_dtype for a in _leaves(args, kwargs) if isinstance(a, cls))
        uargs = tree_map_only(cls, lambda t: t._tensor, args)
        ukwargs = tree_map_only(cls, lambda t: t._tensor, kwargs or {})
        out = func(*uargs, **ukwargs)
        if func in _KEEP_WRAPPED:
            return tree_map_only(Tensor, lambda t: cls(t, fp8_dtype), out)
        if isinstance(args, (list, tuple)) and args and isinstance(args[0], cls) and out is uargs[0]:
            return args[0]  # in-place op on the wrapper (copy_, uniform_, add_, ...): return it
        return out

    # ---- FSDP2 all-gather extension ---------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: Any,
                            mp_policy: Any) -> tuple[tuple[Tensor, ...], Any]:
        import torch.distributed as dist

        shard = self._tensor
        amax = kernels.amax(shard).reshape(1)
        group = mesh.get_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        scale = scale_from_amax(amax, self._fp8_dtype)
        q = kernels.cast(shard, scale, self._fp8_dtype)
        # FSDP2 pads uneven shards on dim 0: the all-gather input must have the padded size.
        rows = -(-outer_size[0] // mesh.size()) if len(outer_size) else 0
        if q.dim() and q.shape[0] != rows:
            q = torch.nn.functional.pad(q.view(torch.uint8), (0, 0, 0, rows - q.shape[0])).view(self._fp8_dtype)
        return (q.view(torch.uint8),), (scale,)

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[Tensor, ...], metadata: Any, param_dtype: torch.dtype,
                             *, out: Optional[Tensor] = None) -> Any:
        (data,) = all_gather_outputs
        (scale,) = metadata
        data = data.view(self._fp8_dtype)
        if out is not None:
            # Re-gather into the existing unsharded parameter: its data views the same storage.
            assert isinstance(out, Fp8GatheredWeight), type(out)
            with torch.no_grad():
                out._scale.copy_(scale)
            return None
        return Fp8GatheredWeight(data, scale.clone(), param_dtype), (data,)


class Fp8GatheredWeight(torch.Tensor):
    """An unsharded weight gathered in FP8: ``_data`` (E4M3, [N, K]) and ``_scale`` (``weight ~ _data / _scale``)."""

    _data: Tensor
    _scale: Tensor

    @staticmethod
    def __new__(cls, data: Tensor, scale: Tensor, dtype: torch.dtype) -> "Fp8GatheredWeight":
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=dtype,
            device=data.device, requires_grad=False,
        )

    def __init__(self, data: Tensor, scale: Tensor, dtype: torch.dtype) -> None:
        self._data = data
        self._scale = scale

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Fp8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, fp8={self._data.dtype})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_data", "_scale"], {"dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Tensor], meta: Any, outer_size: Any, outer_stride: Any) -> "Fp8GatheredWeight":
        return Fp8GatheredWeight(inner["_data"], inner["_scale"], meta["dtype"])

    def dequantize(self) -> Tensor:
        return (self._data.float() / self._scale).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default, aten.as_strided.default, aten.view.default) and isinstance(args[0], cls):
            # Views FSDP2 takes of the unsharded parameter (nn.Parameter's detach, as_strided to
            # the original size): same FP8 data and the same scale object.
            w = args[0]
            return cls(func(w._data, *args[1:], **kwargs), w._scale, w.dtype)
        # Anything else sees the dequantized weight.
        return func(*tree_map_only(cls, lambda t: t.dequantize(), args),
                    **tree_map_only(cls, lambda t: t.dequantize(), kwargs))


def _leaves(args: Any, kwargs: Any) -> list[Any]:
    from torch.utils._pytree import tree_leaves

    return tree_leaves((args, kwargs or {}))


def unwrap_all_gather_weight(t: Any) -> Any:
    """The plain high-precision tensor (or DTensor of it) behind an :class:`Fp8AllGatherWeight`; else ``t``."""
    if isinstance(t, Fp8AllGatherWeight):
        return t._tensor
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor) and isinstance(t._local_tensor, Fp8AllGatherWeight):
        return DTensor.from_local(t._local_tensor._tensor, t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return t
