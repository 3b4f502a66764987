"""grpolab's packages in layers: a package imports only from the layers below its own (imports inside functions
count too). The order follows the pipeline: the math and the options at the bottom, the rollouts above the rewards
and environments they draw through, training above evaluation, the commands on top."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import grpolab

ROOT = Path(grpolab.__file__).parent
sys.path.insert(0, str(ROOT.parent / "tools"))
from layer_graph import face_names, module_imports  # noqa: E402 - one reading of imports, the drawing's too

# Lowest first. A package may import from the layers listed before its own, never from its own layer's other
# packages or from later layers.
LAYERS = [
    ["common"],  # errors, random streams and state, devices, processes, progress, loading by name, token batches
    ["algo"],  # advantages, losses, corrections, group budgets: pure math
    ["config"],  # every command's options, in sections, and their checks (knows algo's choices)
    ["data", "sandbox"],  # the task's records; programs run in isolation
    ["vision"],  # vision-language models: a row's images beside its tokens, one adapter per family
    ["models"],  # models and policies (their prompts come from records), log-probs, checkpoints
    ["rewards", "env", "probes"],  # scoring; environments and tools; the gradient's measurements
    ["rollout"],  # engines, episodes, the rollout service, the collector
    ["eval", "doctor"],  # held-out accuracy, reading a run directory; the doctor's checks of a run's metrics
    ["training"],  # the trainer, the update, the run around the steps
    ["report"],  # the report page, plots, the token view
    ["analysis"],  # the offline probes (rank, mse, groupsize, multiturn, sweep, theory)
    ["commands"],  # the command line, the Python API, Python objects in place of names
    ["trl"],  # TRL's GRPOConfig and GRPOTrainer over the Python API
]
LAYER_OF = {package: i for i, layer in enumerate(LAYERS) for package in layer}


def upward_imports(root: Path = ROOT) -> list[str]:
    """Every import of a package from its own layer (another package) or a later one, as 'module -> package'
    (``grpolab.train`` reached after ``import grpolab`` counts as an import of the package it comes from)."""
    bad = []
    face = face_names(root)
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if len(parts) < 2:  # grpolab/__init__.py and __main__.py: the package's face, above everything
            continue
        package = parts[0]
        for target in sorted(module_imports(path, face) - {package}):
            if target in LAYER_OF and LAYER_OF[target] >= LAYER_OF[package]:
                bad.append(f"{'/'.join(parts)} -> {target}")
    return bad


def test_every_package_has_a_layer_and_grpolab_has_no_loose_module():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert packages == set(LAYER_OF)
    modules = {p.name for p in ROOT.glob("*.py")}
    assert modules == {"__init__.py", "__main__.py"}


def test_imports_run_down_the_layers():
    assert upward_imports() == []


def test_an_upward_import_is_caught(tmp_path):
    """The check itself: a module of a low layer that imports a higher one is named."""
    (tmp_path / "algo").mkdir()
    (tmp_path / "algo" / "loss.py").write_text("def f():\n    from grpolab.training.trainer import GRPOTrainer\n")
    (tmp_path / "training").mkdir()
    (tmp_path / "training" / "trainer.py").write_text("from grpolab.algo.loss import f\n")
    assert upward_imports(tmp_path) == ["algo/loss.py -> training"]


def test_an_attribute_of_grpolab_reached_after_import_grpolab_is_an_import(tmp_path):
    """``import grpolab`` then ``grpolab.train(...)`` uses the package ``train`` comes from (here commands), and
    ``grpolab.training.x`` the package named: a low layer doing either is caught."""
    (tmp_path / "__init__.py").write_text(
        "def __getattr__(name):\n    if name in ('train',):\n        from grpolab.commands import api\n"
    )
    (tmp_path / "algo").mkdir()
    (tmp_path / "algo" / "loss.py").write_text("import grpolab\n\ndef f():\n    return grpolab.train(steps=1)\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "rows.py").write_text("import grpolab\n\ng = grpolab.training.recipe\n")
    assert upward_imports(tmp_path) == ["algo/loss.py -> commands", "data/rows.py -> training"]


def private_imports(root: Path = ROOT) -> list[str]:
    """Every ``from grpolab.x import _name`` in grpolab: a module reaching into another's private names, as
    'module -> x._name'."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("grpolab"):
                names = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                bad += [f"{path.relative_to(root)} -> {node.module.removeprefix('grpolab.')}.{n}" for n in names]
    return bad


def test_no_module_imports_another_s_private_name(tmp_path):
    assert private_imports() == []
    (tmp_path / "probes").mkdir()
    (tmp_path / "probes" / "mse.py").write_text("from grpolab.probes.gram import _count_sketch, score_gram\n")
    assert private_imports(tmp_path) == ["probes/mse.py -> probes.gram._count_sketch"]


@pytest.mark.parametrize("package", ["rewards", "env", "probes"])
def test_siblings_of_a_layer_do_not_import_each_other(package, tmp_path):
    (tmp_path / package).mkdir()
    other = next(p for p in ("rewards", "env", "probes") if p != package)
    (tmp_path / package / "m.py").write_text(f"import grpolab.{other}.x\n")
    assert upward_imports(tmp_path) == [f"{package}/m.py -> {other}"]
