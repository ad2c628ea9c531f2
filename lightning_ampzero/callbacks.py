"""``MemoryReport``: measured memory per rank by category during training, beside the estimate.

Add it to any Trainer (``callbacks=[MemoryReport()]``); it works with every strategy, and knows
the stage and ZeRO settings of ``AmpZeroStrategy``. On every rank it measures

* model states with :func:`lightning_ampzero.memory.measure_model_state` (storages of
  parameters, gathered parameters, gradients and optimizer states; peak per category and peak
  of the total), sampled after each backward and each optimizer step and, under FSDP2 (stages
  1-3), inside its hooks where the transient working set peaks: after each unit's pre-forward
  and pre-backward (the unit and its prefetched successor gathered) and just before each
  post-backward (the unit's unsharded gradients not yet reduce-scattered);
* activations: bytes of the tensors one micro-batch's forward saved for backward (parameters
  excluded, each storage once), on the second micro-batch of training;
* host memory the offload holds (``offloaded``: an offloading optimizer's host store or NVMe
  buffers, the parameter swapper's read pool); states offloaded to a swap file are on the drive
  and counted nowhere, and the estimate is of the run's offload option;
* peak resident memory of the process (``ru_maxrss``).

Every ``log_every_n_steps`` optimizer steps the figures of all ranks are gathered and logged
to the Trainer's loggers (``memory/rank{r}/{category}_mib``) with the estimate of
:mod:`lightning_ampzero.estimate` beside them (``memory/estimate/{category}_mib``). At the end
of training ``report`` holds everything on rank 0, and a rich table is printed if
``print_table``.
"""

from __future__ import annotations

import resource
from typing import Any, Optional

import torch
from torch import nn

from lightning.pytorch.callbacks import Callback

from lightning_ampzero._local import local_tensor
from lightning_ampzero.estimate import (
    PRECISIONS,
    ActivationTrace,
    Estimate,
    estimate,
    format_bytes,
    model_size,
    offload_option,
)
from lightning_ampzero.memory import (
    as_zero_categories,
    device_bytes,
    fsdp_param_groups,
    measure_model_state,
    unsharded_grad_bytes,
)

__all__ = ["MemoryReport"]

_CATEGORIES = ("params", "grads", "optimizer", "working", "model_states", "offloaded", "activations", "peak_rss")
_SAMPLE_FIRST_STEPS = 3


def _peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class _SavedBytes:
    """Counts the storages autograd saves for backward while entered (parameters excluded)."""

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}
        self._ctx: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        base = getattr(t, "_base", None)
        if not isinstance(t, nn.Parameter) and not isinstance(base, nn.Parameter):
            storage = local_tensor(t).untyped_storage()
            self.sizes[storage._cdata] = storage.nbytes()
        return t

    def __enter__(self) -> "_SavedBytes":
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
            self._ctx = None

    @property
    def total(self) -> int:
        return sum(self.sizes.values())


