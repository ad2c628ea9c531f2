"""Configuration of the reference GPT, importable without torch (config checks stay fast)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_ampzero._schema import check_number, config_from_dict


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    seed: int = 1234

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            check_number("model", name, getattr(self, name), minimum=1, integral=True)
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd={self.n_embd} must be divisible by model.n_head={self.n_head}."
            )
        check_number("model", "dropout", self.dropout, minimum=0)

    @classmethod
    def from_dict(cls, data: Any) -> "GPTConfig":
        return config_from_dict(cls, data, path="model")
