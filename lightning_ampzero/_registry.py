"""The strategy names this package adds to Lightning's ``StrategyRegistry``.

Called by ``_bootstrap`` right after ``lightning.pytorch.strategies`` (or
``pytorch_lightning.strategies``) is imported. It must import nothing heavy: the registry entry
holds a lazy factory, and ``AmpZeroStrategy`` (hence torch) is imported only when a Trainer asks
for one of these names. Lightning builds the strategy with
``registry[name]["strategy"](**registry[name]["init_params"])``, so a callable is all it needs.
"""

FLAVORS = ("lightning", "pytorch_lightning")

# name -> (description, AmpZeroStrategy keyword arguments). To add a variant, add a row.
STRATEGY_VARIANTS = {
    "ampzero": (
        "AmpZero ZeRO stage 2 (default): optimizer states and gradients sharded, on FSDP2",
        {"stage": 2},
    ),
    "ampzero_stage_0": (
        "AmpZero stage 0: plain data parallel (DDP), with AmpZero precision and loss scaling",
        {"stage": 0},
    ),
    "ampzero_stage_1": (
        "AmpZero ZeRO stage 1: optimizer states sharded, on FSDP2",
        {"stage": 1},
    ),
    "ampzero_stage_2": (
        "AmpZero ZeRO stage 2: optimizer states and gradients sharded, on FSDP2",
        {"stage": 2},
    ),
    "ampzero_stage_3": (
        "AmpZero ZeRO stage 3: optimizer states, gradients and parameters sharded, on FSDP2",
        {"stage": 3},
    ),
    "ampzero_stage_2_offload": (
        "AmpZero ZeRO-Offload, stage 2: fp32 master weights and Adam state in host memory, step on the CPU",
        {"stage": 2, "offload_optimizer": "cpu"},
    ),
    "ampzero_stage_3_offload": (
        "AmpZero ZeRO-Offload, stage 3: optimizer state and (on GPUs) parameter shards in host memory",
        {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
    ),
    "ampzero_stage_3_offload_nvme": (
        "AmpZero ZeRO-Infinity, stage 3: optimizer state and parameter shards in files under nvme_path (default:"
        " under the Trainer's default_root_dir), as Lightning's deepspeed_stage_3_offload_nvme",
        {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"},
    ),
}


class LazyStrategy:
    """Registry stand-in for ``AmpZeroStrategy``: imports the class on first call.

    An instance (not a function) so that a second registration attempt can recognise our own
    entries (``import lightning_ampzero`` after the .pth already registered them).
    """

    def __init__(self, flavor):
        self.flavor = flavor

    def __call__(self, **init_params):
        from lightning_ampzero._compat import strategy_class

        return strategy_class(self.flavor)(**init_params)

    def __repr__(self):
        return f"LazyStrategy({self.flavor!r})"


def register_strategies(registry, flavor):
    """Add every name of ``STRATEGY_VARIANTS`` to ``registry``; returns the names added.

    Idempotent: names already registered by us are skipped. A name registered by someone
    else is left alone and reported with a ValueError after the other names are added.

    Args:
        registry: ``lightning.pytorch.strategies.StrategyRegistry`` or
            ``pytorch_lightning.strategies.StrategyRegistry`` (two separate objects).
        flavor: ``"lightning"`` or ``"pytorch_lightning"``: which Lightning the registry belongs
            to, hence which copy of ``AmpZeroStrategy`` its entries build (see ``_compat``).
    """
    if flavor not in FLAVORS:
        raise ValueError(f"flavor must be one of {FLAVORS}, got {flavor!r}")
    added, foreign = [], []
    for name, (description, init_params) in STRATEGY_VARIANTS.items():
        # Membership and item access only: the registry's .get() would build a strategy.
        if name in registry:
            if not isinstance(registry[name].get("strategy"), LazyStrategy):
                foreign.append(name)
            continue
        registry.register(name, LazyStrategy(flavor), description=description, **init_params)
        added.append(name)
    if foreign:
        raise ValueError(
            f"strategy names {foreign} are already registered by another package; "
            "lightning_ampzero left them as they are"
        )
    return added
