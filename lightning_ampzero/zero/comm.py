"""Reduce a group's gradients in a low dtype while FSDP2 keeps and accumulates them in fp32.

[Note: stage 1 accumulation dtype]
FSDP2 accumulates the gradients of a group whose reduction it skips (``set_requires_gradient_sync
(False)``, our stage 1 between micro-batches) in the group's ``reduce_dtype``. Under "-mixed" the
``lower_precision_safe_modules`` reduce in bf16/fp16, so with a ``reduce_dtype`` of the low
dtype their full gradients were summed over micro-batches in bf16/fp16. DeepSpeed sums them in
fp32 and only communicates in the low dtype. Stage 1 therefore gives those groups
``reduce_dtype=None`` (fp32: accumulation and FSDP2's buffers), plus :class:`LowPrecisionReduceScatter`
as the group's reduce-scatter, which casts to the low dtype for the wire only. Stages 2 and 3
reduce every micro-batch and accumulate the fp32 shards, so they keep FSDP2's own low-dtype
reduce-scatter (off gloo; on gloo stages 1 and 2 keep those modules in their unit's group and
cast for the wire there: [Note: one group, two wire dtypes]; FSDP2's packing of fp32 gradients
into a bf16 buffer, ``torch._chunk_cat(..., out=bf16)``, also costs 3x packing in fp32 and
casting once on CPU). Stage 3 gathers those modules in the low dtype, so their gradients are
low already and FSDP2 packs without a cast.

[Note: gloo collectives by a ring]
Gloo's all-reduce is a tuned ring; its reduce-scatter is an all-reduce of the whole input (twice
the traffic a reduce-scatter needs) and its all-gather is slow on large buffers, while its
point-to-point send/recv is as fast as the all-reduce's own transfers. So above
:data:`GLOO_REDUCE_SCATTER_MIN_NUMEL` / :data:`GLOO_ALL_GATHER_MIN_NUMEL` elements the groups of a
gloo mesh reduce-scatter and all-gather by a ring of send/recv (:func:`_ring_reduce_scatter_steps`,
:func:`_ring_all_gather_steps`): N-1 steps, each rank sending one chunk to the next rank while
receiving one from the previous (the bandwidth-optimal schedule), with no buffer but FSDP2's own:
the reduce-scatter sums into its input, dead after the call, and receives into its output.
Measured on this 2-core machine, 2 ranks, fp32 (benchmarks/results/gloo_comm.md), for 4.9M
elements (the user-launch GPT's gradients): all-reduce 11.9 ms, gloo's reduce-scatter 22.1 ms
against 7.7 ms by the ring, gloo's all-gather 10.8 ms against 7.6 ms; for 32M, 238 / 57 ms and
177 / 48 ms. Below about 0.5M elements every variant takes 1-4 ms and the noise decides. A ZeRO step's reduce-scatter plus all-gather so costs about DDP's one all-reduce, as
the ZeRO paper counts it; an all-reduce in place of the reduce-scatter (this module's path until
issue 16) cost one and a half, and stages 1-2 ran at 1.16x / 1.11x DDP's step
(benchmarks/results/user_launch.md). Gradients are bit for bit those of gloo's collectives with
2 ranks (a + b == b + a); with more ranks each chunk is summed in ring order, which may differ
from gloo's, as between any two all-reduce algorithms. The all-gather only moves bytes
(sent as bytes: any dtype, FP8 included).
"""

from __future__ import annotations

import functools
import itertools
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_ampzero.zero.groups import repeated_post_backward

try:  # the custom-comm API of FSDP2 (torch >= 2.8); without it stage 1 keeps FSDP2's rule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGather
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatter
except ImportError:  # pragma: no cover - older torch
    _ReduceScatter = _AllGather = None  # type: ignore[assignment,misc]

HAS_CUSTOM_REDUCE_SCATTER = _ReduceScatter is not None
_RSBase: Any = _ReduceScatter if _ReduceScatter is not None else object
_AGBase: Any = _AllGather if _AllGather is not None else object


