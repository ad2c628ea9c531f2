"""Train the small GPT with FP8 on N CPU ranks under AmpZeroStrategy and write per-step losses as JSON.

Run as a script (never inside pytest: Lightning's launcher re-runs the command line for the
other ranks). Each configuration named in ``--configs`` is a set of strategy arguments (below);
all run with the same seed, data and ``--precision``. Per configuration the JSON holds the
per-step losses (mean over ranks), the number of Fp8Linear layers, the type of the sharded
weights' local tensors, and each rank's optimizer-state bytes (total, parameter elements,
parameter tensors) after training.

    python tests/scripts/fp8.py --configs bf16,tensorwise,delayed,delayed_o2 --steps 100 --out fp8.json
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import lightning.pytorch as pl

from lightning_ampzero.fp8 import Fp8Linear, optimizer_state_bytes
from lightning_ampzero.models.gpt import GPTConfig
from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy

from parity import PatternData, Recorder

# The small GPT's layers are 64-256 wide: min_features=0 converts them (the default, 1024,
# keeps layers this small in bf16, where FP8 casts cost more than they save on a GPU).
CONFIGS: dict[str, dict] = {
    "bf16": {},
    "tensorwise": {"fp8": {"recipe": "tensorwise", "min_features": 0}},
    "delayed": {"fp8": {"recipe": "delayed", "min_features": 0}},
    "tensorwise_o1": {"fp8": {"recipe": "tensorwise", "min_features": 0, "msamp": "O1"}},
    "delayed_o2": {"fp8": {"recipe": "delayed", "min_features": 0, "msamp": "O2"}},
    # O1's low-precision gradient reduction: Fp8Linear among the "-mixed" safe modules (weights
    # gathered in FP8, gradients reduce-scattered in bf16: at stage 3 by an FSDP2 group of their
    # own, at stages 1-2 on gloo by their unit's group, zero/comm.py MixedWireReduceScatter).
    "tensorwise_o1_bf16_reduce": {"fp8": {"recipe": "tensorwise", "min_features": 0, "msamp": "O1"},
                                  "precision": {"lower_precision_safe_modules": ["Linear", "Fp8Linear"]}},
    "rowwise": {"fp8": {"recipe": "rowwise", "min_features": 0}},
}


class Probe(pl.Callback):
    def __init__(self) -> None:
        self.info: dict = {}

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        opt = trainer.optimizers[0]
        opt = getattr(opt, "_optimizer", opt)
        locals_ = sorted({type(getattr(p, "_local_tensor", p)).__name__ for p in module.parameters()})
        mine = {"bytes": optimizer_state_bytes(opt), "optimizer": type(opt).__name__}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        from torch.distributed.fsdp import FSDPModule

        from lightning_ampzero.zero.comm import MixedWireReduceScatter

        # The wire dtype of the FP8 layers' gradients: their own groups' reduce dtype (stage 3), or
        # that of the unit's reduce-scatter that sends them apart (stages 1-2 on gloo).
        reduce = set()
        for m in module.modules():
            if not isinstance(m, FSDPModule):
                continue
            group = m._get_fsdp_state()._fsdp_param_group
            custom = group._reduce_scatter_comm if group is not None else None
            if isinstance(custom, MixedWireReduceScatter) and any(isinstance(x, Fp8Linear) for x in custom.modules):
                reduce.add(str(custom.dtype))
            elif isinstance(m, Fp8Linear):
                reduce.add(str(m._get_fsdp_state()._mp_policy.reduce_dtype))
        reduce = sorted(reduce)
        self.info = {
            "fp8_layers": sum(isinstance(m, Fp8Linear) for m in module.modules()),
            "fp8_unit_reduce_dtypes": reduce,
            "local_tensor_types": locals_,
            "ranks": everyone,
        }


def run(name: str, args: argparse.Namespace) -> dict:
    pl.seed_everything(0, verbose=False)
    model = Recorder(model=GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32), lr=3e-3)
    world = args.devices
    micro = args.global_batch // world
    strategy = AmpZeroStrategy(stage=args.stage, **CONFIGS[name])
    probe = Probe()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, precision=args.precision, max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[probe],
    )
    dataset = PatternData(micro * world * args.steps, 32, 256)
    sampler = DistributedSampler(dataset, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False)
    trainer.fit(model, DataLoader(dataset, batch_size=micro, sampler=sampler, shuffle=False))
    losses = torch.tensor(model.losses, dtype=torch.float64)
    dist.all_reduce(losses)
    losses /= dist.get_world_size()
    return {"losses": losses.tolist(), **probe.info}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", required=True, help=f"comma list of: {', '.join(CONFIGS)}")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    results = {name: run(name, args) for name in args.configs.split(",")}
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
