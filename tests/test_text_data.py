"""The main job's data: its training loader resumes within an epoch ([Note: a loader that resumes within its epoch]).

* The loader alone: after a state_dict() taken k batches into an epoch, a new loader given it yields
  exactly the epoch's remaining batches, in the same order, without loading the skipped ones; in the
  main process and with persistent worker processes; a state taken at the epoch's end starts the
  next epoch whole.
* Through Lightning (ampzero_stage_2, one process): a fit resumed from a checkpoint taken at step 3
  sees the batches the uninterrupted fit saw from step 3 on (before, it saw the epoch's first ones
  again), and ends with the same weights.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler

from lightning_ampzero.data.text import DataConfig, ResumableLoader, TextDataModule


class _Counting(Dataset):
    def __init__(self, n: int) -> None:
        self.n, self.loaded = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.loaded.append(i)
        return torch.tensor([i])


def _loader(data: Dataset, epoch: int, **kw) -> ResumableLoader:
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
    sampler.set_epoch(epoch)
    return ResumableLoader(data, batch_size=4, sampler=sampler, drop_last=True, **kw)


def _ids(batches) -> list[list[int]]:
    return [b.flatten().tolist() for b in batches]


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_resumes_within_its_epoch(workers):
    kw = {"num_workers": workers, "persistent_workers": workers > 0}
    full = _ids(_loader(_Counting(64), epoch=1, **kw))
    assert len(full) == 8 and len({tuple(b) for b in full}) == 8

    first = _loader(_Counting(64), epoch=1, **kw)
    it = iter(first)
    head = _ids([next(it) for _ in range(3)])
    state = first.state_dict()
    assert head == full[:3] and state == {"batches_yielded": 3}

    data = _Counting(64)
    resumed = _loader(data, epoch=1, **kw)
    resumed.load_state_dict(state)
    assert len(resumed) == 8  # Lightning's counters assume the epoch's full length
    rest = _ids(resumed)
    assert rest == full[3:]
    if workers == 0:  # the skipped batches' samples were never loaded
        assert sorted(data.loaded) == sorted(i for b in full[3:] for i in b)
    assert resumed.state_dict() == {"batches_yielded": 0}  # the epoch ended: the next starts whole
    resumed.sampler.set_epoch(2)
    assert len(_ids(resumed)) == 8


def test_main_job_resume_within_an_epoch(tmp_path):
    import lightning.pytorch as pl

    from lightning_ampzero.models.gpt import GPTConfig, GPTModule

    class Seen(pl.Callback):
        def __init__(self) -> None:
            self.batches: list[list[int]] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.batches.append(batch[0][:, :8].flatten().tolist())

    def fit(ckpt_path=None):
        pl.seed_everything(0)
        seen = Seen()
        every = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=3, save_top_k=-1,
                                             filename="{step}")
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="ampzero_stage_2", max_steps=6, logger=False,
                             callbacks=[seen, every], enable_progress_bar=False, enable_model_summary=False,
                             limit_val_batches=0, default_root_dir=tmp_path)
        model = GPTModule(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, datamodule=TextDataModule(DataConfig(block_size=16, batch_size=4)), ckpt_path=ckpt_path)
        return seen.batches, [p.detach().clone() for p in model.parameters()]

    whole, weights = fit()
    assert len(whole) == 6 and len({tuple(b) for b in whole}) == 6
    resumed, resumed_weights = fit(tmp_path / "ck" / "step=3.ckpt")
    assert resumed == whole[3:]
    assert all(torch.equal(a, b) for a, b in zip(weights, resumed_weights))


@pytest.mark.parametrize("n_bytes", [66, 67, 1000, 4099])
@pytest.mark.parametrize("kw", [{}, {"val_fraction": 0.0}, {"stride": 7}, {"val_fraction": 0.3, "stride": 50}])
def test_the_pre_flight_window_count_is_the_data_modules(tmp_path, n_bytes, kw):
    # ampzero-train refuses a batch larger than a process's windows before any process starts, from
    # the file's size alone: that count must be the one the data module's loader then sees.
    from lightning_ampzero.data.text import too_few_windows, train_windows

    path = tmp_path / "corpus.bin"
    path.write_bytes(bytes(range(256)) * (n_bytes // 256) + bytes(n_bytes % 256))
    config = DataConfig(path=str(path), block_size=32, batch_size=2, **kw)
    data = TextDataModule(config)
    try:
        data.setup()
    except ValueError:  # too few tokens for one window: the data module says so itself
        assert train_windows(config, n_bytes) == 0
        return
    windows = len(data.train_set)
    assert train_windows(config, n_bytes) == windows
    per_process = -(-windows // 2)
    assert too_few_windows(DataConfig(path=str(path), block_size=32, batch_size=per_process, **kw), windows, 2) is None
    said = too_few_windows(DataConfig(path=str(path), block_size=32, batch_size=per_process + 1, **kw), windows, 2)
    assert said is not None and f"more than the {per_process} training sequences" in said
