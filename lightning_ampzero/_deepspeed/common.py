"""What the parts of the DeepSpeed importer share: its error and warning, ``"auto"``, reading
the JSON file, and the vocabulary of the key tables (each table lives with its section's code).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Union

AUTO = "auto"


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config that cannot be converted: unknown keys, bad values, contradictions."""

    __module__ = "lightning_ampzero.deepspeed"  # the public path, as tracebacks print it


class DeepSpeedConfigWarning(UserWarning):
    """DeepSpeed config keys that have no effect with lightning_ampzero."""

    __module__ = "lightning_ampzero.deepspeed"


# ---------------------------------------------------------------------------------------
# The keys DeepSpeed knows, and what each one becomes here
# ---------------------------------------------------------------------------------------
# Each table maps a key to a target path in the converted result (a str), or to the reason
# it has no effect here (a _NoEffect). Targets: "zero.<f>" / "precision.<f>" /
# "precision.loss_scaler.<f>" (AmpZeroConfig), "trainer.<kwarg>", "batch.<name>"; keys
# handled by code are marked _HANDLED.
# The tables: _TOP (convert.py), _ZERO (zero.py), _FP16 and _BF16 (precision.py).


@dataclass(frozen=True)
class _NoEffect:
    reason: str


_HANDLED = "<handled>"
_FSDP = "FSDP2 schedules its own communication"
_NOT_YET = "not available in this version of lightning_ampzero yet"
_MONITOR = "monitoring/profiling: use Lightning loggers and profilers"


def _env_rank() -> int:
    for key in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if key in os.environ:
            try:
                return int(os.environ[key])
            except ValueError:
                pass
    return 0


def _warn(message: str) -> None:
    if _env_rank() == 0:
        warnings.warn(message, DeepSpeedConfigWarning, stacklevel=3)


def _load(config: Union[str, os.PathLike, Mapping[str, Any]]) -> tuple[dict[str, Any], str]:
    if isinstance(config, Mapping):
        return dict(config), "<dict>"
    path = Path(config)
    if path.is_dir():
        raise FileNotFoundError(f"DeepSpeed config {str(path)!r} is a directory: give the JSON file in it"
                                " (e.g. ds_config.json).")
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config file {str(path)!r} does not exist.")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise DeepSpeedConfigError(f"DeepSpeed config {path}: key {k!r} appears twice.")
            out[k] = v
        return out

    try:
        data = json.loads(path.read_text(), object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        raise DeepSpeedConfigError(f"DeepSpeed config {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise DeepSpeedConfigError(f"DeepSpeed config {path} must hold a JSON object, got {type(data).__name__}.")
    return data, str(path)


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == AUTO
