"""The feature sections of a DeepSpeed config: offload (ZeRO-Offload / ZeRO-Infinity), ``aio``,
``activation_checkpointing`` and ``msamp``, converted into ``OffloadConfig``,
``ActivationCheckpointingConfig`` and ``Fp8Config`` (the other sections: the other modules here).

Each function takes the importer's ``_Converter`` (``conv``) and records into it: ``conv.set``
maps a key to a target field, ``conv.no_effect`` lists keys that change nothing here with the
reason, ``conv.notes`` lists keys whose meaning here differs from DeepSpeed's, ``conv.errors``
collects bad values. Unknown keys go through ``conv.check_keys`` (an error with a suggestion).

[Note: DeepSpeed's activation_checkpointing section]
In DeepSpeed the section only configures ``deepspeed.checkpointing``: nothing is checkpointed
unless the model's own code wraps its layers in ``deepspeed.checkpointing.checkpoint`` (as
Megatron-LM does). A model trained with this strategy calls nothing of DeepSpeed, so the section
is read as the intent it expresses in the configs that carry it: the section turns on full
checkpointing (``mode="full"``) of the repeated blocks (the transformer blocks, found as for
ZeRO's units) with its settings. A conversion note says so; remove the section to turn it off.
``number_checkpoints`` is DeepSpeed's buffer capacity, which Megatron sets to the number of
layers; here it also chooses how many blocks are checkpointed (spread evenly), so the usual
value checkpoints every block.
"""

from __future__ import annotations

from typing import Any, Mapping

OFFLOAD_DEVICES = ("none", "cpu", "nvme")

OFFLOAD_OPTIMIZER_KEYS = ("device", "nvme_path", "buffer_count", "pin_memory", "pipeline", "pipeline_read",
                          "pipeline_write", "fast_init", "ratio")
OFFLOAD_PARAM_KEYS = ("device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory")
AC_KEYS = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization", "number_checkpoints",
           "synchronize_checkpoint_boundary", "profile")
AIO_KEYS = ("block_size", "queue_depth", "thread_count", "intra_op_parallelism", "single_submit",
            "overlap_events", "use_gds")
MSAMP_KEYS = ("enabled", "opt_level")
MSAMP_LEVELS = ("O1", "O2")

_NVME_ONLY = "only used with device 'nvme'"
_MAX_IN_CPU = ("no parameters are cached in host memory beyond the offload.param_buffer_count buffers: every"
               " shard is read from its swap file for each all-gather (through the page cache)")
_AIO_IO = ("swap files are read and written with ordinary file I/O (pread/pwrite through the page cache) by"
           " offload.io_threads threads, one optimizer tile (offload.sub_group_size elements) or one parameter"
           " buffer at a time: there is no libaio queue to size")


def _given(value: Any) -> bool:
    return value not in (None, False, {})


def _no_effect(conv: Any, prefix: str, keys: list[str], reason: str) -> None:
    """One entry for several keys of a section with the same reason: ``aio.block_size/queue_depth``."""
    if keys:
        conv.no_effect.append((f"{prefix}.{'/'.join(keys)}", reason))


