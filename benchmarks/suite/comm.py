"""Communication per step, counted at the c10d layer from a profiler trace of one step.

[Note: counting communication]
Python wrappers around ``torch.distributed`` functions miss DDP: its reducer calls the
process group from C++. Every collective, from Python or C++, passes through a c10d
dispatcher op (``c10d::allreduce_``, ``c10d::_allgather_base_``, ``c10d::_reduce_scatter_base_``,
...), which the profiler records with its input shapes (``record_shapes=True``). So one
profiled step per configuration gives, per rank, every collective of every system (DDP,
FSDP2, DeepSpeed, Lightning's own) by the same rule. The op names a tensor list's dtype only
as "TensorList"; that dtype is taken from the gloo work the op started (``gloo:all_reduce``
etc., which carries its input's dtype), matched by element count.

Accounting (the ZeRO paper's, per rank): an all-reduce of n elements moves 2n (a
reduce-scatter plus an all-gather), a reduce-scatter of an n-element input n, an all-gather
of an n-element output n, a broadcast n. So data parallelism moves 2Ψ per step, ZeRO 1-2 2Ψ
(one reduce-scatter + one all-gather) and ZeRO 3 3Ψ (all-gather in forward and again in
backward). On the wire gloo's ring moves (N-1)/N of that per rank, and gloo implements
reduce_scatter_tensor as an all-reduce of the whole input (the trace shows a
``gloo:all_reduce`` of the full input under every ``c10d::_reduce_scatter_base_``): on gloo a
native reduce-scatter costs as much wire traffic as DDP's all-reduce. lightning_ampzero's gloo
groups reduce-scatter and all-gather by a ring of send/recv instead (zero/comm.py): the sends
under its profiler label (``ampzero::reduce_scatter#<dtype>#<world>``) are (N-1)/N of the
collective's buffer, as bytes, and count as the one collective the label names.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import Any, Optional

DTYPE_BYTES = {
    "float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4,
    "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1,
    "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
}
DTYPE_NAMES = {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16", "double": "fp64", "long int": "int64",
               "int": "int32", "unsigned char": "uint8", "bool": "bool"}

# c10d op -> (kind, which input holds the counted tensors, accounting factor)
_OPS = {
    "c10d::allreduce_": ("all_reduce", 0, 2),
    "c10d::allreduce_coalesced_": ("all_reduce", 0, 2),
    "c10d::reduce_": ("reduce", 0, 1),
    "c10d::broadcast_": ("broadcast", 0, 1),
    "c10d::allgather_": ("all_gather", 0, 1),               # outputs (list of lists)
    "c10d::_allgather_base_": ("all_gather", 0, 1),         # output tensor
    "c10d::allgather_coalesced_": ("all_gather", 0, 1),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 0, 1),
    "c10d::reduce_scatter_": ("reduce_scatter", 1, 1),      # inputs (list of lists)
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1, 1),  # input tensor
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 1),
    "c10d::alltoall_base_": ("all_to_all", 1, 1),
    "c10d::alltoall_": ("all_to_all", 1, 1),
    "c10d::gather_": ("gather", 1, 1),
    "c10d::scatter_": ("scatter", 1, 1),
    "c10d::send": ("p2p", 0, 1),
    "c10d::recv_": ("p2p", 0, 1),
    "c10d::barrier": ("barrier", 0, 0),
    "c10d::monitored_barrier_": ("barrier", 0, 0),
}


def _numel(dims: Any) -> int:
    """Elements of a shape ([2, 3]) or of a nested list of shapes ([[2, 3], [4]]); [] counts 0."""
    if not isinstance(dims, list) or not dims:
        return 0
    if all(isinstance(d, int) for d in dims):
        return math.prod(dims)
    return sum(_numel(d) for d in dims)


def _first_shape_numel(dims: Any) -> int:
    while isinstance(dims, list) and dims and isinstance(dims[0], list):
        dims = dims[0]
    return _numel(dims)


_TORCH_DTYPES = {"torch.float32": "float", "torch.bfloat16": "c10::BFloat16", "torch.float16": "c10::Half",
                 "torch.float64": "double", "torch.uint8": "unsigned char", "torch.int32": "int"}


def _count(kinds: dict, by_dtype: dict, kind: str, moved: int, dtype: str, nbytes: Optional[int] = None) -> None:
    """``nbytes``: the bytes moved, where ``moved`` elements are not all of ``dtype`` (a gather of several dtypes)."""
    nbytes = moved * DTYPE_BYTES.get(dtype, 4) if nbytes is None else nbytes
    k = kinds.setdefault(kind, {"calls": 0, "elements": 0, "bytes": 0})
    k["calls"] += 1
    k["elements"] += moved
    k["bytes"] += nbytes
    by_dtype[DTYPE_NAMES.get(dtype, dtype)] += nbytes


def _count_ring(ring: dict, label: tuple, stands_for: str, moved: int, dtype: str,
                elements: Optional[int] = None) -> None:
    """``moved`` of ``dtype`` per send; ``elements``: the label's count of a ring of several dtypes sent as bytes."""
    entry = ring.setdefault(label, [stands_for, 0, dtype, elements])
    entry[1] += moved


