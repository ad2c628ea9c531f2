"""Trained weights out: a ``save_pretrained`` directory that ``AutoModel*.from_pretrained(dir)`` loads.

Two sources, one layout (``config.json``, ``model.safetensors`` or ``model-0000i-of-0000n``
files with ``model.safetensors.index.json``, HF key names, tied duplicates dropped):

- a live, possibly sharded, model: :func:`save_pretrained` (collective; each tensor is gathered
  alone with ``full_tensor()`` and streamed to disk by rank zero, so no rank holds the model);
- a sharded checkpoint written by strategy ``ampzero``: :func:`export_checkpoint` (also
  ``ampzero-consolidate CKPT OUT --hf-config DIR``), one tensor at a time, no process group.

Both reuse the streaming safetensors writer of checkpoint/consolidate.py
([Note: streaming safetensors]).
"""

from __future__ import annotations

import copy
import functools
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from lightning_ampzero.checkpoint.consolidate import DTYPES, Entry, every_rank_calls, parse_size, write_state
from lightning_ampzero.hf.files import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
from lightning_ampzero.hf.keys import (
    ConvertedOnSave,
    find_pretrained_model,
    group_by_tensor,
    is_pretrained_model,
    matches_any,
    model_to_checkpoint,
    state_tensors,
    tied_targets,
)
from lightning_ampzero.zero.apply import own_class_name

DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers 4.x's default; 5.x writes up to 50GB per file
_OLD_SHARD = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


def export_plan(model: nn.Module) -> list[tuple[str, list[str], torch.Tensor]]:
    """(checkpoint key, the model's names for the tensor, the tensor) for what ``save_pretrained`` would write.

    As in transformers' ``remove_tied_weights_from_state_dict``: of a tensor known under several
    names (tied weights), the names declared as tied copies are dropped; a declared copy whose
    tie was not kept as one object (equal values, two tensors) is dropped too, since
    ``from_pretrained`` ties it back to its source.
    """
    tied = tied_targets(model)
    ignore = getattr(model, "_keys_to_ignore_on_save", None)
    adapters: set[str] = set()
    groups = group_by_tensor(state_tensors(model, adapters))
    if adapters:
        raise NotImplementedError(
            f"{type(model).__name__} holds {len(adapters)} peft adapter tensors (e.g. {sorted(adapters)[:2]}):"
            " exporting"
            " them merged into the base weights is not supported yet. To save the adapters, pass the peft model"
            " (save_pretrained(the peft model, out_dir): what peft's own save_pretrained writes). For merged"
            " weights, consolidate the checkpoint (`ampzero-consolidate CKPT OUT --strip-prefix model.`), load it"
            " into the unsharded peft model, then use peft's merge_and_unload() and save_pretrained()."
        )
    all_names = {n for _, names in groups for n in names}
    chosen: dict[str, tuple[list[str], torch.Tensor]] = {}
    for tensor, names in groups:
        keep = [n for n in sorted(names) if not matches_any(n, [f"^{re.escape(k)}$" for k in tied])]
        if not keep:
            if all(tied[n] in all_names for n in names if n in tied):
                continue  # a copy of a tensor exported under its source's name
            keep = sorted(names)[-1:]
        if matches_any(keep[0], ignore):
            continue
        chosen[keep[0]] = (names, tensor)
    keys = model_to_checkpoint(model, {n: t for n, (_, t) in chosen.items()})
    return [(keys[n], names, t) for n, (names, t) in chosen.items()]


def _out_dtype(dtype: Optional[str | torch.dtype], src: torch.dtype) -> torch.dtype:
    if dtype is None or not src.is_floating_point:
        return src
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported. Allowed: {', '.join(DTYPES)}, a torch.dtype, or None"
                         " to keep each tensor's.")
    return DTYPES[dtype]


def _write_config(config: Any, out: Path, architecture: str, entries: Sequence[Entry],
                  generation_config: Any = None) -> None:
    config = copy.deepcopy(config)
    config.architectures = [architecture]
    floats = [e.dtype for e in entries if e.dtype.is_floating_point]
    if floats:
        config.dtype = max(set(floats), key=floats.count)  # what from_pretrained(dtype="auto") builds in
    config.save_pretrained(str(out))
    if generation_config is not None:
        generation_config.save_pretrained(str(out))


