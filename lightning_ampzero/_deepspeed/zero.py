"""DeepSpeed's ``zero_optimization`` section -> ``zero.*`` (its offload keys: ``features.py``)."""

from __future__ import annotations

from typing import Any

from lightning_ampzero._deepspeed import features
from lightning_ampzero._deepspeed.common import _FSDP, _HANDLED, _MONITOR, _NOT_YET, _NoEffect

_ZERO: dict[str, Any] = {
    "stage": "zero.stage",
    "reduce_bucket_size": "zero.reduce_bucket_size",
    "allgather_bucket_size": "zero.allgather_bucket_size",
    "stage3_prefetch_bucket_size": "zero.prefetch_bucket_size",
    "prefetch_bucket_size": "zero.prefetch_bucket_size",
    "stage3_param_persistence_threshold": "zero.param_persistence_threshold",
    "param_persistence_threshold": "zero.param_persistence_threshold",
    "zero_hpz_partition_size": "zero.hpz_partition_size",
    "offload_optimizer": _HANDLED,
    "offload_param": _HANDLED,
    "cpu_offload": _HANDLED,
    "cpu_offload_params": _HANDLED,
    "cpu_offload_param": _HANDLED,  # the spelling of DeepSpeed's current ZeRO config model
    "cpu_offload_use_pin_memory": _HANDLED,
    "overlap_comm": "zero.overlap_comm",  # stages 1-3 (convert_zero: a note at stage 0)
    "contiguous_gradients": _NoEffect("FSDP2 reduces gradients from contiguous buffers already"),
    "reduce_scatter": _NoEffect("stages 2-3 always reduce-scatter gradients"),
    "allgather_partitions": _NoEffect("parameters are always all-gathered per communication unit"),
    "use_multi_rank_bucket_allreduce": _NoEffect(_FSDP),
    "round_robin_gradients": _NoEffect(_FSDP),
    "sub_group_size": _HANDLED,
    "stage3_max_live_parameters": _NoEffect("live parameters are bounded by the units in flight (prefetch_bucket_size)"),
    "max_live_parameters": _NoEffect("live parameters are bounded by the units in flight (prefetch_bucket_size)"),
    "stage3_max_reuse_distance": "zero.max_reuse_distance",
    "max_reuse_distance": "zero.max_reuse_distance",
    "stage3_model_persistence_threshold": _NoEffect("use param_persistence_threshold"),
    "model_persistence_threshold": _NoEffect("use param_persistence_threshold"),
    "stage3_gather_16bit_weights_on_model_save": _NoEffect(
        "checkpoints are sharded directories; consolidate one into a single file when you need it"
    ),
    "stage3_gather_fp16_weights_on_model_save": _NoEffect(
        "checkpoints are sharded directories; consolidate one into a single file when you need it"
    ),
    "gather_16bit_weights_on_model_save": _NoEffect(
        "checkpoints are sharded directories; consolidate one into a single file when you need it"
    ),
    "stage3_module_granularity_threshold": _NoEffect("units are built from reduce/allgather bucket sizes"),
    "module_granularity_threshold": _NoEffect("units are built from reduce/allgather bucket sizes"),
    "stage3_use_all_reduce_for_fetch_params": _NoEffect(_FSDP),
    "use_all_reduce_for_fetch_params": _NoEffect(_FSDP),
    "elastic_checkpoint": _NoEffect("checkpoints reshard through torch.distributed.checkpoint"),
    "load_from_fp32_weights": _NoEffect("checkpoints hold the fp32 shards"),
    "ignore_unused_parameters": _NoEffect("FSDP2 tolerates unused parameters"),
    "legacy_stage1": _NoEffect("there is one stage-1 implementation"),
    "memory_efficient_linear": _NoEffect("linear layers are torch's"),
    "override_module_apply": _NoEffect("modules are built in configure_model under the sharded context"),
    "pipeline_loading_checkpoint": _NoEffect("not part of lightning_ampzero"),
    "log_trace_cache_warnings": _NoEffect(_MONITOR),
    "zero_quantized_weights": _NoEffect("ZeRO++ quantized communication is " + _NOT_YET),
    "zero_quantized_nontrainable_weights": _NoEffect("ZeRO++ quantized communication is " + _NOT_YET),
    "zero_quantized_gradients": _NoEffect("ZeRO++ quantized communication is " + _NOT_YET),
    "zeropp_loco_param": _NoEffect("ZeRO++ quantized communication is " + _NOT_YET),
    "mics_shard_size": _NoEffect("MiCS is not part of lightning_ampzero (see hpz_partition_size)"),
    "mics_hierarchical_params_gather": _NoEffect("MiCS is not part of lightning_ampzero"),
    "cpuadam_cores_perc": _NoEffect("there is no DeepSpeed CPU Adam here"),
}


