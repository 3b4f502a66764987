"""grpolab's packages in layers: a package imports only from the layers below its own (imports inside functions
count too). The order follows the pipeline: the math and the options at the bottom, the rollouts above the rewards
and environments they draw through, training above evaluation, the commands on top, and tools/ (the scripts beside
the package) above them all."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import grpolab

ROOT = Path(grpolab.__file__).parent
sys.path.insert(0, str(ROOT.parent / "tools"))
from layer_graph import face_names, module_imports, tool_modules, tool_names  # noqa: E402 - the drawing's reading

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
    ["tools"],  # tools/: the GPU check, the layer drawing, torchrun's batch runner (scripts, not grpolab's package)
]
LAYER_OF = {package: i for i, layer in enumerate(LAYERS) for package in layer}
TOOLS = ROOT.parent / "tools"


def upward_imports(root: Path = ROOT, tools: Path = TOOLS) -> list[str]:
    """Every import of a package from its own layer (another package) or a later one, as 'module -> package'
    (``grpolab.train`` reached after ``import grpolab`` counts as an import of the package it comes from; a module
    of ``tools`` imported by name, as one does with tools/ on ``sys.path``, as an import of ``tools``). tools/'s own
    modules are read too, as the package ``tools``."""
    bad = []
    face, scripts = face_names(root), tool_names(tools)
    modules = [(path, path.relative_to(root).parts) for path in sorted(root.rglob("*.py"))]
    modules += [(path, ("tools", *path.relative_to(tools).parts)) for path in tool_modules(tools)]
    for path, parts in modules:
        if len(parts) < 2:  # grpolab/__init__.py and __main__.py: the package's face, above everything
            continue
        package = parts[0]
        for target in sorted(module_imports(path, face, scripts) - {package}):
            if target in LAYER_OF and LAYER_OF[target] >= LAYER_OF[package]:
                bad.append(f"{'/'.join(parts)} -> {target}")
    return bad


def test_every_package_has_a_layer_and_grpolab_has_no_loose_module():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert packages == set(LAYER_OF) - {"tools"}
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


def private_imports(root: Path = ROOT, tools: Path = TOOLS) -> list[str]:
    """Every ``from grpolab.x import _name`` in grpolab and tools/, and ``from .m import _name`` between tools/'s
    modules: a module reaching into another's private names, as 'module -> x._name'."""
    bad = []
    ours = ("grpolab", *tool_names(tools))  # grpolab's modules and tools/'s, not the standard library's
    paths = [(p, p.relative_to(root).as_posix()) for p in sorted(root.rglob("*.py"))]
    paths += [(p, "tools/" + p.relative_to(tools).as_posix()) for p in tool_modules(tools)]
    for path, name in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            module = node.module or ""
            if node.level == 0 and module.split(".")[0] not in ours:
                continue
            names = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            bad += [f"{name} -> {'.' * node.level}{module.removeprefix('grpolab.')}.{n}" for n in names]
    return bad


def test_no_module_imports_another_s_private_name(tmp_path):
    assert private_imports() == []
    root, tools = tmp_path / "grpolab", tmp_path / "tools"
    (root / "probes").mkdir(parents=True)
    (root / "probes" / "mse.py").write_text("from grpolab.probes.gram import _count_sketch, score_gram\n")
    (tools / "checks").mkdir(parents=True)
    (tools / "checks" / "__init__.py").write_text("")
    (tools / "checks" / "a.py").write_text("from .common import _helper, Check\n")
    (tools / "b.py").write_text("from grpolab.probes.gram import _select\nfrom os import _exit\n")
    (tools / "c.py").write_text("from checks.a import _run\nfrom b import _x\n")
    assert private_imports(root, tools) == [
        "probes/mse.py -> probes.gram._count_sketch",
        "tools/b.py -> probes.gram._select",
        "tools/c.py -> checks.a._run",
        "tools/c.py -> b._x",
        "tools/checks/a.py -> .common._helper",
    ]


def test_tools_may_use_any_package_and_no_package_imports_a_tool(tmp_path):
    """tools/ is the top layer: its scripts import grpolab's packages, commands included; a package that imports a
    script of tools/ by name (as with tools/ on ``sys.path``), or a package of it, is caught."""
    root, tools = tmp_path / "grpolab", tmp_path / "tools"
    for d in (root / "algo", root / "training", tools / "gpu_checks"):
        d.mkdir(parents=True)
    (tools / "gpu_check.py").write_text("import grpolab.commands.cli\nfrom gpu_checks import CHECKS\n")
    (tools / "gpu_checks" / "__init__.py").write_text("from grpolab.trl import GRPOTrainer\n")
    (root / "algo" / "loss.py").write_text("def f():\n    import gpu_check\n")
    (root / "training" / "run.py").write_text("from gpu_checks.common import Check\n")
    assert upward_imports(root, tools) == ["algo/loss.py -> tools", "training/run.py -> tools"]


@pytest.mark.parametrize("package", ["rewards", "env", "probes"])
def test_siblings_of_a_layer_do_not_import_each_other(package, tmp_path):
    (tmp_path / package).mkdir()
    other = next(p for p in ("rewards", "env", "probes") if p != package)
    (tmp_path / package / "m.py").write_text(f"import grpolab.{other}.x\n")
    assert upward_imports(tmp_path) == [f"{package}/m.py -> {other}"]
