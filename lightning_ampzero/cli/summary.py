"""The end-of-run summary of ``ampzero-train``: what is measured during training, and its table.

Measured on every rank, gathered to rank 0 at the end of training:

* losses of every optimizer step (averaged over ranks), and the last validation loss;
* throughput: tokens of all ranks per second of training, counted from the end of the first
  optimizer step (start-up, the first all-gathers and allocator warm-up excluded);
* model-state memory per rank by category (``lightning_ampzero.memory``: parameters,
  gradients, optimizer states, the peak over sampled steps), beside the ZeRO formula;
* activations: bytes of the tensors one micro-batch's forward saved for backward (parameters
  excluded, each storage counted once), measured on the second micro-batch;
* peak resident memory of each process;
* loss-scale statistics when the precision plugin has a dynamic loss scaler (fp16).
"""

from __future__ import annotations

import resource
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from lightning.pytorch.callbacks import Callback

from lightning_ampzero.memory import PeakModelState, as_zero_categories, zero_formula

_SAMPLE_FIRST_STEPS = 3
_SAMPLE_EVERY = 50


class _SavedTensorBytes:
    """Counts the bytes autograd saves for backward while active (parameters excluded)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._ctx: Any = None

    def __enter__(self) -> "_SavedTensorBytes":
        def pack(t: torch.Tensor) -> torch.Tensor:
            base = getattr(t, "_base", None)
            if not isinstance(t, nn.Parameter) and not isinstance(base, nn.Parameter):
                self.tensors.append(t)
            return t

        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
            self._ctx = None

    def bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for t in self.tensors:
            local = t.to_local() if hasattr(t, "to_local") else t
            storage = local.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        self.tensors.clear()
        return total


def _peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class SummaryCallback(Callback):
    """Measures a run (see the module docstring); ``summary`` holds the result on rank 0."""

    def __init__(self, app: Any, job_dir: Path) -> None:
        self.app = app
        self.job_dir = Path(job_dir)
        self.summary: dict[str, Any] = {}
        self._peak = PeakModelState()
        self._losses: list[float] = []
        self._tokens = 0
        self._tokens_at_mark = 0
        self._t_mark: Optional[float] = None
        self._t_start = time.perf_counter()
        self._activations: Optional[int] = None
        self._saved: Optional[_SavedTensorBytes] = None
        self._step_losses: list[float] = []

    # -- sampling ----------------------------------------------------------------------
    def _should_sample(self, step: int) -> bool:
        return step < _SAMPLE_FIRST_STEPS or step % _SAMPLE_EVERY == 0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1 and self._activations is None:
            self._saved = _SavedTensorBytes().__enter__()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        # Stages 1-2 keep the gathered parameters from forward to the end of backward, and the
        # ZeRO formula counts them: sample them here. (Stage 3's gathered units are transient
        # buffers the formula leaves out; its optimizer-step sample holds the shards.)
        if self.app.strategy.stage in (1, 2) and self._should_sample(trainer.global_step):
            self._peak.sample(pl_module, trainer.optimizers)
        if self._saved is not None:
            self._saved.__exit__(None, None, None)
            self._activations = self._saved.bytes()
            self._saved = None

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._should_sample(trainer.global_step):
            self._peak.sample(pl_module, trainer.optimizers)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._step_losses.append(float(loss.detach().float()))
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        self._tokens += int(x.numel())
        if not self._is_step_boundary(trainer):
            return
        self._losses.append(sum(self._step_losses) / max(1, len(self._step_losses)))
        self._step_losses = []
        step = trainer.global_step
        if self._should_sample(step - 1):
            self._peak.sample(pl_module, trainer.optimizers)
        if step == 1:
            self._t_mark, self._tokens_at_mark = time.perf_counter(), self._tokens

    @staticmethod
    def _is_step_boundary(trainer: Any) -> bool:
        # on_train_batch_end runs after the optimizer step of the last micro-batch of a step.
        loop = trainer.fit_loop.epoch_loop
        return not loop._should_accumulate() if hasattr(loop, "_should_accumulate") else True

    # -- gathering ---------------------------------------------------------------------
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        now = time.perf_counter()
        stage = self.app.strategy.stage
        measured = as_zero_categories(self._peak.peak, stage).as_dict() if self._peak.peak else {}
        local = {
            "rank": trainer.global_rank,
            "memory": {**measured, "activations": self._activations, "peak_rss": _peak_rss_bytes()},
            "losses": self._losses,
            "tokens": self._tokens,
            "tokens_after_first_step": self._tokens - self._tokens_at_mark,
            "seconds_after_first_step": (now - self._t_mark) if self._t_mark is not None else None,
            "train_seconds": now - self._t_start,
        }
        gathered = _all_gather_object(local, trainer.world_size)
        if not trainer.is_global_zero:
            return
        self.summary = self._compose(trainer, pl_module, gathered)

    def _compose(self, trainer: Any, pl_module: Any, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        app = self.app
        n_steps = min(len(r["losses"]) for r in ranks)
        losses = [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(n_steps)]
        window = max(1, min(10, n_steps // 10 or 1))
        seconds = [r["seconds_after_first_step"] for r in ranks if r["seconds_after_first_step"]]
        tokens_after = sum(r["tokens_after_first_step"] for r in ranks)
        numel = sum(p.numel() for p in pl_module.parameters())
        formula = self._formula(pl_module, trainer, numel)
        val = trainer.callback_metrics.get("val_loss")
        return {
            "stage": app.strategy.stage,
            "precision": str(trainer.precision),
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "num_params": numel,
            "steps": trainer.global_step,
            "losses": losses,
            "loss_first": sum(losses[:window]) / window if losses else None,
            "loss_last": sum(losses[-window:]) / window if losses else None,
            "loss_window": window,
            "val_loss": float(val) if val is not None else None,
            "tokens": sum(r["tokens"] for r in ranks),
            "tokens_per_s": tokens_after / max(seconds) if seconds else None,
            "train_seconds": max(r["train_seconds"] for r in ranks),
            "memory": {"per_rank": [{"rank": r["rank"], **r["memory"]} for r in sorted(ranks, key=lambda r: r["rank"])],
                       "formula": formula},
            "loss_scale": self._loss_scale(trainer),
        }

    def _formula(self, pl_module: nn.Module, trainer: Any, numel: int) -> Optional[dict[str, int]]:
        params = [p for p in pl_module.parameters()]
        if not params:
            return None
        local = params[0].to_local() if hasattr(params[0], "to_local") else params[0]
        param_bytes = local.element_size()
        state_bytes = 0
        for opt in trainer.optimizers:
            opt = getattr(opt, "_optimizer", opt)
            for state in opt.state.values():
                state_bytes = sum(v.element_size() for v in state.values()
                                  if isinstance(v, torch.Tensor) and v.ndim > 0)
                break
            break
        f = zero_formula(numel, trainer.world_size, self.app.strategy.stage, param_bytes=param_bytes,
                         grad_bytes=param_bytes, state_bytes=state_bytes or 2 * param_bytes, master_bytes=param_bytes)
        return f.as_dict()

    @staticmethod
    def _loss_scale(trainer: Any) -> Optional[dict[str, float]]:
        """fp16: the dynamic scaler's statistics; bf16/fp32 with an overflow check: its counts."""
        from lightning_ampzero.precision.scaler import DynamicLossScaler

        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is None or not hasattr(scaler, "stats"):
            return None
        stats = {k: float(v) for k, v in scaler.stats().items()}
        if isinstance(scaler, DynamicLossScaler):
            return stats
        if getattr(scaler, "checks_overflow", False):
            stats.pop("loss_scale", None)
            return stats
        return None


