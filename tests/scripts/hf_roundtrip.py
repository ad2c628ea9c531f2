"""Pretrained round trip through Lightning on 2 CPU processes (issue 12, acceptance 2).

Loads a ``save_pretrained`` directory in ``configure_model`` with ``lightning_ampzero.hf.from_pretrained``,
checks on every rank that the loaded parameters equal the files bit for bit, trains ``--steps``
steps, writes a sharded checkpoint (ModelCheckpoint), exports live with ``hf.save_pretrained``
into ``<work-dir>/export`` and saves the trained parameters gathered into one process
(``<work-dir>/trained.pt``) for the test to compare with.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_ampzero.hf as hf
from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return -1


class LoadingStrategy(AmpZeroStrategy):
    """Calls load_pending_pretrained after setup, measuring peak RSS around it.

    Harmless once the strategy loads pending models itself: a model loads once, and then this
    finds nothing to load (``load`` stays empty).
    """

    load: dict = {}

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        Path("/proc/self/clear_refs").write_text("5")  # restart the peak-RSS mark (VmHWM)
        before = _status_bytes("VmRSS")
        stats = hf.load_pending_pretrained(self.model)
        if stats:
            self.load = {"increase": _status_bytes("VmHWM") - before, "bytes_read": stats[0].bytes_read,
                         "local_bytes": stats[0].local_bytes, "largest_tensor": stats[0].largest_tensor}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class FineTune(pl.LightningModule):
    def __init__(self, model_dir: str, lr: float = 1e-2) -> None:
        super().__init__()
        self.model_dir = model_dir
        self.lr = lr
        self.losses: list[float] = []
        self.loaded_exact: bool | None = None

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            from transformers import AutoModelForCausalLM

            self.model = hf.from_pretrained(AutoModelForCausalLM, self.model_dir)

    def on_train_start(self) -> None:
        from safetensors.torch import load_file

        file = {k: v for f in Path(self.model_dir).glob("*.safetensors") for k, v in load_file(str(f)).items()}
        self.loaded_exact = all(torch.equal(_full(p).detach().cpu(), file[n]) for n, p in self.model.named_parameters())

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.model(input_ids=x, labels=x).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--work-dir", required=True)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    work = Path(args.work_dir)

    pl.seed_everything(0, verbose=False)
    module = FineTune(args.model_dir)
    gen = torch.Generator().manual_seed(0)
    # two sequences, seen over and over: the loss falls within a few steps
    data = TensorDataset(torch.randint(0, 128, (2, 16), generator=gen).repeat(args.steps, 1))
    checkpoint = ModelCheckpoint(dirpath=work / "ckpt", filename="last", save_on_train_epoch_end=True)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=LoadingStrategy(stage=args.stage), max_steps=args.steps,
        logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[checkpoint],
        use_distributed_sampler=True,
    )
    trainer.fit(module, DataLoader(data, batch_size=1))

    hf.save_pretrained(module.model, work / "export", max_shard_size="40KB")
    # What a transformers user calls first: its own save_pretrained, on every rank
    # ([Note: save_pretrained of a sharded model] in lightning_ampzero/hf/export.py).
    try:
        module.model.save_pretrained(work / f"own_{dist.get_rank()}")
        own = "wrote"
    except Exception as e:  # noqa: BLE001 - the message is the result
        own = f"{type(e).__name__}: {e}"
    trained = {n: _full(t).detach().cpu().clone() for n, t in module.model.state_dict().items()}
    losses = torch.tensor(module.losses, dtype=torch.float64)
    dist.all_reduce(losses)
    exact = [None] * dist.get_world_size()
    dist.all_gather_object(exact, module.loaded_exact)
    load = [None] * dist.get_world_size()
    dist.all_gather_object(load, trainer.strategy.load)
    owns = [None] * dist.get_world_size()
    dist.all_gather_object(owns, own)
    if dist.get_rank() == 0:
        torch.save(trained, work / "trained.pt")
        Path(args.out).write_text(json.dumps({
            "losses": (losses / dist.get_world_size()).tolist(), "loaded_exact": exact, "load": load,
            "own_save_pretrained": owns,
            "ckpt": str(next((work / "ckpt").glob("*.ckpt"))),
        }))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
