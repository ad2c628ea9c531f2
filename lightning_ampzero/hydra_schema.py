"""The config schema of ``ampzero-train``, registered in Hydra's ConfigStore.

Every node of the composed config is typed by a frozen dataclass of the one schema. The
strategy's six nodes are the six fields of ``AmpZeroConfig``: ``strategy`` is its ``zero``
(:class:`~lightning_ampzero.config.ZeroConfig`), ``precision``
(:class:`~lightning_ampzero.config.PrecisionConfig`), ``offload``
(:class:`~lightning_ampzero.config.OffloadConfig`), ``activation_checkpointing``
(:class:`~lightning_ampzero.config.ActivationCheckpointingConfig`), ``fp8``
(:class:`~lightning_ampzero.config.Fp8Config`) and ``compile``
(:class:`~lightning_ampzero.config.CompileConfig`); ``model`` by ``GPTConfig``, ``data`` by
``DataConfig``, ``optim`` / ``scheduler`` by the DeepSpeed-section configs, and ``trainer`` /
``run`` by the two classes below. Hydra cannot take these classes as they are (they are frozen,
so OmegaConf would make them read-only, and they hold tuples), so :func:`structured` derives a
plain, mutable twin of each, field for field, with the same name and defaults. Nothing is
written twice: a field added to ``ZeroConfig`` is a config key at once.

Validation happens in two layers, both before any training process starts:

1. Composition (Hydra + OmegaConf, against the structured twins): an unknown key or a value of
   the wrong type fails with the key's full path; ``lightning_ampzero.train`` adds a
   "did you mean" (see :func:`explain_error`).
2. :func:`typed_config` builds the frozen dataclasses, whose ``__post_init__`` rejects bad values
   naming the allowed ones.

The config groups (``conf/<group>/*.yaml``) each name their group's schema as their base
(``defaults: [/schema/<group>@_here_, _self_]``), Hydra's documented pattern, so an option
file with a misspelt key fails when it is composed, whatever primary config uses it. The
strategy options that also set ``offload`` (``zero3_offload``, ...) are ``# @package _global_``
files extending a plain strategy option at ``@strategy``; ``offload`` itself is typed by the
primary schema (docs/configuration.md says why offload is not a group of its own).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Mapping, Optional, Union

from lightning_ampzero._schema import FromDict, check_choice, check_number, config_from_dict
from lightning_ampzero.config import (
    ActivationCheckpointingConfig,
    AmpZeroConfig,
    CompileConfig,
    Fp8Config,
    OffloadConfig,
    PrecisionConfig,
    ZeroConfig,
)
from lightning_ampzero.data.text import DataConfig
from lightning_ampzero.deepspeed import OptimizerConfig, SchedulerConfig

__all__ = [
    "GROUPS",
    "RunConfig",
    "TrainAppConfig",
    "TrainerConfig",
    "conf_dir",
    "explain_error",
    "register_configs",
    "structured",
    "typed_config",
]

ACCELERATORS = ("cpu", "gpu", "cuda", "auto")
CLIP_ALGORITHMS = ("norm", "value")
LAUNCHERS = ("auto", "local", "external")
LOGGERS = ("csv", "tensorboard", "none")


@dataclass(frozen=True)
class TrainerConfig(FromDict, section="trainer"):
    """The ``lightning.pytorch.Trainer`` arguments ``ampzero-train`` exposes (``trainer.<name>=...``).

    ``precision`` is the precision group's and ``strategy`` the strategy group's; the rest
    are passed to the Trainer unchanged. ``devices`` is the number of processes per node (or
    ``"auto"``, or a list of device indices) and ``num_nodes`` the number of nodes.
    """

    accelerator: str = "cpu"
    devices: Any = 2
    num_nodes: int = 1
    max_steps: int = -1
    max_epochs: Optional[int] = None
    max_time: Optional[str] = None
    # int = a number of batches, float = a fraction (Lightning's meaning).
    val_check_interval: Optional[Union[int, float]] = None
    limit_val_batches: Optional[Union[int, float]] = None
    limit_train_batches: Optional[Union[int, float]] = None
    num_sanity_val_steps: int = 0
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = None
    gradient_clip_algorithm: str = "norm"
    log_every_n_steps: int = 10
    enable_progress_bar: bool = True
    enable_model_summary: bool = True
    deterministic: bool = False

    def __post_init__(self) -> None:
        check_choice("trainer", "accelerator", self.accelerator, ACCELERATORS)
        check_choice("trainer", "gradient_clip_algorithm", self.gradient_clip_algorithm, CLIP_ALGORITHMS)
        check_number("trainer", "num_nodes", self.num_nodes, minimum=1, integral=True)
        check_number("trainer", "accumulate_grad_batches", self.accumulate_grad_batches, minimum=1, integral=True)
        check_number("trainer", "log_every_n_steps", self.log_every_n_steps, minimum=1, integral=True)
        check_number("trainer", "max_steps", self.max_steps, minimum=-1, integral=True)
        devices = self.devices
        if isinstance(devices, (list, tuple)):
            object.__setattr__(self, "devices", tuple(devices))
            if not devices or not all(isinstance(d, int) and not isinstance(d, bool) for d in devices):
                raise ValueError(f"trainer.devices must be a count, \"auto\" or a list of device indices, got {devices!r}.")
        elif devices != "auto" and (isinstance(devices, bool) or not isinstance(devices, int) or devices < 1 and devices != -1):
            raise ValueError(f"trainer.devices must be a count, -1, \"auto\" or a list of device indices, got {devices!r}.")
        if self.accelerator == "cpu" and (devices == -1 or isinstance(devices, (list, tuple))):
            # Lightning's CPUAccelerator takes a count only; it stopped in every worker (a new-user trial)
            raise ValueError(f"trainer.devices={devices!r} with trainer.accelerator=cpu: on CPU devices is the number"
                             " of processes (trainer.devices=2) or \"auto\"; -1 and device indices are for GPUs.")
        if self.gradient_clip_val is not None:
            check_number("trainer", "gradient_clip_val", self.gradient_clip_val, minimum=0)

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``Trainer(...)`` (unset optional ones left out)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if isinstance(out["devices"], tuple):
            out["devices"] = list(out["devices"])
        out = {k: v for k, v in out.items() if v is not None}
        if isinstance(self.val_check_interval, int) and not isinstance(self.val_check_interval, bool):
            # "Validate every N steps" across epoch boundaries: without this Lightning counts N
            # within an epoch and refuses a corpus with fewer than N batches per epoch.
            out["check_val_every_n_epoch"] = None
        return out


@dataclass(frozen=True)
class RunConfig(FromDict, section="run"):
    """How the job runs: process launching, outputs.

    Attributes:
        launcher: ``auto``: start the training processes of this node here, unless a launcher
            (torchrun, srun, ``LOCAL_RANK`` set) already did, in which case train in this
            process; ``local``: always start them here; ``external``: never.
        threads_per_process: torch intra-op threads per training process; ``None`` = the cores
            of this machine divided by the processes on it (at least 1).
        checkpoint: save a (sharded) checkpoint at the end of training, and every
            ``checkpoint_every_n_steps`` steps when that is set.
        checkpoint_every_n_steps: optimizer steps between checkpoints; ``None`` = only at the end.
        ckpt_path: resume from this checkpoint (a directory written by a previous run).
        logger: ``csv`` (metrics.csv in the job directory), ``tensorboard`` or ``none``.
        summary: print the summary table at the end (it is always written to ``summary.json``).
        timeout_s: stop the training processes after this many seconds (``None``: no limit).
        profile_steps: profile this many optimizer steps (after the fifth) on every rank and print
            where the step time goes, MFU factored into its measured terms (lightning_ampzero/cli/profile.py);
            0 = off.
    """

    launcher: str = "auto"
    threads_per_process: Optional[int] = None
    checkpoint: bool = True
    checkpoint_every_n_steps: Optional[int] = None
    ckpt_path: Optional[str] = None
    logger: str = "csv"
    summary: bool = True
    timeout_s: Optional[float] = None
    profile_steps: int = 0

    def __post_init__(self) -> None:
        check_choice("run", "launcher", self.launcher, LAUNCHERS)
        check_choice("run", "logger", self.logger, LOGGERS)
        if self.threads_per_process is not None:
            check_number("run", "threads_per_process", self.threads_per_process, minimum=1, integral=True)
        if self.checkpoint_every_n_steps is not None:
            check_number("run", "checkpoint_every_n_steps", self.checkpoint_every_n_steps, minimum=1, integral=True)
        if self.timeout_s is not None:
            check_number("run", "timeout_s", self.timeout_s, minimum=1)
        check_number("run", "profile_steps", self.profile_steps, minimum=0, integral=True)


def _model_config_class() -> type:
    # models.config is torch-free, so composing and validating a config loads neither torch nor lightning.
    from lightning_ampzero.models.config import GPTConfig

    return GPTConfig


def _default_model() -> Any:
    return _model_config_class()()


@dataclass(frozen=True)
class TrainAppConfig:
    """The whole ``ampzero-train`` config. Each field is a config group (or a plain node)."""

    seed: int = 1234
    strategy: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    # Offload is a node, not a group: the strategy group's *_offload / *_nvme options set it
    # (conf/strategy/zero3_offload.yaml); docs/configuration.md ("Offload, activation
    # checkpointing and FP8") says why.
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config.off)
    compile: CompileConfig = field(default_factory=CompileConfig)  # a node: compile.enabled=true
    model: Any = field(default_factory=_default_model)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        check_number("", "seed", self.seed, integral=True)
        if self.data.block_size > self.model.block_size:
            raise ValueError(
                f"data.block_size={self.data.block_size} exceeds model.block_size={self.model.block_size}:"
                " the model has no position embedding beyond it. Lower data.block_size or raise model.block_size."
            )
        try:
            self.amp_config  # AmpZeroConfig's cross-field checks (offload needs a stage ...), before anything starts
        except ValueError as e:
            raise ValueError(_as_written(str(e), "strategy")) from None

    @property
    def amp_config(self) -> AmpZeroConfig:
        """The strategy's config: the ``strategy``, ``precision``, ``offload``, ``activation_checkpointing``,
        ``fp8`` and ``compile`` nodes."""
        return AmpZeroConfig(zero=self.strategy, precision=self.precision, fp8=self.fp8,
                             activation_checkpointing=self.activation_checkpointing, offload=self.offload,
                             compile=self.compile)

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))


#: node of TrainAppConfig -> its schema class (the config groups of conf/ and the plain nodes).
def _node_types() -> dict[str, type]:
    return {
        "strategy": ZeroConfig,
        "precision": PrecisionConfig,
        "offload": OffloadConfig,
        "activation_checkpointing": ActivationCheckpointingConfig,
        "fp8": Fp8Config,
        "compile": CompileConfig,
        "model": _model_config_class(),
        "data": DataConfig,
        "trainer": TrainerConfig,
        "optim": OptimizerConfig,
        "scheduler": SchedulerConfig,
        "run": RunConfig,
    }


#: Config groups with option files in conf/ (each has a schema registered as /schema/<group>).
GROUPS = ("strategy", "precision", "activation_checkpointing", "fp8", "model", "data", "trainer")


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------
# Structured-config twins of the frozen dataclasses
# ---------------------------------------------------------------------------------------

_PRIMITIVES = (int, float, str, bool)


def _omegaconf_type(hint: Any) -> tuple[Any, bool]:
    """(type for OmegaConf, is a nested dataclass) for one field's type hint."""
    if dataclasses.is_dataclass(hint):
        return structured(hint), True
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (tuple, list, typing.Tuple, typing.List):
        item = args[0] if args else Any
        if item is Ellipsis or item not in _PRIMITIVES:
            item = Any
        if len(args) > 1 and args[1] is not Ellipsis and len(set(args)) == 1:
            item = args[0] if args[0] in _PRIMITIVES else Any
        return List[item], False  # type: ignore[valid-type]
    if origin is Union:
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            sub, nested = _omegaconf_type(inner[0])
            return Optional[sub], nested
        if all(a in _PRIMITIVES for a in inner):
            return hint, False
        return Any, False
    if hint in _PRIMITIVES or hint is Any:
        return hint, False
    return Any, False