def _all_gather_object(obj: Any, world_size: int) -> list[Any]:
    import torch.distributed as dist

    if world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------


def _mib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 2**20:,.2f}"


def render_summary(summary: dict[str, Any], console: Any = None) -> None:
    """Print the summary of a finished run with rich."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title="ampzero-train summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("strategy", f"ZeRO stage {summary['stage']}, {summary['world_size']} processes"
                  f" ({summary.get('num_nodes', 1)} node(s)), precision {summary['precision']}")
    table.add_row("model", f"{summary['num_params']:,} parameters")
    table.add_row("steps", f"{summary['steps']} optimizer steps, {summary['tokens']:,} tokens")
    if summary.get("loss_first") is not None:
        w = summary.get("loss_window", 1)
        table.add_row("train loss", f"{summary['loss_first']:.4f} -> {summary['loss_last']:.4f}"
                      f" (mean of the first / last {w} steps)")
    if summary.get("val_loss") is not None:
        table.add_row("val loss", f"{summary['val_loss']:.4f}")
    if summary.get("tokens_per_s"):
        table.add_row("throughput", f"{summary['tokens_per_s']:,.0f} tokens/s (all processes, after the first step)")
    table.add_row("train time", f"{summary['train_seconds']:.1f} s")
    scale = summary.get("loss_scale")
    if scale:
        counts = f"{scale.get('overflows', 0):.0f} overflows, {scale.get('skipped_steps', 0):.0f} skipped steps"
        if "loss_scale" in scale:
            table.add_row("loss scale", f"{scale['loss_scale']:g} at the end, {counts}")
        else:
            table.add_row("overflow check", counts)
    table.add_row("checkpoint", str(summary.get("checkpoint") or "-"))
    table.add_row("logs", str(summary.get("logs") or "-"))
    table.add_row("job dir", str(summary.get("job_dir") or "-"))
    console.print(table)

    memory = summary.get("memory") or {}
    per_rank = memory.get("per_rank") or []
    if per_rank:
        mem = Table(title="memory per process in MiB (model states beside the ZeRO formula)", title_justify="left")
        for col in ("rank", "params", "grads", "optimizer", "states", "activations", "peak RSS"):
            mem.add_column(col, justify="right", no_wrap=True)
        for r in per_rank:
            mem.add_row(str(r["rank"]), _mib(r.get("params")), _mib(r.get("grads")), _mib(r.get("optimizer")),
                        _mib(r.get("total")), _mib(r.get("activations")), _mib(r.get("peak_rss")))
        f = memory.get("formula")
        if f:
            mem.add_row("formula", _mib(f["params"]), _mib(f["grads"]), _mib(f["optimizer"]), _mib(f["total"]), "", "",
                        style="italic")
        console.print(mem)
