"""Parameters that some ranks give no gradient: a mixture of experts' routing, a branch some ranks take.

[Note: parameters unused on some ranks]
FSDP2 reduce-scatters, per group, the parameters that have a gradient *on this rank*. When the
ranks differ in which ones (an expert that got no token on one rank), their reduce-scatter inputs
are laid out differently; with experts of one shape the lengths even agree, so the sum silently
adds one rank's gradient of expert 0 to another rank's gradient of expert 2. Measured (a new-user
trial, tests/scripts/unused_on_some_ranks.py: layer ``a`` run on rank 0 only, ``b`` on rank 1
only, same shapes): after one SGD step at stages 2 and 3, ``a`` and ``b`` were 0.0107 from
Lightning's ``ddp_find_unused_parameters_true``, which sums a zero for the rank that did not use
them. A hash-routed MoE drifted the same way.

``set_reduce_scatter_unused_params(True)`` makes FSDP2 reduce a zero gradient for a trainable
parameter without one, so every rank lays out the same list, as DDP's ``find_unused_parameters``
does. A parameter that no rank used then gets a zero gradient, where DDP and one process leave
None, which an optimizer skips (no weight decay, no momentum step). So each group's reducing
post-backward records which parameters had a gradient on this rank, and at the end of the
backward one all-reduce (MAX) of those flags, in model order (the same on every rank), finds the
ones no rank used: a gradient that this backward created for them (zeros) is set back to None.
Under accumulation a gradient an earlier micro-batch left stays (zeros were added to it). The
price is one small all-reduce per reducing backward.

[Note: units reduced in different orders]
The zero above covers a parameter inside a unit. A whole unit that some rank skips, or whose output
gets no gradient there (a branch chosen from the data, ``self.a(h) if x[0, 0] > 0 else self.b(h)``,
with each branch a unit of its own: a ``reduce_bucket_size`` smaller than the branches together),
is reduced by FSDP2's end-of-backward callback on that rank, after the others, while the ranks that
ran it reduce it in its place in the backward. Collectives pair in call order, so one rank's
gradients of ``a`` were summed with another's of ``b``: with units of one size, silently
(tests/scripts/branch_units.py: stages 1 and 2 were 0.0023 from ``ddp_find_unused_parameters_true``
after 3 SGD steps); with sizes that differ, or a unit one rank never gathered (FSDP2 reduces
nothing for it there: one collective fewer), gloo aborts in C++. So each reducing post-backward
also records its unit's place in this backward's reductions, and the flags' all-reduce (MAX)
carries, per unit, the place and the number of units minus the place: the two maxima add up to the
number of units only when every rank reduced the unit in the same place. Otherwise the gradients
are wrong on every rank, and the backward raises :data:`REDUCED_OUT_OF_ORDER`, naming the units, on
every rank, before an optimizer step can use them. The flags' all-reduce was there already (two
integers more per unit). Stage 3 gathers each unit in its forward, so there such a branch usually
mismatches in the forward already (gloo's collective-mismatch abort).

[Note: layers dropped on some ranks]
Hugging Face's audio encoders (wav2vec2, HuBERT, WavLM, data2vec-audio, SEW, UniSpeech,
SpeechT5, SeamlessM4T, ...) and NLLB-MoE drop whole layers at random in training (``layerdrop``,
0.1 by default for wav2vec2), drawn per rank. At stages 1-3 a layer is a sharding unit whose
forward all-gathers it, so a rank that skipped one would pair its next layer's collective with
another rank's for this one. transformers has a mode for ZeRO-3 and FSDP ("synced GPUs": every
rank runs every layer), on when the encoder has ``_is_fsdp_managed_module``, which
``fully_shard`` sets on every module it manages. What a dropped layer's output becomes in that
mode is transformers' choice: in transformers 5 it is kept, so layerdrop has no effect, as under
its own Trainer with FSDP or DeepSpeed ZeRO-3. Measured (tests/scripts/layerdrop.py, a 4-layer
wav2vec2, layerdrop 0.5, per-rank draws): stages 1-3 equal Lightning's ddp with that mode turned
on by hand, bit for bit, and are 0.0465 from ddp dropping layers. Users are told once
(``layerdrop_message``), since a regulariser they set does nothing.

[Note: generate() on some ranks]
``fully_shard`` marks the model too, so transformers' ``generate()`` runs synced: one all-reduce
per token, so that ranks whose sequences end at different steps keep calling the model while
its forward needs collectives. The most common sampling code, a callback that generates on rank 0
only (``if trainer.is_global_zero``), then waits in that all-reduce for ranks that never come:
measured on a GPT-2 in ``on_validation_epoch_end`` at stages 2 and 3, the watchdog ended the run,
where Lightning's ddp printed the sample. Synced generation is needed only while some unit is
sharded: when every unit is gathered (evaluation leaves them so) a forward needs no collective,
and one rank, or ranks stopping at different steps, generate alone. So a transformers model's
``generate`` decides ``synced_gpus`` per call, when the caller does not: synced while any of its
units is sharded. With that, the sample above matches ddp's at stages 1-3.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_ampzero.process import collective_device
from lightning_ampzero.watchdog import is_peer_lost
from lightning_ampzero.zero.groups import (
    FSDP2_REDUCES_UNUSED,
    give_unused_zero_gradients,
    has_local_gradient,
    repeated_post_backward,
)


class UnusedTracker:
    """Records, per reducing post-backward, the parameters without a local gradient; sets them back to None
    at the end of the backward when no rank had one (the Note)."""

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        self.group = group
        # sharded parameter -> (used on this rank, its sharded gradient was None before this reduction)
        self.seen: dict[int, tuple[nn.Parameter, bool, bool]] = {}
        self.order: dict[int, int] = {}
        # [Note: units reduced in different orders]: (unit, its name) in model order; unit -> its place
        # in this backward's reductions (from 1)
        self.units: list[tuple[Any, str]] = []
        self.places: dict[int, int] = {}
        self.task = -1  # the backward (autograd graph task) whose flush is queued

    def install(self, model: nn.Module) -> None:
        from lightning_ampzero.memory import fsdp_param_groups

        names = {id(m): name for name, m in model.named_modules()}
        for group in fsdp_param_groups(model):  # each group once
            name = ", ".join(names.get(id(m), type(m).__name__) or "(root)" for m in group.modules)
            self.units.append((group, name))
            group.reduce_scatter_unused_params = True  # what FSDPModule.set_reduce_scatter_unused_params sets
            for fp in group.fsdp_params:
                self.order.setdefault(id(fp.sharded_param), len(self.order))  # model order: the same on every rank
            if not getattr(group, "_ampzero_unused", False):
                group.post_backward = self._recording(group, group.post_backward)
                group._ampzero_unused = True

    def _recording(self, group: Any, post_backward: Any) -> Any:
        @functools.wraps(post_backward)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            # The reducing call: what FSDP2 is about to reduce (its own tests); not torch 2.11's repeat
            # ([Note: FSDP2 across torch versions] in groups.py).
            if group.reduce_grads and not repeated_post_backward(group, "unused"):
                task = torch._C._current_graph_task_id()
                for fp in group.fsdp_params:
                    if not hasattr(fp, "_unsharded_param") or not fp.unsharded_param.requires_grad:
                        continue
                    if not self.seen or task not in (-1, self.task):
                        # The first reduction of this backward. Records left by one an exception ended
                        # (its flush never ran) are dropped, or no flush would ever be queued again.
                        self.seen, self.places, self.task = {}, {}, task
                        torch.autograd.Variable._execution_engine.queue_callback(self.flush)
                    had = has_local_gradient(fp)
                    self.seen[id(fp.sharded_param)] = (fp.sharded_param, had, fp.sharded_param.grad is None)
                    self.places.setdefault(id(group), len(self.places) + 1)
                if not FSDP2_REDUCES_UNUSED:
                    give_unused_zero_gradients(group)
            return post_backward(*args, **kwargs)

        return recorded

    def flush(self) -> None:
        """At the end of the backward: one all-reduce of the flags; None again where no rank had a gradient."""
        from lightning_ampzero.zero.comm import finish_in_flight

        finish_in_flight()  # reduce-scatters left in flight finish before another collective starts
        seen, self.seen = sorted(self.seen.items(), key=lambda kv: self.order.get(kv[0], -1)), {}
        places, self.places = self.places, {}
        # [Note: units reduced in different orders]: per unit its place (0: not reduced) and n - place
        n = len(self.units)
        mine = [places.get(id(group), 0) for group, _ in self.units]
        flags = torch.tensor([had for _, (_, had, _) in seen] + mine + [n - p for p in mine], dtype=torch.int32,
                             device=collective_device(self.group))  # NCCL: a CUDA tensor
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        values = flags.tolist()
        latest, earliest = values[len(seen):len(seen) + n], [n - v for v in values[len(seen) + n:]]
        moved = [name for (_, name), a, b in zip(self.units, latest, earliest) if a != b]
        if moved:
            listed = "; ".join(moved[:6]) + ("; ..." if moved[6:] else "")
            raise RuntimeError(REDUCED_OUT_OF_ORDER.format(units=listed))
        for (_, (param, _, fresh)), anyone in zip(seen, values):
            # Only a gradient this backward created: an earlier micro-batch's stays (zeros were added to it).
            if not anyone and fresh:
                param.grad = None


REDUCED_OUT_OF_ORDER = (
    "ZeRO: in this backward the ranks reduced the gradients of some sharding units in different orders"
    " (units: {units}):"
    " a unit ran its forward, or got a gradient, on some ranks only (a branch chosen from the data, an expert that is"
    " a unit of its own). Collectives pair in call order, so these gradients were summed across the wrong units, and"
    " training stops before an optimizer step uses them. Make every rank run every unit: keep the branches inside one"
    " unit (a reduce_bucket_size larger than the branches together, as the default 5e8 elements is, or wrap_modules"
    " naming the module around them), or use stage 0 (DDP with find_unused_parameters=True), which allows it."
    " See [Note: units reduced in different orders] in lightning_ampzero/zero/unused.py."
)


def layers_dropped(model: nn.Module) -> list[str]:
    """"Class (layerdrop=p)" for each module whose Hugging Face config drops its layers in training."""
    found = []
    for module in model.modules():
        layerdrop = getattr(getattr(module, "config", None), "layerdrop", 0.0)
        if isinstance(layerdrop, (int, float)) and layerdrop > 0 and isinstance(getattr(module, "layers", None),
                                                                                nn.ModuleList):
            found.append(f"{type(module).__name__} (layerdrop={layerdrop})")
    return found


def layerdrop_message(dropping: list[str], stage: int) -> str:
    return (f"ZeRO stage {stage}: {', '.join(dropping)} drops layers at random per rank. Sharded, every rank runs "
            "every layer (transformers' mode for FSDP and DeepSpeed ZeRO-3), or the ranks' collectives would pair "
            "different layers; transformers 5 keeps a dropped layer's output there, so layerdrop has no effect, as "
            "under its own Trainer with FSDP or ZeRO-3. Set layerdrop=0.0 in the model's config to silence this, or "
            "train at stage 0 (DDP, find_unused_parameters=True) to drop layers.")


# A rank-0-only generate() after trainer.fit() at stage 3 (the usual end of a script): the other ranks
# finish the script and leave, and rank 0's next all-gather fails on gloo's "Connection closed by
# peer ... typically caused by a remote worker crashing", which sends the user to look for a crash
# (a new-user trial; the watchdog, which names generate() during fit, has stopped with fit).
GENERATE_ALONE = (
    "{name}.generate() on rank {rank}: the model is sharded (ZeRO stage 3), so each forward gathers its units"
    " from every rank, and the other ranks left (nothing crashed: they were not calling generate()). Call"
    " generate() on every rank (drop `if trainer.is_global_zero:`; every rank gets the same tokens), or export"
    " the weights (lightning_ampzero.hf.save_pretrained on every rank) and generate from the plain model."
)


def generate_in_step(model: nn.Module) -> None:
    """Each transformers model under ``model`` chooses ``synced_gpus`` per ``generate()`` call: synced while
    one of its units is sharded ([Note: generate() on some ranks])."""
    import sys

    if "transformers" not in sys.modules:  # only transformers' generate() takes synced_gpus
        return
    from transformers import GenerationMixin

    from lightning_ampzero.memory import fsdp_param_groups

    for module in model.modules():
        if not isinstance(module, GenerationMixin) or "generate" in vars(module):
            continue
        groups = fsdp_param_groups(module)
        original = module.generate

        @functools.wraps(original)
        def generate(*args: Any, _original: Any = original, _groups: list = groups, **kwargs: Any) -> Any:
            sharded = dist.is_initialized() and dist.get_world_size() > 1 and not all(g.is_unsharded for g in _groups)
            if kwargs.get("synced_gpus") is None and dist.is_initialized():
                kwargs["synced_gpus"] = sharded
            try:
                return _original(*args, **kwargs)
            except RuntimeError as error:
                if not (sharded and is_peer_lost(error)):
                    raise
                from lightning_ampzero.zero.apply import own_class_name

                raise RuntimeError(GENERATE_ALONE.format(name=own_class_name(_original.__self__),
                                                         rank=dist.get_rank())) from error

        module.generate = generate
