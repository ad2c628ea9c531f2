"""The end-of-run summary of ``ampzero-train``: what is measured during training, and its table.

:class:`SummaryCallback` measures, on every rank, and gathers to rank 0 at the end of training:

* losses of every optimizer step (averaged over ranks), and the last validation loss;
* throughput: tokens of all ranks per second of training, counted from the end of the first
  optimizer step (start-up, the first all-gathers and allocator warm-up excluded);
* model FLOP utilisation: model FLOPs per second (lightning_ampzero/flops.py) over the GEMM peak
  that every rank measures at the end of training, all at once, with the threads it trained with;
* loss-scale statistics when the precision plugin has a dynamic loss scaler (fp16), or the
  overflow counts of a bf16/fp32 overflow check.

Memory by category per rank (parameters, gradients, optimizer states, activations, peak RSS)
beside the estimate (the ZeRO formula) is :class:`lightning_ampzero.callbacks.MemoryReport`'s;
``ampzero-train`` runs both and :func:`render_summary` prints both tables.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import torch

from lightning.pytorch.callbacks import Callback

from lightning_ampzero.flops import model_flops_per_token, precision_peak_flops


class SummaryCallback(Callback):
    """Measures a run (see the module docstring); ``summary`` holds the result on rank 0."""

    def __init__(self, app: Any, job_dir: Path) -> None:
        self.app = app
        self.job_dir = Path(job_dir)
        self.summary: dict[str, Any] = {}
        self._losses: list[float] = []
        self._tokens = 0
        self._tokens_at_mark = 0
        self._t_mark: Optional[float] = None
        self._t_start = time.perf_counter()
        self._step_losses: list[float] = []
        self._seq_len = 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            # Lightning hands this hook the loss it backpropagates: divided by accumulate_grad_batches
            # under automatic optimization. The summary reports training_step's own loss, as the progress
            # bar does (it reported 1.40 for 5.59 with 4 micro-batches, a new-user trial).
            scale = trainer.accumulate_grad_batches if getattr(pl_module, "automatic_optimization", True) else 1
            self._step_losses.append(float(loss.detach().float()) * scale)
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        self._tokens += int(x.numel())
        self._seq_len = int(x.shape[-1]) if x.dim() > 0 else 1
        if not self._is_step_boundary(trainer):
            return
        self._losses.append(sum(self._step_losses) / max(1, len(self._step_losses)))
        self._step_losses = []
        if self._t_mark is None:  # this run's first step, also in a resumed run (a trial: no throughput there)
            self._t_mark, self._tokens_at_mark = time.perf_counter(), self._tokens

    @staticmethod
    def _is_step_boundary(trainer: Any) -> bool:
        # on_train_batch_end runs after the optimizer step of the last micro-batch of a step.
        loop = trainer.fit_loop.epoch_loop
        return not loop._should_accumulate() if hasattr(loop, "_should_accumulate") else True

    # -- gathering ---------------------------------------------------------------------
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        now = time.perf_counter()
        local = {
            "rank": trainer.global_rank,
            "losses": self._losses,
            "tokens": self._tokens,
            "tokens_after_first_step": self._tokens - self._tokens_at_mark,
            "seconds_after_first_step": (now - self._t_mark) if self._t_mark is not None else None,
            "train_seconds": now - self._t_start,
            # After the clock stopped: every rank at once, as they trained (threads, neighbours).
            "gemm_peak_flops": precision_peak_flops(str(trainer.precision), trainer.strategy.root_device),
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
        val = trainer.callback_metrics.get("val_loss")
        tokens_per_s = tokens_after / max(seconds) if seconds else None
        flops_per_token = model_flops_per_token(pl_module, self._seq_len) if self._seq_len else None
        peak = sum(r["gemm_peak_flops"] for r in ranks)
        return {
            "stage": app.strategy.stage,
            "precision": str(trainer.precision),
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "num_params": numel,
            # this run's steps, which its tokens and losses count; a resumed run started after the rest
            "steps": n_steps,
            "resumed_at_step": trainer.global_step - n_steps,
            "losses": losses,
            "loss_first": sum(losses[:window]) / window if losses else None,
            "loss_last": sum(losses[-window:]) / window if losses else None,
            "loss_window": window,
            "val_loss": float(val) if val is not None else None,
            "tokens": sum(r["tokens"] for r in ranks),
            "tokens_per_s": tokens_per_s,
            "model_flops_per_token": flops_per_token,
            "gemm_peak_flops": peak,
            "mfu": tokens_per_s * flops_per_token / peak if tokens_per_s and flops_per_token and peak else None,
            "train_seconds": max(r["train_seconds"] for r in ranks),
            "loss_scale": self._loss_scale(trainer),
            "features": self._features(trainer, pl_module),
        }

    def _features(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        """The offload / activation-checkpointing / FP8 / compile settings, and what they did on this rank: the
        optimizer classes, checkpointed and compiled blocks and FP8 layers are read from the trained objects,
        not the config."""
        from lightning_ampzero.fp8 import Fp8Linear
        from lightning_ampzero.torch_compile import compiled_blocks

        app = self.app
        ac = getattr(trainer.strategy, "activation_checkpointing", None)
        optimizers = [type(getattr(o, "_optimizer", o)).__name__ for o in trainer.optimizers]
        return {
            "offload_optimizer": app.offload.offload_optimizer,
            "offload_param": app.offload.offload_param,
            # On an accelerator FSDP2's CPUOffloadPolicy ('cpu') or the swap file ('nvme'); on accelerator=cpu
            # the swap file on tmpfs ('cpu') or under nvme_path: applied where the strategy swapped them.
            "offload_param_applied": app.offload.offload_param != "none" and (
                trainer.strategy.root_device.type != "cpu" or getattr(trainer.strategy, "param_swapper", None) is not None),
            "optimizers": optimizers,
            "activation_checkpointing": app.activation_checkpointing.mode,
            "checkpointed_blocks": len(ac.blocks) if ac is not None else 0,
            "cpu_checkpointing": app.activation_checkpointing.cpu_checkpointing,
            "fp8": app.fp8.recipe if app.fp8.enabled else None,
            "fp8_msamp": app.fp8.msamp if app.fp8.enabled else None,
            "fp8_layers": sum(isinstance(m, Fp8Linear) for m in pl_module.modules()),
            "compile": app.compile.backend if app.compile.enabled else None,
            "compiled_blocks": len(compiled_blocks(pl_module)),
        }

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


def _describe_features(f: dict[str, Any]) -> str:
    parts = []
    if f.get("offload_optimizer", "none") != "none":
        parts.append(f"optimizer state offloaded to {f['offload_optimizer']} ({', '.join(f.get('optimizers', []))})")
    if f.get("offload_param", "none") != "none":
        applied = f.get("offload_param_applied", True)
        why = "" if applied else " (not applied)"
        parts.append(f"parameters offloaded to {f['offload_param']}{why}")
    if f.get("activation_checkpointing", "none") != "none":
        where = ", checkpoints in host memory" if f.get("cpu_checkpointing") else ""
        parts.append(f"activation checkpointing {f['activation_checkpointing']}"
                     f" ({f.get('checkpointed_blocks', 0)} blocks{where})")
    if f.get("fp8"):
        msamp = f" + MS-AMP {f['fp8_msamp']}" if f.get("fp8_msamp") not in (None, "none") else ""
        parts.append(f"FP8 {f['fp8']}{msamp} ({f.get('fp8_layers', 0)} Linear layers)")
    if f.get("compile"):
        parts.append(f"torch.compile {f['compile']} ({f.get('compiled_blocks', 0)} blocks)")
    return "; ".join(parts)


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


def render_summary(summary: dict[str, Any], console: Any = None) -> None:
    """Print the summary of a finished run with rich."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # logs and CI: rich would squeeze the tables into 80 columns
            console = Console(width=140)
    table = Table(title="ampzero-train summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("strategy", f"ZeRO stage {summary['stage']}, {summary['world_size']} process{'es' if summary['world_size'] != 1 else ''}"
                  f" ({summary.get('num_nodes', 1)} node(s)), precision {summary['precision']}")
    table.add_row("model", f"{summary['num_params']:,} parameters")
    features = _describe_features(summary.get("features") or {})
    if features:
        table.add_row("features", features)
    resumed = summary.get("resumed_at_step") or 0
    span = f" (resumed at step {resumed}: steps {resumed + 1}-{resumed + summary['steps']})" if resumed else ""
    table.add_row("steps", f"{summary['steps']} optimizer steps, {summary['tokens']:,} tokens{span}")
    if summary.get("loss_first") is not None:
        w = summary.get("loss_window", 1)
        table.add_row("train loss", f"{summary['loss_first']:.4f} -> {summary['loss_last']:.4f}"
                      f" (mean of the first / last {w} steps)")
    if summary.get("val_loss") is not None:
        table.add_row("val loss", f"{summary['val_loss']:.4f}")
    if summary.get("tokens_per_s"):
        table.add_row("throughput", f"{summary['tokens_per_s']:,.0f} tokens/s (all processes, after the first step)")
    if summary.get("mfu"):
        achieved = summary["tokens_per_s"] * summary["model_flops_per_token"]
        table.add_row("MFU", f"{summary['mfu']:.1%}: {achieved / 1e9:,.1f} GFLOP/s of model work over a"
                      f" {summary['gemm_peak_flops'] / 1e9:,.0f} GFLOP/s GEMM peak measured by all processes")
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

    if summary.get("memory"):
        from lightning_ampzero.callbacks import render_memory_report

        render_memory_report(summary["memory"], console)
    if summary.get("profile"):
        from lightning_ampzero.cli.profile import render_profile

        render_profile(summary["profile"], summary, console)