def parse_trace(path: str) -> dict:
    """Collectives of one profiled step: totals (elements, bytes by dtype) and per kind."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    events = [e for e in events if e.get("ph") == "X"]
    gloo = sorted((e for e in events if str(e.get("name", "")).startswith("gloo:")), key=lambda e: e["ts"])
    # gloo works, by element count of their input, in start order: dtype of TensorList ops
    pool: dict[int, list[str]] = defaultdict(list)
    for e in gloo:
        args = e.get("args", {})
        types = args.get("Input type") or []
        pool[_first_shape_numel(args.get("Input Dims"))].append(types[0] if types else "?")
    ops = sorted((e for e in events if str(e.get("name", "")).startswith("c10d::")), key=lambda e: e["ts"])
    # lightning_ampzero's gloo reduce-scatter / all-gather done by an all-reduce (zero/comm.py): the
    # all-reduce under such a label counts as the collective it stands for, in the label's dtype.
    labels = [e for e in events if str(e.get("name", "")).startswith(("ampzero::reduce_scatter#",
                                                                     "ampzero::all_gather#"))]
    kinds: dict[str, dict] = {}
    unparsed: dict[str, int] = defaultdict(int)
    elements = 0
    by_dtype: dict[str, int] = defaultdict(int)
    ring: dict[tuple, list] = {}
    for e in ops:
        name = e["name"]
        spec = _OPS.get(name)
        if spec is None:
            unparsed[name] += 1
            continue
        kind, index, factor = spec
        args = e.get("args", {})
        dims = args.get("Input Dims") or []
        types = args.get("Input type") or []
        counted = dims[index] if index < len(dims) else []
        n = _numel(counted)
        label = next((lb for lb in labels if name in ("c10d::allreduce_", "c10d::send", "c10d::recv_",
                                                      "c10d::_allgather_base_")
                      and lb.get("tid") == e.get("tid") and lb["ts"] <= e["ts"] <= lb["ts"] + lb.get("dur", 0)), None)
        if label is not None and name == "c10d::_allgather_base_":
            # gloo's own all-gather of several dtypes sent as bytes: "<...>#<ring number>#<elements>"
            mixed = int(label["name"].split("#")[-1])
            key = _first_shape_numel(dims[1] if len(dims) > 1 else counted)
            if pool.get(key):
                pool[key].pop(0)
            _count(kinds, by_dtype, kind, mixed, "unsigned char", nbytes=n)
            elements += mixed
            continue
        if label is not None and name != "c10d::allreduce_":
            # a ring of send/recv (zero/comm.py): its sends, (N-1)/N of the collective's buffer, as bytes
            # "<collective>#<dtype>#<world>", and "#<ring number>" when each step of a ring is
            # labelled on its own (zero/comm.py): one collective per ring number
            # "#<elements>" after the ring number: an all-gather of several dtypes sent as bytes
            stands_for, torch_dtype, world, *number = label["name"].split("::", 1)[1].split("#")
            mixed = int(number.pop()) if len(number) == 2 else None
            key = _first_shape_numel(counted)
            if pool.get(key):
                pool[key].pop(0)
            if name == "c10d::send":
                dtype = _TORCH_DTYPES.get(torch_dtype, "?")
                moved = n * int(world) // (int(world) - 1) // DTYPE_BYTES.get(dtype, 4)
                _count_ring(ring, tuple(number) or (label["ts"], label.get("tid")), stands_for, moved, dtype,
                            mixed)
            continue
        if label is not None:
            stands_for, torch_dtype = label["name"].split("::", 1)[1].split("#")[:2]
            dtype = _TORCH_DTYPES.get(torch_dtype, "?")
            key = _first_shape_numel(counted)
            wire_type = pool[key].pop(0) if pool.get(key) else "?"
            n = n * DTYPE_BYTES.get(wire_type, 4) // DTYPE_BYTES.get(dtype, 4)  # all-gather: sent as integers
            _count(kinds, by_dtype, stands_for, n, dtype)
            elements += n
            continue
        # the gloo work this op started: its input is the op's input (all-gather: the shard)
        key = _first_shape_numel(dims[1] if kind == "all_gather" and len(dims) > 1 else counted)
        work_dtype = pool[key].pop(0) if pool.get(key) else "?"
        dtype = types[index] if index < len(types) else "?"
        if dtype not in DTYPE_BYTES:  # "TensorList"
            dtype = work_dtype
        moved = factor * n
        _count(kinds, by_dtype, kind, moved, dtype)
        elements += moved
    for stands_for, moved, dtype, mixed in ring.values():  # one collective per label, however many sends
        if mixed is not None:  # ``moved`` counted bytes
            _count(kinds, by_dtype, stands_for, mixed, dtype, nbytes=moved * DTYPE_BYTES.get(dtype, 4))
            elements += mixed
            continue
        _count(kinds, by_dtype, stands_for, moved, dtype)
        elements += moved
    return {
        "elements": elements,
        "bytes": sum(by_dtype.values()),
        "bytes_by_dtype": dict(by_dtype),
        "by_kind": kinds,
        "calls": sum(k["calls"] for k in kinds.values()),
        "unparsed_ops": dict(unparsed),
    }


def formula_elements(numel: int, stage: int, accumulate: int) -> int:
    """ZeRO paper's elements per rank per optimizer step, with ``accumulate`` micro-batches.

    DP and stage 1 reduce once per optimizer step (2Ψ: the all-reduce / reduce-scatter +
    all-gather); stage 2 reduce-scatters after every micro-batch ((a+1)Ψ); stage 3 gathers
    in forward and in backward and reduce-scatters, every micro-batch (3aΨ). With a = 1 these
    are the paper's 2Ψ, 2Ψ, 2Ψ, 3Ψ.
    """
    a = accumulate
    return {0: 2 * numel, 1: 2 * numel, 2: (a + 1) * numel, 3: 3 * a * numel}[stage]
