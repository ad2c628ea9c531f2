"""Data for the ``ampzero-train`` job: byte-level windows of a shipped corpus or any file."""

from lightning_ampzero.data.text import SHIPPED_CORPORA, ByteWindows, DataConfig, TextDataModule, read_tokens

__all__ = ["SHIPPED_CORPORA", "ByteWindows", "DataConfig", "TextDataModule", "read_tokens"]
