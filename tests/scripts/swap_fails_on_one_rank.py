"""Stage 3 with parameters and optimizer on NVMe, 2 ranks, where one rank cannot create its swap files.

The failing rank (``--rank``) gets a file-size limit (RLIMIT_FSIZE) in the LightningModule's
``setup`` hook, which runs before the strategy's setup, so its ``posix_fallocate`` of a swap file
fails (EFBIG) as a full drive's would, while the other rank's succeeds. Each rank writes
``<out>.<rank>.json``: the exception ``fit`` raised there (type and message) and the seconds it took.
"""

from __future__ import annotations

import argparse
import json
import resource
import signal
import time

import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from _common import quiet_trainer


class _Model(BoringModel):
    def __init__(self, failing_rank: int) -> None:
        super().__init__()
        self.failing_rank = failing_rank

    def setup(self, stage: str) -> None:
        if self.global_rank == self.failing_rank:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an EFBIG error instead of the signal's kill
            resource.setrlimit(resource.RLIMIT_FSIZE, (16, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--nvme", required=True)
    parser.add_argument("--rank", type=int, default=1)
    args = parser.parse_args()
    from lightning_ampzero.strategy import AmpZeroStrategy

    strategy = AmpZeroStrategy(stage=3, offload_param="nvme", offload_optimizer="nvme", nvme_path=args.nvme)
    trainer = quiet_trainer(strategy, args.nvme, steps=2)
    start = time.monotonic()
    said = None
    try:
        trainer.fit(_Model(args.rank))
    except Exception as e:  # noqa: BLE001 - what each rank was told is the measurement
        said = {"type": type(e).__name__, "message": str(e)}
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # the failing rank writes its report too
    with open(f"{args.out}.{trainer.global_rank}.json", "w") as f:
        json.dump({"error": said, "seconds": time.monotonic() - start}, f)


if __name__ == "__main__":
    main()
