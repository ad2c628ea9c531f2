"""What stage 1-2 could gain without FSDP2: a flat-buffer ZeRO-2 prototype against bare DDP and FSDP2.

Issue 16 wants stages 1-2 at DDP's step time. ampzero runs them on FSDP2 and the suite puts it
within 1-5% of raw FSDP2, so what is left over DDP is FSDP2's own per-step structure on CPU
(benchmarks/profile_step.py): every step it copies the shards into an all-gather buffer and the
gathered bytes out into each parameter (``foreach_copy_``, ``split_with_sizes_copy``), packs the
gradients into the reduce-scatter buffer (``_chunk_cat``), and wraps every parameter, gradient
and state in a DTensor. A DeepSpeed-style design avoids all but the gradient packing: the
parameters are views into one flat buffer, so each rank's shard is a slice of it, the optimizer
steps that slice in place and the all-gather writes the other ranks' slices straight into the
parameters.

This script measures that design's ceiling before anyone builds it: the suite's GPT and
workload (``benchmarks/suite``), 2 ranks, one thread each; per repetition it runs bare DDP, raw
FSDP2 at stage 2 (ampzero's units and policies, ``apply_zero``) and the prototype one after the
other in the same processes, and prints each one's median step and its ratio to DDP's, per
repetition, and whether its losses equal DDP's (the prototype is checked to compute the same
thing, not assumed to). The prototype is a measurement, not a feature: one bucket (the suite's
``reduce_bucket_size`` of 5e8 makes FSDP2 one group here too), reduce-scatter and all-gather by
ampzero's gloo rings, fused AdamW on each rank's slice, no accumulation, clipping, checkpoints or
offload.

``--systems`` adds ``zro``: torch's own ZeRO-1, DDP with ``ZeroRedundancyOptimizer`` (each rank steps
its share of whole parameters and broadcasts them, bucketed), a library alternative for stage 1
that would need no engine of ampzero's own::

    torchrun --standalone --nproc_per_node=2 benchmarks/flat_zero_ceiling.py --precision bf16-mixed --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the suite, run from anywhere

from benchmarks.suite.configs import Workload  # noqa: E402
from benchmarks.suite.systems import _autocast, adamw, loss_fn, make_loader  # noqa: E402


class FlatZero2:
    """Parameters as views into one flat fp32 buffer per optimizer group, each rank stepping its slice.

    Per group: ``params`` (the model's, now views of ``flat``), ``grads`` (a buffer of the same
    layout the gradients are copied into as autograd produces them), ``shard`` (this rank's slice
    of ``flat`` as a leaf the optimizer holds) whose ``.grad`` receives the reduce-scatter.
    """

    def __init__(self, model: nn.Module, optimizer_groups: list[dict], make_optimizer: Callable[[list[dict]], Any],
                 group: dist.ProcessGroup) -> None:
        self.group = group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.world = world
        self.sections = []
        shard_groups = []
        for spec in optimizer_groups:
            params = [p for p in spec["params"] if p.requires_grad]
            numel = sum(p.numel() for p in params)
            padded = -(-numel // world) * world
            flat = torch.zeros(padded)
            grads = torch.zeros(padded)
            at = 0
            for p in params:
                n = p.numel()
                flat[at:at + n].copy_(p.detach().view(-1))
                p.data = flat[at:at + n].view_as(p)  # the parameter is now a view of the flat buffer
                view = grads[at:at + n].view_as(p)
                p.register_post_accumulate_grad_hook(self._into(view))
                at += n
            shard = flat.view(world, -1)[rank].detach()  # shares storage with ``flat``
            shard.requires_grad_(True)
            shard.grad = torch.zeros_like(shard)
            self.sections.append((flat, grads, shard))
            shard_groups.append({**{k: v for k, v in spec.items() if k != "params"}, "params": [shard]})
        self.optimizer = make_optimizer(shard_groups)

    @staticmethod
    def _into(view: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            view.copy_(p.grad)  # as DDP copies a gradient into its bucket
            p.grad = None

        return hook

    def step(self) -> None:
        from lightning_ampzero.zero.comm import _ring_all_gather_steps, _ring_reduce_scatter_steps, _run

        for flat, grads, shard in self.sections:
            _run(_ring_reduce_scatter_steps(shard.grad, grads, self.group))
            shard.grad.div_(self.world)  # the mean, as DDP's all-reduce and FSDP2's AVG
        self.optimizer.step()
        for flat, grads, shard in self.sections:
            _run(_ring_all_gather_steps(flat, shard, self.group))


def timed_run(name: str, w: Workload, precision: str, rank: int) -> tuple[list[float], list[float], list[float]]:
    """Wall and CPU seconds of each timed step, and every step's loss."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from lightning_ampzero.config import PrecisionConfig, ZeroConfig
    from lightning_ampzero.models.gpt import GPT
    from lightning_ampzero.precision.policy import dtype_plan, fsdp_policies
    from lightning_ampzero.zero.apply import apply_zero

    torch.manual_seed(0)
    model: nn.Module = GPT(w.gpt_config())
    step: Callable[[], None]
    if name == "ddp":
        ddp = DistributedDataParallel(model)
        opt = adamw(model, w.lr)
        forward, step, zero = ddp, opt.step, lambda: opt.zero_grad(set_to_none=True)
    elif name == "zro":
        # PyTorch's own ZeRO-1: DDP's all-reduce, each rank steps its share of the parameters,
        # then broadcasts them (bucketed: parameters_as_bucket_view)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = DistributedDataParallel(model)
        reference = adamw(model, w.lr)
        # AdamW's own keywords only (its groups also carry Adam's ``decoupled_weight_decay``)
        keep = set(reference.defaults) - {"decoupled_weight_decay"}
        specs = [{k: v for k, v in g.items() if k in keep | {"params"}} for g in reference.param_groups]
        chosen = {k: reference.defaults[k] for k in ("fused", "foreach")}
        opt = ZeroRedundancyOptimizer(specs[0]["params"], optimizer_class=torch.optim.AdamW,
                                      parameters_as_bucket_view=True,
                                      **{**{k: v for k, v in specs[0].items() if k != "params"}, **chosen})
        for g in specs[1:]:
            opt.add_param_group(g)
        forward, step, zero = ddp, opt.step, lambda: opt.zero_grad(set_to_none=True)
    elif name == "fsdp2":
        mesh = init_device_mesh("cpu", (w.world,), mesh_dim_names=("dp",))
        zcfg = ZeroConfig(stage=2, reduce_bucket_size=w.reduce_bucket_size, allgather_bucket_size=w.allgather_bucket_size,
                          prefetch_bucket_size=w.prefetch_bucket_size,
                          param_persistence_threshold=w.param_persistence_threshold)
        mp_policy, module_policies = fsdp_policies(dtype_plan(precision, PrecisionConfig()), model, 2)
        apply_zero(model, mesh, zcfg, mp_policy, module_policies=module_policies)
        opt = adamw(model, w.lr)
        forward, step, zero = model, opt.step, lambda: opt.zero_grad(set_to_none=True)
    else:
        reference = adamw(model, w.lr)  # the suite's groups and hyper-parameters
        specs = [{k: v for k, v in g.items()} for g in reference.param_groups]
        chosen = {k: reference.defaults[k] for k in ("fused", "foreach")}  # each group carries the rest
        flat = FlatZero2(model, specs, lambda groups: torch.optim.AdamW(groups, **chosen), dist.group.WORLD)
        forward, step, zero = model, flat.step, lambda: None
    autocast = _autocast(precision)
    times, cpu, losses = [], [], []
    batches = iter(make_loader(w, rank))
    for i in range(w.total_steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        zero()
        x, y = next(batches)
        with autocast():
            loss = loss_fn(forward(x), y)
        loss.backward()
        step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        losses.append(loss.item())
    return times[w.warmup:], cpu[w.warmup:], losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", default="bf16-mixed", choices=("32-true", "bf16-mixed"))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--systems", default="ddp,fsdp2,flat",
                   help="comma-separated, ddp first: ddp, fsdp2, flat, zro (DDP + ZeroRedundancyOptimizer)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per system and repetition")
    args = p.parse_args()
    torch.set_num_threads(1)  # as the suite: one thread per rank on this 2-core machine
    w = Workload(steps=args.steps)
    # as the suite's workers: glibc keeps freed memory for every system alike (ampzero's default;
    # without it each step's large buffers are mapped and faulted in again, and the step doubles)
    from lightning_ampzero.host_memory import keep_freed_host_memory

    keep_freed_host_memory(w.host_memory_cache_mb)
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    rank = dist.get_rank()
    systems = tuple(args.systems.split(","))
    assert systems[0] == "ddp", "ratios are to ddp: list it first"
    medians: dict[str, list[float]] = {s: [] for s in systems}
    cpu_means: dict[str, list[float]] = {s: [] for s in systems}
    losses: dict[str, list[float]] = {}
    for rep in range(args.reps):
        for name in systems[rep % len(systems):] + systems[:rep % len(systems)]:  # order rotated per repetition
            times, cpu, run_losses = timed_run(name, w, args.precision, rank)
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (statistics.median(times), statistics.median(cpu)))
            medians[name].append(max(t for t, _ in gathered))  # a step ends when the slower rank's does
            cpu_means[name].append(statistics.mean(c for _, c in gathered))  # CPU time: mean over ranks
            losses[name] = run_losses
    if rank == 0:
        print(f"{args.precision}, GPT {w.n_layer} x {w.n_embd}, micro-batch {w.micro_batch} x {w.seq}, "
              f"{args.reps} repetitions of {args.steps} steps (median step: wall of the slower rank, CPU mean over"
              " ranks; ratios per repetition, median [min-max])")
        for name in systems:
            ratios = [m / d for m, d in zip(medians[name], medians["ddp"])]
            cpu_ratios = [m / d for m, d in zip(cpu_means[name], cpu_means["ddp"])]
            same = max(abs(a - b) / abs(b) for a, b in zip(losses[name], losses["ddp"]))
            print(f"  {name:6s} {statistics.median(medians[name]) * 1000:7.1f} ms  / ddp "
                  f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]  CPU "
                  f"{statistics.median(cpu_means[name]) * 1000:6.1f} ms  / ddp {statistics.median(cpu_ratios):.3f} "
                  f"[{min(cpu_ratios):.3f}-{max(cpu_ratios):.3f}]  "
                  f"loss max rel. diff from ddp {same:.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
