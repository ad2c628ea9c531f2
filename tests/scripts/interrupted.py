"""A training step interrupted by an exception that the user's code catches, on 2 ranks.

Manual optimization; at step 2 a hook raises during backward and ``training_step`` catches it and
skips the batch. The reference run skips the same batch without running it. For each case rank 0
writes the largest difference between the two runs' final parameters, whether the strategy warned,
the error message if the run stopped, and (stage 0) the largest difference against Lightning's own
``ddp`` skipping the batch. [Note: a step interrupted by an exception] in lightning_ampzero/zero/recover.py.
``--stop0``: stage 0 interrupted, ``--unused0``: stage 0 with a parameter the loss never uses, under
automatic optimization; both end the run with the strategy's error. ``--gan``: a GAN whose generator
step goes back through a forward made before the discriminator's step, against Lightning's ``ddp``;
``--gan-flat``: the same GAN with layers of both networks held by the LightningModule itself, in one
unit, which ends the run with the strategy's error.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl

from lightning_ampzero.process import run_and_exit
from lightning_ampzero.strategy import AmpZeroStrategy
from lightning_ampzero.zero.recover import INTERRUPTED_WARNING


class Boom(RuntimeError):
    pass


class Skipping(pl.LightningModule):
    """Four blocks; step 2 is skipped, either at once ("skip") or by an exception in backward ("raise")."""

    def __init__(self, variant: str, retry: bool, child: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.variant, self.retry, self.child = variant, retry, child
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
                                      for _ in range(4)])
        self.boom = False

    def forward(self, x):
        return self.run_blocks(x)

    def run_blocks(self, x):
        handle = None
        if self.boom:
            def bomb(grad):
                raise Boom("a hook raised during backward")

            # after blocks 1-3's backward, and their reduce-scatters, before block 0's
            handle = self.blocks[0].register_forward_hook(lambda m, i, out: out.register_hook(bomb) and None)
        try:
            return self.blocks(x)  # a child, called as a Hugging Face wrapper calls self.model(...)
        finally:
            if handle is not None:
                handle.remove()

    def model_output(self, x):
        # child: the step method calls the child directly, never this module's forward
        return self.run_blocks(x) if self.child else self(x)

    def training_step(self, batch, i):
        opt = self.optimizers()
        opt.zero_grad()
        if i == 2 and self.variant == "skip":
            return
        self.boom = i == 2 and self.variant == "raise"
        x = batch[0] * 0.5 if i == 2 and self.variant == "half" else batch[0]
        try:
            self.manual_backward(self.model_output(x).pow(2).mean())
        except Boom:
            self.boom = False
            if not self.retry:
                return
            # the user's retry, in the same training_step, on a half of the input
            opt.zero_grad()
            self.manual_backward(self.model_output(batch[0] * 0.5).pow(2).mean())
        opt.step()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Unused(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(16, 16), nn.Linear(16, 16)

    def training_step(self, batch, i):
        return self.used(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Gan(pl.LightningModule):
    """A GAN stepped as PyTorch's DCGAN example steps it: one generator forward, the discriminator's
    step on the detached fake, then the generator's step through the same fake ([Note: one network
    per unit] in lightning_ampzero/zero/units.py). The generator's head and the discriminator come
    after the last block, so the old plan put them in one unit."""

    def __init__(self, flat: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.flat = flat
        self.gen = nn.Sequential(nn.Linear(16, 32), *[Block() for _ in range(3)], nn.Linear(32, 16))
        self.disc = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
        if flat:  # the generator's head and the discriminator's first layer, held by the module itself
            self.head, self.d_in = self.gen[-1], self.disc[0]
            self.gen, self.disc = self.gen[:-1], nn.Sequential(nn.Tanh(), self.disc[2])

    def training_step(self, batch, i):
        opt_g, opt_d = self.optimizers()
        if self.flat:
            gen, disc = (lambda x: self.head(self.gen(x))), (lambda x: self.disc(self.d_in(x)))
        else:
            gen, disc = self.gen, self.disc
        fake = gen(batch[0])
        opt_d.zero_grad()
        self.manual_backward(disc(fake.detach()).mean() - disc(batch[0].flip(0)).mean())
        opt_d.step()
        opt_g.zero_grad()
        self.manual_backward(-disc(fake).mean())
        opt_g.step()

    def configure_optimizers(self):
        g, d = list(self.gen.parameters()), list(self.disc.parameters())
        if self.flat:
            g, d = g + list(self.head.parameters()), d + list(self.d_in.parameters())
        return torch.optim.Adam(g, lr=1e-2), torch.optim.Adam(d, lr=1e-2)


def _fit(strategy, variant: str, retry: bool = False, child: bool = False) -> tuple[dict, bool]:
    pl.seed_everything(0, verbose=False)
    model = Gan(variant == "gan_flat") if variant.startswith("gan") else Skipping(variant, retry, child)
    data = DataLoader(TensorDataset(torch.randn(64, 16, generator=torch.Generator().manual_seed(1))), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=6, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data)
    # the warning names this file (the user's code: training_step, or the line calling fit), never
    # contextlib's or torch's frames it is raised under
    warned = any(str(w.message) == INTERRUPTED_WARNING and os.path.samefile(w.filename, __file__) for w in caught)
    params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
              for k, v in model.state_dict().items()}
    return params, warned


def _count_flushes() -> Callable[[], int]:
    """Count the calls of the unused-parameter tracker's end-of-backward flush on this rank; the
    function returned gives the count so far and starts again from 0."""
    from lightning_ampzero.zero.unused import UnusedTracker

    calls = [0]
    flush = UnusedTracker.flush

    def counted(self) -> None:
        calls[0] += 1
        flush(self)

    def take() -> int:
        n, calls[0] = calls[0], 0
        return n

    UnusedTracker.flush = counted  # type: ignore[method-assign]
    return take


def _diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--stop0", action="store_true", help="stage 0, interrupted: the run ends with the error")
    p.add_argument("--unused0", action="store_true", help="stage 0, an unused parameter: the run ends with the error")
    p.add_argument("--gan", action="store_true", help="only the GAN: stages 1-3 against Lightning's ddp")
    p.add_argument("--gan-flat", action="store_true", help="the GAN's two networks' layers in one unit: the error")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    if args.gan_flat:
        _fit(AmpZeroStrategy(stage=2, reduce_bucket_size=2e3), "gan_flat")
        return
    if args.gan:
        reference, _ = _fit("ddp_find_unused_parameters_true", "gan")
        gan = {}
        for stage, bucket in ((1, 2e3), (2, 2e3), (3, 2e3), (2, 5e8)):
            ours, _ = _fit(AmpZeroStrategy(stage=stage, reduce_bucket_size=bucket), "gan")
            gan[f"{stage}/{bucket:g}"] = _diff(ours, reference)
        if dist.get_rank() == 0:
            Path(args.out).write_text(json.dumps(gan, indent=1))
        return
    if args.stop0:
        _fit(AmpZeroStrategy(stage=0), "raise")
        return
    if args.unused0:
        model = Unused()
        data = DataLoader(TensorDataset(torch.randn(32, 16)), batch_size=4)
        pl.Trainer(accelerator="cpu", devices=2, strategy=AmpZeroStrategy(stage=0), max_steps=4, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(model, data)
        return
    results: dict = {}
    # (stage, reduce_bucket_size): several groups, and the whole model in the root's group
    for stage, bucket in ((1, 2e3), (2, 5e8), (3, 2e3), (3, 5e8)):
        make = lambda: AmpZeroStrategy(stage=stage, reduce_bucket_size=bucket)  # noqa: E731
        skipped, false_alarm = _fit(make(), "skip")
        raised, warned = _fit(make(), "raise")
        results[f"{stage}/{bucket:g}"] = {"diff": _diff(skipped, raised), "warned": warned, "false_alarm": false_alarm}
    # The end-of-backward check of the unused-parameter tracker ([Note: parameters unused on some
    # ranks], [Note: units reduced in different orders]) runs after every reducing backward,
    # the interrupted one excepted: counted per run, several units (stage 1).
    flushes = _count_flushes()
    make = lambda: AmpZeroStrategy(stage=1, reduce_bucket_size=2e3)  # noqa: E731
    _fit(make(), "skip")
    after_skip = flushes()
    _fit(make(), "raise")
    results["flushes/1/2000"] = {"skip": after_skip, "raise": flushes()}
    # a retry inside the same training_step trains as the same step without the exception
    for bucket in (2e3, 5e8):
        make = lambda: AmpZeroStrategy(stage=2, reduce_bucket_size=bucket)  # noqa: E731
        retried, warned = _fit(make(), "raise", retry=True)
        halved, _ = _fit(make(), "half")
        results[f"retry/{bucket:g}"] = {"warned": warned, "diff": _diff(retried, halved)}
    # stage 0 (DDP): manual optimization as Lightning's ddp runs it
    ours, _ = _fit(AmpZeroStrategy(stage=0), "skip")
    lightning_ddp, _ = _fit("ddp", "skip")
    results["0"] = {"diff_to_lightning_ddp": _diff(ours, lightning_ddp)}
    # [Note: backward inside a step method]: training_step calls a child, as with self.model(...)
    reference, _ = _fit("ddp", "plain", child=True)
    for stage, bucket in ((1, 5e8), (2, 5e8), (2, 2e3), (3, 5e8)):
        ours, _ = _fit(AmpZeroStrategy(stage=stage, reduce_bucket_size=bucket), "plain", child=True)
        results[f"child/{stage}/{bucket:g}"] = {"diff_to_lightning_ddp": _diff(ours, reference)}
    make = lambda: AmpZeroStrategy(stage=2)  # noqa: E731
    retried, warned = _fit(make(), "raise", retry=True, child=True)
    halved, _ = _fit(make(), "half", child=True)
    results["child/retry"] = {"warned": warned, "diff": _diff(retried, halved)}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    run_and_exit(main)  # see [Note: exit without finalization] in lightning_ampzero/process.py