# Mapped keys that act only at stage 3 (the ``zero.*`` fields they set are read only there).
_STAGE3_ONLY = ("stage3_prefetch_bucket_size", "prefetch_bucket_size", "stage3_param_persistence_threshold",
                "param_persistence_threshold", "zero_hpz_partition_size", "stage3_max_reuse_distance",
                "max_reuse_distance")


def convert_zero(conv: Any, z: dict[str, Any]) -> None:
    if "stage" not in z:  # DeepSpeed's default, with or without the section: no ZeRO, plain data parallel
        conv.set("zero.stage", 0, "zero_optimization.stage (absent: DeepSpeed's default)")
        # said, as the strategy's own default is stage 2 (unless a stage= given beside the config wins)
        if not conv.stage_given:
            conv.notes.append(("zero_optimization.stage", "absent: stage 0 as in DeepSpeed, plain data parallel"
                               " (DDP); set it, or pass stage= to AmpZeroStrategy, for ZeRO"))
    if not z:
        return
    stage = z.get("stage", 0)
    if stage == 0 and z.get("overlap_comm") is not None:
        z = {k: v for k, v in z.items() if k != "overlap_comm"}
        conv.no_effect.append(("zero_optimization.overlap_comm", "stage 0 is DDP, whose all-reduce always overlaps backward"))
    if stage == 3 and z.get("allgather_bucket_size") is not None:
        # DeepSpeed's stage-3 optimizer is not given it (its all-gathers follow the prefetch bucket);
        # here it would shrink the units (the smaller of the two bucket sizes): a trial saw 1e8 applied.
        z = {k: v for k, v in z.items() if k != "allgather_bucket_size"}
        conv.no_effect.append(("zero_optimization.allgather_bucket_size", "DeepSpeed's stage 3 does not read it"
                               " (its all-gathers follow stage3_prefetch_bucket_size), so neither does this import"))
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        if z.get(key) == 0 and not isinstance(z.get(key), bool):
            # DeepSpeed accepts 0 (ge=0: every tensor its own bucket; transformers' own test config
            # has it) where zero.* takes at least 1 element; refused before (a new-user trial).
            z = {**z, key: 1}
            conv.notes.append((f"zero_optimization.{key}", "0 read as 1 element: the smallest buckets, every module"
                               " a communication unit of its own (many small collectives; leave the key out for"
                               " the default, 5e8)"))
    conv.walk(z, _ZERO, "zero_optimization")
    if stage == 3 and "stage3_max_reuse_distance" not in z and "max_reuse_distance" not in z:
        # DeepSpeed's default, where ours is 0 (README: a model under about 0.5B parameters then
        # stays gathered through the step): a config that leaves it out means DeepSpeed's (a new-user
        # trial saw 0 in the resolved config). Read as DeepSpeed reads it, so nothing to warn about.
        conv.set("zero.max_reuse_distance", 1e9, "zero_optimization.stage3_max_reuse_distance (absent: DeepSpeed's"
                 " default)")
    if isinstance(stage, int) and stage < 3:
        for key in _STAGE3_ONLY:
            if key in z and z[key] is not None:
                conv.no_effect.append((f"zero_optimization.{key}", f"a stage-3 setting, and the stage is {stage}"))
    features.convert_offload(conv, z)
