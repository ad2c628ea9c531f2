"""Lightning's ``StochasticWeightAveraging`` at stages 1-3: its averaged copy laid out as the model.

[Note: an averaged copy of a sharded model]
``StochasticWeightAveraging`` deep-copies the LightningModule in its ``setup`` hook, before the
strategy shards it, and then pairs the copy's ``parameters()`` with the model's, element-wise
(``p_swa.copy_(p_model)``, the running mean, and back into the model at the end). After
``fully_shard`` the model's parameters are DTensors while the copy's are whole tensors, so stages
1-3 stopped at the first averaging epoch with torch's "aten.copy_.default got mixed torch.Tensor
and DTensor" (Lightning refuses the callback outright with its own FSDP and DeepSpeed
strategies). Every operation SWA does is element-wise, so a copy whose parameters are DTensors
laid out exactly as the model's (same mesh, placements, local shard) averages each rank's shard
on that rank, and the whole averaged model is the one ddp averages. :func:`shard_averaged_copies`
does that after sharding, with no communication: each rank keeps its chunk of the copy's own
values, the chunks ``fully_shard`` took of the same tensors. Parameters outside FSDP2 (0-dim,
[Note: 0-dim parameters] in scalars.py) stay whole on both sides. Buffers are not sharded, so
the BatchNorm statistics SWA recomputes in its extra epoch follow the model's ([Note: buffer
broadcast] in buffers.py). Each parameter keeps the copy's dtype, as under ddp (SWA copies
before a "-true" precision casts).

[Note: the averaged copy in a sharded checkpoint]
Lightning saves the copy's ``state_dict()`` among the callback's states, which a sharded
checkpoint writes once, from rank 0, in ``meta.pt``: rank 0's shards would come back on every
rank. So :func:`pop_averaged_states` moves it into the DCP state (``averaged_<i>``, beside
``state_dict``), where each rank writes its shards and a load reshards to any world size and
stage; :func:`restore_averaged_states` loads it in place into the live copy (sharded by then:
the strategy restores after setup) and hands Lightning that state to load, as it saved it.

[Note: SWA's setup on a model already sharded]
The callback copies the module again in the setup hook of every later run (``trainer.validate``,
``test``, ``predict`` or another ``fit`` after a fit), where the module is still sharded from the
fit, and FSDP2 refuses to deep-copy a sharded module ("FSDP does not support deepcopy"; stages 1-3,
a new-user trial). What such a copy must be is known: the model's current values, laid out as the
model, which the copy from the first run already is. So :func:`copy_in_setup_when_sharded` makes
the callback's setup refresh that copy in place (parameters and buffers, shard by shard, no
communication) instead of copying the module, after the strategy has put evaluation's gathered
units back to their shards; a module not yet sharded is copied as before.

[Note: EMAWeightAveraging at stages 1-3]
Lightning 2.6's ``WeightAveraging`` (``EMAWeightAveraging``) keeps a torch ``AveragedModel``: a
deep copy of the LightningModule made in its setup hook (before sharding, as SWA's), updated
after each step element-wise (``torch._foreach_lerp_`` for the EMA), swapped with the model's
values around each validation epoch and copied into the model at the end of the fit. It stopped at
the first validation on "got mixed torch.Tensor and DTensor" (a new-user trial). So the copy's
module is laid out as the model too (:func:`shard_like`), which makes every one of those
operations act on each rank's shard. Two more things: the swap after a validation epoch meets the
units evaluation left gathered (the strategy reshards them only at ``on_validation_end``, after the
callbacks' epoch-end hooks), so the callback's ``on_validation_epoch_end`` reshards first
(:func:`prepare_averaging_callbacks`); and its checkpoint puts the averaged weights in
``state_dict`` and the model's in ``current_model_state``, which a sharded checkpoint writes from
rank 0 only, so that one goes into the DCP state too and is loaded back beside the model
(:func:`pop_averaged_states`, :func:`averaged_targets`, :func:`restore_averaged_states`).

The copy is matched to the model by parameter name. A model whose layers ``configure_model``
builds has none of them when SWA copies it (under ddp as well, where the two ``parameters()``
lists are then zipped out of step without an error); that is refused with what to do.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

#: What a user whose model ``configure_model`` builds is told (the copy has no such layers).
BUILT_IN_CONFIGURE_MODEL = (
    "StochasticWeightAveraging copies the LightningModule in its setup hook, before configure_model() runs, so"
    " its averaged copy lacks the parameters configure_model() creates ({names}). Build those layers in"
    " __init__ to use StochasticWeightAveraging, or leave the callback out."
)


def _averaging(callbacks: Iterable[Any]) -> list[Any]:
    """The ``StochasticWeightAveraging`` callbacks holding an averaged copy, in the Trainer's order."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    return [cb for cb in callbacks
            if isinstance(cb, StochasticWeightAveraging) and getattr(cb, "_average_model", None) is not None]


