"""Materialising the meta parameters of a model after it was sharded (stage 3).

Two sources, in this order:

1. chunks stored by :class:`lightning_ampzero.zero.init.ZeroInit` (a model built in
   ``configure_model()``: its exact one-process values, see [Note: partitioned construction] in
   init.py): each meta DTensor parameter gets its local tensor and the chunk is copied into it;
2. anything still on meta (a user who built on the meta device on purpose) is allocated and
   initialised by ``reset_parameters`` bottom-up (children first), so a module that initialises
   its whole subtree (like models.gpt.GPT) has the last word. Lightning's own helper calls
   ``reset_parameters`` top-down, so a parent's deliberate init would be overwritten.

Only meta tensors are touched: never ``to_empty()`` on the whole tree (torchmetrics states and
buffers computed in constructors live there).
"""

from __future__ import annotations

import warnings
from typing import Mapping, MutableMapping, Optional

import torch
from torch import nn

from lightning_ampzero._local import local_tensor
from lightning_ampzero.memory import fsdp_param_groups


#: Below this, a model built whole on every rank costs nothing worth a note (it was printed for every
#: small model a new user tried, a 66-parameter BoringModel included).
NOTE_BUILT_OUTSIDE_BYTES = 2**30


def built_outside_note(module: nn.Module, min_bytes: Optional[int] = None) -> Optional[str]:
    """A note for a stage-3 model whose parameters exist in full (built outside ``configure_model()``) and
    hold at least ``min_bytes`` (default :data:`NOTE_BUILT_OUTSIDE_BYTES`, read at each call), else None.

    Such a model is sharded after the fact, as stages 0-2 do; it only cost each rank the whole
    model while it was built.
    """
    # 0-dim parameters are built whole on purpose (nothing to shard: [Note: 0-dim parameters] in scalars.py),
    # and so are lazy modules' parameters, in configure_model() too (ZeroInit marks them: zero/init.py)
    built = [(n, p) for n, p in module.named_parameters()
             if not p.is_meta and p.dim() > 0 and not getattr(p, "_ampzero_lazy", False)]
    least = NOTE_BUILT_OUTSIDE_BYTES if min_bytes is None else min_bytes
    if not built or sum(p.numel() * p.element_size() for _, p in built) < least:
        return None
    numel = sum(p.numel() for _, p in built)
    return (
        f"ZeRO stage 3: {len(built)} parameters ({numel:,} elements, e.g. {built[0][0]!r}) were built outside"
        " `configure_model()`, so every rank held them whole while they were built; they are sharded now."
        " Build the model in your LightningModule's `configure_model()` hook to hold only a shard"
        " (`lightning_ampzero.zero.init.ZeroInit`)."
    )


