"""``apply_compile(model, cfg)``: ``torch.compile`` each block of the model, in place.

Which modules: the blocks the partitioner and activation checkpointing find
(``zero.units.find_blocks``: the classes named in ``cfg.modules``, or the repeated blocks such as
transformer blocks). Each one is compiled with ``nn.Module.compile``, which keeps the module
object, its class, names and state-dict keys (so checkpoints, ``zero.wrap_modules`` and the
memory estimator see the model as without it) and compiles its ``__call__`` on first use.

[Note: compile order] Checkpointing, then compile, then partitioning (strategy.py's transform
order, as torchtitan orders them). Activation checkpointing replaces a block's ``forward``, which
the compiled call then traces, so the recomputation is part of the compiled backward. FSDP2's
hooks are added after compilation and run outside the compiled graphs (FSDP2 marks them so), so
the all-gathers and reduce-scatters stay where the eager run has them; DDP (stage 0) sees
ordinary modules. Per block, not the whole model: one graph per block class is compiled once
and reused by every block (parameters are graph inputs), compile time does not grow with depth,
and the communication between blocks overlaps as in eager mode.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable

import torch
from torch import nn

from lightning_ampzero.activation.apply import CacheArguments, _CheckpointedForward
from lightning_ampzero.config import CompileConfig
from lightning_ampzero.zero.units import find_blocks

__all__ = ["apply_compile", "compile_note", "compiled_blocks"]


def _check_backend(backend: str) -> None:
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        close = difflib.get_close_matches(backend, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"compile.backend={backend!r} is not a torch.compile backend.{hint} Backends here:"
                         f" {', '.join(sorted(known))}.")


def compiled_blocks(model: nn.Module) -> list[str]:
    """Names of the submodules that ``apply_compile`` (or the user) compiled in place."""
    return [name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]


# [Note: a cache inside a compiled block]
# Hugging Face's decoders pass a key/value cache object (DynamicCache) to every layer in a training
# forward when ``config.use_cache`` is on, the default. Each layer indexes it with its own
# ``layer_idx``, a constant to dynamo, so each layer of a block class compiled a graph of its own,
# and past ``torch._dynamo.config.recompile_limit`` (8) the rest ran eager without a word (a
# new-user trial: a 12-layer Llama, 8 graphs). In a training forward (gradients on) a compiled
# block therefore runs without the cache object, as a checkpointed block does ([Note: a cache
# inside a checkpointed block] in activation/apply.py): one graph for every layer, and nothing
# else changes, since training reads no cache (the model's returned cache is empty). Evaluation and
# generation (no gradients) keep it, and so run the block eagerly (_EvalWithCache): compiled, each
# layer again recompiled until the limit (a trial's 10-layer Llama validating at stage 3).
class _TrainingForward:
    """A compiled block's ``forward``: without a key/value cache object when gradients are on (the Note)."""

    def __init__(self, module: nn.Module, original: Callable) -> None:
        self.original = original
        self.cache = CacheArguments(module, original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            args, kwargs, _ = self.cache.dropped(args, kwargs)
        return self.original(*args, **kwargs)


class _EvalWithCache:
    """A compiled block's call (``_compiled_call_impl``): eager when a cache object comes without gradients (the Note)."""

    def __init__(self, block: nn.Module, compiled: Callable) -> None:
        self.block, self.compiled = block, compiled
        self.cache = block.forward.cache  # the forward's own signature (it wraps the block's original forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() and self.cache.given(args, kwargs):
            return self.block._call_impl(*args, **kwargs)
        return self.compiled(*args, **kwargs)


def apply_compile(model: nn.Module, config: CompileConfig) -> list[str]:
    """Compile every block of ``model`` in place; returns the names of the blocks compiled.

    A block already compiled (a second fit of the same module, or compiled by the user) is left
    as it is.
    """
    if not config.enabled:
        return []
    _check_backend(config.backend)
    blocks = find_blocks(model, config.modules)
    if not blocks:
        raise ValueError(
            "compile found no block to compile: the model has no repeated block (a class occurring at least"
            " twice in a ModuleList/Sequential). Name the block classes in compile.modules, or call"
            " torch.compile on your model yourself and leave compile off."
        )
    options = {"backend": config.backend, "fullgraph": config.fullgraph, "dynamic": config.dynamic}
    if config.mode is not None:
        options["mode"] = config.mode
    names = []
    for name, block in blocks:
        if getattr(block, "_compiled_call_impl", None) is None:
            if not isinstance(block.__dict__.get("forward"), (_CheckpointedForward, _TrainingForward)):
                block.forward = _TrainingForward(block, block.forward)  # checkpointed: it drops the cache itself
            block.compile(**options)
            block._compiled_call_impl = _EvalWithCache(block, block._compiled_call_impl)
        names.append(name)
    return names


def compile_note(model: nn.Module, names: list[str], config: CompileConfig) -> str:
    """What was compiled, said at setup: otherwise nothing in a plain Trainer script told a compiled run
    from an eager one, and its first step's minutes of compiling read as a hang (new-user trial)."""
    classes = sorted({type(model.get_submodule(name)).__name__ for name in names})
    note = (f"torch.compile ({config.backend}): {len(names)} block(s) of {', '.join(classes)}. Each class compiles"
            " at its first training step (and its first evaluation without a key/value cache; with one, a block"
            " runs eagerly): seconds to a few minutes on CPU, then cached.")
    # Delayed FP8 keeps Python bookkeeping in each Fp8Linear's forward and backward (the step's
    # amax all-reduce), where dynamo breaks the graph: say it, or the blocks look compiled whole.
    delayed = sum(getattr(m, "_fp8_sync", None) is not None
                  for name in names for m in model.get_submodule(name).modules())
    if delayed:
        note += (f" The {delayed} Fp8Linear(s) under fp8.recipe='delayed' in these blocks run their per-step amax"
                 " bookkeeping in Python, so each block is compiled in pieces between them; fp8.recipe='tensorwise'"
                 " or 'rowwise' keeps one graph per block.")
    return note