@functools.lru_cache(maxsize=None)
def structured(cls: type) -> type:
    """A mutable OmegaConf-compatible dataclass with ``cls``'s name, fields, types and defaults."""
    hints = typing.get_type_hints(cls)
    defaults = cls()
    fields = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if hint is Any and dataclasses.is_dataclass(getattr(defaults, f.name)):
            hint = type(getattr(defaults, f.name))
        otype, nested = _omegaconf_type(hint)
        value = getattr(defaults, f.name)
        if nested and value is not None:
            twin = otype if dataclasses.is_dataclass(otype) else typing.get_args(otype)[0]
            fields.append((f.name, otype, field(default_factory=functools.partial(_twin_instance, twin, value))))
        elif isinstance(value, (list, tuple, dict)):
            fields.append((f.name, otype, field(default_factory=functools.partial(_copy, _plain(value)))))
        else:
            fields.append((f.name, otype, field(default=value)))
    twin = dataclasses.make_dataclass(cls.__name__, fields)
    twin.__module__ = __name__
    twin.__doc__ = f"Structured-config twin of {cls.__module__}.{cls.__qualname__} (see hydra_schema)."
    return twin


def _copy(value: Any) -> Any:
    import copy

    return copy.deepcopy(value)


def _twin_instance(twin: type, value: Any) -> Any:
    kwargs = {}
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        kwargs[f.name] = _twin_instance(structured(type(v)), v) if dataclasses.is_dataclass(v) else _plain(v)
    return twin(**kwargs)