@dataclass(frozen=True)
class CommDtypePolicy(MixedPrecisionPolicy):
    """A MixedPrecisionPolicy whose group communicates its gradients in ``comm_dtype``.

    ``reduce_dtype`` stays what FSDP2 accumulates and reduce-scatters into (None: fp32). How the
    low dtype is sent depends on the mesh (:func:`lightning_ampzero.zero.apply._wire_dtypes`): on
    gloo the modules stay in their unit's group and its :class:`MixedWireReduceScatter` sends their
    part in ``comm_dtype``; elsewhere at stage 1 they are a group of their own with a
    :class:`LowPrecisionReduceScatter`, at stage 2 a group FSDP2 reduce-scatters in ``comm_dtype``.

    ``gather_dtype`` (stage 3): the dtype these modules' parameters are all-gathered in, autocast's.
    On gloo they stay in their unit's group and only their parameters gather in it ([Note: safe
    modules gathered in the low dtype inside their unit's group]); elsewhere it is their group's
    ``param_dtype``.
    """

    comm_dtype: Optional[torch.dtype] = None
    gather_dtype: Optional[torch.dtype] = None
    #: False: on gloo the gradients go in fp32 with the rest of the unit's (``gather_dtype`` still
    #: holds at stage 3): [Note: the safe modules' gradients on gloo] in precision/policy.py.
    low_on_gloo: bool = True


class _PlainAlloc:
    """The ``allocate`` of FSDP2's custom comms: an ordinary tensor (FSDP2 frees it when done)."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class LowPrecisionReduceScatter(_PlainAlloc, _RSBase):
    """FSDP2 reduce-scatter that sends ``dtype``: mean in fp32, cast, sum in ``dtype``, cast back.

    Dividing by the world size before the cast, as the stage-0 DDP hook does (precision/ddp.py),
    keeps fp16 from overflowing on a sum whose mean fits, and gives stages 0 and 1 one order of
    operations.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Optional[dist.Work]:
        _launch(self.steps(output_tensor, input_tensor, group, op), later=False)
        return None  # done: FSDP2 waits on nothing

    def steps(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
              op: Any) -> "Steps":
        if op == dist.ReduceOp.AVG:
            # Divide FSDP2's fp32 reduce-scatter input in place (its own, as the ring's), then round:
            # the same bits as a division into a low-dtype ``out=``, which on CPU costs 3x as much
            # (6.2 against 0.6 + 1.2 ms for 4.7M elements, one thread).
            send = input_tensor.div_(dist.get_world_size(group)).to(self.dtype)
        elif op == dist.ReduceOp.SUM:  # FSDP2 divides before / after the call itself
            send = input_tensor.to(self.dtype)
        else:
            raise NotImplementedError(
                f"LowPrecisionReduceScatter handles the AVG and SUM reductions FSDP2 uses by default, got {op}:"
                " leave the gradient divide factor of stage 1 -mixed modules at its default."
            )
        received = torch.empty(output_tensor.shape, dtype=self.dtype, device=output_tensor.device)
        # on gloo, above the threshold: the ring ([Note: gloo collectives by a ring])
        yield from GlooReduceScatter(native_off_gloo=True).steps(received, send, group, dist.ReduceOp.SUM)
        output_tensor.copy_(received)


#: Elements of the full (unsharded) buffer from which a gloo mesh reduce-scatters, and all-gathers,
#: by a ring of send/recv ([Note: gloo collectives by a ring]; benchmarks/results/gloo_comm.md).
GLOO_REDUCE_SCATTER_MIN_NUMEL = 500_000
GLOO_ALL_GATHER_MIN_NUMEL = 500_000
#: Profiler labels around each step of those rings: benchmarks/suite/comm.py counts the sends under them as
#: the reduce-scatter / all-gather they stand for (the dtype it was for, after "#"; the world size after a
#: second "#"; after a third, the ring's number, the same for all its steps).
RS_LABEL, AG_LABEL = "ampzero::reduce_scatter", "ampzero::all_gather"
#: Tag of the rings' send/recv, apart from user point-to-point traffic (tag 0 by default).
_RING_TAG = 0x5A31
_ring_numbers = itertools.count()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous tensor's memory as bytes (what send/recv moves; gloo has no FP8 type)."""
    return t.view(torch.uint8)


def _exchange(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup, rank: int, world: int,
              tag: int = _RING_TAG) -> list[dist.Work]:
    """Start sending ``send`` to the next rank of the ring and receiving ``recv`` from the previous one."""
    return [dist.isend(_bytes(send), group=group, group_dst=(rank + 1) % world, tag=tag),
            dist.irecv(_bytes(recv), group=group, group_src=(rank - 1) % world, tag=tag)]


#: A collective written as a generator: each ``yield`` hands the works it must wait on before
#: going on; the code after the last one finishes it. :func:`_run` drives one to the end at once,
#: :func:`_launch` may leave it in flight while backward goes on ([Note: reduce-scatters in flight]).
Steps = Iterator[list[Any]]


def _run(steps: Steps) -> None:
    for works in steps:
        for work in works:
            work.wait()