def convert_offload(conv: Any, z: Mapping[str, Any]) -> None:
    """``zero_optimization.offload_optimizer`` / ``offload_param`` (and the legacy ``cpu_offload*`` keys,
    ``sub_group_size``) -> ``offload.*``. Records in ``conv.offload_optimizer`` ``"nvme"`` when either
    section swaps to NVMe (``aio`` tunes both), else the optimizer's device."""
    opt_path, par_path = "zero_optimization.offload_optimizer", "zero_optimization.offload_param"
    opt = conv.section(z.get("offload_optimizer"), opt_path)
    par = conv.section(z.get("offload_param"), par_path)
    conv.check_keys(opt, OFFLOAD_OPTIMIZER_KEYS, opt_path)
    conv.check_keys(par, OFFLOAD_PARAM_KEYS, par_path)
    opt_dev, opt_key = _device(conv, opt, opt_path), f"{opt_path}.device"
    par_dev, par_key = _device(conv, par, par_path), f"{par_path}.device"
    # DeepSpeed's pre-0.3.13 spelling of the same two switches.
    if z.get("cpu_offload") is True and opt_dev == "none":
        opt_dev, opt_key = "cpu", "zero_optimization.cpu_offload"
    for legacy in ("cpu_offload_params", "cpu_offload_param"):
        if z.get(legacy) is True and par_dev == "none":
            par_dev, par_key = "cpu", f"zero_optimization.{legacy}"
    if opt_dev != "none":
        conv.set("offload.offload_optimizer", opt_dev, opt_key)
    if par_dev != "none":
        conv.set("offload.offload_param", par_dev, par_key)
    conv.offload_optimizer = "nvme" if "nvme" in (opt_dev, par_dev) else opt_dev

    # One pin_memory for both (OffloadConfig): sections that offload must agree.
    if opt_dev != "none" and par_dev != "none" and opt.get("pin_memory", True) != par.get("pin_memory", True):
        conv.errors.append(
            f"{opt_path}.pin_memory={opt.get('pin_memory', True)!r} and {par_path}.pin_memory="
            f"{par.get('pin_memory', True)!r} differ: lightning_ampzero has one setting for both (offload.pin_memory)."
            " Give them the same value."
        )
    for section, path, device in ((opt, opt_path, opt_dev), (par, par_path, par_dev)):
        if "pin_memory" not in section:
            continue
        if device == "none":
            if _given(section["pin_memory"]):
                conv.no_effect.append((f"{path}.pin_memory", "the section's device is 'none'"))
        else:
            conv.set("offload.pin_memory", section["pin_memory"], f"{path}.pin_memory")
    if "cpu_offload_use_pin_memory" in z:
        key = "zero_optimization.cpu_offload_use_pin_memory"
        if opt_dev != "none" or par_dev != "none":
            conv.set("offload.pin_memory", z["cpu_offload_use_pin_memory"], key)
        elif _given(z["cpu_offload_use_pin_memory"]):
            conv.no_effect.append((key, "nothing is offloaded"))

    for key in ("nvme_path", "buffer_count"):
        if key not in opt:
            continue
        if opt_dev == "nvme":
            conv.set(f"offload.{key}", opt[key], f"{opt_path}.{key}")
        elif _given(opt[key]):
            conv.no_effect.append((f"{opt_path}.{key}", _NVME_ONLY))
    # ZeRO-Infinity's parameter swapping (offload/params.py): one nvme_path for both sections (two
    # different paths are an error, from conv.set), its buffers under their own names.
    for key, target in (("nvme_path", "nvme_path"), ("buffer_count", "param_buffer_count"),
                        ("buffer_size", "param_buffer_size")):
        if key not in par:
            continue
        if par_dev == "nvme":
            conv.set(f"offload.{target}", par[key], f"{par_path}.{key}")
        elif _given(par[key]):
            conv.no_effect.append((f"{par_path}.{key}", _NVME_ONLY))
    if _given(par.get("max_in_cpu")):
        conv.no_effect.append((f"{par_path}.max_in_cpu", _MAX_IN_CPU if par_dev == "nvme" else _NVME_ONLY))
    _no_effect(conv, opt_path, [k for k in ("pipeline", "pipeline_read", "pipeline_write") if _given(opt.get(k))],
               "NVMe reads ahead and writes behind always (offload.io_threads)")
    if _given(opt.get("fast_init")):
        conv.no_effect.append((f"{opt_path}.fast_init", "swap files are preallocated (posix_fallocate) at setup"))
    if opt.get("ratio") not in (None, 1, 1.0):
        conv.no_effect.append((f"{opt_path}.ratio", "partial offload is not implemented: the whole optimizer state is"
                                                    " offloaded"))

    if "sub_group_size" in z:
        key = "zero_optimization.sub_group_size"
        if opt_dev != "none":
            conv.set("offload.sub_group_size", z["sub_group_size"], key)
        elif _given(z["sub_group_size"]):
            conv.no_effect.append((key, "without optimizer offload the optimizer steps each rank's shards at once"
                                        " (tiles are the host step's unit)"))


