"""Reference models shipped with the package (the default model of ``ampzero-train``, tests, benchmarks).

Lazy: ``lightning_ampzero.models.config`` (GPTConfig) must stay importable without torch.
"""

__all__ = ["GPT", "GPTConfig", "GPTModule"]


def __getattr__(name):
    if name == "GPTConfig":
        from lightning_ampzero.models.config import GPTConfig

        return GPTConfig
    if name in ("GPT", "GPTModule"):
        from lightning_ampzero.models import gpt

        return getattr(gpt, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
