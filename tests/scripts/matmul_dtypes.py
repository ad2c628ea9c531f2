"""Run ``ampzero-train`` in this process (one device) and record the dtypes its matrix products run in.

    python tests/scripts/matmul_dtypes.py <out.json> <job dir> [overrides...]

A TorchDispatchMode sees every aten op after autocast has cast its inputs, so the dtypes it
records are the ones the kernels computed in, not what the loss suggests.
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ampzero.process import run_and_exit

MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_attention_math"}


class Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name in MATMULS:
            dtypes = sorted({str(a.dtype) for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()})
            self.seen[f"{name}:{','.join(dtypes)}"] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    from torch.utils._python_dispatch import _disable_current_modes

    import lightning_ampzero.flops as flops
    from lightning_ampzero.train import main as train_main

    # The summary's GEMM peak (lightning_ampzero/flops.py) times fp32 matmuls of its own after
    # training: not the model's products, so they run outside the recorder.
    peak = flops.gemm_peak_flops

    def peak_unrecorded(*args, **kwargs):  # type: ignore[no-untyped-def]
        with _disable_current_modes():
            return peak(*args, **kwargs)

    flops.gemm_peak_flops = peak_unrecorded
    out, job_dir, *overrides = sys.argv[1:]
    recorder = Recorder()
    with recorder:
        train_main([*overrides, "trainer.devices=1", f"hydra.run.dir={job_dir}", "run.checkpoint=false",
                    "run.summary=false", "trainer.enable_progress_bar=false"])
    with open(out, "w") as f:
        json.dump(dict(recorder.seen), f)


if __name__ == "__main__":
    run_and_exit(main)