def _clear_old_weights(out: Path) -> None:
    """Remove an earlier export's weight files: a stale shard or index would be loaded with the new ones."""
    if out.is_dir():
        for p in out.iterdir():
            if p.is_file() and _OLD_SHARD.fullmatch(p.name):
                p.unlink()


def _write(entries: list[Entry], fetch: Callable[[Entry], torch.Tensor], out: Path, max_shard_size: Any,
           write: bool) -> list[Path]:
    if write:
        out.mkdir(parents=True, exist_ok=True)
        _clear_old_weights(out)
    paths = write_state(entries, fetch, out, fmt="safetensors", max_shard_size=parse_size(max_shard_size), write=write,
                        single_name=SAFE_WEIGHTS_NAME)
    assert not write or len(paths) == 1 or (out / SAFE_WEIGHTS_INDEX_NAME).is_file()
    return paths


def save_pretrained(
    model: nn.Module,
    out_dir: str | Path,
    *,
    dtype: Optional[str | torch.dtype] = None,
    max_shard_size: str | int | None = DEFAULT_MAX_SHARD_SIZE,
) -> list[Path]:
    """Write ``model`` (a transformers model, or a module holding exactly one) as a ``save_pretrained`` directory.

    Collective: every rank calls it with the same ``out_dir`` (rank zero's is used), e.g. after
    ``trainer.fit`` or from a callback's ``on_train_end(trainer, pl_module)``::

        lightning_ampzero.hf.save_pretrained(pl_module.model, "out/finetuned")

    Each tensor is gathered alone (``DTensor.full_tensor()``) and streamed into the file by rank
    zero: per rank, one full tensor at a time. ``dtype`` casts floating tensors ("bf16", "fp16",
    "fp32" or a torch.dtype; None keeps each parameter's dtype). Outputs over ``max_shard_size``
    are split into files with an index, as ``save_pretrained`` does. Returns the files written
    (on rank zero; [] elsewhere).

    A peft model (``PeftModel``, or a module holding one) is written as its own
    ``save_pretrained`` writes it: the adapters and their config, which
    ``PeftModel.from_pretrained(base, out_dir)`` loads ([Note: adapters of a sharded peft model]).
    """
    import torch.distributed as dist

    peft_model = _peft_model(model)
    model = find_pretrained_model(model) if peft_model is None else peft_model
    every_rank_calls("save_pretrained")  # [Note: an export called on rank zero alone]
    distributed = dist.is_available() and dist.is_initialized()
    if distributed and dist.get_world_size() > 1:
        box = [str(out_dir)]
        dist.broadcast_object_list(box, src=0)
        out_dir = box[0]
    is_zero = not distributed or dist.get_rank() == 0
    out = Path(out_dir)
    if peft_model is not None:
        paths = _save_adapters(peft_model, out, is_zero, dtype)
        if distributed:
            dist.barrier()
        return paths
    try:
        plan = export_plan(model)
    except ConvertedOnSave as e:  # the same on every rank
        paths = _save_whole(model, out, is_zero, dtype, max_shard_size, str(e))
        if distributed:
            dist.barrier()
        return paths
    entries = [Entry(key, tuple(t.shape), _out_dtype(dtype, t.dtype)) for key, _, t in plan]
    tensors = {key: t for key, _, t in plan}

    @torch.no_grad()
    def fetch(e: Entry) -> torch.Tensor:
        t = tensors[e.name]
        if hasattr(t, "full_tensor"):  # a DTensor: all-gather (collective, same order on every rank)
            t = t.full_tensor()
        return t.detach().to(device="cpu", dtype=e.dtype)

    paths = _write(entries, fetch, out, max_shard_size, is_zero)
    if is_zero:
        gen = getattr(model, "generation_config", None)
        can_generate = getattr(model, "can_generate", lambda: False)()
        _write_config(model.config, out, own_class_name(model), entries, gen if can_generate else None)
    if distributed:
        dist.barrier()  # the directory is complete on every rank's return
    return paths


