"""Checkpoint I/O of the strategy: sharded directories through torch.distributed.checkpoint."""

from lightning_ampzero.checkpoint.sharded import METADATA_FILE, is_sharded_checkpoint, load_sharded, save_sharded

__all__ = ["METADATA_FILE", "is_sharded_checkpoint", "load_sharded", "save_sharded"]
