"""Byte-level language-modelling data: the shipped corpus or any file, cut into fixed windows.

Tokens are the file's bytes (vocabulary 256, the default of ``GPTConfig``), so no tokenizer
has to be downloaded or shipped. The file is split once, by position, into a training part
and a held-out tail; each part is cut into windows of ``block_size + 1`` bytes (input and
next-byte target). The training loader shuffles; under a distributed strategy Lightning
replaces its sampler with a ``DistributedSampler`` so every rank sees different windows. The
training loader is resumable (:class:`ResumableLoader`): a checkpoint taken within an epoch
continues with the batches that epoch had left.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset

from lightning_ampzero._schema import FromDict, check_choice, check_number

CORPUS_DIR = Path(__file__).parent / "corpus"
#: Corpora shipped inside the package (name -> file). See corpus/README.md for source and licence.
SHIPPED_CORPORA = {"shakespeare": CORPUS_DIR / "shakespeare.txt"}


@dataclass(frozen=True)
class DataConfig(FromDict, section="data"):
    """Where the bytes come from and how they are batched.

    Attributes:
        corpus: name of a corpus shipped with the package (``shakespeare``); ignored when ``path`` is set.
            ``None`` (``data=text_file``): ``path`` is required.
        path: any file, read as bytes (UTF-8 text works: multi-byte characters become several tokens).
        block_size: tokens per training sequence; must not exceed the model's ``block_size``.
        batch_size: sequences per micro-batch per process.
        val_fraction: share of the file (its tail) held out for validation.
        stride: distance between the starts of consecutive windows; ``None`` = ``block_size``
            (non-overlapping windows).
        num_workers: DataLoader worker processes per rank (0 = load in the training process).
    """

    corpus: Optional[str] = "shakespeare"
    path: Optional[str] = None
    block_size: int = 64
    batch_size: int = 16
    val_fraction: float = 0.05
    stride: Optional[int] = None
    num_workers: int = 0

    def __post_init__(self) -> None:
        if self.path is None:
            if self.corpus is None:
                # data=text_file: its ``path: ???`` could not say this (OmegaConf's merge keeps the
                # schema's default under a ``???``), and the job trained on the shipped corpus (a trial).
                raise ValueError("data.path is not set: data=text_file trains on a file of yours; give it as"
                                 " data.path=/path/to/corpus.txt (or train on the shipped corpus: data=shakespeare).")
            check_choice("data", "corpus", self.corpus, tuple(SHIPPED_CORPORA))
        for name in ("block_size", "batch_size"):
            check_number("data", name, getattr(self, name), minimum=1, integral=True)
        check_number("data", "num_workers", self.num_workers, minimum=0, integral=True)
        if self.stride is not None:
            check_number("data", "stride", self.stride, minimum=1, integral=True)
        check_number("data", "val_fraction", self.val_fraction, minimum=0)
        if self.val_fraction >= 1:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {self.val_fraction!r}.")

    @property
    def file(self) -> Path:
        return Path(self.path).expanduser() if self.path is not None else SHIPPED_CORPORA[self.corpus]


def read_tokens(path: Path) -> torch.Tensor:
    """The bytes of ``path`` as a uint8 tensor (one token per byte)."""
    raw = Path(path).read_bytes()
    if not raw:
        raise ValueError(f"data file {path} is empty.")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class ByteWindows(Dataset):
    """Windows ``tokens[s : s + block_size + 1]`` for ``s = 0, stride, 2 * stride, ...``.

    Item ``i`` is ``(input, target)``: two int64 tensors of ``block_size`` tokens, the target
    shifted by one.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: Optional[int] = None) -> None:
        self.tokens = tokens
        self.block_size = block_size
        self.stride = stride or block_size
        self._len = window_count(len(tokens), block_size, self.stride)
        if self._len == 0:
            raise ValueError(
                f"{len(tokens)} tokens are too few for one window of block_size={block_size} (+1 target)."
            )

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self._len:
            raise IndexError(i)
        s = i * self.stride
        window = self.tokens[s : s + self.block_size + 1].long()
        return window[:-1], window[1:]


def window_count(n_tokens: int, block_size: int, stride: int) -> int:
    """How many windows of ``block_size`` (+1 target) start ``stride`` apart in ``n_tokens`` tokens."""
    span = n_tokens - block_size - 1
    return span // stride + 1 if span >= 0 else 0


def val_token_count(n_tokens: int, val_fraction: float, block_size: int) -> int:
    """How many tokens at the file's tail :func:`split_tokens` holds out (at least one window's, if any)."""
    n_val = int(n_tokens * val_fraction)
    return max(n_val, block_size + 1) if val_fraction > 0 else n_val


