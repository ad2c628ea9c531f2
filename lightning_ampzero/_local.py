"""The tensor a rank holds, for code that reads or writes parameters, gradients and state in place."""

from __future__ import annotations

from torch import Tensor


def local_tensor(t: Tensor) -> Tensor:
    """A DTensor's local shard, else ``t`` itself.

    ``_local_tensor`` rather than ``to_local()``: every caller works on this rank's storage under
    ``no_grad`` (copies into it, reads its storage, steps an optimizer over it), where
    ``to_local()`` would only add an autograd view per call. Duck-typed so that importing this
    does not import ``torch.distributed.tensor``.
    """
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local
