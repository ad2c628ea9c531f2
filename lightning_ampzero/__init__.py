"""lightning_ampzero: DeepSpeed-ZeRO features for PyTorch Lightning on top of PyTorch FSDP2.

Strategy names (``Trainer(strategy="ampzero_stage_3")``) work without importing this
package: see ``_bootstrap.py`` for how they get registered.

This module is imported at every interpreter start-up (by the installed .pth file), so it
must stay free of imports: the public classes are loaded on first attribute access.
"""

__version__ = "0.1.0"

__all__ = [
    "ActivationCheckpointingConfig",
    "AmpZeroConfig",
    "AmpZeroPrecision",
    "AmpZeroStrategy",
    "DynamicLossScaler",
    "Fp8Config",
    "LossScalerConfig",
    "OffloadConfig",
    "PrecisionConfig",
    "ZeroConfig",
    "__version__",
]

# public name -> module defining it (lightning.pytorch flavor; pytorch_lightning users get
# theirs from lightning_ampzero._compat.strategy_class("pytorch_lightning")).
_LAZY = {
    "AmpZeroStrategy": "lightning_ampzero.strategy",
    "AmpZeroPrecision": "lightning_ampzero.precision.plugin",
    "AmpZeroConfig": "lightning_ampzero.config",
    "ZeroConfig": "lightning_ampzero.config",
    "PrecisionConfig": "lightning_ampzero.config",
    "LossScalerConfig": "lightning_ampzero.config",
    "Fp8Config": "lightning_ampzero.config",
    "ActivationCheckpointingConfig": "lightning_ampzero.config",
    "OffloadConfig": "lightning_ampzero.config",
    "DynamicLossScaler": "lightning_ampzero.precision.scaler",
}

# `typing` is not loaded at start-up; mypy and pyright treat a local TYPE_CHECKING like typing's.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from lightning_ampzero.config import (
        ActivationCheckpointingConfig,
        AmpZeroConfig,
        Fp8Config,
        LossScalerConfig,
        OffloadConfig,
        PrecisionConfig,
        ZeroConfig,
    )
    from lightning_ampzero.precision.plugin import AmpZeroPrecision
    from lightning_ampzero.precision.scaler import DynamicLossScaler
    from lightning_ampzero.strategy import AmpZeroStrategy


def __getattr__(name):
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


# Registers the strategy names (now if Lightning is already imported, else when it is) for
# processes where the .pth is not active, e.g. a source checkout on PYTHONPATH; idempotent.
from lightning_ampzero import _bootstrap as _bootstrap  # noqa: E402

_bootstrap.install()
