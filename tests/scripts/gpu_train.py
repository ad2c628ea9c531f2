"""One CUDA GPU, a user's plain ``Trainer`` script: ampzero's stages, precisions and offloads on a model we did not write.

A Hugging Face Llama from a tiny config (tied embeddings, rotary buffers, ``nn.Linear`` layers
that FP8 converts) trains for a few AdamW steps on fixed random tokens, once with Lightning's own
single-device strategy (the reference, one per Trainer precision) and once per configuration
named on the command line, each in this process, from bit-identical initial weights. Per
configuration the JSON holds the losses, the largest difference of the final parameters from the
reference's relative to how far the reference's parameters moved (``rel``: 0 is bit for bit, 1 is
as far off as the whole update), the seconds it took, and the traceback if it raised. Every
configuration runs even when one fails, so one device run reports all of them.

Usage: ``python gpu_train.py OUT.json [NAME ...]`` (no names: all of ``CONFIGS``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl

from lightning_ampzero.config import Fp8Config
from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy

# cuBLAS picks deterministic algorithms only with a fixed workspace (set before CUDA starts).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
VOCAB, SEQ, BATCH, STEPS = 512, 64, 8, 8
NVME = tempfile.mkdtemp(prefix="ampzero-gpu-nvme-")
FP8 = {"fp8": Fp8Config(recipe="tensorwise", min_features=0)}

# name: (Trainer precision, AmpZeroStrategy keywords, reference name). A reference name starting
# with "ref:" is Lightning's single-device run at that precision; otherwise another configuration.
CONFIGS: dict[str, tuple[str, dict | None, str]] = {
    # Lightning's single-device run again: the run-to-run difference of this GPU's kernels.
    "auto/32-true": ("32-true", None, "ref:32-true"),
    "auto/bf16-mixed": ("bf16-mixed", None, "ref:bf16-mixed"),
    **{f"s{s}/32-true": ("32-true", {"stage": s}, "ref:32-true") for s in range(4)},
    **{f"s{s}/bf16-mixed": ("bf16-mixed", {"stage": s}, "ref:bf16-mixed") for s in range(4)},
    "s2/16-mixed": ("16-mixed", {"stage": 2}, "ref:16-mixed"),
    "s3/16-mixed": ("16-mixed", {"stage": 3}, "ref:16-mixed"),
    "s0/bf16-true": ("bf16-true", {"stage": 0}, "ref:bf16-mixed"),
    "s3/bf16-true": ("bf16-true", {"stage": 3}, "s0/bf16-true"),
    "s2/bf16-mixed/offload_opt": ("bf16-mixed", {"stage": 2, "offload_optimizer": "cpu"}, "ref:bf16-mixed"),
    "s3/bf16-mixed/offload_opt+param": ("bf16-mixed", {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
                                        "ref:bf16-mixed"),
    "s3/bf16-mixed/nvme": ("bf16-mixed", {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme",
                                          "nvme_path": NVME}, "ref:bf16-mixed"),
    "s3/bf16-mixed/ckpt_cpu": ("bf16-mixed", {"stage": 3, "activation_checkpointing": {
        "mode": "full", "cpu_checkpointing": True}}, "ref:bf16-mixed"),
    "s0/bf16-mixed/fp8": ("bf16-mixed", {"stage": 0, **FP8}, "ref:bf16-mixed"),
    "s3/bf16-mixed/fp8": ("bf16-mixed", {"stage": 3, **FP8}, "s0/bf16-mixed/fp8"),
    "s3/bf16-mixed/fp8_o1": ("bf16-mixed", {"stage": 3, "fp8": Fp8Config(recipe="tensorwise", min_features=0,
                                                                          msamp="O1")}, "s0/bf16-mixed/fp8"),
    "s3/bf16-mixed/compile": ("bf16-mixed", {"stage": 3, "compile": True}, "ref:bf16-mixed"),
}


class Lm(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                          tie_word_embeddings=True)
        self.model = LlamaForCausalLM(cfg)
        self.losses: list[float] = []

    def training_step(self, batch, i):
        (x,) = batch
        loss = self.model(input_ids=x, labels=x).loss
        self.losses.append(loss.detach().float().item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
            for n, p in module.named_parameters()}


def train(precision: str, kw: dict | None, accelerator: str = "gpu") -> tuple[list[float], dict[str, torch.Tensor]]:
    pl.seed_everything(0, verbose=False)
    module = Lm()
    data = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ), generator=torch.Generator().manual_seed(1))
    trainer = pl.Trainer(accelerator=accelerator, devices=1, precision=precision, max_steps=STEPS,
                         strategy="auto" if kw is None else AmpZeroStrategy(**kw), logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)  # Lightning's DistributedSampler would shuffle
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=BATCH))
    params = _params(module)
    if dist.is_initialized():
        dist.destroy_process_group()
    return module.losses, params


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("names", nargs="*")
    ap.add_argument("--accelerator", default="gpu", help="cpu: a dry run of the script itself")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    pl.seed_everything(0, verbose=False)
    init = _params(Lm())
    runs: dict[str, tuple[list[float], dict[str, torch.Tensor]]] = {}
    report: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    "torch": torch.__version__}
    for name in args.names or list(CONFIGS):
        precision, kw, ref = CONFIGS[name]
        entry: dict = {}
        start = time.perf_counter()
        try:
            if ref not in runs:
                runs[ref] = (train(ref[4:], None, args.accelerator) if ref.startswith("ref:")
                             else train(*CONFIGS[ref][:2], args.accelerator))
            runs[name] = losses, params = train(precision, kw, args.accelerator)
            ref_losses, ref_params = runs[ref]
            moved = max(float((ref_params[n] - init[n]).abs().max()) for n in init)
            entry = {"losses": losses, "ref_losses": ref_losses,
                     "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                     "rel": max(float((params[n] - ref_params[n]).abs().max()) for n in init) / moved}
        except Exception:  # noqa: BLE001 - every configuration reports, one failure does not hide the rest
            entry = {"error": traceback.format_exc()[-3000:]}
            if dist.is_initialized():
                dist.destroy_process_group()
        entry["seconds"] = round(time.perf_counter() - start, 1)
        report[name] = entry
        print(name, {k: v for k, v in entry.items() if k not in ("losses", "ref_losses")}, flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    run_and_exit(main)
