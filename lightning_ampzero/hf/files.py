"""A Hugging Face checkpoint directory on disk: which file holds each tensor, its shape and dtype.

Only headers are read here (the safetensors header is a length-prefixed JSON, so no tensor
data is touched and nothing is mapped); tensor data is read per tensor by :meth:`read`.

[Note: one mapping per read] ``safetensors.safe_open`` maps the whole file and
``get_slice(key)[rows]`` returns a tensor backed by that mapping: the pages it touches count
in the process's RSS (as file-backed memory) for as long as the file stays open. Measured on
this machine (8 tensors of 8 MiB, half of each read): one handle kept open grew RssFile by
36 MB, the sum of the slices; closing it dropped it back. So each read opens the file, copies
its slice into place and closes it: the resident cost of a read is one slice, not the sum of
every slice read from a file. Opening costs a header parse (a few KB of JSON per file).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from lightning_ampzero.checkpoint.consolidate import _ST_DTYPE, tensor_nbytes

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_TORCH_DTYPE = {code: dtype for dtype, code in _ST_DTYPE.items()}  # safetensors dtype code -> torch


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.dtype)


def read_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a ``save_pretrained`` directory (or a single .safetensors file)."""
    if path.is_file() and path.suffix == ".safetensors":
        return [path]
    if (path / SAFE_WEIGHTS_INDEX_NAME).is_file():
        weight_map = json.loads((path / SAFE_WEIGHTS_INDEX_NAME).read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    if (path / SAFE_WEIGHTS_NAME).is_file():
        return [path / SAFE_WEIGHTS_NAME]
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: pass the directory that `save_pretrained` wrote.")
    found = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    hint = ""
    if any(n.endswith(".bin") or n.endswith(".pt") for n in found):
        hint = (" It holds pickled weights (.bin), which cannot be read in slices: convert them once with"
                " `Model.from_pretrained(dir).save_pretrained(dir)` (transformers writes safetensors).")
    raise FileNotFoundError(
        f"{path} has neither {SAFE_WEIGHTS_NAME} nor {SAFE_WEIGHTS_INDEX_NAME}"
        f" (found: {', '.join(found[:8]) or 'nothing'})."
        + hint
    )


class CheckpointFiles:
    """Tensor index of a ``save_pretrained`` checkpoint; reads slices of one tensor at a time."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.tensors: dict[str, TensorInfo] = {}
        for file in weight_files(self.path):
            for key, meta in read_header(file).items():
                if key == "__metadata__":
                    continue
                if meta["dtype"] not in _TORCH_DTYPE:
                    raise TypeError(f"{file}: tensor {key!r} has dtype {meta['dtype']}, which torch cannot load.")
                self.tensors[key] = TensorInfo(file, tuple(meta["shape"]), _TORCH_DTYPE[meta["dtype"]])
        self.bytes_read = 0  # sum of the bytes of every slice returned by read()
        self.largest_read = 0

    def copy_into(self, key: str, dst: torch.Tensor, region: Optional[Sequence[slice]] = None) -> None:
        """Copy tensor ``key`` (or only ``region`` of it: one slice per leading dimension) into ``dst``, casting."""
        from safetensors import safe_open

        info = self.tensors[key]
        with safe_open(str(info.file), framework="pt") as f:  # [Note: one mapping per read]
            src = f.get_tensor(key) if region is None else f.get_slice(key)[tuple(region)]
            if tuple(src.shape) != tuple(dst.shape):
                raise RuntimeError(f"{key}: read {tuple(src.shape)} from {info.file.name} for a destination of"
                                   f" {tuple(dst.shape)}.")
            nbytes = src.numel() * src.element_size()
            self.bytes_read += nbytes
            self.largest_read = max(self.largest_read, nbytes)
            dst.copy_(src)
            del src