# ---------------------------------------------------------------------------------------
# ConfigStore and the conf/ directory
# ---------------------------------------------------------------------------------------

PRIMARY_SCHEMA = "ampzero_train_schema"


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore: ``ampzero_train_schema`` (the primary config's
    base) and ``schema/<group>`` (each option file's base). Idempotent."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name=PRIMARY_SCHEMA, node=structured(TrainAppConfig))
    types_ = _node_types()
    for group in GROUPS:
        cs.store(group="schema", name=group, node=structured(types_[group]))


def conf_dir(package_dir: Optional[Path] = None) -> Path:
    """The directory of the config groups: ``lightning_ampzero/conf`` in an installed wheel,
    ``conf/`` at the repository root in a source checkout or editable install.

    ``package_dir`` (default: this package's directory) is where to look from.
    """
    here = Path(package_dir or Path(__file__).parent).resolve()
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(
        f"lightning_ampzero's Hydra configs were not found (looked in {here / 'conf'} and {here.parent / 'conf'})."
        " Reinstall the package."
    )


# ---------------------------------------------------------------------------------------
# From the composed config to the frozen dataclasses
# ---------------------------------------------------------------------------------------


def typed_config(cfg: Any) -> TrainAppConfig:
    """Build :class:`TrainAppConfig` from a composed (DictConfig) or plain config.

    Value errors name the group they come from; the ``hydra`` node, if present, is ignored.
    """
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    else:
        data = _plain(dict(cfg))
    assert isinstance(data, dict)
    data.pop("hydra", None)
    types_ = _node_types()
    unknown = [k for k in data if k not in types_ and k != "seed"]
    if unknown:
        key = unknown[0]
        raise ValueError(f"Unknown config key {key!r}.{_did_you_mean(key, list(types_) + ['seed'])}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        if name == "seed":
            kwargs[name] = value
            continue
        try:
            kwargs[name] = config_from_dict(types_[name], value, path=name)
        except (ValueError, TypeError) as e:
            message = _as_written(str(e), name)
            raise ValueError(f"Invalid value in config group '{name}' ({types_[name].__name__}): {message}") from None
    return TrainAppConfig(**kwargs)


#: node -> (section name used in the typed configs' messages, its path in this config)
_SECTION_NAMES = {
    "strategy": (("zero", "strategy"),),
    "precision": (("loss_scaler", "precision.loss_scaler"),),
}


def _as_written(message: str, node: str) -> str:
    """The typed configs name their own sections ("zero.stage"); say it as the user wrote it."""
    for section, path in _SECTION_NAMES.get(node, ()):
        message = re.sub(rf"(?<![\w.]){re.escape(section)}\.", f"{path}.", message)
    return message


def _did_you_mean(key: str, allowed: Any) -> str:
    close = difflib.get_close_matches(str(key), [str(a) for a in allowed], n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def explain_error(exc: BaseException) -> Optional[str]:
    """A user-facing message, with a "did you mean", for a Hydra / OmegaConf composition error.

    Returns None when the error is not one this function understands (the caller then shows
    Hydra's own message).
    """
    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

    chain: list[BaseException] = []
    e: Optional[BaseException] = exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for err in chain:
        if isinstance(err, MissingConfigException):
            options = list(getattr(err, "options", None) or [])
            name = str(getattr(err, "missing_cfg_file", "") or "")
            group, _, option = name.rpartition("/")
            if options and group:
                return (f"'{option}' is not an option of config group '{group}'.{_did_you_mean(option, options)}"
                        f" Options: {', '.join(sorted(options))}.")
            return None
    for err in chain:
        if isinstance(err, (ConfigKeyError, AttributeError)) and isinstance(err, OmegaConfBaseException):
            full_key = getattr(err, "full_key", None) or getattr(err, "key", None)
            key = str(getattr(err, "key", "") or str(full_key).rsplit(".", 1)[-1])
            candidates = _keys_of(getattr(err, "object_type", None), getattr(err, "parent_node", None))
            where = str(full_key).rpartition(".")[0]
            owner = f"'{where}'" if where else "the top level"
            kind = getattr(getattr(err, "object_type", None), "__name__", None)
            schema = f" ({kind})" if kind else ""
            return (f"Unknown config key '{full_key}': {owner}{schema} has no key '{key}'."
                    f"{_did_you_mean(key, candidates)}{_elsewhere(key, where)}{_zero_node(str(full_key))}"
                    f"{_own_node(key, where)}"
                    + (f" Keys: {', '.join(sorted(candidates))}." if candidates else ""))
        if isinstance(err, ValidationError):
            full_key = getattr(err, "full_key", None)
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            node = (f" '{full_key}' is a node of keys, not a value: {_NODE_EXAMPLES[str(full_key)]}."
                    if str(full_key) in ("compile", "offload") else "")  # compile=true, as AmpZeroStrategy(compile=True)
            return f"Invalid value for '{full_key}': {first}" + ("." if node and not first.endswith(".") else "") + node
    return None


def _zero_node(full_key: str) -> str:
    """" ZeRO's settings are the 'strategy' node here: strategy.stage=3." for ``zero.stage=3``: the
    Python config's section (``AmpZeroStrategy(config=...)``'s ``zero``) and DeepSpeed's
    ``zero_optimization`` are the Hydra node ``strategy``."""
    head, _, rest = full_key.partition(".")
    if head not in ("zero", "zero_optimization"):
        return ""
    return f" ZeRO's settings are the 'strategy' node here: strategy.{rest or '<key>'}, e.g. strategy.stage=3."


def _elsewhere(key: str, where: str) -> str:
    """" It is a key of 'offload' (offload.offload_optimizer)." when another top-level node has ``key``
    (``strategy.offload_optimizer=cpu``: DeepSpeed nests offload under zero_optimization, we do not)."""
    nodes = [name for name, cls in _node_types().items()
             if name != where and dataclasses.is_dataclass(cls) and key in {f.name for f in dataclasses.fields(cls)}]
    return f" It is a key of '{nodes[0]}': {nodes[0]}.{key}." if len(nodes) == 1 else ""


# How each node that is a keyword of AmpZeroStrategy (compile=True, offload_optimizer=...) is set here.
_NODE_EXAMPLES = {
    "compile": "compile.enabled=true (or false)",
    "precision": "precision=bf16-mixed (a config group)",
    "offload": "offload.offload_optimizer=cpu, or strategy=zero3_offload",
    "activation_checkpointing": "activation_checkpointing=full (a config group)",
    "fp8": "fp8=tensorwise (a config group)",
}


def _own_node(key: str, where: str) -> str:
    """" 'compile' is a node of its own here: compile.enabled=true." for ``strategy.compile=true``
    (``AmpZeroStrategy(compile=True)`` in Python; a new-user trial wrote it so)."""
    if not where or key not in _NODE_EXAMPLES:
        return ""
    return f" '{key}' is a node of its own here, not a key of '{where}': {_NODE_EXAMPLES[key]}."


def _keys_of(object_type: Any, parent: Any) -> list[str]:
    if object_type is not None and dataclasses.is_dataclass(object_type):
        return [f.name for f in dataclasses.fields(object_type)]
    try:
        return [str(k) for k in parent.keys()]  # type: ignore[union-attr]
    except Exception:
        return []
