"""Reference models shipped with the package (the default model of ``ampzero-train``, tests, benchmarks)."""

from lightning_ampzero.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