# [Note: a model that transformers converts on save]
# transformers 5 holds a mixture of experts' weights fused (Qwen2-MoE's and Mixtral's experts: one
# [experts, ...] tensor per projection) and splits them back into per-expert tensors in its own
# save_pretrained (weight converters). No file tensor is then one parameter, which the streaming
# export needs, and every documented way out refused such a model (a new-user trial: Qwen2-MoE and
# Mixtral at stages 0 and 3, live and from a checkpoint). Such a model is exported whole instead:
# each tensor gathered once (tied ones share it), kept by rank zero, which hands the full state dict
# to the model's own save_pretrained(state_dict=...), so transformers converts it as it always does.
# Rank zero holds the whole model in host memory for the call (said in a warning); the other ranks
# hold one gathered tensor at a time, as in the streaming export.
def _save_whole(model: nn.Module, out: Path, is_zero: bool, dtype: Optional[str | torch.dtype],
                max_shard_size: Any, why: str) -> list[Path]:
    from lightning.pytorch.utilities import rank_zero_warn

    from lightning_ampzero.estimate import format_bytes

    full: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for name, value in model.state_dict(keep_vars=True).items():  # the same order on every rank
            if id(value) not in done:
                t = value.full_tensor() if hasattr(value, "full_tensor") else value  # collective
                t = t.detach().to(device="cpu", dtype=_out_dtype(dtype, value.dtype))
                done[id(value)] = t if is_zero else torch.empty(0)
            if is_zero:
                full[name] = done[id(value)]
    if not is_zero:
        return []
    size = sum(t.nbytes for t in done.values())
    rank_zero_warn(f"{why} The model is exported whole instead: rank 0 holds all of it ({format_bytes(size)}) for"
                   f" {own_class_name(model)}.save_pretrained(state_dict=...), which converts it.")
    # the class's own, not the instance's: the strategy replaced that one ([Note: save_pretrained of a sharded model])
    return _own_save_pretrained(functools.partial(type(model).save_pretrained, model), out, max_shard_size,
                                state_dict=full, is_main_process=True)


def _own_save_pretrained(save: Callable[..., Any], out: Path, max_shard_size: Any, **kwargs: Any) -> list[Path]:
    """``save(out, ...)``, a transformers model's own ``save_pretrained``, after an earlier export's weight files
    in ``out`` are removed; returns the weight files written."""
    out.mkdir(parents=True, exist_ok=True)
    _clear_old_weights(out)
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    save(str(out), **kwargs)
    return sorted(p for p in out.iterdir() if p.is_file() and _OLD_SHARD.fullmatch(p.name))


# [Note: save_pretrained of a sharded model]
# At stages 1-3 a transformers (or peft) model's parameters are DTensors holding this rank's shard.
# Its own ``save_pretrained()`` reads them as whole tensors: measured (a new-user trial, GPT-2 at
# stage 3, transformers 5), called on rank 0 alone it stopped in a DTensor redistribution that
# waited for the other ranks (gloo's "Connection closed by peer" once they had exited), and called
# on every rank it failed with torch's "invalid python storage", leaving a directory without
# weights; neither names what to use. Each such model's ``save_pretrained`` is replaced, on the
# instance, by one that says it: :func:`save_pretrained` above, or consolidating a checkpoint.
# A call given ``state_dict=`` (full tensors the caller gathered) reads no parameter, and goes
# through: that is how :func:`_save_adapters` writes a peft model's adapters.
def refuse_own_save_pretrained(module: nn.Module, stage: int) -> None:
    """Make the ``save_pretrained`` of each transformers/peft model in ``module`` say what to call instead."""
    peft = sys.modules.get("peft")
    for m in module.modules():
        if is_pretrained_model(m) or (peft is not None and isinstance(m, peft.PeftModel)):
            # A partial of a module-level function: the model stays picklable and deep-copyable.
            m.__dict__["save_pretrained"] = functools.partial(_sharded_save_pretrained, m, stage)


