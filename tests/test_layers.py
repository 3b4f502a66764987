"""grpolab's packages in layers: a package imports only from the layers below its own (imports inside functions
count too). The order follows the pipeline: the math and the options at the bottom, the rollouts above the rewards
and environments they draw through, training above evaluation, the commands on top."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import grpolab

ROOT = Path(grpolab.__file__).parent

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


def _imports(path: Path) -> set[str]:
    """The grpolab packages a module imports (``grpolab.x.y`` -> ``x``; ``from grpolab import x`` -> ``x``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "grpolab" else [f"grpolab.{a.name}" for a in node.names]
        out |= {n.split(".")[1] for n in names if n.startswith("grpolab.")}
    return out


def upward_imports(root: Path = ROOT) -> list[str]:
    """Every import of a package from its own layer (another package) or a later one, as 'module -> package'."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if len(parts) < 2:  # grpolab/__init__.py and __main__.py: the package's face, above everything
            continue
        package = parts[0]
        for target in sorted(_imports(path) - {package}):
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


@pytest.mark.parametrize("package", ["rewards", "env", "probes"])
def test_siblings_of_a_layer_do_not_import_each_other(package, tmp_path):
    (tmp_path / package).mkdir()
    other = next(p for p in ("rewards", "env", "probes") if p != package)
    (tmp_path / package / "m.py").write_text(f"import grpolab.{other}.x\n")
    assert upward_imports(tmp_path) == [f"{package}/m.py -> {other}"]
