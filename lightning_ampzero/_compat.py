"""One source, two Lightnings: ``lightning.pytorch`` and the standalone ``pytorch_lightning``.

[Note: the pytorch_lightning copies]
``pytorch_lightning`` is a separate copy of Lightning built on ``lightning_fabric``. Its Trainer
checks ``isinstance(strategy, pytorch_lightning.strategies.Strategy)`` and the like, so a class
derived from ``lightning.pytorch``'s base classes is rejected there, and vice versa. Lightning
itself produces the standalone package by rewriting import names in its sources; we do the same,
at import time, for our only two Lightning-facing modules (``_REWRITTEN``): their source is
compiled again under ``lightning_ampzero._pl.*`` with

    lightning.pytorch                  -> pytorch_lightning
    lightning.fabric                   -> lightning_fabric
    lightning_ampzero.strategy         -> lightning_ampzero._pl.strategy
    lightning_ampzero.precision.plugin -> lightning_ampzero._pl.precision.plugin

Every other module of the package is framework-agnostic and shared by both copies (one
``AmpZeroConfig`` class, so isinstance checks on configs hold in both). Rules for the two
rewritten modules, checked when the copy is built: import Lightning only by absolute
``lightning.pytorch...`` / ``lightning.fabric...`` names (never ``import lightning`` or
``from lightning import ...``), and use absolute imports for our own modules (a relative import
would resolve inside ``lightning_ampzero._pl``). The copies are compiled with the original file
name and unchanged line numbers, so tracebacks, coverage and debuggers point at the real file.

``_bootstrap``'s finder routes ``lightning_ampzero._pl.*`` imports to :func:`find_pl_spec`; the
copies are ordinary modules in ``sys.modules``, so their classes pickle by reference.
"""

import ast
import importlib
import importlib.machinery
import importlib.util
import re

FLAVORS = ("lightning", "pytorch_lightning")

# module of the lightning.pytorch flavor -> its pytorch_lightning copy
_REWRITTEN = {
    "lightning_ampzero.strategy": "lightning_ampzero._pl.strategy",
    "lightning_ampzero.precision.plugin": "lightning_ampzero._pl.precision.plugin",
}
_COPY_TO_SOURCE = {copy: source for source, copy in _REWRITTEN.items()}
_PL_PACKAGES = ("lightning_ampzero._pl", "lightning_ampzero._pl.precision")

_RENAMES = {
    "lightning.pytorch": "pytorch_lightning",
    "lightning.fabric": "lightning_fabric",
    **_REWRITTEN,
}
# Whole dotted names only: `lightning.pytorch_x` or `my_lightning.fabric` are left alone.
_RENAME_RE = re.compile(
    r"(?<![\w.])(" + "|".join(re.escape(name) for name in sorted(_RENAMES, key=len, reverse=True)) + r")(?![\w])"
)


def strategy_class(flavor="lightning"):
    """``AmpZeroStrategy`` for the given Lightning: ``"lightning"`` or ``"pytorch_lightning"``."""
    return _module(flavor, "lightning_ampzero.strategy").AmpZeroStrategy


def precision_class(flavor="lightning"):
    """``AmpZeroPrecision`` for the given Lightning: ``"lightning"`` or ``"pytorch_lightning"``."""
    return _module(flavor, "lightning_ampzero.precision.plugin").AmpZeroPrecision


def _module(flavor, name):
    if flavor == "lightning":
        return importlib.import_module(name)
    if flavor == "pytorch_lightning":
        return importlib.import_module(_REWRITTEN[name])
    raise ValueError(f"flavor must be one of {FLAVORS}, got {flavor!r}")


def rewrite_source(source):
    """The pytorch_lightning version of a ``lightning.pytorch`` module's source."""
    return _RENAME_RE.sub(lambda match: _RENAMES[match.group(1)], source)


def find_pl_spec(fullname):
    """Spec for a ``lightning_ampzero._pl.*`` module (called by ``_bootstrap``'s finder)."""
    if fullname in _PL_PACKAGES:
        # Empty packages: they only give the copies a parent, as the import system requires.
        return importlib.machinery.ModuleSpec(fullname, _EmptyPackageLoader(), is_package=True)
    source_name = _COPY_TO_SOURCE.get(fullname)
    if source_name is None:
        raise ModuleNotFoundError(
            f"No module named {fullname!r}: lightning_ampzero._pl holds only the pytorch_lightning "
            f"copies of {sorted(_REWRITTEN)}. If one of those imports another module of the package "
            "with a relative import, make it absolute (see lightning_ampzero/_compat.py).",
            name=fullname,
        )
    source_spec = importlib.util.find_spec(source_name)
    if source_spec is None or source_spec.origin is None:
        raise ModuleNotFoundError(f"No module named {source_name!r} (needed for {fullname!r})", name=fullname)
    spec = importlib.machinery.ModuleSpec(
        fullname, _RewritingLoader(source_name, source_spec), origin=source_spec.origin
    )
    spec.has_location = True  # sets __file__ to the original file
    return spec


class _EmptyPackageLoader:
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        pass


class _RewritingLoader:
    def __init__(self, source_name, source_spec):
        self._source_name = source_name
        self._source_spec = source_spec

    def create_module(self, spec):
        return None

    def is_package(self, fullname):
        return False

    def get_source(self, fullname):
        return rewrite_source(self._source_spec.loader.get_source(self._source_name))

    def exec_module(self, module):
        source = self.get_source(module.__name__)
        path = self._source_spec.origin
        tree = ast.parse(source, path)
        _check_imports(tree, self._source_name, path)
        exec(compile(tree, path, "exec", dont_inherit=True), module.__dict__)


def _check_imports(tree, source_name, path):
    """Refuse imports the rewrite cannot handle, naming the line, instead of mixing two Lightnings."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            # `from lightning_ampzero.precision import plugin` names a rewritten module too
            names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
            relative = node.level > 0
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
            relative = False
        else:
            continue
        if relative:
            problem = "a relative import"
        elif any(name == "lightning" or name.startswith("lightning.") for name in names):
            problem = f"an import of {names[0]!r}"
        elif any(name in _REWRITTEN for name in names[1:]):
            problem = f"`from {names[0]} import ...` of a module that has its own copy"
        else:
            continue
        raise ImportError(
            f"{path}:{node.lineno}: {source_name} has {problem}, which its pytorch_lightning copy "
            "cannot rewrite. Import Lightning as `lightning.pytorch...` / `lightning.fabric...` and "
            "our modules by absolute name (see lightning_ampzero/_compat.py)."
        )