def _ring_reduce_scatter_steps(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                               label: str = RS_LABEL) -> Steps:
    """``output`` = the sum over ranks of chunk ``rank`` of ``input`` (1-D); ``input`` is overwritten.

    Step s: send the partial sum of chunk (rank - s - 1), receive the previous rank's partial sum
    of chunk (rank - s - 2) into ``output`` and add it into this rank's copy of that chunk. At the
    last step that chunk is the rank's own: this rank's part is added into ``output``, which then
    holds the whole sum. Each step's sends are posted under ``label`` plus "#" and the ring's number
    (benchmarks/suite/comm.py counts them as one collective).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = input.view(world, -1)
    label = f"{label}#{next(_ring_numbers)}"
    for step in range(world - 1):
        with torch.profiler.record_function(label):
            works = _exchange(chunks[(rank - step - 1) % world], output, group, rank, world)
        yield works
        target = (rank - step - 2) % world
        if step < world - 2:
            chunks[target].add_(output)
        else:
            output.add_(chunks[target])


def _lockstep(*parts: Steps) -> Steps:
    """Several collectives' steps side by side: each yield waits on every part's current works."""
    live = list(parts)
    while live:
        works: list[Any] = []
        going = []
        for part in live:
            step = next(part, None)
            if step is not None:
                works.extend(step)
                going.append(part)
        live = going
        if works:
            yield works


def _ring_all_gather_steps(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                           elements: Optional[int] = None) -> Steps:
    """``output`` (1-D) = every rank's ``input``, in rank order. Step s passes on chunk (rank - s).

    ``elements``: the parameter elements ``output`` holds when it holds several dtypes as bytes
    (added to the label, for benchmarks/suite/comm.py's count of elements).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = output.view(world, -1)
    if input.data_ptr() != chunks[rank].data_ptr():  # FSDP2 copies in place: usually the same
        chunks[rank].copy_(input.view(-1))
    label = f"{AG_LABEL}#{output.dtype}#{world}#{next(_ring_numbers)}"  # as the reduce-scatter's
    if elements is not None:
        label += f"#{elements}"
    for step in range(world - 1):
        with torch.profiler.record_function(label):
            works = _exchange(chunks[(rank - step) % world], chunks[(rank - step - 1) % world], group, rank, world)
        yield works


# [Note: reduce-scatters in flight]
# FSDP2 calls a group's reduce-scatter from the group's post-backward hook and, on CPU (no
# streams), expects the result on return; so with several groups every unit's backward stopped
# until its gradients had crossed the wire, where DDP's bucketed all-reduce runs in gloo's threads
# as backward goes on. Yet when nothing reads the output before the end of backward, FSDP2 only
# takes views of it: with no gradient already there to add into, no division or cast after the
# call, no post-accumulate-grad hook and no CPU offload (read from the caller's ``foreach_reduce``
# frame, :func:`_may_finish_later`), each parameter's ``.grad`` becomes a view of the output, and
# the first reader is whatever runs after ``backward()`` returns (the loss scaler, clipping, the
# optimizer). Then :func:`_launch` posts the ring's first exchange and returns; gloo's own threads
# move the bytes while the next unit computes its backward. The rest of the collective (waiting
# on the exchange, the adds, the division, the copies back) runs before the next reduce-scatter
# starts, or at the end of backward from an autograd final callback (queued once per backward,
# after FSDP2's own, so the root's late reductions are finished too). The same operations run on
# the same buffers in the same order, so the bits are those of the blocking call. Stages 1-3
# (``overlap``); stage 3's gradient offload, which reads the output as soon as FSDP2 returns,
# finishes it first (offload/grads.py). At stage 3 on the suite's GPT (bare loop, bf16-mixed,
# alternating runs) the backward went from 63.5-64.0 to 59.2-59.7 ms. The all-gathers of
# stages 1-2 are prefetched the same way (:class:`GlooAllGather`
# returns a Work whose ``wait()`` finishes the ring; apply.py ``_prefetch_forward_on_gloo``).
# It matters for a model of several groups below stage 3 (beyond one bucket, ``reduce_bucket_size``,
# 5e8 elements by default; [Note: units below stage 3] in units.py): the suite's GPT with
# per-block units (``reduce_bucket_size=1e6``), stage 1 bf16-mixed, bare loop, 16 interleaved
# rounds: 1.34x bare DDP's step blocking, 1.23x in flight. A model in one bucket is one group,
# reduced once at the very end of backward: nothing left to overlap, and it still runs faster
# (1.05x in that A/B) than the same model in units. A collective is written as a generator of
# its waits (``Steps``), so the blocking and the in-flight call are one code path.
# The contract is DDP's and DeepSpeed's (``overlap_comm``): gradients are final when
# ``backward()`` returns. Code that runs *during* backward and reads or writes the ``.grad`` of
# the group reduced last (a tensor hook on an activation, a module backward hook), whose
# reduce-scatter is still in flight until the next group's starts, sees the output buffer while
# the ring still fills it: not the old gradient, as under DDP, but whatever the buffer holds (a
# new-user trial found it, issue 16's note; a second trial read values up to 7.7e11 there, and
# final ones in the groups reduced before it). A post-accumulate-grad
# hook on the group's own parameters is detected and keeps the group blocking; the others cannot
# be seen from here, so such code needs ``zero.overlap_comm=False`` (DeepSpeed's key; every
# collective then finishes before backward goes on, and the all-gathers are not prefetched), or,
# below stage 3, a model of one group (the default below ``reduce_bucket_size`` elements). Tested both ways
# in tests/test_comm_in_flight.py.
_in_flight: list[Steps] = []
_callback_task = -1  # the backward (autograd graph task) whose final callback finishes them


_ONE_DTYPE_WAY_OUT = (
    " Reduce every gradient in one dtype to avoid this path: AmpZeroStrategy(precision={'communication_data_type':"
    " 'fp32'}) (Hydra: strategy.precision.communication_data_type=fp32), and report it.")


def _foreach_reduce_locals() -> Optional[dict[str, Any]]:
    """The local variables of FSDP2's ``foreach_reduce`` calling the reduce-scatter that calls this, or None.

    ``foreach_reduce`` is the reduce-scatter's direct caller in torch 2.13; a wrapper or two between
    them is allowed.
    """
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return None
        if frame.f_code.co_name == "foreach_reduce" and "fsdp_params" in frame.f_locals:
            return frame.f_locals
        frame = frame.f_back
    return None


def _may_finish_later(output: torch.Tensor, caller: Optional[dict[str, Any]]) -> bool:
    """Whether FSDP2's ``foreach_reduce`` (``caller``: its locals) reads ``output`` only after backward (the Note).

    Where it does, the group's shards are first given the hook of [Note: a gradient straight to a shard]."""
    if caller is None or (caller.get("postdivide_factor") is not None or caller.get("all_reduce_group") is not None
                          or caller.get("all_reduce_hook") is not None
                          or caller.get("orig_dtype") not in (None, output.dtype)):
        return False
    params = caller["fsdp_params"]
    if not all(fp.sharded_param.grad is None and not getattr(fp, "offload_to_cpu", False)
               and not getattr(fp.sharded_param, "_post_accumulate_grad_hooks", None) for fp in params):
        return False
    for fp in params:
        _finish_before_direct_gradient(fp.sharded_param)
    return True


# [Note: a gradient straight to a shard]
# A reduce-scatter left in flight makes each ``.grad`` of its group a view of its output, which
# the ring is still filling. Autograd can add into that ``.grad`` later in the same backward: at
# stage 3 a term computed in a step method from a parameter read outside its unit's forward (a
# weight penalty, its whole value taken with ``full_tensor()``, [Note: a loss computed from a
# shard] in strategy.py) sends its gradient to the shard itself, and the shard's accumulation runs
# after the unit's post-backward. Its in-place add went into the buffer the ring then finished
# writing, and the penalty's gradient was lost: a Llama's penalised weight grew where DDP's shrank
# (tests/test_zero_shard_in_step.py; equal to DDP's with ``overlap_comm=False``). So each shard of
# a group left in flight gets, once, a gradient hook that finishes the collectives in flight
# before autograd accumulates into it: the add then lands on the final values, in the blocking
# call's order (the same bits). The hook runs only when a gradient reaches the shard directly,
# never in a plain step (gradients reach the gathered parameters there), so it costs nothing there.
def _finish_before_direct_gradient(param: torch.Tensor) -> None:
    if param.requires_grad and not getattr(param, "_ampzero_finish_hook", False):
        param.register_hook(_finish_then_accumulate)
        param._ampzero_finish_hook = True  # type: ignore[attr-defined]


def _finish_then_accumulate(grad: torch.Tensor) -> None:
    finish_in_flight()


def finish_in_flight() -> None:
    """Finish every reduce-scatter left in flight, oldest first ([Note: reduce-scatters in flight])."""
    while _in_flight:
        _run(_in_flight.pop(0))


def _launch(steps: Steps, *, later: bool) -> None:
    """Run ``steps``; with ``later``, only to its first wait, when the end of this backward can finish it."""
    global _callback_task
    finish_in_flight()  # the previous unit's transfer, which had this unit's backward to get done
    task = torch._C._current_graph_task_id()
    if later and task != _callback_task:
        if task == -1:  # not inside a backward pass (a call from user code): finish at once
            later = False
        else:
            torch.autograd.Variable._execution_engine.queue_callback(finish_in_flight)
            _callback_task = task
    if not later:
        _run(steps)
        return
    _in_flight.append(_started(steps))


def _started(steps: Steps) -> Steps:
    """``steps`` with its first exchange posted now; iterating the result goes on from there."""
    first = next(steps, None)
    return iter(()) if first is None else itertools.chain([first], steps)


class GlooReduceScatter(_PlainAlloc, _RSBase):
    """Reduce-scatter on gloo: by a ring of send/recv from ``min_numel`` input elements.

    ``native_off_gloo``: on a group of another backend, the backend's own reduce-scatter
    (what :class:`LowPrecisionReduceScatter` needs; :func:`install_gloo_comms` installs this class
    on gloo groups only).
    ``overlap``: leave the collective in flight while backward goes on where FSDP2 allows it
    ([Note: reduce-scatters in flight]; stages 1-2).
    """

    def __init__(self, min_numel: Optional[int] = None, *, native_off_gloo: bool = False,
                 overlap: bool = False) -> None:
        self.min_numel = GLOO_REDUCE_SCATTER_MIN_NUMEL if min_numel is None else min_numel
        self.native_off_gloo = native_off_gloo
        self.overlap = overlap

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> Optional[dist.Work]:
        later = self.overlap and _may_finish_later(output_tensor, _foreach_reduce_locals())
        _launch(self.steps(output_tensor, input_tensor, group, op), later=later)
        return None  # done, or finished before anything reads it: FSDP2 waits on nothing

    def steps(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
              op: Any) -> Steps:
        if (input_tensor.numel() < self.min_numel or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
                or (self.native_off_gloo and dist.get_backend(group) != "gloo")):
            # Looked up at call time, so tools that patch torch.distributed (traffic counters) see it.
            reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            yield [reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=True)]
            return
        world = dist.get_world_size(group)
        yield from _ring_reduce_scatter_steps(output_tensor.view(-1), input_tensor.view(-1), group,
                                              f"{RS_LABEL}#{input_tensor.dtype}#{world}")
        if op == dist.ReduceOp.AVG:  # the sum, then the division gloo's reduce-scatter makes
            output_tensor.div_(world)


