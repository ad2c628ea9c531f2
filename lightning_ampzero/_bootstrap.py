"""Registers our strategy names in Lightning's StrategyRegistry without ``import lightning_ampzero``.

[Note: registration without an import]
Lightning has no entry-point group for strategies: a name such as "ampzero_stage_3" resolves
only if ``StrategyRegistry.register`` ran in the process before the Trainer is built, which
would normally force every user script to ``import lightning_ampzero`` first. So the wheel
installs ``lightning_ampzero_strategies.pth`` into site-packages. Its one line imports this
package at interpreter start-up, and ``lightning_ampzero/__init__.py`` calls :func:`install`.

That runs in every Python process of the environment, so it must cost nothing:
importing lightning (~1 s) or torch there is out of the question, and this module imports
nothing at all (only ``sys``, which is built in). :func:`install` puts one finder at the front
of ``sys.meta_path``. The finder answers for two module names only,
``lightning.pytorch.strategies`` and ``pytorch_lightning.strategies``: it lets the other finders
locate the real module and wraps its loader, so that right after the module body has run
(``StrategyRegistry`` exists and holds Lightning's own names) ``_registry.register_strategies``
adds ours. Those entries are lazy factories: nothing that imports torch is loaded before a
Trainer asks for one of our names. If Lightning was imported before :func:`install` ran
(``import lightning; import lightning_ampzero`` without the .pth), it registers at once.

The same finder serves ``lightning_ampzero._pl.*``, the pytorch_lightning copies of our two
Lightning-facing modules (see ``_compat.py``). It lives here rather than in ``_compat`` so that a
fresh process that unpickles such a class (a spawned rank) can import it: the unpickler imports
``lightning_ampzero`` first, which installs the finder.

Failure policy: an error in our registration is swallowed and reported once as a
RuntimeWarning; errors raised by Lightning's own modules propagate unchanged. The .pth line does
nothing when LIGHTNING_AMPZERO_NO_AUTOREGISTER is set (non-empty).
"""

import sys

# module whose import triggers registration -> flavor for _registry.register_strategies
_TARGETS = {
    "lightning.pytorch.strategies": "lightning",
    "pytorch_lightning.strategies": "pytorch_lightning",
}
_PL_PACKAGE = "lightning_ampzero._pl"
_PL_PREFIX = _PL_PACKAGE + "."


class _Finder:
    """The ``sys.meta_path`` entry. Returns None, at the cost of one set lookup, for every other name."""

    _lightning_ampzero_finder = True  # marker: install() must not add a second finder

    def __init__(self):
        self._warned = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname in _TARGETS:
            return self._find_wrapped(fullname, path, target)
        if fullname == _PL_PACKAGE or fullname.startswith(_PL_PREFIX):
            from lightning_ampzero import _compat

            return _compat.find_pl_spec(fullname)
        return None

    def invalidate_caches(self):
        pass

    def _find_wrapped(self, fullname, path, target):
        # Ask the finders behind us, as the import system would have (ours first would recurse).
        for finder in list(sys.meta_path):
            if getattr(finder, "_lightning_ampzero_finder", False):
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RegisteringLoader(spec.loader, _TARGETS[fullname], self)
        return spec

    def register(self, module, flavor):
        try:
            from lightning_ampzero._registry import register_strategies

            register_strategies(module.StrategyRegistry, flavor)
        except Exception as err:  # never let our registration break the user's `import lightning`
            self.warn_once(flavor, err)

    def warn_once(self, flavor, err):
        if self._warned:
            return
        self._warned = True
        message = (
            f"lightning_ampzero could not register its strategy names with {flavor} "
            f"({type(err).__name__}: {err}). Pass the strategy object instead: "
            "Trainer(strategy=lightning_ampzero.AmpZeroStrategy(stage=...))."
        )
        try:
            import warnings

            warnings.warn(message, RuntimeWarning, stacklevel=2)
        except Exception:  # `-W error` turns the warning into an exception: still never raise
            sys.stderr.write(f"RuntimeWarning: {message}\n")


class _RegisteringLoader:
    """Runs the real loader, then registers our names in the module it just executed."""

    def __init__(self, loader, flavor, finder):
        self._loader = loader
        self._flavor = flavor
        self._finder = finder

    def create_module(self, spec):
        create_module = getattr(self._loader, "create_module", None)
        return None if create_module is None else create_module(spec)

    def exec_module(self, module):
        # Give the module its real loader back before it runs: inspect, importlib.resources and
        # importlib.reload read __loader__ / __spec__.loader and must not see this wrapper.
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        self._loader.exec_module(module)
        self._finder.register(module, self._flavor)

    def __getattr__(self, name):  # get_source, is_package, get_resource_reader, ...
        return getattr(self._loader, name)


def install():
    """Put the finder on ``sys.meta_path`` (once) and register in already-imported registries."""
    try:
        finder = next((f for f in sys.meta_path if getattr(f, "_lightning_ampzero_finder", False)), None)
        if finder is None:
            finder = _Finder()
            sys.meta_path.insert(0, finder)
        for name, flavor in _TARGETS.items():
            module = sys.modules.get(name)
            if module is not None and hasattr(module, "StrategyRegistry"):
                finder.register(module, flavor)
    except Exception as err:  # start-up must survive anything we get wrong
        _Finder().warn_once("Lightning", err)
