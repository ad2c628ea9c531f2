"""The keywords of :class:`~lightning_ampzero.strategy.AmpZeroStrategy`.

How its ``config`` and keyword overrides become one :class:`AmpZeroConfig`, and the typed signature
a LightningCLI reads. Shared by the strategy's ``lightning.pytorch`` and ``pytorch_lightning`` copies
(lightning_ampzero/_compat.py), so it imports no Lightning: the strategy hands it its ``rank_zero_info``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import typing
from typing import Any, Callable, Iterator, Mapping, Optional, Union

from lightning_ampzero._schema import suggest
from lightning_ampzero.config import (
    ActivationCheckpointingConfig,
    AmpZeroConfig,
    CompileConfig,
    OffloadConfig,
    PrecisionConfig,
    ZeroConfig,
)


def _flat_keywords() -> dict[str, type]:
    """Each keyword :func:`resolve_config` takes flat -> the config dataclass whose field it is.

    The sections' field names are distinct, so ``stage=3`` can only mean ``ZeroConfig.stage``.
    """
    return {f.name: section for section in (AmpZeroConfig, ZeroConfig, OffloadConfig)
            for f in dataclasses.fields(section) if f.init}


def _nested_home(name: str) -> str:
    """Where a keyword that is not flat lives (``communication_data_type``: the precision section), or ""."""
    def sections(cls: type, chain: tuple) -> Iterator[tuple]:
        for f in dataclasses.fields(cls):
            if f.init and f.default_factory is not dataclasses.MISSING:  # a nested section (its dataclass)
                inner = type(f.default_factory())
                if dataclasses.is_dataclass(inner) and inner not in (ZeroConfig, OffloadConfig):
                    yield chain + ((f.name, inner),)
                    yield from sections(inner, chain + ((f.name, inner),))

    for chain in sections(AmpZeroConfig, ()):
        if name in {f.name for f in dataclasses.fields(chain[-1][1]) if f.init}:
            call = f"{name}=..."
            for field, cls in reversed(chain):
                call = f"{field}={cls.__name__}({call})"
            path = ".".join(field for field, _ in chain)
            return f" It is a field of {chain[-1][1].__name__} (the `{path}` section): AmpZeroStrategy({call})."
    return ""


#: Trainer(precision=...) spellings Lightning still takes, as its own precision strings.
_LIGHTNING_SPELLINGS = {"16": "16-mixed", "32": "32-true", "bf16": "bf16-mixed"}


def resolve_config(config: Any, overrides: Mapping[str, Any],
                   say: Callable[[str], None] = lambda message: None) -> tuple[AmpZeroConfig, Any]:
    """The AmpZeroConfig for a strategy: from ours, a DeepSpeed config (path or dict), or defaults; plus overrides.

    Keyword overrides name fields of :class:`AmpZeroConfig` (``precision=...``) or of
    :class:`ZeroConfig` (``stage=3, reduce_bucket_size=5e7, ...``). ``say``: told which values of
    ``config`` the keywords replaced (:func:`say_replaced`).
    """
    imported = None
    # A keyword given as None leaves the value of `config` (or the default): a LightningCLI passes
    # every keyword of the signature, unset ones as None ([Note: keywords a LightningCLI sees]).
    overrides = {k: v for k, v in overrides.items() if v is not None}
    named = list(overrides)
    if config is None:
        cfg = AmpZeroConfig()
    elif isinstance(config, AmpZeroConfig):
        cfg = config
    elif isinstance(config, (str, os.PathLike, Mapping)):
        from lightning_ampzero.deepspeed import convert_deepspeed_config

        imported = convert_deepspeed_config(config, stage_given="stage" in overrides)
        cfg = imported.config
    else:
        raise TypeError(
            f"config must be an AmpZeroConfig, a DeepSpeed config (dict or path to a JSON file) or None,"
            f" got {type(config).__name__}."
        )
    given = cfg
    if overrides.get("precision") is not None and not isinstance(overrides["precision"], (PrecisionConfig, Mapping)):
        # [precision] AmpZeroStrategy(precision="16-mixed"): shorthand for the precision config's
        # `precision`, which wins over the Trainer's flag (the way to get 16-mixed on CPU). Lightning's
        # older spellings (precision=16, "bf16", as Trainer takes them) mean what they mean there; an
        # int was stored unchecked and failed inside fit (a new-user trial).
        overrides = dict(overrides)
        overrides["precision"] = _LIGHTNING_SPELLINGS.get(str(overrides["precision"]), overrides["precision"])
        cfg = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, precision=overrides.pop("precision")))
    owner = _flat_keywords()  # [offload] flat too: offload_optimizer="cpu", ...
    unknown = [k for k in overrides if k not in owner]
    if unknown:
        from lightning_ampzero._deepspeed.lightning_keywords import lightning_keyword_hint

        def hint(name: str) -> str:
            ported = lightning_keyword_hint(name)  # a keyword of Lightning's DeepSpeedStrategy
            return ' ' + ported if ported else _nested_home(name) or suggest(name, set(owner))

        # Every unknown keyword at once: a port from DeepSpeedStrategy usually brings several.
        head = (f"an unknown argument {unknown[0]!r}.{hint(unknown[0])}" if len(unknown) == 1 else
                f"{len(unknown)} unknown arguments:" + "".join(f" {name!r}:{hint(name)}" for name in unknown))
        raise TypeError(f"AmpZeroStrategy got {head} Arguments: config, {', '.join(sorted(set(owner) - {'zero'}))}.")
    if overrides.get("offload_optimizer") is False:  # Lightning's DeepSpeedStrategy default: no offload
        overrides = {**overrides, "offload_optimizer": "none"}
    if overrides.get("offload_optimizer") is True:  # Lightning's DeepSpeedStrategy(offload_optimizer=True)
        from lightning_ampzero._deepspeed.lightning_keywords import lightning_keyword_hint

        raise ValueError(lightning_keyword_hint("offload_optimizer", True))
    top_kw, zero_kw, offload_kw = ({k: v for k, v in overrides.items() if owner[k] is section}
                                   for section in (AmpZeroConfig, ZeroConfig, OffloadConfig))
    # A nested config may be given as a mapping (e.g. the registry's init params, a Hydra node), and
    # activation_checkpointing as its mode ("full", "selective"), compile as a bool.
    hints = typing.get_type_hints(AmpZeroConfig)
    for name, value in list(top_kw.items()):
        if isinstance(value, Mapping) and dataclasses.is_dataclass(hints[name]):
            top_kw[name] = hints[name].from_dict(value)
        elif name == "activation_checkpointing" and isinstance(value, str):
            top_kw[name] = ActivationCheckpointingConfig(mode=value)
        elif name == "compile" and isinstance(value, bool):
            top_kw[name] = CompileConfig(enabled=value)  # [compile] AmpZeroStrategy(compile=True)
    # One replace, so that cross-field checks (AmpZeroConfig.__post_init__) see the final values.
    if zero_kw:
        top_kw["zero"] = dataclasses.replace(top_kw.get("zero", cfg.zero), **zero_kw)
    if offload_kw:
        top_kw["offload"] = dataclasses.replace(top_kw.get("offload", cfg.offload), **offload_kw)
    if top_kw:
        cfg = dataclasses.replace(cfg, **top_kw)
    if config is not None:
        say_replaced(given, cfg, named, dict(imported.sources) if imported is not None else None, say=say)
    return cfg, imported


def _keyword_path(name: str, owner: Mapping[str, type]) -> str:
    """The dotted config field keyword ``name`` sets (``stage`` -> ``zero.stage``, ``precision`` ->
    ``precision.precision``): the attribute path in an AmpZeroConfig and a DeepSpeed import's target."""
    if name == "precision":  # the shorthand for the precision section's own field
        return "precision.precision"
    section = owner[name]
    return f"zero.{name}" if section is ZeroConfig else f"offload.{name}" if section is OffloadConfig else name


