"""``apply_activation_checkpointing(model, cfg)``: ZeRO-R activation checkpointing, in place.

Which modules: the same blocks the partitioner uses (``zero.units.find_blocks``: the classes
named in ``cfg.modules``, or automatically the repeated blocks, e.g. transformer blocks), of
which ``every_n`` / ``number_checkpoints`` choose a subset. Each chosen block's ``forward`` is
replaced by an instance attribute that runs the original forward under non-reentrant
``torch.utils.checkpoint``; module classes, names and state-dict keys do not change, so
partitioning, checkpoints and ``zero.wrap_modules`` see the same model as without it.

[Note: AC inside FSDP2] Checkpointing is applied before partitioning (strategy.py's transform
order): FSDP2's hooks run in ``Module.__call__``, around the checkpointed ``forward``. In
forward, the unit is all-gathered before the checkpoint runs; in backward, FSDP2's pre-backward
hook (on the block's outputs) all-gathers it again before autograd reaches the checkpoint's
saved tensors, which is when the recomputation runs. So recomputation always finds the full
parameters, and under stage 3 they are not kept between forward and backward.

Recipes:

* ``full``: nothing inside a checkpointed block is kept; backward re-runs its forward.
* ``selective``: inside a block, the outputs of matrix multiplications and attention are kept
  (:data:`SAVE_OPS`, the expensive FLOPs), everything else (norms, activations, adds, views) is
  recomputed: most of the memory of ``full`` at almost none of its recompute FLOPs.
"""

from __future__ import annotations

import functools
import inspect
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_ampzero.activation.saved import BufferPool, SavedInputsHooks
from lightning_ampzero.config import ActivationCheckpointingConfig
from lightning_ampzero.zero.units import find_blocks


def _aten_ops(*names: str) -> frozenset:
    ops = []
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            ops.append(packet.default)
    return frozenset(ops)


#: Ops whose outputs the ``selective`` recipe keeps (everything else in a block is recomputed).
SAVE_OPS = _aten_ops(
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
)


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> Any:
    return create_selective_checkpoint_contexts(_selective_policy)


