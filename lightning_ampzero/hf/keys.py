"""Names: a Hugging Face model's parameter names <-> the keys of its checkpoint files.

Both directions use transformers' own machinery, so a checkpoint loads here exactly when
``from_pretrained`` would load it and an export is what ``save_pretrained`` would write:
loading renames each checkpoint key with ``rename_source_key`` (the model's registered weight
renamings, then adding or stripping ``base_model_prefix``), saving maps each name through
``revert_weight_conversion`` and drops tied duplicates the way ``save_pretrained`` does. Weight
*converters* (several checkpoint tensors fused into one parameter, e.g. MoE experts) are not
supported: a fused parameter cannot be read as a slice of one stored tensor, so they are
refused with the names involved.

transformers is imported inside the functions: it is an optional dependency.
"""

from __future__ import annotations

import re
import sys
from typing import Iterable, Iterator

import torch
from torch import nn

# Segments that wrappers (activation checkpointing, torch.compile, FSDP1) insert into names;
# the checkpoint knows the unwrapped names (torch.distributed.checkpoint strips the same ones).
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean_name(name: str) -> str:
    for seg in _WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name


def is_pretrained_model(module: nn.Module) -> bool:
    if "transformers" not in sys.modules:  # an HF model exists only once transformers was imported
        return False
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel)


def find_pretrained_model(module: nn.Module) -> nn.Module:
    """``module`` itself if it is a transformers model, else the one outermost transformers model inside it."""
    if is_pretrained_model(module):
        return module
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if is_pretrained_model(sub) and not any(name.startswith(f + ".") for f, _ in found):
            found.append((name, sub))
    if len(found) != 1:
        what = ", ".join(repr(n) for n, _ in found) if found else "none"
        raise ValueError(
            f"{type(module).__name__} holds {len(found) or 'no'} transformers models (found: {what}): pass the"
            " model to export itself, e.g. `save_pretrained(pl_module.model, out_dir)`."
        )
    return found[0][1]


def _tuner_layers(model: nn.Module) -> list[str]:
    """Names of peft's LoRA (and other tuner) layers: each wraps the original layer as ``base_layer``."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [n for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]


def state_tensors(model: nn.Module, adapters: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every parameter and persistent buffer, tied names included (same object twice).

    Names are the checkpoint's: wrapper segments dropped, and inside a peft tuner layer
    ``q_proj.base_layer.weight`` is the pretrained ``q_proj.weight``; the tuner's own tensors
    (``q_proj.lora_A.default.weight``) are added to ``adapters`` when it is given.
    """
    tuners = [t + "." for t in _tuner_layers(model)]
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        own = [(n, t) for n, t in mod._parameters.items() if t is not None]
        own += [(n, t) for n, t in mod._buffers.items() if t is not None and n not in mod._non_persistent_buffers_set]
        for n, t in own:
            name = clean_name(prefix + n)
            tuner = next((p for p in tuners if name.startswith(p)), None)
            if tuner is not None:
                if name.startswith(tuner + "base_layer."):
                    name = tuner + name[len(tuner) + len("base_layer."):]
                elif adapters is not None:
                    adapters.add(name)
            yield name, t


def group_by_tensor(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[torch.Tensor, list[str]]]:
    """Unique tensors in first-seen order, each with every name it has (a tied weight has several)."""
    groups: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, t in named:
        entry = groups.setdefault(id(t), (t, []))
        if name not in entry[1]:
            entry[1].append(name)
    return list(groups.values())


def tied_targets(model: nn.Module) -> dict[str, str]:
    """{tied name: name it is tied to}, as transformers declares it for this model and its config."""
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    if callable(expand):
        try:
            return dict(expand(all_submodels=True))
        except (TypeError, ValueError):
            pass
    keys = getattr(model, "_tied_weights_keys", None)  # transformers 4.x: a list of names / patterns
    if isinstance(keys, dict):
        return dict(keys)
    return {}


def _conversions(model: nn.Module) -> tuple[list, list] | None:
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # transformers 4.x: prefixes only
        return None
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    return renamings, [m for m in mapping if isinstance(m, WeightConverter)]


def checkpoint_to_model(
    model: nn.Module, checkpoint_keys: Iterable[str], model_keys: Iterable[str]
) -> tuple[dict[str, str], dict[str, list[str]]]:
    """({checkpoint key: model name} for keys that load 1:1, {model name: checkpoint keys} fused by a converter)."""
    known = dict.fromkeys(model_keys, True)
    prefix = getattr(model, "base_model_prefix", "") or None
    conv = _conversions(model)
    one_to_one: dict[str, str] = {}
    fused: dict[str, list[str]] = {}
    for key in checkpoint_keys:
        pattern = None
        if conv is not None:
            from transformers.core_model_loading import rename_source_key

            renamings, converters = conv
            # the same two tries as transformers' convert_and_load_state_dict_in_model
            renamed, pattern = rename_source_key(key, renamings, converters, prefix, known)
            if renamed not in known and key in known:
                renamed, pattern = rename_source_key(key, [], [], prefix, known)
        else:
            renamed = key
            if renamed not in known and prefix:
                if key.startswith(prefix + ".") and key[len(prefix) + 1:] in known:
                    renamed = key[len(prefix) + 1:]
                elif f"{prefix}.{key}" in known:
                    renamed = f"{prefix}.{key}"
        if renamed not in known:
            continue
        if pattern is not None:
            fused.setdefault(renamed, []).append(key)
        else:
            one_to_one[key] = renamed
    return one_to_one, fused


def model_to_checkpoint(model: nn.Module, named: dict[str, torch.Tensor]) -> dict[str, str]:
    """{model name: checkpoint key} as ``save_pretrained`` would name each tensor of ``named``."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return {n: n for n in named}
    # Shape-only stand-ins: a renaming hands its input tensor back unchanged, so identity tells
    # which name each output key came from; a converter builds new tensors (refused below).
    stand_ins = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in named.items()}
    by_id = {id(t): n for n, t in stand_ins.items()}
    out = revert_weight_conversion(model, dict(stand_ins))
    result: dict[str, str] = {}
    converted = []
    for key, t in out.items():
        t = t[0] if isinstance(t, list) else t
        if id(t) in by_id:
            result[by_id[id(t)]] = key
        else:
            converted.append(key)
    if converted:
        raise ConvertedOnSave(
            f"{type(model).__name__} saves {len(converted)} tensors through transformers weight converters"
            f" (e.g. {converted[:3]}), which streaming export does not support."
        )
    return result


class ConvertedOnSave(NotImplementedError):
    """The model's ``save_pretrained`` builds new tensors from its parameters (transformers 5's MoE experts):
    no file tensor is one parameter, so the export cannot stream (hf/export.py takes the whole model instead)."""


def matches_any(name: str, patterns: Iterable[str] | None) -> bool:
    return any(re.search(p, name) for p in (patterns or ()))