def split_tokens(tokens: torch.Tensor, val_fraction: float, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Train on the head of the file, validate on its tail (the split never cuts a window in two)."""
    n_val = val_token_count(len(tokens), val_fraction, block_size)
    if len(tokens) - n_val < block_size + 1:
        raise ValueError(f"{len(tokens)} tokens are too few for val_fraction={val_fraction} and block_size={block_size}.")
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]


def train_windows(config: DataConfig, n_tokens: int) -> int:
    """How many training windows a file of ``n_tokens`` gives (:func:`split_tokens`, then :class:`ByteWindows`)."""
    n_train = n_tokens - val_token_count(n_tokens, config.val_fraction, config.block_size)
    return window_count(n_train, config.block_size, config.stride or config.block_size)


def too_few_windows(config: DataConfig, windows: int, world: int) -> Optional[str]:
    """Why ``windows`` training windows give some process no full batch, or None.

    Lightning's DistributedSampler gives each process ceil(n / world) windows and the loader
    drops a last incomplete batch: with fewer windows than a batch, Lightning stopped on "No
    training batches" and the main job's summary then failed on it (a trial).
    """
    per_process = -(-windows // world)
    if per_process >= config.batch_size:
        return None
    return (f"data.batch_size={config.batch_size} is more than the {per_process} training sequences each of the"
            f" {world} process(es) gets from {config.file} ({windows} windows of block_size={config.block_size})."
            f" Lower data.batch_size to at most {per_process}, or train on a longer file.")


# [Note: a loader that resumes within its epoch]
# Lightning saves a loader's state_dict() in the checkpoint when it has one, and hands it back
# before the resumed fit's first iter(); a loader without one starts the interrupted epoch again
# (the main job's default 200 steps end inside its first epoch, so every resume replayed it). The
# state is the number of batches this epoch has yielded: Lightning prefetches no batch from a
# loader with a length (loops/fetchers.py), so what was yielded was trained on. The resumed
# epoch draws the same order (the DistributedSampler's is fixed by seed and epoch, which Lightning
# sets before iter()) and skips that many batches of indices, without loading their data. A
# checkpoint at an epoch's end saves 0: the next epoch starts whole. len() stays the epoch's full
# length, which Lightning's progress counters assume.
class ResumableLoader(DataLoader):
    """A :class:`~torch.utils.data.DataLoader` that a checkpoint taken within an epoch resumes where it stopped."""

    _yielded = 0
    _skip = 0

    def __iter__(self) -> Iterator[Any]:
        self._yielded = self._skip
        for batch in super().__iter__():
            self._yielded += 1
            yield batch

    @property
    def _index_sampler(self) -> Any:  # type: ignore[override]
        return _SkipFirst(self, super()._index_sampler)

    def state_dict(self) -> dict[str, int]:
        done = self._yielded >= len(self)
        return {"batches_yielded": 0 if done else self._yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = int(state.get("batches_yielded", 0))


class _SkipFirst:
    """The loader's batch sampler; the first iteration after a resume leaves out the batches already trained on."""

    def __init__(self, loader: ResumableLoader, inner: Any) -> None:
        self.loader, self.inner = loader, inner

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        # A generator: the skip is taken when the first batch of indices is drawn, not at iter();
        # torch's worker iterator calls iter() on its sampler twice before drawing (__init__, _reset).
        skip, self.loader._skip = self.loader._skip, 0
        yield from itertools.islice(self.inner, skip, None)


def _datamodule_base() -> type:
    import lightning.pytorch as pl

    return pl.LightningDataModule


class TextDataModule(_datamodule_base()):  # type: ignore[misc]
    """LightningDataModule over :class:`ByteWindows` of one file (see :class:`DataConfig`)."""

    def __init__(self, config: Optional[DataConfig] = None) -> None:
        super().__init__()
        self.config = config or DataConfig()
        self.train_set: Optional[ByteWindows] = None
        self.val_set: Optional[ByteWindows] = None

    def setup(self, stage: str = "fit") -> None:
        if self.train_set is not None:
            return
        cfg = self.config
        train, val = split_tokens(read_tokens(cfg.file), cfg.val_fraction, cfg.block_size)
        self.train_set = ByteWindows(train, cfg.block_size, cfg.stride)
        self.val_set = ByteWindows(val, cfg.block_size) if len(val) else None

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup() first"
        world = getattr(self.trainer, "world_size", 1) if self.trainer is not None else 1
        too_few = too_few_windows(self.config, len(self.train_set), world)
        if too_few:
            raise ValueError(too_few)
        return ResumableLoader(
            self.train_set, batch_size=self.config.batch_size, shuffle=True, drop_last=True,
            num_workers=self.config.num_workers, persistent_workers=self.config.num_workers > 0,
        )

    def val_dataloader(self) -> Any:
        if self.val_set is None:
            return []
        return DataLoader(self.val_set, batch_size=self.config.batch_size, shuffle=False, num_workers=self.config.num_workers)
