"""Shared machinery of the typed config dataclasses (the one schema).

Every feature config is a frozen dataclass that validates itself in ``__post_init__``.
This module gives them a common ``from_dict`` (the :class:`FromDict` mixin over
:func:`config_from_dict`) that rejects unknown keys with a "did you mean" hint: DeepSpeed
silently ignores a misspelt key, we do not.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Iterable, Mapping, TypeVar

T = TypeVar("T")
C = TypeVar("C", bound="FromDict")


def suggest(key: str, allowed: Iterable[str]) -> str:
    """A ``" Did you mean 'x'?"`` suffix for an error message, or ``""`` if nothing is close."""
    close = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def check_choice(owner: str, field: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(
            f"{owner}.{field}={value!r} is not valid. Allowed values: {', '.join(map(repr, allowed))}."
        )


def check_class_names(owner: str, field: str, value: Any) -> tuple[str, ...]:
    """A list of class names (``zero.wrap_modules``, ``compile.modules``, ...) as a tuple, or a ValueError.

    Hydra hands lists; the frozen configs keep a tuple, so they stay hashable. A lone string is
    refused rather than read as a sequence of one-letter names.
    """
    if isinstance(value, str):
        raise ValueError(f"{owner}.{field} must be a list of class names, got the string {value!r}.")
    names = tuple(value)
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{owner}.{field} must hold class names, got {name!r}.")
    return names


def check_number(owner: str, field: str, value: Any, *, minimum: float | None = None, integral: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{owner}.{field} must be a number, got {value!r} ({type(value).__name__}).")
    if integral and float(value) != int(value):
        raise ValueError(f"{owner}.{field} must be a whole number, got {value!r}.")
    if minimum is not None and value < minimum:
        raise ValueError(f"{owner}.{field} must be >= {minimum}, got {value!r}.")


def config_from_dict(cls: type[T], data: Mapping[str, Any] | None, *, path: str = "") -> T:
    """Build ``cls`` from a mapping, failing on unknown keys with the key's path and a suggestion.

    Nested dataclass fields are built recursively from nested mappings.
    """
    data = dict(data or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    prefix = f"{path}." if path else ""
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        raise ValueError(
            f"Unknown config key {prefix + key!r} for {cls.__name__}.{suggest(key, fields)}"
            f" Known keys: {', '.join(sorted(fields))}."
        )
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        field_type = fields[name].type
        nested = _dataclass_type(cls, name, field_type)
        if nested is not None and isinstance(value, Mapping):
            value = config_from_dict(nested, value, path=f"{prefix}{name}")
        kwargs[name] = value
    return cls(**kwargs)


class FromDict:
    """Mixin giving a config dataclass ``from_dict(data)``: :func:`config_from_dict` on the class.

    The class names its section as a class keyword, ``class ZeroConfig(FromDict, section="zero")``:
    the prefix of the key paths in its error messages (``Unknown config key 'zero.stag'``). No
    keyword = the root (``AmpZeroConfig``), or the section inherited from a base class.
    It adds no dataclass field and no state, so equality, hashing, pickling and the Hydra twins
    (:func:`lightning_ampzero.hydra_schema.structured` copies fields only) are the dataclass's own.
    """

    # Not annotated, so that typing.get_type_hints(cls) stays the dataclass fields (strategy, hydra_schema).
    _section = ""

    def __init_subclass__(cls, *, section: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if section is not None:
            cls._section = section

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # A misspelt keyword of the dataclass itself (``Fp8Config(recipee=...)``, as the docs' own
        # examples construct them) got Python's bare "unexpected keyword argument", where the dict
        # and Hydra forms suggest the field (a new-user trial). Checked here, before __init__.
        if kwargs:
            names = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
            unknown = [k for k in kwargs if k not in names]
            if unknown:
                raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {unknown[0]!r}."
                                f"{suggest(unknown[0], names)} Fields: {', '.join(names)}.")
        return super().__new__(cls)

    @classmethod
    def from_dict(cls: type[C], data: Mapping[str, Any] | None) -> C:
        return config_from_dict(cls, data, path=cls._section)


def _dataclass_type(cls: type, name: str, annotation: Any) -> type | None:
    import typing

    hints = typing.get_type_hints(cls)
    hint = hints.get(name, annotation)
    if dataclasses.is_dataclass(hint):
        return hint  # type: ignore[return-value]
    return None


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