def _weight_averaging(callbacks: Iterable[Any], *, holding: bool = True) -> list[Any]:
    """The ``WeightAveraging`` callbacks (Lightning 2.6+), those holding an ``AveragedModel`` when ``holding``."""
    from lightning.pytorch import callbacks as lightning_callbacks

    cls = getattr(lightning_callbacks, "WeightAveraging", None)
    return [cb for cb in callbacks if cls is not None and isinstance(cb, cls)
            and (not holding or getattr(cb, "_average_model", None) is not None)]


def shard_like(copy: nn.Module, model: nn.Module) -> int:
    """Make each parameter of ``copy`` that is a DTensor in ``model`` (same name) a DTensor laid out alike.

    Values are ``copy``'s own, each rank keeping its chunk. Returns the number of parameters
    replaced. Tied parameters stay tied: every module holding one gets the same new parameter.
    """
    live = dict(model.named_parameters())
    mine = dict(copy.named_parameters())
    if mine.keys() != live.keys():
        missing = sorted(live.keys() - mine.keys())
        if missing:
            shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
            raise RuntimeError(BUILT_IN_CONFIGURE_MODEL.format(names=shown))
        raise RuntimeError(
            f"StochasticWeightAveraging's averaged copy has parameters the model does not"
            f" ({', '.join(sorted(mine.keys() - live.keys())[:3])}): the model's parameters changed after the"
            " callback copied it in its setup hook."
        )
    replaced: dict[int, nn.Parameter] = {}
    for name, param in mine.items():
        target = live[name]
        if not isinstance(target, DTensor) or isinstance(param, DTensor):
            continue
        # src_data_rank=None: no communication; every rank chunks its own (equal) copy.
        local = distribute_tensor(param.detach(), target.device_mesh, target.placements, src_data_rank=None)
        if local.to_local().shape != target.to_local().shape:
            raise RuntimeError(
                f"lightning_ampzero: the averaged copy of {name} would hold a shard of shape"
                f" {tuple(local.to_local().shape)} where the model's is {tuple(target.to_local().shape)}:"
                " this torch version shards differently from what zero/averaged.py expects."
            )
        replaced[id(param)] = nn.Parameter(local, requires_grad=param.requires_grad)
    for module in copy.modules():
        for attr, param in list(module._parameters.items()):
            if param is not None and id(param) in replaced:
                module._parameters[attr] = replaced[id(param)]
    return len(replaced)


def shard_averaged_copies(callbacks: Iterable[Any], model: nn.Module) -> int:
    """:func:`shard_like` the averaged copy of every ``StochasticWeightAveraging`` and ``WeightAveraging`` in ``callbacks``."""
    callbacks = list(callbacks)
    return (sum(shard_like(cb._average_model, model) for cb in _averaging(callbacks))
            + sum(shard_like(cb._average_model.module, model) for cb in _weight_averaging(callbacks)))


def pop_averaged_states(callbacks: Iterable[Any], checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Move each averaged copy's state out of ``checkpoint["callbacks"]``: ``{"averaged_<i>": state}`` for DCP.

    The callback's entry keeps ``average_model_state=None`` ([Note: the averaged copy in a sharded checkpoint]).
    """
    moved: dict[str, Any] = {}
    saved = checkpoint.get("callbacks", {})
    callbacks = list(callbacks)
    for i, cb in enumerate(_averaging(callbacks)):
        entry = saved.get(cb.state_key)
        if isinstance(entry, dict) and entry.get("average_model_state") is not None:
            moved[f"averaged_{i}"] = entry["average_model_state"]
            entry["average_model_state"] = None
    # WeightAveraging: the averaged weights are "state_dict" already; the model's go beside them
    # ([Note: EMAWeightAveraging at stages 1-3]).
    if _weight_averaging(callbacks) and "current_model_state" in checkpoint:
        moved[CURRENT] = checkpoint.pop("current_model_state")
    return moved


#: Where a sharded checkpoint keeps the model's own weights when ``state_dict`` holds the averaged ones.
CURRENT = "current_model_state"


def averaged_targets(callbacks: Iterable[Any], model_state: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Where DCP loads the saved averaged states: ``{"averaged_<i>": state}`` of the live SWA copies, in
    place, and for a ``WeightAveraging`` a fresh copy of the model's state (``model_state()``, sharded
    alike) for its ``current_model_state``."""
    callbacks = list(callbacks)
    targets = {f"averaged_{i}": cb._average_model.state_dict() for i, cb in enumerate(_averaging(callbacks))}
    if _weight_averaging(callbacks):
        targets[CURRENT] = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v
                            for k, v in model_state().items()}
    return targets