def _sharded_save_pretrained(model: nn.Module, stage: int, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get("state_dict") is not None or len(args) >= 3:  # (save_directory, is_main_process, state_dict)
        return type(model).save_pretrained(model, *args, **kwargs)
    name = own_class_name(model)
    raise RuntimeError(
        f"{name}.save_pretrained() cannot write this model: at ZeRO stage {stage} its parameters are sharded"
        " across the ranks, and it would read only this rank's pieces. Call"
        " `lightning_ampzero.hf.save_pretrained(model, out_dir)` on every rank instead (rank 0 writes the files"
        f" {name}.save_pretrained writes, which from_pretrained loads), e.g. after trainer.fit() or in a"
        " callback's on_train_end; or save a checkpoint and run `ampzero-consolidate CKPT OUT --hf-config DIR`."
        " (docs/bring_your_own_model.md)"
    )


def _peft_model(module: nn.Module) -> Optional[nn.Module]:
    """``module`` if it is a peft ``PeftModel``, else the one outermost inside it, else None."""
    if "peft" not in sys.modules:
        return None
    from peft import PeftModel

    found = [m for m in module.modules() if isinstance(m, PeftModel)]
    return found[0] if found else None


def _save_adapters(model: nn.Module, out: Path, is_zero: bool, dtype: Optional[str | torch.dtype]) -> list[Path]:
    """A peft model's adapters, as its own ``save_pretrained`` writes them, from sharded parameters.

    [Note: adapters of a sharded peft model] peft's ``save_pretrained`` reads ``state_dict()``,
    whose values are this rank's shards (DTensors) at stages 1-3: it stopped with "Attempted to
    access the data pointer on an invalid python storage" and left a directory holding only a
    README (a new-user trial, issue 16's note). peft's own selection
    (``get_peft_model_state_dict``, for every adapter) names the tensors to save; only those are
    gathered, in the state dict's order on every rank, and rank zero hands them to peft's
    ``save_pretrained(state_dict=...)``, which writes its usual files. The base model's weights are
    not gathered.
    """
    from peft import get_peft_model_state_dict

    state = model.state_dict()
    key_of = {id(v): k for k, v in state.items()}
    wanted: set[str] = set()
    for name in model.peft_config:
        for value in get_peft_model_state_dict(model, state_dict=state, adapter_name=name).values():
            if id(value) not in key_of:
                raise NotImplementedError(
                    f"peft computes the saved tensors of adapter {name!r} ({type(model.peft_config[name]).__name__})"
                    " rather than selecting them: save from a consolidated checkpoint (`ampzero-consolidate CKPT OUT"
                    " --strip-prefix model.`, loaded into the unsharded peft model)."
                )
            wanted.add(key_of[id(value)])

    @torch.no_grad()
    def gathered(t: torch.Tensor) -> torch.Tensor:
        t = t.full_tensor() if hasattr(t, "full_tensor") else t  # collective: same order on every rank
        return t.detach().cpu()

    full = {k: gathered(v).to(_out_dtype(dtype, v.dtype)) for k, v in state.items() if k in wanted}
    if not is_zero:
        return []
    model.save_pretrained(str(out), state_dict=full, is_main_process=True)
    return sorted(p for p in out.rglob("*") if p.is_file())


def _model_class(config: Any, name: Optional[str]) -> Any:
    import transformers

    name = name or (config.architectures or [None])[0]
    if not name:
        raise ValueError("The config names no architecture (`architectures` is empty): pass the model class"
                         f" (--hf-class {_class_hint(config)}).")
    cls = getattr(transformers, name, None)
    if cls is None:
        raise ValueError(f"transformers has no model class {name!r}: pass the right one with --hf-class.")
    return cls


def _class_hint(config: Any) -> str:
    """The classes transformers' Auto* factories build for ``config.model_type``, as a hint.

    A fresh ``GPT2Config().save_pretrained()`` names no architecture, and the hint named a Llama
    class whatever the model was (a new-user trial).
    """
    from transformers.models.auto import modeling_auto

    model_type = getattr(config, "model_type", None)
    names = [table.get(model_type) for table in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                 modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
                                                 modeling_auto.MODEL_MAPPING_NAMES)]
    names = [n for n in names if isinstance(n, str)]
    return " or ".join(dict.fromkeys(names)) if names else "LlamaForCausalLM, say"