def say_replaced(given: AmpZeroConfig, final: AmpZeroConfig, names: list[str],
                 sources: Optional[Mapping[str, str]] = None, *, say: Callable[[str], None]) -> None:
    """Tell ``say`` (the strategy's rank-zero info) which keywords replaced a different value of ``config``.

    A keyword beside ``config`` wins (``AmpZeroStrategy(config="ds.json", stage=3)`` with ``"stage": 1``
    in the file trains at stage 3). That is the documented rule, but a DeepSpeed user whose file
    says stage 1 saw nothing tell them the file's value was not used (a new-user trial), so each
    replaced value is named once, at construction.

    ``sources`` (a DeepSpeed config's): field -> the key it came from; a field the file did not set
    (``zero.stage`` for a file without ``zero_optimization.stage``) was not replaced, so not named.
    """
    owner = _flat_keywords()
    replaced = []
    for name in names:
        target = _keyword_path(name, owner)
        before, after = (functools.reduce(getattr, target.split("."), cfg) for cfg in (given, final))
        if sources is not None:
            key = sources.get(target)
            if key is None or "(absent" in key:
                continue
        if before is not None and before != after:  # (None: the config left it to the Trainer)
            text = (f"{name} {before!r} -> {after!r}" if not dataclasses.is_dataclass(after)
                    else f"{name} (the whole section)")
            replaced.append(f"{text} (the DeepSpeed config's {key})" if sources is not None else text)
    if replaced:
        say(f"AmpZeroStrategy: keywords given beside `config` replace its values: {', '.join(replaced)}.")


def _keyword_signature(init: Any) -> inspect.Signature:
    """``init``'s signature with its ``**overrides`` spelt out as typed keywords (default None).

    [Note: keywords a LightningCLI sees]
    LightningCLI (jsonargparse) builds a strategy's options from its ``__init__`` signature, and
    cannot see what ``**overrides`` takes: ``init_args: {stage: 3}`` or ``--trainer.strategy.stage=3``
    stopped with "Option 'stage' is not accepted", where DeepSpeedStrategy takes ``stage=3``. So the
    signature names each field that :func:`resolve_config` takes flat, typed from the config
    dataclasses (a nested section also as a mapping, ``activation_checkpointing`` also as its mode,
    ``compile`` also as a bool, ``precision`` also as a precision string). Every default is None,
    meaning "not given": the CLI passes them all, and None must not overwrite a value of ``config``.
    """
    params = [p for p in inspect.signature(init).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    shorthand = {"precision": str, "activation_checkpointing": str, "compile": bool}
    for name, section in _flat_keywords().items():
        if name == "zero":  # its fields are keywords of their own
            continue
        hint = typing.get_type_hints(section)[name]
        if section is AmpZeroConfig:  # a nested section: also a mapping, some also a shorthand
            hint = Union[(hint, shorthand[name], dict)] if name in shorthand else Union[hint, dict]
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                        annotation=Optional[hint]))
    return inspect.Signature(params, return_annotation=None)
