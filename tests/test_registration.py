"""Strategy names resolve with no `import lightning_ampzero`, in both Lightnings.

Each check runs in a fresh interpreter: what is tested is interpreter start-up (the installed
.pth) and first imports, which an already-initialised pytest process cannot show.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_ampzero import _compat
from lightning_ampzero._registry import STRATEGY_VARIANTS

EXPECTED_NAMES = {"ampzero", "ampzero_stage_0", "ampzero_stage_1", "ampzero_stage_2", "ampzero_stage_3"}
OPT_OUT = "LIGHTNING_AMPZERO_NO_AUTOREGISTER"
# The checkout these tests belong to. Since the .pth imports lightning_ampzero at start-up, the
# installed copy wins over the current directory, for every test of the suite: it must be this one.
PACKAGE_DIR = Path(__file__).resolve().parents[1] / "lightning_ampzero"
INSTALL_HINT = 'install the package from the repository root: pip install -e ".[dev]"'
FLAVORS = {  # flavor -> (Trainer package, module of our strategy class in that flavor)
    "lightning": ("lightning.pytorch", "lightning_ampzero.strategy"),
    "pytorch_lightning": ("pytorch_lightning", "lightning_ampzero._pl.strategy"),
}


def run_python(code, tmp_path, *, env=None, timeout=300):
    """Run `code` in a fresh interpreter (cwd outside the repo); returns the JSON of its last line."""
    full_env = {k: v for k, v in os.environ.items() if k != OPT_OUT}
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=tmp_path,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.fixture(scope="module")
def pth_active(tmp_path_factory):
    """Fail (never skip) unless the .pth of THIS checkout is active in fresh interpreters."""
    state, _ = run_python(
        """
        import json, sys
        m = sys.modules.get("lightning_ampzero")
        print(json.dumps({"bootstrapped": "lightning_ampzero._bootstrap" in sys.modules,
                          "file": getattr(m, "__file__", None)}))
        """,
        tmp_path_factory.mktemp("pth"),
    )
    if not state["bootstrapped"]:
        pytest.fail(f"lightning_ampzero_strategies.pth is not active in {sys.executable}: {INSTALL_HINT}")
    installed = Path(state["file"]).resolve().parent
    if installed != PACKAGE_DIR:
        pytest.fail(f"the .pth imports lightning_ampzero from {installed}, not from this checkout ({PACKAGE_DIR}): {INSTALL_HINT}")


@pytest.fixture(scope="module", params=sorted(FLAVORS))
def flavor_report(request, pth_active, tmp_path_factory):
    """One fresh interpreter per flavor: import only Lightning, list the names, build a Trainer."""
    flavor = request.param
    package, _ = FLAVORS[flavor]
    other = "pytorch_lightning" if flavor == "lightning" else "lightning.pytorch"
    report, _ = run_python(
        f"""
        import json, sys
        import {package} as L
        from {package}.strategies import ParallelStrategy, StrategyRegistry
        names = {{n: StrategyRegistry[n]["description"] for n in StrategyRegistry if n.startswith("ampzero")}}
        loaded_early = sorted(m for m in ("lightning_ampzero.strategy", "lightning_ampzero._pl.strategy") if m in sys.modules)
        trainer = L.Trainer(strategy="ampzero_stage_3", accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        strategy = trainer.strategy
        from lightning_ampzero._compat import strategy_class
        print(json.dumps({{
            "names": names,
            "trainer": {{
                "loaded_early": loaded_early,
                "module": type(strategy).__module__,
                "is_ours": type(strategy) is strategy_class("{flavor}"),
                "is_framework_strategy": isinstance(strategy, ParallelStrategy),
                "stage": strategy.config.zero.stage,
                "other_lightning_loaded": "{other}" in sys.modules,
            }},
        }}))
        """,
        tmp_path_factory.mktemp(flavor),
    )
    return flavor, report


def test_trainer_resolves_name_without_import(flavor_report):
    """(a), (b): `Trainer(strategy="ampzero_stage_3")` builds our class for that Lightning, loaded lazily."""
    flavor, report = flavor_report
    assert report["trainer"] == {
        "loaded_early": [],  # registration imported nothing of the strategy
        "module": FLAVORS[flavor][1],
        "is_ours": True,
        "is_framework_strategy": True,  # derived from THIS Lightning's base classes
        "stage": 3,
        "other_lightning_loaded": False,  # the two Lightnings are not mixed
    }


def test_all_names_listed(flavor_report):
    _, report = flavor_report
    names = report["names"]
    assert EXPECTED_NAMES <= set(names)
    assert set(names) == set(STRATEGY_VARIANTS)
    assert all(names.values()), "every name has a description"


def test_bootstrap_imports_nothing_heavy(pth_active, tmp_path):
    """The .pth adds exactly two modules to start-up, and neither torch nor Lightning."""
    code = "import json, sys; print(json.dumps(sorted(sys.modules)))"
    with_pth, _ = run_python(code, tmp_path)
    without_pth, _ = run_python(code, tmp_path, env={OPT_OUT: "1"})
    assert set(with_pth) - set(without_pth) == {"lightning_ampzero", "lightning_ampzero._bootstrap"}
    assert not {"torch", "lightning", "pytorch_lightning"} & set(with_pth)


def test_import_order_and_idempotence(tmp_path):
    """Without the .pth: Lightning imported first, then our package registers at once; twice is harmless."""
    result, stderr = run_python(
        """
        import importlib, json, sys
        from lightning.pytorch.strategies import StrategyRegistry
        before = "ampzero" in StrategyRegistry
        import lightning_ampzero
        from lightning_ampzero._registry import register_strategies
        again = register_strategies(StrategyRegistry, "lightning")
        importlib.reload(lightning_ampzero)
        import pytorch_lightning.strategies as pl_strategies  # imported after the hook: registered on import
        finders = sum(bool(getattr(f, "_lightning_ampzero_finder", False)) for f in sys.meta_path)
        print(json.dumps({"before": before, "after": "ampzero" in StrategyRegistry, "again": again,
                          "pl": "ampzero" in pl_strategies.StrategyRegistry, "finders": finders,
                          "real_loader": type(pl_strategies.__spec__.loader).__name__}))
        """,
        tmp_path,
        env={OPT_OUT: "1", "PYTHONPATH": str(PACKAGE_DIR.parent)},
    )
    assert result == {
        "before": False,
        "after": True,
        "again": [],
        "pl": True,
        "finders": 1,
        "real_loader": "SourceFileLoader",
    }
    assert "lightning_ampzero could not register" not in stderr


def test_registration_failure_warns_once_and_never_breaks_import(pth_active, tmp_path):
    result, stderr = run_python(
        """
        import json, sys, types
        broken = types.ModuleType("lightning_ampzero._registry")
        def register_strategies(registry, flavor):
            raise RuntimeError("simulated registry change")
        broken.register_strategies = register_strategies
        sys.modules["lightning_ampzero._registry"] = broken
        import lightning.pytorch, pytorch_lightning
        print(json.dumps("ampzero" in lightning.pytorch.strategies.StrategyRegistry))
        """,
        tmp_path,
    )
    assert result is False
    assert stderr.count("lightning_ampzero could not register") == 1, stderr


def test_pl_copy_pickles_by_reference(pth_active, tmp_path):
    """A spawned rank unpickles the pytorch_lightning copy in a fresh interpreter."""
    result, _ = run_python(
        """
        import json, pickle, subprocess, sys
        from lightning_ampzero._compat import strategy_class
        data = pickle.dumps(strategy_class("pytorch_lightning")(stage=1))
        child = "import pickle, sys; s = pickle.loads(sys.stdin.buffer.read()); print(type(s).__module__, s.config.zero.stage)"
        out = subprocess.run([sys.executable, "-c", child], input=data, capture_output=True, check=True, timeout=300)
        print(json.dumps(out.stdout.decode().split()))
        """,
        tmp_path,
    )
    assert result == ["lightning_ampzero._pl.strategy", "1"]


def test_rewrite_renames_whole_dotted_names_only():
    source = (
        "import lightning.pytorch as pl\n"
        "from lightning.fabric.utilities import rank_zero_info\n"
        "from lightning_ampzero.precision.plugin import AmpZeroPrecision\n"
        "import lightning_ampzero.strategy\n"
        "from lightning_ampzero.strategy_utils import x  # not one of ours\n"
        "from my_lightning.pytorch import y\n"
    )
    assert _compat.rewrite_source(source) == (
        "import pytorch_lightning as pl\n"
        "from lightning_fabric.utilities import rank_zero_info\n"
        "from lightning_ampzero._pl.precision.plugin import AmpZeroPrecision\n"
        "import lightning_ampzero._pl.strategy\n"
        "from lightning_ampzero.strategy_utils import x  # not one of ours\n"
        "from my_lightning.pytorch import y\n"
    )


@pytest.mark.parametrize(
    "line",
    [
        "import lightning as L",
        "from lightning import Trainer",
        "from .config import AmpZeroConfig",
        "from lightning_ampzero.precision import plugin",
    ],
)
def test_rewrite_refuses_imports_it_cannot_rename(line):
    import ast

    tree = ast.parse(_compat.rewrite_source(f"import os\n{line}\n"))
    with pytest.raises(ImportError, match=r"x\.py:2: lightning_ampzero\.strategy has .*absolute"):
        _compat._check_imports(tree, "lightning_ampzero.strategy", "x.py")


def test_rewritten_modules_pass_the_import_check():
    """The lead's two Lightning-facing modules follow the rules of _compat (checked without importing them)."""
    import ast
    import importlib.util

    for name in _compat._REWRITTEN:
        spec = importlib.util.find_spec(name)
        source = _compat.rewrite_source(spec.loader.get_source(name))
        _compat._check_imports(ast.parse(source), name, spec.origin)


def test_public_api_resolves_lazily():
    import importlib.metadata

    import lightning_ampzero

    assert lightning_ampzero.__version__ == importlib.metadata.version("lightning-ampzero")
    for name in lightning_ampzero.__all__:
        assert getattr(lightning_ampzero, name) is not None
        assert name in dir(lightning_ampzero)
    assert lightning_ampzero.AmpZeroStrategy is _compat.strategy_class("lightning")
    assert lightning_ampzero.AmpZeroPrecision is _compat.precision_class("lightning")
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        lightning_ampzero.NoSuchThing
