"""Hugging Face checkpoints in and out of a sharded model.

In (inside ``configure_model``; strategy ``ampzero`` streams each rank's shards in at setup)::

    self.model = lightning_ampzero.hf.from_pretrained(AutoModelForCausalLM, "path/to/model")

Out (every rank calls it; rank zero writes a directory ``AutoModelForCausalLM.from_pretrained`` loads)::

    lightning_ampzero.hf.save_pretrained(self.model, "out/finetuned")

and from a sharded checkpoint: ``ampzero-consolidate CKPT OUT --hf-config path/to/model``.
See docs/bring_your_own_model.md. transformers is an optional dependency, imported on use.
"""

from lightning_ampzero.hf.export import export_checkpoint, export_plan, refuse_own_save_pretrained, save_pretrained
from lightning_ampzero.hf.load import (
    LoadStats,
    PretrainedSource,
    from_pretrained,
    load_pending_pretrained,
    load_pretrained_,
)

__all__ = [
    "LoadStats", "PretrainedSource", "export_checkpoint", "export_plan", "from_pretrained",
    "load_pending_pretrained", "load_pretrained_", "save_pretrained",
]