def _device(conv: Any, section: Mapping[str, Any], path: str) -> str:
    device = section.get("device", "none")
    if device is None:
        return "none"
    if device not in OFFLOAD_DEVICES:
        conv.errors.append(f"{path}.device={device!r} is not valid. Allowed values:"
                           f" {', '.join(map(repr, OFFLOAD_DEVICES))}.")
        return "none"
    return device


def convert_aio(conv: Any, aio: Mapping[str, Any]) -> None:
    """``aio`` -> ``offload.io_threads`` (its thread count) when optimizer state or parameters go to NVMe."""
    conv.check_keys(aio, AIO_KEYS, "aio")
    if not aio:
        return
    if conv.offload_optimizer != "nvme":
        conv.no_effect.append(("aio", "it tunes NVMe offload, and neither offload_optimizer.device nor"
                                      " offload_param.device is 'nvme'"))
        return
    for key in ("thread_count", "intra_op_parallelism"):
        if key in aio:
            conv.set("offload.io_threads", aio[key], f"aio.{key}")
    _no_effect(conv, "aio", [k for k in ("block_size", "queue_depth", "single_submit", "overlap_events")
                             if _given(aio.get(k))], _AIO_IO)
    if _given(aio.get("use_gds")):
        conv.no_effect.append(("aio.use_gds", "GPUDirect Storage is not used: tiles pass through host memory"))


def convert_activation_checkpointing(conv: Any, section: Mapping[str, Any]) -> None:
    """``activation_checkpointing`` -> full checkpointing of the repeated blocks (see the module's note)."""
    conv.check_keys(section, AC_KEYS, "activation_checkpointing")
    if not section:
        return
    conv.set("activation_checkpointing.mode", "full", "activation_checkpointing")
    conv.notes.append((
        "activation_checkpointing",
        "DeepSpeed checkpoints only what the model wraps in deepspeed.checkpointing.checkpoint; here the section"
        " turns on full checkpointing of the repeated blocks (activation_checkpointing.mode='full'); remove the"
        " section to turn it off",
    ))
    for key, value in section.items():
        if key == "partition_activations":
            if _given(value):
                conv.no_effect.append((
                    "activation_checkpointing.partition_activations",
                    "it splits checkpoints across a tensor-parallel group; data-parallel ranks hold different"
                    " samples, so there is nothing to split (use cpu_checkpointing to take them off the accelerator)",
                ))
        elif value is not None:
            conv.set(f"activation_checkpointing.{key}", value, f"activation_checkpointing.{key}")


def convert_msamp(conv: Any, section: Mapping[str, Any]) -> None:
    """``msamp`` {enabled, opt_level} -> ``Fp8Config(msamp=opt_level)`` (lightning_ampzero.fp8, not MS-AMP)."""
    conv.check_keys(section, MSAMP_KEYS, "msamp")
    if not section or not conv.flag(section, "msamp"):
        return
    level = section.get("opt_level", "O1")
    if level not in MSAMP_LEVELS:
        why = " (O3, FP8 master weights, is not implemented)" if level == "O3" else ""
        conv.errors.append(f"msamp.opt_level={level!r} is not valid{why}. Allowed values: 'O1', 'O2'.")
        return
    conv.set("fp8.enabled", True, "msamp.enabled")
    conv.set("fp8.msamp", level, "msamp.opt_level")
    conv.notes.append((
        "msamp",
        f"FP8 training with MS-AMP {level} by lightning_ampzero.fp8 (not the MS-AMP package): nn.Linear layers with"
        " min(in, out) >= fp8.min_features (1024) get FP8 GEMMs, recipe 'tensorwise'; run it with bf16"
        " (bf16.enabled or precision='bf16-mixed')",
    ))


def convert_features(conv: Any, data: Mapping[str, Any]) -> None:
    """The feature sections (after ``zero``: ``aio`` depends on the offload device)."""
    convert_aio(conv, conv.section(data.get("aio"), "aio"))
    convert_activation_checkpointing(
        conv, conv.section(data.get("activation_checkpointing"), "activation_checkpointing"))
    convert_msamp(conv, conv.section(data.get("msamp"), "msamp"))