def _mixed_gather_elements(output: torch.Tensor, world: int) -> Optional[int]:
    """The parameter elements of an all-gather of several dtypes sent as bytes, read from FSDP2's
    ``foreach_all_gather`` (the caller), else None: the gather's profiler label carries the count for
    benchmarks/suite/comm.py, since bytes alone do not tell elements of two sizes apart."""
    if output.dtype != torch.uint8:
        return None
    caller = sys._getframe(2).f_locals  # foreach_all_gather -> GlooAllGather.__call__ -> here
    dtypes, numels = caller.get("param_all_gather_input_dtypes"), caller.get("param_all_gather_input_numels")
    if dtypes is None or numels is None or len({d for ds in dtypes for d in ds}) < 2:
        return None
    return world * sum(n for ns in numels for n in ns)


class GlooAllGather(_PlainAlloc, _AGBase):
    """All-gather on gloo: by a ring of send/recv from ``min_numel`` output elements."""

    def __init__(self, min_numel: Optional[int] = None) -> None:
        self.min_numel = GLOO_ALL_GATHER_MIN_NUMEL if min_numel is None else min_numel

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> Optional[dist.Work]:
        finish_in_flight()  # [Note: reduce-scatters in flight]: their sends go first, on every rank
        world = dist.get_world_size(group)
        elements = _mixed_gather_elements(output_tensor, world)
        if output_tensor.numel() < self.min_numel:
            all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            if elements is None:
                return all_gather(output_tensor, input_tensor, group=group, async_op=async_op)
            with torch.profiler.record_function(f"{AG_LABEL}#{output_tensor.dtype}#{world}#{next(_ring_numbers)}"
                                                f"#{elements}"):  # its elements, for the benchmarks' count
                return all_gather(output_tensor, input_tensor, group=group, async_op=async_op)
        steps = _ring_all_gather_steps(output_tensor.view(-1), input_tensor.view(-1), group, elements)
        if not async_op:
            _run(steps)
            return None  # done: FSDP2 waits on nothing
        # FSDP2 prefetches this group (stages 1-2 on gloo, apply.py) and waits on the Work right
        # before it copies the parameters out: the bytes move in gloo's threads meanwhile.
        return _StepsWork(_started(steps))


