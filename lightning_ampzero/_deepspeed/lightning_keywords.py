"""Lightning's ``DeepSpeedStrategy(...)`` keywords that ``AmpZeroStrategy`` does not take, and what to write.

A user porting ``DeepSpeedStrategy(stage=3, offload_optimizer=True, contiguous_gradients=True, ...)``
got a bare "unknown argument" for most of them, where the same keys in a DeepSpeed JSON config are
either mapped or listed as having no effect, with the reason (a new-user trial). The keywords that
mean the same here (``stage``, ``reduce_bucket_size``, ``allgather_bucket_size``, ``overlap_comm``,
``nvme_path``, ``pin_memory``, ``sub_group_size``, ``process_group_backend``) are taken as they are;
the loss-scaler and activation-checkpointing ones are fields of nested sections, which the
strategy's own message names.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_ampzero._deepspeed.features import _MAX_IN_CPU
from lightning_ampzero._deepspeed.zero import _ZERO


def _remove(why: str) -> str:
    return f"has no effect here ({why}): remove it"


_AIO = ("has no effect here: swap files are read with ordinary file I/O by offload.io_threads threads"
        " (Lightning's thread_count is io_threads=...)")

#: keyword -> what to write instead (a sentence that reads after "Lightning's DeepSpeedStrategy(<keyword>=...)").
_INSTEAD = {
    "zero_optimization": "is stage=0 here for False (plain data parallel) and stage=1, 2 or 3 for ZeRO",
    "offload_parameters": "is offload_param='cpu' here (or 'nvme' with nvme_path=...), at stage=3",
    "offload_params_device": "is offload_param='cpu' or 'nvme' here",
    "offload_optimizer_device": "is offload_optimizer='cpu' or 'nvme' here",
    "remote_device": ("has no counterpart: build the model in configure_model() and it is created sharded;"
                      " offload_param='cpu' / 'nvme' says where the parameter shards live"),
    "params_buffer_count": "is param_buffer_count=... here",
    "params_buffer_size": "is param_buffer_size=... here",
    "optimizer_buffer_count": "is buffer_count=... here",
    "thread_count": "is io_threads=... here",
    "max_in_cpu": f"has no effect here: {_MAX_IN_CPU}",
    "block_size": _AIO, "queue_depth": _AIO, "single_submit": _AIO, "overlap_events": _AIO,
    "zero_allow_untested_optimizer": _remove("any torch optimizer trains with every stage"),
    "logging_batch_size_per_gpu": _remove("DeepSpeed's throughput log; use a Lightning logger or profiler"),
    "logging_level": _remove("DeepSpeed's own log level; ampzero's messages are Lightning's rank-zero info and warnings"),
    "load_full_weights": ("has no counterpart: Trainer(ckpt_path=...) loads ampzero's sharded checkpoint"
                          " directories; to start from a single file's weights, build the model in __init__ and"
                          " load_state_dict them before fit, without ckpt_path"),
    "timeout": "is timeout_s=<seconds> here (a number, not a timedelta), the process group's timeout",
    "exclude_frozen_parameters": _remove("checkpoints hold every parameter, frozen ones included"),
}
for _key in ("contiguous_gradients", "allgather_partitions", "reduce_scatter"):
    _INSTEAD[_key] = _remove(_ZERO[_key].reason)


def lightning_keyword_hint(name: str, value: Any = None) -> Optional[str]:
    """What to write instead of Lightning DeepSpeedStrategy's keyword ``name``, or None if it is not one."""
    if name == "offload_optimizer" and isinstance(value, bool):
        return ("offload_optimizer takes a device here: Lightning's DeepSpeedStrategy(offload_optimizer=True) is"
                " offload_optimizer='cpu' (or 'nvme' with nvme_path=...); False, its default, is taken as 'none'.")
    said = _INSTEAD.get(name)
    return None if said is None else f"Lightning's DeepSpeedStrategy({name}=...) {said}."