def select_blocks(n: int, every_n: int, number_checkpoints: Optional[int]) -> list[int]:
    """Indices of the blocks to checkpoint among ``n``: every ``every_n``-th from the first, or
    ``number_checkpoints`` of them spread evenly (the first always included)."""
    if n == 0:
        return []
    if number_checkpoints is not None:
        k = min(int(number_checkpoints), n)
        return sorted({(i * n) // k for i in range(k)})
    return list(range(0, n, int(every_n)))


@dataclass
class BlockProfile:
    forward_calls: int = 0
    forward_s: float = 0.0
    recompute_calls: int = 0
    recompute_s: float = 0.0


def _synchronize(device: Optional[torch.device]) -> bool:
    if device is None or device.type in ("cpu", "meta"):
        return False  # host compute is synchronous: nothing to wait for
    module = getattr(torch, device.type, None)
    if module is not None and hasattr(module, "synchronize"):
        module.synchronize(device)
        return True
    return False


def _device_of(args: tuple, kwargs: dict) -> Optional[torch.device]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return None


# [Note: a cache inside a checkpointed block]
# A decoder block called with a key/value cache object writes its keys and values into it during
# forward. Checkpointed, the block runs again in backward and finds the cache filled: T5's
# cross-attention then reads the cached states instead of computing them, saves fewer tensors, and
# torch's checkpoint stops ("A different number of tensors was saved during the original forward
# and recomputation"; a new-user trial, issue 16's note); a block that found no such check appends
# its keys twice: transformers 5's GPT-2 (which passes the cache *positionally*, and which this
# code did not see until a new-user trial) then attended over 32 keys for 16 tokens in the
# recomputation: eager attention stopped on a mask of the wrong size, selective checkpointing on
# "aten.slice.Tensor encountered during backward but not found in storage", and SDPA silently did
# the work twice. A cache has no use in a training forward whose blocks are recomputed, so under
# checkpointing a block given a cache object runs without it (``None`` for the parameters named as
# in Hugging Face's decoder blocks, by keyword or in their place among the positional arguments,
# and ``use_cache=False``), as transformers does for its own gradient checkpointing, and says so
# once. A ``use_cache=True`` with no cache object has nothing to fill and is left alone, with no
# warning. Blocks that declare ``_can_checkpoint_with_cache`` (transformers' flag for a block that
# only reads its cache) keep their arguments.
CACHE_KWARGS = ("cache", "past_key_value", "past_key_values", "layer_past")


class CacheArguments:
    """Where a block's ``forward`` takes a key/value cache object, and how to call it without one (the Note).

    torch_compile.py applies the same to compiled blocks.
    """

    def __init__(self, module: nn.Module, forward: Callable) -> None:
        # Hugging Face's opt-out for blocks that only read their cache (the recomputation reads the same states).
        self.read_only = bool(getattr(module, "_can_checkpoint_with_cache", False))
        self.positions: dict[int, str] = {}  # index among the positional arguments -> parameter name
        try:
            params = list(inspect.signature(forward).parameters.values())
        except (TypeError, ValueError):  # a builtin or C forward: keywords only
            params = []
        for i, param in enumerate(params):
            if param.kind not in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
                break
            if param.name in CACHE_KWARGS or param.name == "use_cache":
                self.positions[i] = param.name

    def given(self, args: tuple, kwargs: dict) -> bool:
        """Whether a cache object is passed (by keyword or in its position), read-only or not."""
        return (any(kwargs.get(key) is not None for key in CACHE_KWARGS)
                or any(name != "use_cache" and i < len(args) and args[i] is not None
                       for i, name in self.positions.items()))

    def dropped(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, dict]:
        """``(args, kwargs, changes)``: the arguments without a cache object; ``changes`` is {} when there was none."""
        if self.read_only:
            return args, kwargs, {}
        by_keyword = {key: None for key in CACHE_KWARGS if kwargs.get(key) is not None}
        cached_at = [i for i, name in self.positions.items()
                     if name != "use_cache" and i < len(args) and args[i] is not None]
        changed: dict[str, Any] = {**by_keyword, **{self.positions[i]: None for i in cached_at}}
        if not changed:
            return args, kwargs, {}  # a use_cache flag with no cache object to fill is left as the model passes it
        flag_at = [i for i, name in self.positions.items() if name == "use_cache" and i < len(args) and args[i]]
        new_args = tuple(None if i in cached_at else (False if i in flag_at else a) for i, a in enumerate(args))
        new_kwargs = {**kwargs, **by_keyword}
        if kwargs.get("use_cache") or flag_at:
            changed["use_cache"] = False
            if "use_cache" in kwargs:
                new_kwargs["use_cache"] = False
        return new_args, new_kwargs, changed


class _CheckpointedForward:
    """The replacement ``forward`` of a checkpointed block."""

    def __init__(self, owner: "ActivationCheckpointing", name: str, module: nn.Module, original: Callable) -> None:
        self.owner, self.name, self.original = owner, name, original
        self.cache = CacheArguments(module, original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self.owner
        if not torch.is_grad_enabled():
            return self.original(*args, **kwargs)  # evaluation: nothing is saved, nothing to checkpoint
        cfg = owner.config
        args, kwargs = self._without_cache(args, kwargs)
        device = _device_of(args, kwargs)
        if cfg.synchronize_checkpoint_boundary:
            owner.boundaries += 1
            _synchronize(device)
        start = owner._clock(device) if cfg.profile else 0.0
        with owner.saved_inputs_context():
            if owner.context_fn is None:
                out = checkpoint(self._run, *args, use_reentrant=False, **kwargs)
            else:
                out = checkpoint(self._run, *args, use_reentrant=False, context_fn=owner.context_fn, **kwargs)
        if cfg.synchronize_checkpoint_boundary:
            _synchronize(device)
        if cfg.profile:
            p = owner.profile[self.name]
            p.forward_calls += 1
            p.forward_s += owner._clock(device) - start
        return out

    def _without_cache(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments without a key/value cache object ([Note: a cache inside a checkpointed block])."""
        args, kwargs, changed = self.cache.dropped(args, kwargs)
        if changed and not self.owner.warned_cache and not torch.compiler.is_compiling():  # a warning would split the graph
            self.owner.warned_cache = True
            self.owner.warn(
                f"activation checkpointing: the checkpointed block {self.name!r} was called in training with a"
                f" key/value cache (arguments {', '.join(sorted(changed))}). Backward re-runs the block,"
                " which would fill the cache a second time (Hugging Face's T5 then stopped with CheckpointError),"
                f" so checkpointed blocks run without it: {', '.join(f'{k}={v}' for k, v in sorted(changed.items()))},"
                " as Hugging Face's gradient_checkpointing_enable() does. Pass use_cache=False to the model in"
                " training_step to silence this."
            )
        return args, kwargs

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        # A call while autograd runs a backward graph is the recomputation. Under torch.compile the
        # compiled backward recomputes (and applies a buffer update once), and the graph-task query,
        # which dynamo cannot trace, would split the block's graph: a compiled block ran eager.
        if torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1:
            return self.original(*args, **kwargs)
        with _outside_checkpoint():
            kept = _persistent_buffers(self.original.__self__)  # [Note: buffers a recomputation updates]
        device = _device_of(args, kwargs)
        start = self.owner._clock(device) if self.owner.config.profile else 0.0
        try:
            return self.original(*args, **kwargs)
        finally:  # also when recomputation stops early (it raises once it has what it needs)
            with _outside_checkpoint(), torch.no_grad():
                for buffer, value in kept:
                    buffer.copy_(value)
            if self.owner.config.profile:
                p = self.owner.profile[self.name]
                p.recompute_calls += 1
                p.recompute_s += self.owner._clock(device) - start


# [Note: buffers a recomputation updates]
# The recomputation runs the block's forward a second time, in training mode: a BatchNorm in it
# updated its running statistics twice per step (a ResNet under activation checkpointing ended
# its conformance run with num_batches_tracked 20 for 10 steps, and running means off), as with
# torch's own checkpoint. The block's persistent buffers (the module state a forward may update:
# running statistics, spectral norm's vectors) are copied before the recomputation and put back
# after it: the step then updates them once, as without checkpointing. All of them, not only those
# whose version counter moved: BatchNorm's kernel updates its running statistics without counting
# it. Non-persistent buffers (causal masks, rotary tables) are caches, not state, and are left alone.
def _persistent_buffers(block: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(buffer, buffer.detach().clone())
            for module in block.modules() for name, buffer in module._buffers.items()
            if buffer is not None and name not in module._non_persistent_buffers_set]


def _outside_checkpoint() -> Any:
    """Ops the recomputation must not count: ``selective`` replays the forward under a dispatch mode
    that stops at any op the forward did not run (torch 2.13 ``_CachedTorchDispatchMode``)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


# [Note: sharding hooks inside a selectively checkpointed block]
# ``selective`` replays the forward of a block under a dispatch mode that pairs each op of the
# recomputation with the same op's n-th call in the forward, and stops when the counts differ.
# A sharding group inside the block (stage 3 under "-mixed": the block's Linears gather in the low
# dtype as a group of their own, [Note: low-precision groups] in zero/apply.py) runs FSDP2's
# forward hooks inside the region; what they do depends on the schedule, not on the block: in the
# forward the group was all-gathered there (25 ``aten.view`` of the copy-out in a 2-layer BERT),
# in the recomputation backward had gathered it already. A Hugging Face BERT at stage 3 then
# stopped in its first backward ("aten.view.default invocation index 18 encountered during
# backward but not found in storage"; a new-user trial, bf16-mixed and 16-mixed). Those hooks move
# parameters, not activations the block computes, so while a selective-checkpoint mode is active
# they run with the dispatch modes put aside, in the forward and in the recomputation alike.
def _unseen_by_selective(hook: Callable) -> Callable:
    # Resolved once per hook, not on every call: the wrapper runs around each unit's forward hooks.
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

    selective_modes = (_CachingTorchDispatchMode, _CachedTorchDispatchMode)

    @functools.wraps(hook)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not any(isinstance(m, selective_modes) for m in _get_current_dispatch_mode_stack()):
            return hook(*args, **kwargs)
        with _outside_checkpoint():
            return hook(*args, **kwargs)

    run._ampzero_unseen = True  # type: ignore[attr-defined]
    return run


class ActivationCheckpointing:
    """What :func:`apply_activation_checkpointing` did to a model. With ``mode="none"`` it did
    nothing and this object is inert (``blocks`` is empty)."""

    def __init__(self, config: ActivationCheckpointingConfig) -> None:
        self.config = config
        self.blocks: list[str] = []
        self.candidates: list[str] = []
        self.pool: Optional[BufferPool] = None
        self.hooks: Optional[SavedInputsHooks] = None
        self.profile: dict[str, BlockProfile] = {}
        self.boundaries = 0
        # ``full`` passes no context_fn: under torch.compile one must return selective-checkpoint
        # dispatch modes, and torch's own default is the only other one it accepts.
        self.context_fn: Optional[Callable] = _selective_context if config.mode == "selective" else None
        self._patched: list[tuple[nn.Module, Any]] = []
        self.warn: Callable[[str], None] = functools.partial(warnings.warn, stacklevel=4)
        self.warned_cache = False

    @property
    def enabled(self) -> bool:
        return bool(self.blocks)

    def summary(self) -> str:
        """One line for the user: what is checkpointed, and where the checkpoints live.

        Nothing said it was on, so a user could not tell the setting took effect (a new-user trial).
        """
        if not self.blocks:
            return "activation checkpointing: off"
        where = ", checkpoints in host memory" if self.config.cpu_checkpointing else ""
        names = ", ".join(self.blocks[:3]) + (", ..." if len(self.blocks) > 3 else "")
        return (f"activation checkpointing: {self.config.mode}{where}, {len(self.blocks)} of {len(self.candidates)}"
                f" blocks ({names})")

    def after_sharding(self, model: nn.Module) -> int:
        """Under ``selective``, hide FSDP2's forward hooks from the checkpoint's op replay (the Note
        [sharding hooks inside a selectively checkpointed block]); returns how many were wrapped."""
        if self.context_fn is None or not self.blocks:
            return 0
        wrapped = 0
        for module in model.modules():
            for hooks in (module._forward_pre_hooks, module._forward_hooks):
                for key, hook in list(hooks.items()):
                    if (getattr(hook, "__module__", "") or "").startswith("torch.distributed.fsdp") \
                            and not getattr(hook, "_ampzero_unseen", False):
                        hooks[key] = _unseen_by_selective(hook)
                        wrapped += 1
        return wrapped

    def saved_inputs_context(self) -> Any:
        return self.hooks.context() if self.hooks is not None else nullcontext()

    def _clock(self, device: Optional[torch.device]) -> float:
        _synchronize(device)  # profiling times device work, so it waits for it
        return time.perf_counter()

    def profile_summary(self) -> dict[str, dict[str, float]]:
        """Per checkpointed block: forward and recompute calls and mean seconds."""
        out = {}
        for name, p in self.profile.items():
            out[name] = {
                "forward_calls": p.forward_calls,
                "forward_ms": 1e3 * p.forward_s / max(p.forward_calls, 1),
                "recompute_calls": p.recompute_calls,
                "recompute_ms": 1e3 * p.recompute_s / max(p.recompute_calls, 1),
            }
        return out

    def report(self) -> str:
        rows = [f"{'block':<24} {'fwd calls':>9} {'fwd ms':>9} {'recomp calls':>12} {'recomp ms':>9}"]
        for name, s in self.profile_summary().items():
            rows.append(f"{name:<24} {s['forward_calls']:>9} {s['forward_ms']:>9.3f} {s['recompute_calls']:>12}"
                        f" {s['recompute_ms']:>9.3f}")
        return "\n".join(rows)

    def remove(self) -> None:
        """Undo :func:`apply_activation_checkpointing` (restore every patched ``forward``)."""
        for module, previous in self._patched:
            if previous is None:
                del module.forward
            else:
                module.forward = previous
        self._patched.clear()
        self.blocks.clear()


def apply_activation_checkpointing(
    model: nn.Module,
    config: ActivationCheckpointingConfig,
    *,
    mesh: Any = None,
    warn: Callable[[str], None] = None,  # type: ignore[assignment]
) -> ActivationCheckpointing:
    """Checkpoint the blocks of ``model`` chosen by ``config``, in place; returns what was done.

    Args:
        model: the module to transform (before partitioning, see [Note: AC inside FSDP2]).
        config: the :class:`~lightning_ampzero.config.ActivationCheckpointingConfig`.
        mesh: the device mesh, to decide whether ``partition_activations`` can do anything.
        warn: how to warn (the strategy passes a rank-zero warning); defaults to ``warnings.warn``.
    """
    handle = ActivationCheckpointing(config)
    if config.mode == "none":
        return handle
    if warn is None:
        warn = functools.partial(warnings.warn, stacklevel=3)
    else:
        handle.warn = warn
    if config.partition_activations:
        dims = tuple(getattr(mesh, "mesh_dim_names", None) or ("dp",))
        # [Note: partition_activations] DeepSpeed splits each checkpoint across the *model*
        # (tensor) parallel group, whose ranks hold the same activations. Data-parallel ranks hold
        # activations of different samples: there is no copy to split, so the option saves nothing.
        warn(
            f"activation_checkpointing.partition_activations=True has no effect: the device mesh {dims} is pure data"
            " parallel, and data-parallel ranks hold activations of different samples, so there is no replicated"
            " checkpoint to split across them (DeepSpeed partitions across the tensor-parallel group only)."
            " To take checkpoints off the accelerator use cpu_checkpointing=True."
        )
    blocks = find_blocks(model, config.modules)
    if not blocks:
        raise ValueError(
            "activation_checkpointing found no block to checkpoint: the model has no repeated block (a class"
            " occurring at least twice in a ModuleList/Sequential). Name the block classes in"
            " activation_checkpointing.modules."
        )
    hf = [name or type(model).__name__ for name, m in model.named_modules() if getattr(m, "gradient_checkpointing", None) is True]
    if hf:
        # Both wrap the same blocks (a trial: a config's activation_checkpointing section beside
        # model.gradient_checkpointing_enable()): the results are the same, each backward recomputes more.
        off = ("model.gradient_checkpointing_disable()" if hasattr(model, "gradient_checkpointing_disable")
               else "the model's own switch")  # transformers' method; diffusers and others set the flag too
        warn(
            f"activation_checkpointing is on and so is the model's own gradient checkpointing ({', '.join(hf[:3])}"
            f"{', ...' if len(hf) > 3 else ''} set gradient_checkpointing=True, as transformers'"
            " gradient_checkpointing_enable() does): the blocks are checkpointed twice, which gives the same results"
            f" but recomputes more in each backward. Keep one: {off}, or activation_checkpointing='none'."
        )
    chosen = select_blocks(len(blocks), config.every_n, config.number_checkpoints)
    applied = [blocks[i][1].__dict__.get("forward") for i in chosen]
    if all(isinstance(f, _CheckpointedForward) and f.owner.config == config for f in applied):
        # Set up again (a second fit of the same module): it is checkpointed exactly so already.
        if len({id(f.owner) for f in applied}) == 1:
            return applied[0].owner
    handle.candidates = [name for name, _ in blocks]
    if config.cpu_checkpointing or config.contiguous_memory_optimization:
        if config.contiguous_memory_optimization:
            handle.pool = BufferPool(capacity=len(chosen))
        handle.hooks = SavedInputsHooks(cpu=config.cpu_checkpointing, pool=handle.pool)
    for i in chosen:
        name, module = blocks[i]
        current = module.__dict__.get("forward")
        if isinstance(current, _CheckpointedForward):
            raise ValueError(
                f"module {name!r} is already activation-checkpointed with another configuration"
                f" ({current.owner.config}). Call .remove() on the earlier handle first."
            )
        module.forward = _CheckpointedForward(handle, name, module, module.forward)
        handle._patched.append((module, current))
        handle.blocks.append(name)
        if config.profile:
            handle.profile[name] = BlockProfile()
    return handle
