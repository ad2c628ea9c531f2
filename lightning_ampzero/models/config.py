"""Configuration of the reference GPT, importable without torch (config checks stay fast)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_ampzero._schema import FromDict, check_number


@dataclass(frozen=True)
class GPTConfig(FromDict, section="model"):
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
