"""Stage 0 (DDP) precision: low-precision compute copies of fp32 parameters, per-parameter reduce dtypes.

Under stages 1-3 FSDP2's MixedPrecisionPolicy does both; DDP has neither, so these two small
transforms give stage 0 the same numerics (see policy.py, [Note: master weights]):

* :func:`cast_parameters_in_forward` ("-true"): for the duration of the root module's forward,
  every floating parameter is replaced by a low-precision copy made with an autograd cast, so
  compute and activations are in the low dtype and the gradient flows back, through the cast,
  into the fp32 parameter's ``.grad``. The fp32 parameters stay the model's parameters: the
  optimizer updates them (the master weights), checkpoints save them under their usual names.
* :func:`register_reduce_dtypes`: a DDP communication hook that all-reduces each parameter's
  gradient in its own dtype (the low dtype for "-true", for the ``lower_precision_safe_modules``
  under "-mixed", or ``communication_data_type``), one collective per dtype present in a bucket.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        out = [_cast_floats(v, dtype) for v in value]
        return type(value)(*out) if hasattr(value, "_fields") else type(value)(out)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


class ParameterCast:
    """The hooks of :func:`cast_parameters_in_forward` (``remove()`` undoes it)."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        self.module, self.dtype = module, dtype
        self._depth = 0
        self._saved: list[tuple[nn.Module, str, nn.Parameter]] = []
        self._handles = [
            module.register_forward_pre_hook(self._pre, with_kwargs=True),
            module.register_forward_hook(self._post, with_kwargs=True, always_call=True),
        ]

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._depth += 1
        if self._depth == 1:
            copies: dict[int, Tensor] = {}  # tied parameters share one copy
            for sub in module.modules():
                for name, param in sub._parameters.items():
                    if param is None or not param.is_floating_point() or param.dtype == self.dtype:
                        continue
                    copy = copies.get(id(param))
                    if copy is None:
                        copy = copies[id(param)] = param.to(self.dtype)
                    self._saved.append((sub, name, param))
                    # Plain assignment into _parameters: nn.Module.__setattr__ accepts only Parameters.
                    sub._parameters[name] = copy  # type: ignore[assignment]
        # Floating inputs follow the parameters, as FSDP2's cast_forward_inputs does.
        return _cast_floats(args, self.dtype), _cast_floats(kwargs, self.dtype)

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            for sub, name, param in reversed(self._saved):
                sub._parameters[name] = param
            self._saved.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def cast_parameters_in_forward(module: nn.Module, dtype: torch.dtype) -> ParameterCast:
    """Run ``module``'s forward with ``dtype`` copies of its floating parameters (fp32 masters kept).

    The hooks sit on ``module`` (the LightningModule under stage 0, whose forward Lightning
    redirects to ``training_step`` etc.), so one cast covers the whole step, parameters used
    outside their own module's forward (tied weights) included. Nested calls of the root
    (``self(x)`` inside ``training_step``) reuse the copies.
    """
    return ParameterCast(module, dtype)


class _ReduceState:
    def __init__(self, dtypes: dict[int, torch.dtype], group: Optional[dist.ProcessGroup]) -> None:
        self.dtypes = dtypes
        self.group = group

    def __getstate__(self) -> dict:
        raise TypeError("the reduce-dtype hook state holds parameter ids and cannot be pickled")


# No annotations on bucket / return: DDP compares them to the real classes, and this module's
# `from __future__ import annotations` would turn them into strings.
def _reduce_in_dtypes(state: _ReduceState, bucket):  # type: ignore[no-untyped-def]
    group = state.group if state.group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    grads = bucket.gradients()
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, param in enumerate(bucket.parameters()):
        by_dtype.setdefault(state.dtypes.get(id(param), buffer.dtype), []).append(i)
    packs: list[tuple[list[int], Tensor]] = []
    futures = []
    for dtype, index in by_dtype.items():
        whole = len(index) == len(grads)
        flat = buffer if whole else torch.cat([grads[i].reshape(-1) for i in index])
        # Divide before the cast: the sum of world_size gradients cannot then overflow a low dtype
        # where the mean does not. In place: ``unpack`` writes every reduced value back over it.
        send = flat.div_(world).to(dtype)  # no copy where dtype is the buffer's
        futures.append(dist.all_reduce(send, group=group, async_op=True).get_future())
        packs.append((index, send))

    # [Note: stream order of the reduce-dtype hook]
    # An NCCL future completes when the all-reduce is *enqueued*; its result is ready for a reader
    # only once the reader's stream waits on NCCL's, which ``wait()`` on that future arranges (it
    # blocks no thread). ``collect_all`` returns a device-less future, and only a future built
    # with the CUDA devices of its values synchronizes streams (``torch.futures.Future``'s
    # ``devices``): so the callback waits on every NCCL future itself before reading, and the
    # result is set on a future of the buffer's device, so that DDP's own ``wait()`` on it orders
    # its reads after the copies below. On CPU (gloo) a completed future is a finished collective
    # and both steps cost nothing.
    result: torch.futures.Future = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)

    def unpack(_: torch.futures.Future) -> None:
        try:
            for future in futures:
                future.wait()
            for index, reduced in packs:
                if len(index) == len(grads):
                    if reduced is not buffer:
                        buffer.copy_(reduced)
                    continue
                offset = 0
                for i in index:
                    n = grads[i].numel()
                    grads[i].copy_(reduced[offset:offset + n].view_as(grads[i]))
                    offset += n
        except Exception as err:  # a failed collective: DDP's wait() raises it
            result.set_exception(err)
            return
        result.set_result(buffer)

    torch.futures.collect_all(futures).then(unpack)
    return result


def register_reduce_dtypes(ddp: nn.parallel.DistributedDataParallel, dtypes: dict[int, torch.dtype]) -> None:
    """All-reduce the gradient of each parameter ``p`` in ``dtypes[id(p)]`` (fp32 if absent)."""
    ddp.register_comm_hook(_ReduceState(dtypes, ddp.process_group), _reduce_in_dtypes)