class MemoryReport(Callback):
    """Measures memory per rank by category and reports it beside the estimate.

    Args:
        log_every_n_steps: gather and log every this many optimizer steps (0: only at the end).
        print_table: print a rich table on rank 0 when training ends.
        activation_estimate: an :class:`~lightning_ampzero.estimate.ActivationTrace` of the same
            micro-batch (e.g. from :func:`~lightning_ampzero.estimate.gpt_activations`) to show
            beside the measured activations.
        checkpointing: the activation-checkpointing setting to read from ``activation_estimate``.
        optimizer: optimizer name for the estimate; ``None`` infers it from the optimizer state
            (two states per parameter: Adam, one: SGD with momentum, none: SGD).
    """

    def __init__(
        self,
        log_every_n_steps: int = 50,
        print_table: bool = True,
        activation_estimate: Optional[ActivationTrace] = None,
        checkpointing: str = "none",
        optimizer: Optional[str] = None,
    ) -> None:
        if isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 0:
            raise ValueError(f"log_every_n_steps must be a whole number >= 0, got {log_every_n_steps!r}.")
        if activation_estimate is not None:
            activation_estimate.bytes(checkpointing)  # validates the setting
        self.log_every_n_steps = log_every_n_steps
        self.print_table = print_table
        self.activation_estimate = activation_estimate
        self.checkpointing = checkpointing
        self.optimizer = optimizer
        self.report: dict[str, Any] = {}
        self._peak: dict[str, int] = {}
        self._peak_total = 0
        self._activations: Optional[int] = None
        self._saved: Optional[_SavedBytes] = None
        self._last_logged = -1
        self._hooked: list[Any] = []

    # -- measuring ---------------------------------------------------------------------
    def _sample(self, trainer: Any, pl_module: nn.Module) -> None:
        m = measure_model_state(pl_module, trainer.optimizers)
        # Model states on the device: what the offload holds in host memory is reported beside them.
        self._peak_total = max(self._peak_total, device_bytes(m))
        # The estimate's stage-3 working set is what a unit holds while it runs: its gathered
        # parameters and its unsharded gradients, in the same sample (separate peaks would not add up).
        unsharded = unsharded_grad_bytes(pl_module)
        m.update(grads_sharded=m["grads"] - unsharded, grads_unsharded=unsharded,
                 working=m["params_gathered"] + unsharded)
        for k, v in m.items():
            self._peak[k] = max(self._peak.get(k, 0), v)

    def _sampling(self, trainer: Any) -> bool:
        step = trainer.global_step
        return step < _SAMPLE_FIRST_STEPS or (self.log_every_n_steps > 0 and step % self.log_every_n_steps == 0)

    def _hook_fsdp(self, trainer: Any, pl_module: nn.Module) -> None:
        """Sample inside FSDP2's unit hooks for this step (the estimate's working set exists only there).

        Wraps the methods on each param group instance (FSDP2 calls them by attribute), so only
        this model is affected, and only on sampled steps: a sample walks every parameter. It wraps
        what the instance holds, which may be the strategy's own wrapper (the unused-parameter
        tracker and gradient offload wrap ``post_backward``), and puts that back afterwards:
        wrapping the class's method skipped them on sampled steps, and unhooking then dropped them
        for the rest of the run.
        """
        for group in fsdp_param_groups(pl_module):
            held = {}
            for name, after in (("pre_forward", True), ("pre_backward", True), ("post_backward", False)):
                held[name] = group.__dict__.get(name)  # an instance wrapper, or None: the class's method
                setattr(group, name, self._sampling_wrapper(getattr(group, name), after, trainer, pl_module))
            self._hooked.append((group, held))

    def _sampling_wrapper(self, fn: Any, after: bool, trainer: Any, pl_module: nn.Module) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not after:
                self._sample(trainer, pl_module)
            out = fn(*args, **kwargs)
            if after:
                self._sample(trainer, pl_module)
            return out
        return wrapped

    def _unhook_fsdp(self) -> None:
        for group, held in self._hooked:
            for name, wrapper in held.items():
                if wrapper is None:
                    group.__dict__.pop(name, None)  # the class's method again
                else:
                    setattr(group, name, wrapper)
        self._hooked = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._sampling(trainer) and not self._hooked:
            self._hook_fsdp(trainer, pl_module)
        if batch_idx == 1 and self._activations is None:
            self._saved = _SavedBytes().__enter__()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self._saved is not None:
            self._saved.__exit__(None, None, None)
            self._activations = self._saved.total
            self._saved = None
        # Stages 1-2 hold their gathered parameters from forward to the end of backward only:
        # sampled after backward or after the step, FSDP2 has already resharded them.
        if self._sampling(trainer):
            self._sample(trainer, pl_module)

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if self._sampling(trainer):
            self._sample(trainer, pl_module)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._unhook_fsdp()
        if self._saved is not None:  # the step had no backward (manual optimization without one)
            self._saved.__exit__(None, None, None)
            self._saved = None
        if not self._sampling(trainer):
            return
        self._sample(trainer, pl_module)
        step = trainer.global_step
        # every rank sees the same global_step, so all of them enter the gather together
        if self.log_every_n_steps and step > self._last_logged and step % self.log_every_n_steps == 0:
            self._last_logged = step
            self._log(trainer, pl_module, step)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._unhook_fsdp()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._unhook_fsdp()
        if self._saved is not None:
            self._saved.__exit__(None, None, None)
            self._saved = None
        ranks = self._gather(trainer, self._local(trainer))
        est = self._estimate(trainer, pl_module)
        if not trainer.is_global_zero:
            return
        self.report = {
            "stage": _stage(trainer),
            "world_size": trainer.world_size,
            "per_rank": ranks,
            "estimate": {**est.as_dict(), "cpu_per_rank": _host_per_rank(est, trainer)} if est is not None else None,
            "activation_estimate": (self.activation_estimate.bytes(self.checkpointing)
                                    if self.activation_estimate is not None else None),
        }
        self._log_dict(trainer, ranks, est, trainer.global_step)
        if self.print_table:
            render_memory_report(self.report)

    # -- gathering and logging ---------------------------------------------------------
    def _local(self, trainer: Any) -> list[float]:
        stage = _stage(trainer)
        cats = as_zero_categories(self._peak, stage) if self._peak else None
        params, grads = float(cats.params if cats else 0), float(cats.grads if cats else 0)
        working = 0.0
        if stage == 2 and self._peak:
            # Stage 2: gradients are shards; a reduction group's unsharded gradients, until its
            # reduce-scatter, are the working set, as in the estimate.
            grads, working = float(self._peak.get("grads_sharded", 0)), float(self._peak.get("grads_unsharded", 0))
        if stage == 3 and self._peak:
            # Stage 3: the formula's parameters and gradients are the shards; what the units held
            # gathered and unsharded at a sample is the working set, as in the estimate.
            params, working = float(self._peak.get("params_sharded", 0)), float(self._peak.get("working", 0))
            grads = float(self._peak.get("grads_sharded", 0))
        return [
            params, grads,
            float(cats.optimizer if cats else 0), working, float(self._peak_total), float(self._peak.get("offloaded", 0)),
            float(self._activations if self._activations is not None else -1), float(_peak_rss_bytes()),
        ]

    @staticmethod
    def _gather(trainer: Any, local: list[float]) -> list[dict[str, Any]]:
        t = torch.tensor(local, dtype=torch.float64)
        if trainer.world_size > 1:
            import torch.distributed as dist

            from lightning_ampzero.process import collective_device

            if dist.is_available() and dist.is_initialized():
                t = t.to(collective_device())  # NCCL gathers CUDA tensors only
                out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
                dist.all_gather(out, t)
                t = torch.stack(out).cpu()
        rows = t.reshape(-1, len(_CATEGORIES)).tolist()
        return [
            {"rank": r, **{k: (None if k == "activations" and v < 0 else int(v)) for k, v in zip(_CATEGORIES, row)}}
            for r, row in enumerate(rows)
        ]

    def _log(self, trainer: Any, pl_module: Any, step: int) -> None:
        ranks = self._gather(trainer, self._local(trainer))
        if trainer.is_global_zero:
            self._log_dict(trainer, ranks, self._estimate(trainer, pl_module), step)

    def _log_dict(self, trainer: Any, ranks: list[dict[str, Any]], est: Optional[Estimate], step: int) -> None:
        metrics: dict[str, float] = {}
        for r in ranks:
            for k in _CATEGORIES:
                if r.get(k) is not None:
                    metrics[f"memory/rank{r['rank']}/{k}_mib"] = r[k] / 2**20
        if est is not None:
            for k, v in (("params", est.gpu_params), ("grads", est.gpu_grads), ("optimizer", est.gpu_optimizer),
                         ("working", est.gpu_working), ("model_states", est.gpu)):
                metrics[f"memory/estimate/{k}_mib"] = v / 2**20
            metrics["memory/estimate/offloaded_mib"] = _host_per_rank(est, trainer) / 2**20
        if self.activation_estimate is not None:
            metrics["memory/estimate/activations_mib"] = self.activation_estimate.bytes(self.checkpointing) / 2**20
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def _estimate(self, trainer: Any, pl_module: nn.Module) -> Optional[Estimate]:
        strategy = trainer.strategy
        config = getattr(strategy, "config", None)
        zero = getattr(config, "zero", None)
        precision = str(getattr(trainer.precision_plugin, "precision", trainer.precision))
        precision = precision if precision in PRECISIONS else "32-true"
        try:
            size = model_size(pl_module, zero)
            nodes = max(1, int(getattr(trainer, "num_nodes", 1)))
            offload = getattr(config, "offload", None)
            return estimate(size, _stage(trainer), offload_option(offload) if offload is not None else "none",
                            gpus_per_node=max(1, trainer.world_size // nodes), nodes=nodes, precision=precision,
                            optimizer=self.optimizer or _infer_optimizer(trainer), zero=zero, buffers=offload,
                            accelerator="cpu" if trainer.strategy.root_device.type == "cpu" else "gpu")
        except ValueError:
            return None


def _host_per_rank(est: Estimate, trainer: Any) -> int:
    """The estimate's host memory (per node) for one rank: what ``offloaded`` measures."""
    return est.cpu // max(1, trainer.world_size // max(1, int(getattr(trainer, "num_nodes", 1))))


def _stage(trainer: Any) -> int:
    stage = getattr(trainer.strategy, "stage", None)
    return int(stage) if isinstance(stage, int) else 0


def _infer_optimizer(trainer: Any) -> str:
    for opt in trainer.optimizers:
        opt = getattr(opt, "_optimizer", opt)
        for state in opt.state.values():
            n = sum(1 for v in state.values() if isinstance(v, torch.Tensor) and v.ndim > 0)
            return {0: "sgd", 1: "sgd-momentum"}.get(n, "adam")
    return "adam"


def render_memory_report(report: dict[str, Any], console: Any = None) -> None:
    """Print a :class:`MemoryReport` report (measured per rank, estimate below) with rich."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # logs and CI: rich would squeeze the table into 80 columns
            console = Console(width=140)
    title = f"memory per rank, ZeRO stage {report['stage']}, {report['world_size']} ranks (measured peaks)"
    caption = ("model states: the largest total at one moment; the categories peak at different moments, so it can"
               " be below their sum, which the estimate gives")
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    offloaded = any(r.get("offloaded") for r in report["per_rank"]) or bool((report.get("estimate") or {}).get("cpu"))
    cols = ("rank", "params", "grads", "optimizer", "working set", "model states", "offloaded (host)", "activations",
            "peak RSS")
    for col in cols if offloaded else [c for c in cols if c != "offloaded (host)"]:
        table.add_column(col, justify="right")
    host = (lambda b: [format_bytes(b) if b else ""]) if offloaded else (lambda b: [])
    for r in report["per_rank"]:
        table.add_row(str(r["rank"]), format_bytes(r["params"]), format_bytes(r["grads"]),
                      format_bytes(r["optimizer"]), format_bytes(r["working"]) if r["working"] else "",
                      format_bytes(r["model_states"]), *host(r.get("offloaded")),
                      format_bytes(r["activations"]), format_bytes(r["peak_rss"]))
    est = report.get("estimate")
    if est:
        table.add_row("estimate", format_bytes(est["gpu_params"]), format_bytes(est["gpu_grads"]),
                      format_bytes(est["gpu_optimizer"]), format_bytes(est["gpu_working"]), format_bytes(est["gpu"]),
                      *host(est.get("cpu_per_rank")), format_bytes(report.get("activation_estimate")), "",
                      style="italic")
        if est.get("deepspeed_gpu") is not None:
            table.add_row("DeepSpeed", "", "", "", "", format_bytes(est["deepspeed_gpu"]), *host(None), "", "",
                          style="dim")
    console.print(table)