class _StepsWork(dist.Work):
    """The :class:`dist.Work` of a collective left in flight: ``wait()`` runs the rest of its steps."""

    def __init__(self, steps: Steps) -> None:
        super().__init__()
        self._steps: Optional[Steps] = steps

    def wait(self, timeout: Any = None) -> bool:
        if self._steps is not None:
            steps, self._steps = self._steps, None
            _run(steps)
        return True

    def is_completed(self) -> bool:
        return self._steps is None


class MixedWireReduceScatter(_PlainAlloc, _RSBase):
    """Reduce-scatter of one FSDP2 group (fp32 gradients) that sends some modules' gradients in ``dtype``.

    [Note: one group, two wire dtypes]
    Under "-mixed" the ``lower_precision_safe_modules`` reduce in bf16/fp16 and everything else
    in fp32. FSDP2 takes one reduce dtype per group, so below stage 3 those modules used to be a
    group of their own inside each unit ([Note: low-precision groups] in apply.py): per unit
    two all-gathers, two reduce-scatters and FSDP2's forward hooks on every safe module. On a
    gloo mesh they now stay in their unit's group, which packs every gradient in
    fp32 as usual; this reduce-scatter splits the packed input by parameter into a low-dtype
    buffer (divided by the world size, then cast, as :class:`LowPrecisionReduceScatter`) and
    an fp32 one (summed, then divided, as the fp32 group's :class:`GlooReduceScatter`), reduces
    each (the low part by a ring above the threshold, and then the fp32 part too, beside the
    low part's), and writes both back into FSDP2's fp32 output. Each element goes through the
    same operations as in the two-group layout, so with 2 ranks the bits are the same (with more,
    an fp32 part under the threshold is summed in ring order rather than gloo's); the step loses
    a group's hooks and collectives (benchmarks/README.md, issue 16).
    At stage 3 the safe modules also gather in the low dtype, per parameter inside the same group
    ([Note: safe modules gathered in the low dtype inside their unit's group]).

    Which parameters FSDP2 packed, in which order: those with a gradient this backward, in group
    order, one padded shard per parameter and rank. FSDP2 passes that list to its reduction
    (``foreach_reduce(fsdp_params, ...)``, the function that calls this one), so it is read from
    there rather than guessed, and checked against the input's size; a torch that calls this
    another way gets an error, never a wrong split. A parameter goes in ``dtype`` when the module
    that owns it is one of ``modules`` (module objects, which loading a state dict never replaces,
    unlike the parameters).
    """

    def __init__(self, modules: "list[Any]", dtype: torch.dtype, *, overlap: bool = True) -> None:
        self.dtype = dtype
        self.modules = list(modules)  # held: their identity decides, so their ids must stay theirs
        self._low = {id(m) for m in self.modules}
        self.overlap = overlap

    def _runs(self, params: list[Any], numel: int, world: int) -> list[tuple[int, int, bool]]:
        """(start, stop, low) column ranges of the input viewed as (world, numel // world), merged by dtype."""
        runs: list[tuple[int, int, bool]] = []
        start = 0
        for fp in params:
            stop = start + fp.padded_sharded_param_size.numel()
            low = id(fp._module_info.module) in self._low
            if runs and runs[-1][2] == low:
                runs[-1] = (runs[-1][0], stop, low)
            else:
                runs.append((start, stop, low))
            start = stop
        if start * world != numel:
            names = ", ".join(fp._module_info.param_name for fp in params[:4])
            raise RuntimeError(
                f"lightning_ampzero: the reduce-scatter input has {numel} elements, but the {len(params)} parameters"
                f" FSDP2 says it packed ({names}, ...) make {start * world}: this torch version packs gradients"
                " differently from what zero/comm.py MixedWireReduceScatter expects." + _ONE_DTYPE_WAY_OUT
            )
        return runs

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> Optional[dist.Work]:
        caller = _foreach_reduce_locals()
        if caller is None:
            raise RuntimeError(
                "lightning_ampzero: MixedWireReduceScatter (zero/comm.py) was called outside FSDP2's foreach_reduce,"
                " so it cannot tell which parameters the reduce-scatter input packs; this torch version reduces"
                " gradients differently from torch 2.13." + _ONE_DTYPE_WAY_OUT
            )
        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            raise NotImplementedError(
                f"MixedWireReduceScatter handles the AVG and SUM reductions FSDP2 uses by default, got {op}: leave"
                " the gradient divide factor at its default."
            )
        runs = self._runs(caller["fsdp_params"], input_tensor.numel(), dist.get_world_size(group))
        later = self.overlap and _may_finish_later(output_tensor, caller)
        _launch(self.steps(runs, output_tensor, input_tensor, group, op), later=later)
        return None  # done, or finished before anything reads it: FSDP2 waits on nothing

    def steps(self, runs: list[tuple[int, int, bool]], output_tensor: torch.Tensor, input_tensor: torch.Tensor,
              group: dist.ProcessGroup, op: Any) -> Steps:
        world = dist.get_world_size(group)
        if all(not low for _, _, low in runs):
            yield from GlooReduceScatter().steps(output_tensor, input_tensor, group, op)
            return
        if all(low for _, _, low in runs):
            yield from LowPrecisionReduceScatter(self.dtype).steps(output_tensor, input_tensor, group, op)
            return
        packed = input_tensor.view(world, -1)
        sizes = {flag: sum(b - a for a, b, low in runs if low is flag) for flag in (True, False)}
        send = {True: torch.empty(world, sizes[True], dtype=self.dtype, device=input_tensor.device),
                False: torch.empty(world, sizes[False], dtype=input_tensor.dtype, device=input_tensor.device)}
        at = {True: 0, False: 0}
        for a, b, low in runs:
            if low and op == dist.ReduceOp.AVG:
                packed[:, a:b].div_(world)  # in fp32, before rounding (LowPrecisionReduceScatter)
            send[low][:, at[low]:at[low] + b - a].copy_(packed[:, a:b])
            at[low] += b - a
        received = {flag: torch.empty(sizes[flag], dtype=send[flag].dtype, device=input_tensor.device)
                    for flag in (True, False)}
        low = GlooReduceScatter(native_off_gloo=True)
        # When the low part goes by the ring, so does the rest (LayerNorms, embeddings: usually
        # under the threshold), side by side: its exchange rides along the low part's instead of
        # being a gloo collective of its own. Suite, bf16-mixed / DDP, old and new code in
        # alternating runs: stage 1 1.089-1.099 -> 1.063-1.078, stage 2 1.100-1.121 -> 1.057-1.080.
        rest = GlooReduceScatter(0 if send[True].numel() >= low.min_numel else None, native_off_gloo=True)
        yield from _lockstep(low.steps(received[True], send[True].view(-1), group, dist.ReduceOp.SUM),
                             rest.steps(received[False], send[False].view(-1), group, op))
        at = {True: 0, False: 0}
        for a, b, low in runs:
            output_tensor[a:b].copy_(received[low][at[low]:at[low] + b - a])
            at[low] += b - a