def meta_model(hf_config: str | Path, model_class: Optional[str] = None) -> nn.Module:
    """The model a Hugging Face config describes, built on the meta device (names, shapes, ties; no memory).

    ``hf_config``: a directory with ``config.json`` or the file itself, local (no download). The class
    is the config's ``architectures[0]`` unless ``model_class`` names one.
    """
    from transformers import AutoConfig

    path = Path(hf_config)
    if not path.exists():
        raise ValueError(f"{path} does not exist: give a local model directory (with config.json) or a config.json.")
    config = AutoConfig.from_pretrained(str(path))
    cls = _model_class(config, model_class)
    with torch.device("meta"):
        return cls._from_config(copy.deepcopy(config)) if hasattr(cls, "_from_config") else cls(config)


def _detect_prefix(ckpt_names: Sequence[str], model_names: set[str]) -> str:
    """The prefix under which most checkpoint names are the model's names (e.g. 'model.' for `self.model`)."""
    counts: dict[str, int] = {}
    for c in ckpt_names:
        cuts = [0] + [i + 1 for i, ch in enumerate(c) if ch == "."]
        for i in cuts:
            if c[i:] in model_names:
                counts[c[:i]] = counts.get(c[:i], 0) + 1
    if not counts:
        raise ValueError("No tensor of the checkpoint has a name of the model built from the config: check --hf-config"
                         " (and --hf-class).")
    return max(counts, key=lambda p: (counts[p], -len(p)))


def export_checkpoint(
    ckpt: str | Path,
    out_dir: str | Path,
    hf_config: str | Path,
    *,
    prefix: Optional[str] = None,
    model_class: Optional[str] = None,
    dtype: Optional[str] = None,
    max_shard_size: str | int | None = DEFAULT_MAX_SHARD_SIZE,
) -> list[Path]:
    """Turn a sharded ``ampzero`` checkpoint into a ``save_pretrained`` directory (no process group needed).

    ``hf_config`` is a directory with the model's ``config.json`` (the directory the model was
    loaded from does); the model class is the config's ``architectures[0]`` unless
    ``model_class`` names one. ``prefix`` is where the model sits in the LightningModule
    ('model.' for ``self.model``); by default the prefix that matches most names is used.
    """
    from transformers import AutoConfig

    from lightning_ampzero.checkpoint.consolidate import checkpoint_entries, checkpoint_fetcher
    from lightning_ampzero.checkpoint.sharded import _check_loadable

    ckpt, out = Path(ckpt), Path(out_dir)
    _check_loadable(ckpt)
    model = meta_model(hf_config, model_class)
    config, cls = AutoConfig.from_pretrained(str(hf_config)), type(model)  # the config as the user wrote it
    keyed = {e.name: (key, meta) for key, e, meta in checkpoint_entries(ckpt)}
    try:
        plan = export_plan(model)
    except ConvertedOnSave as e:
        return _export_whole(ckpt, out, model, hf_config, keyed, prefix, dtype, max_shard_size, str(e))
    if prefix is None:
        prefix = _detect_prefix(list(keyed), {n for _, names, _ in plan for n in names})
    entries, source, missing = [], {}, []
    used = set()
    for key, names, t in plan:
        found = next((prefix + n for n in names if prefix + n in keyed), None)
        if found is None:
            missing.append(names[0])
            continue
        used.add(found)
        ckpt_key, meta = keyed[found]
        if tuple(meta.size) != tuple(t.shape):
            raise _shape_mismatch(found, tuple(meta.size), tuple(t.shape), hf_config)
        entries.append(Entry(key, tuple(meta.size), _out_dtype(dtype, meta.properties.dtype)))
        source[key] = (ckpt_key, meta)
    # names of the model's own tensors under the prefix that the model does not have
    plan_names = {prefix + n for _, names, _ in plan for n in names}
    extra = [k for k in keyed if k.startswith(prefix) and k not in used and k not in plan_names]
    if missing or extra:
        raise _names_mismatch(ckpt, cls.__name__, hf_config, prefix, missing, extra)
    paths = _write(entries, checkpoint_fetcher(ckpt, source), out, max_shard_size, True)
    gen_file = Path(hf_config) / "generation_config.json"
    _write_config(config, out, cls.__name__, entries)
    if gen_file.is_file():
        shutil.copyfile(gen_file, out / gen_file.name)
    return paths