def move_real_tensors_(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for everything but meta tensors (left for :func:`materialize_meta_`).

    A subtree without meta tensors moves with ``.to`` (its own ``_apply``: torchmetrics moves its
    states, Lightning updates its device); elsewhere each real parameter and buffer moves alone.
    """
    if not any(t.is_meta for t in module.parameters()) and not any(t.is_meta for t in module.buffers()):
        module.to(device)
        return
    with torch.no_grad():
        for name, buf in module._buffers.items():
            if buf is not None and not buf.is_meta and buf.device != device:
                module._buffers[name] = buf.to(device)
        for p in module._parameters.values():
            if p is not None and not p.is_meta and p.device != device:
                p.data = p.data.to(device)
    for child in module.children():
        move_real_tensors_(child, device)


def _owners(module: nn.Module) -> dict[int, list[tuple[str, nn.Module, str]]]:
    """id(param) -> [(fqn, owning module, attribute name)], every name of a shared parameter."""
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for mname, m in module.named_modules(remove_duplicate=False):
        for pname, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((f"{mname}.{pname}" if mname else pname, m, pname))
    return owners


@torch.no_grad()
def _allocate(p: nn.Parameter, device: torch.device) -> None:
    # What `to_empty` does to one parameter: a DTensor (FSDP2's sharded parameter, whose object
    # FSDP2 keeps a reference to) swaps in a local tensor on `device`, keeping the object.
    new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
    torch.utils.swap_tensors(p, new)


@torch.no_grad()
def materialize_meta_(module: nn.Module, device: torch.device,
                      shards: Optional[MutableMapping[str, torch.Tensor]] = None) -> None:
    """Give every meta parameter and buffer of ``module`` (sharded or not) real storage on ``device`` and its values.

    ``shards``: ``{fqn: this rank's chunk}`` from :func:`lightning_ampzero.zero.init.take_local_shards`;
    a parameter named there gets that chunk (its local shape must match FSDP2's, or this raises).
    Each chunk is removed from ``shards`` as soon as it is copied (see below), so pass the dict
    itself, not a copy. The others are initialised by ``reset_parameters`` of their modules,
    bottom-up.
    """
    if shards is None:
        shards = {}
    owners = _owners(module)
    params = {id(p): p for _, p in module.named_parameters(remove_duplicate=False)}
    used: set[str] = set()
    fresh: set[int] = set()  # allocated here without a chunk: reset_parameters must initialise them
    for key, p in params.items():
        if not p.is_meta:
            continue
        names = [fqn for fqn, _, _ in owners[key]]
        chunk = next((shards[n] for n in names if n in shards), None)
        used.update(n for n in names if n in shards)
        _allocate(p, device)
        if chunk is None:
            fresh.add(key)
            continue
        local = local_tensor(p)
        if local.shape != chunk.shape:
            raise RuntimeError(
                f"Parameter {names[0]!r}: the chunk built for this rank has shape {tuple(chunk.shape)} but the"
                f" sharded parameter's local shape is {tuple(local.shape)}. The model changed shape between"
                " `configure_model()` and sharding, or was sharded over another process group than it was built"
                " on; build and shard it over the same group."
            )
        local.copy_(chunk)
        # Drop the chunk now: holding every chunk until the end would keep two copies of the
        # rank's shard alive at once (chunks + FSDP2's shards). At 2.5B parameters on 2 ranks that
        # made setup's peak (9.9 GiB per rank) the run's peak, above training's (7.7 GiB).
        for n in names:
            shards.pop(n, None)
        del chunk
    unused = sorted(set(shards) - used)
    if unused and fresh:
        names = [owners[k][0][0] for k in fresh]
        raise RuntimeError(
            f"Chunks were built for parameters {unused[:3]} but the sharded model has meta parameters {names[:3]}"
            " under other names: a transform between `configure_model()` and sharding renamed them. Apply it"
            " inside `configure_model()` instead."
        )
    buffers_fresh: set[int] = set()  # modules with a buffer allocated here
    new_buffers: dict[int, torch.Tensor] = {}  # a buffer shared by modules stays shared
    for m in module.modules():
        for name, buf in m._buffers.items():
            if buf is not None and buf.is_meta:
                if id(buf) not in new_buffers:
                    new_buffers[id(buf)] = torch.empty_like(buf, device=device)
                m._buffers[name] = new_buffers[id(buf)]
                buffers_fresh.add(id(m))
    if fresh or buffers_fresh:
        _reset_bottom_up(module, fresh, buffers_fresh, owners)
    # FSDP2 pads each local shard into its own buffer; re-read the tensors swapped in above (what
    # FSDPModule._apply does after to_empty).
    for group in fsdp_param_groups(module):
        for fsdp_param in group.fsdp_params:
            fsdp_param.reset_sharded_param()


def _reset_bottom_up(module: nn.Module, fresh: set[int], buffers_fresh: set[int], owners: Mapping[int, list]) -> None:
    initialised: set[int] = set()

    def needs(m: nn.Module) -> bool:  # something in its subtree was allocated without a value
        return any(id(p) in fresh for p in m.parameters()) or any(id(s) in buffers_fresh for s in m.modules())

    def visit(m: nn.Module) -> None:
        for child in m.children():
            visit(child)
        reset = getattr(m, "reset_parameters", None)
        if callable(reset) and needs(m):
            # A module reset for a buffer alone keeps the values its parameters were given: FP8's
            # delayed recipe adds meta buffers (amax history, scale) to Linears whose weights already
            # hold this rank's chunk of the one-process model or of a checkpoint, and their
            # reset_parameters() drew new weights over those (a new-user trial: stage 3 + "delayed"
            # started a from_pretrained model from random Linears, 0.18 from the file).
            kept = [(p, local_tensor(p).clone()) for p in m.parameters() if id(p) not in fresh]
            reset()
            with torch.no_grad():
                for p, value in kept:
                    local_tensor(p).copy_(value)
            initialised.update(id(p) for p in m.parameters())

    with warnings.catch_warnings():
        # On a CPU mesh torch warns that random ops on DTensors "may not have complete support":
        # each rank fills its own shard from its own generator, which is what sharded init means
        # here (modules wanting values identical to an unsharded init use models/init.py).
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        visit(module)
    missing = [owners[k][0][0] for k in fresh if k not in initialised]
    if missing:
        raise RuntimeError(
            f"Parameters {missing[:3]} were built on the meta device but no module that owns them defines"
            " `reset_parameters()`, so they would start as uninitialised memory. Build the model in"
            " `configure_model()` without a meta-device context (the strategy keeps only each rank's shard"
            " of the exact one-process values), or give their module a `reset_parameters()` method."
        )