def install_mixed_wire(fsdp_module: Any, low: "dict[Any, torch.dtype]", *, overlap: bool) -> bool:
    """Give an FSDP2 group owning parameters of ``low``'s modules (module -> wire dtype) a :class:`MixedWireReduceScatter`.

    ``low`` names every module that owns such parameters directly (a safe module's submodules too:
    its old group of its own covered every parameter under it). A module whose wire dtype is fp32
    sends with the rest of the group's gradients: the group keeps its reduce-scatter (False when
    that is all the group owns).
    """
    group = fsdp_module._get_fsdp_state()._fsdp_param_group
    if group is None:
        return False
    owners = {id(fp._module_info.module) for fp in group.fsdp_params}
    mine = [m for m in low if id(m) in owners and low[m] != torch.float32]
    if not mine:
        return False
    dtypes = {low[m] for m in mine}
    if len(dtypes) != 1:
        raise ValueError(f"one FSDP2 group can send its gradients in one low dtype, got {sorted(map(str, dtypes))}.")
    fsdp_module.set_custom_reduce_scatter(MixedWireReduceScatter(mine, dtypes.pop(), overlap=overlap))
    return True


# [Note: safe modules gathered in the low dtype inside their unit's group]
# At stage 3 under "-mixed" the ``lower_precision_safe_modules`` (the Linears) all-gather in the
# low dtype: autocast casts their weights to it at every call anyway, so the forward computes on
# the same bits and the gathers move half the bytes. FSDP2 takes one ``param_dtype`` per group,
# so they used to be a group of their own inside each unit ([Note: low-precision groups] in
# apply.py): two groups per block, each gathered twice (forward, backward) and reduce-scattered
# once, and the suite's GPT (4 blocks) made 15 collectives a step where stage 2 makes 3. On gloo
# each of those small collectives waits about 1 ms and FSDP2's hooks cost CPU time on each group
# (issue 16's profile: bf16-mixed stage 3 about 20 ms a step behind stage 2 with the same bytes).
# On a 1-D gloo mesh they now stay in their unit's group: their FSDPParams gather in the low dtype
# (set per parameter after FSDP2's own dtype setup, ``_init_mp_dtypes`` at lazy init; FSDP2 sends
# an all-gather of several dtypes as bytes), the rest in fp32, in one collective; the group's
# reduction wants one gradient dtype, so before its post-backward their low gradients become fp32
# (exact; ``reduce_dtype`` fp32 for them, accumulated in fp32 between micro-batches as FSDP2 does
# for any ``reduce_dtype``), and the group's MixedWireReduceScatter sends them in the low dtype as
# their own group's reduce-scatter did ([Note: one group, two wire dtypes]); the zero gradient FSDP2
# reduces for a parameter unused on this rank is made fp32 too. Their group also cast their
# floating inputs to the low dtype (``cast_forward_inputs``): a forward pre-hook on each module
# keeps that (``cast_inputs_to``), so a Linear called under ``autocast(enabled=False)`` computes
# in the low dtype as before rather than failing on mixed dtypes. Parameters offloaded to the host
# and FP8 weights (which all-gather their own way) keep the group of their own, as does any mesh
# other than 1-D gloo (NCCL: not measured on a GPU yet). Below stage 3 the Linears gather in fp32:
# gathering them low there too measured 2-3 ms faster a step, but outside the module's own call
# (a weight read for a penalty, a Linear under ``autocast(enabled=False)``) the low gathered
# weight differed from stage 0's, where stages 1-2 promise its bits (a new-user trial, issue 16).
def gather_in_low_dtype(fsdp_module: Any, low: "dict[Any, torch.dtype]") -> bool:
    """Make the FSDPParams of ``low``'s modules (module -> dtype) in ``fsdp_module``'s group gather in that dtype
    ([Note: safe modules gathered in the low dtype inside their unit's group])."""
    group = fsdp_module._get_fsdp_state()._fsdp_param_group
    dtypes = {id(m): d for m, d in low.items()}
    if group is None or not any(id(fp._module_info.module) in dtypes for fp in group.fsdp_params):
        return False
    init_mp_dtypes, post_backward = group._init_mp_dtypes, group.post_backward
    lows: list[Any] = []

    def init_then_gather_low() -> None:
        init_mp_dtypes()
        lows.clear()
        for fp in group.fsdp_params:
            dtype = dtypes.get(id(fp._module_info.module))
            if (dtype is None or fp.param_dtype is not None or fp.orig_dtype == dtype
                    or not fp.orig_dtype.is_floating_point or getattr(fp, "offload_to_cpu", False)
                    or hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather")):  # FP8 all-gathers its own way
                continue
            fp.param_dtype, fp.reduce_dtype = dtype, fp.orig_dtype
            lows.append(fp)

    @functools.wraps(post_backward)
    def fp32_gradients_then_post_backward(*args: Any, **kwargs: Any) -> Any:
        # FSDP2's zeros for unused parameters (torch 2.13's flag; on torch 2.11 the unused tracker gives
        # them before this runs), but not in torch 2.11's repeated call ([Note: FSDP2 across torch versions])
        zeros = (group.reduce_grads and getattr(group, "reduce_scatter_unused_params", False)
                 and not repeated_post_backward(group, "low_gather"))
        for fp in lows:
            param = getattr(fp, "_unsharded_param", None)
            if param is None:
                continue
            fp.accumulate_unsharded_grad_if_needed()  # into an fp32 sum an earlier micro-batch left
            fp.to_accumulated_grad_if_needed()  # else the low gradient, as fp32
            if zeros and fp.unsharded_accumulated_grad is None and param.grad is None and param.requires_grad:
                fp.unsharded_accumulated_grad = torch.zeros(param.shape, dtype=fp.orig_dtype, device=param.device)
        return post_backward(*args, **kwargs)

    group._init_mp_dtypes = init_then_gather_low
    group.post_backward = fp32_gradients_then_post_backward
    group._ampzero_gathers_low = True
    return True


def cast_inputs_to(module: Any, dtype: torch.dtype) -> None:
    """Cast ``module``'s floating-point forward inputs to ``dtype``, as FSDP2's ``cast_forward_inputs`` did for its
    group of its own ([Note: safe modules gathered in the low dtype inside their unit's group])."""
    from lightning_ampzero.precision.ddp import _cast_floats

    def pre_hook(module: Any, args: Any, kwargs: Any) -> Any:
        return _cast_floats(args, dtype), _cast_floats(kwargs, dtype)

    module.register_forward_pre_hook(pre_hook, with_kwargs=True)


def install_gloo_comms(fsdp_module: Any, group: dist.ProcessGroup, *, reduce_scatter: bool = True,
                       overlap: bool = False) -> bool:
    """Give a group of a gloo mesh :class:`GlooAllGather` (and :class:`GlooReduceScatter`); False elsewhere."""
    if _AllGather is None or dist.get_backend(group) != "gloo":
        return False
    fsdp_module.set_custom_all_gather(GlooAllGather())
    if reduce_scatter:
        fsdp_module.set_custom_reduce_scatter(GlooReduceScatter(overlap=overlap))
    return True