def _export_whole(ckpt: Path, out: Path, model: nn.Module, hf_config: str | Path, keyed: dict[str, Any],
                  prefix: Optional[str], dtype: Optional[str], max_shard_size: Any, why: str) -> list[Path]:
    """:func:`export_checkpoint` of a model that transformers converts on save ([Note: a model that
    transformers converts on save]): the checkpoint's tensors loaded into the model built from the
    config, and the model's own ``save_pretrained``. Holds the whole model in host memory."""
    import warnings

    from lightning_ampzero.checkpoint.consolidate import checkpoint_fetcher
    from lightning_ampzero.estimate import format_bytes

    shapes = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
    names = list(shapes)
    if prefix is None:
        prefix = _detect_prefix(list(keyed), set(names))
    source = {n: keyed[prefix + n] for n in names if prefix + n in keyed}
    fetch = checkpoint_fetcher(ckpt, source)
    full = {}
    for n, (_, meta) in source.items():
        if tuple(meta.size) != shapes[n]:  # before reading it
            raise _shape_mismatch(prefix + n, tuple(meta.size), shapes[n], hf_config)
        full[n] = fetch(Entry(n, tuple(meta.size), _out_dtype(dtype, meta.properties.dtype)))
    model.load_state_dict(full, strict=False, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # a tied copy the checkpoint holds once
    missing = [n for n, t in model.state_dict().items() if t.is_meta]
    extra = [k for k in keyed if k.startswith(prefix) and k[len(prefix):] not in shapes]
    if missing or extra:
        raise _names_mismatch(ckpt, type(model).__name__, hf_config, prefix, missing, extra)
    warnings.warn(f"{why} The model is exported whole instead: it is loaded into host memory"
                  f" ({format_bytes(sum(t.nbytes for t in full.values()))}) for {type(model).__name__}.save_pretrained,"
                  " which converts it.", stacklevel=3)
    return _own_save_pretrained(model.save_pretrained, out, max_shard_size)


def _shape_mismatch(key: str, saved: tuple[int, ...], built: tuple[int, ...], hf_config: str | Path) -> ValueError:
    return ValueError(f"{key}: the checkpoint holds {saved}, the model built from {hf_config} has {built}: the config"
                      " is not the trained model's.")


#: Names peft gives a wrapped layer's tensors (LoRA and its variants): a checkpoint of a peft model.
_PEFT_NAMES = re.compile(r"\.(base_layer|lora_[AB]|lora_embedding_[AB]|lora_magnitude_vector)(\.|$)")


def _names_mismatch(ckpt: Path, cls_name: str, hf_config: str | Path, prefix: str, missing: Sequence[str],
                    extra: Sequence[str]) -> ValueError:
    if any(_PEFT_NAMES.search(k) for k in extra):
        # A new-user trial: a LoRA fit's checkpoint met only the generic "Check --hf-config" advice.
        return ValueError(
            f"{ckpt} holds a peft model (LoRA adapters beside the base layers, e.g."
            f" {[k for k in extra if _PEFT_NAMES.search(k)][:2]}), not a plain {cls_name}: --hf-config exports"
            " transformers models, and merging adapters into the base weights needs peft's config (rank, alpha)."
            " Consolidate it as a state dict (`ampzero-consolidate CKPT peft.safetensors --strip-prefix <the"
            " attribute holding the peft model, e.g. model.> --dtype fp32`), load that into the peft model built as"
            " in training (get_peft_model(base, LoraConfig(...)).load_state_dict(...)), then"
            " merge_and_unload().save_pretrained(OUT). From the live run, lightning_ampzero.hf.save_pretrained(peft"
            " model, OUT) writes the adapters as peft does.")
    return ValueError(
        f"{ckpt} does not match {cls_name} built from {hf_config} under prefix {prefix!r}:"
        f" {len(missing)} model tensors missing (e.g. {list(missing[:5])}), {len(extra)} checkpoint tensors"
        f" not in the model (e.g. {list(extra[:5])}). Check --hf-config, --hf-class and --strip-prefix."
    )