def restore_averaged_states(callbacks: Iterable[Any], checkpoint: dict[str, Any], loaded: dict[str, Any],
                            model_state: Callable[[], dict[str, Any]]) -> None:
    """Put the states DCP loaded back where the callbacks read them: ``averaged_<i>`` in
    ``checkpoint["callbacks"]``; for a ``WeightAveraging``, ``current_model_state``, and in
    ``state_dict`` the averaged weights DCP loaded into the model (``model_state()``), which the
    callback copies into its ``AveragedModel`` before loading ``current_model_state`` into the model."""
    saved = checkpoint.get("callbacks", {})
    callbacks = list(callbacks)
    for i, cb in enumerate(_averaging(callbacks)):
        entry = saved.get(cb.state_key)
        if isinstance(entry, dict) and f"averaged_{i}" in loaded and entry.get("average_model_state") is None:
            entry["average_model_state"] = loaded[f"averaged_{i}"]
    if CURRENT in loaded:
        checkpoint[CURRENT] = loaded[CURRENT]
        checkpoint["state_dict"] = model_state()


def refresh_like(copy: nn.Module, model: nn.Module) -> None:
    """Copy ``model``'s parameters and buffers into ``copy``, laid out alike (:func:`shard_like`), by name."""
    live = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in copy.named_parameters():
            param.copy_(live[name])
        buffers = dict(model.named_buffers())
        for name, buffer in copy.named_buffers():
            if name in buffers:
                buffer.copy_(buffers[name])


def prepare_averaging_callbacks(callbacks: Iterable[Any], reshard: Callable[[], None]) -> None:
    """Before the callbacks' setup: SWA's setup refreshes its copy of a sharded module
    (:func:`copy_in_setup_when_sharded`), and a ``WeightAveraging`` swaps back after validation
    with the units resharded ([Note: EMAWeightAveraging at stages 1-3]).

    ``reshard`` puts evaluation's gathered units back to their shards (the strategy's, [Note:
    units left gathered by evaluation]).
    """
    callbacks = list(callbacks)
    copy_in_setup_when_sharded(callbacks, reshard)
    for cb in _weight_averaging(callbacks, holding=False):
        if getattr(cb.on_validation_epoch_end, "_ampzero_reshard", False):
            continue
        swap_back = cb.on_validation_epoch_end

        def on_validation_epoch_end(trainer: Any, pl_module: nn.Module, swap_back: Any = swap_back) -> None:
            reshard()
            swap_back(trainer, pl_module)

        on_validation_epoch_end._ampzero_reshard = True  # type: ignore[attr-defined]
        cb.on_validation_epoch_end = on_validation_epoch_end


def copy_in_setup_when_sharded(callbacks: Iterable[Any], reshard: Callable[[], None]) -> None:
    """Make each ``StochasticWeightAveraging``'s setup refresh its averaged copy once the module is sharded.

    [Note: SWA's setup on a model already sharded].
    """
    from lightning.pytorch.callbacks import StochasticWeightAveraging
    from torch.distributed.fsdp import FSDPModule

    for cb in callbacks:
        if not isinstance(cb, StochasticWeightAveraging) or getattr(cb.setup, "_ampzero_refresh", False):
            continue
        copy_module = cb.setup

        def setup(trainer: Any, pl_module: nn.Module, stage: str, cb: Any = cb, copy_module: Any = copy_module) -> None:
            if cb._average_model is None or not isinstance(pl_module, FSDPModule):
                return copy_module(trainer, pl_module, stage)
            reshard()
            refresh_like(cb._average_model, pl_module)

        setup._ampzero_refresh = True  # type: ignore[attr-defined]
        cb.setup = setup


# Lightning callbacks that read the model's parameters as whole tensors, with no sharded path here yet
# (a new-user trial of Lightning 2.6's callbacks at stages 1-3): ModelPruning flattens the parameters
# (parameters_to_vector) and stopped at the end of the epoch on "would remove or reshape sharded
# dimension 0". Refused at setup instead, with the ways that work.
_WHOLE_MODEL_CALLBACKS = {
    "ModelPruning": "prune at stage 0 (DDP), or prune the consolidated weights after training",
}


def refuse_whole_model_callbacks(callbacks: Iterable[Any], stage: int) -> None:
    """Raise for a callback of :data:`_WHOLE_MODEL_CALLBACKS` at stages 1-3, naming what to use instead."""
    from lightning.pytorch import callbacks as lightning_callbacks

    for name, instead in _WHOLE_MODEL_CALLBACKS.items():
        cls = getattr(lightning_callbacks, name, None)
        found = [type(cb).__name__ for cb in callbacks if cls is not None and isinstance(cb, cls)]
        if found:
            raise ValueError(
                f"{found[0]} reads the model's parameters as whole tensors, and at ZeRO stage {stage} each rank holds"
                f" only its shard of them (it would stop inside torch on a DTensor error): {instead}."
            )
