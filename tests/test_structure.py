"""The shape of the code, checked: options in sections of a readable size, functions that fit on a screen, a
training step read in one pass, builders that take the sections they need, option names written once."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
from pathlib import Path

import grpolab
from grpolab.config import fields
from grpolab.config.train import TrainConfig

ROOT = Path(grpolab.__file__).parent
REPO = ROOT.parent
SCRIPT_FOLDERS = ("benchmarks", "tools")  # run from the checkout, never imported by grpolab: the same size limits
MAX_FIELDS, MAX_FUNCTION, MAX_STEP = 25, 60, 40
MAX_FILE, MAX_CLASS = 600, 450
ROLLOUT_FILE, ROLLOUT_CLASS = 500, 300  # the engines and the wire: one side, one stage per file


def _modules():
    for info in pkgutil.walk_packages(grpolab.__path__, "grpolab."):
        if not info.name.endswith("__main__"):  # runs the command line
            yield importlib.import_module(info.name)


def _trees():
    for path in sorted(ROOT.rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text())


def _is_python_script(path: Path) -> bool:
    """A file without a suffix that runs as Python: its shebang names python (tools/as-cpu is bash)."""
    with open(path, "rb") as f:
        first = f.readline(200)
    return first.startswith(b"#!") and b"python" in first


def _scripts():
    """Every Python file under benchmarks/ and tools/, in subfolders too, with the extension-less Python scripts."""
    for folder in SCRIPT_FOLDERS:
        for path in sorted((REPO / folder).rglob("*")):
            if path.is_file() and (path.suffix == ".py" or (not path.suffix and _is_python_script(path))):
                yield path


def _sized_trees():
    """What the size limits read: grpolab's modules and the scripts of benchmarks/ and tools/, each named by its path
    from the repository root (``grpolab/rollout/wire.py``, ``benchmarks/stale_gradient.py``)."""
    for path, tree in _trees():
        yield f"grpolab/{path}", tree
    for path in _scripts():
        yield path.relative_to(REPO).as_posix(), ast.parse(path.read_text(), filename=str(path))


TRL_CONFIGS = (
    "grpolab.trl.config.GRPOConfig",
    "grpolab.trl.rloo_config.RLOOConfig",
    "grpolab.trl.distillation_config.DistillationConfig",
)  # TRL's 189, 163 and 149 fields


def test_no_dataclass_has_more_than_25_fields():
    big = [
        f"{module.__name__}.{name}: {len(dataclasses.fields(obj))}"
        for module in _modules()
        for name, obj in vars(module).items()
        if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__
        if len(dataclasses.fields(obj)) > MAX_FIELDS
        if f"{module.__name__}.{name}" not in TRL_CONFIGS
    ]
    assert big == []


def _code_lines(node: ast.AST) -> int:
    """A function's or class's lines, less its own docstring's (an ``Args:``/``Returns:`` docstring grows with the
    signature, not the code)."""
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if ast.get_docstring(node) is not None and len(node.body) > 1:
        lines -= first.end_lineno - first.lineno + 1
    return lines


def test_no_function_is_longer_than_60_lines():
    long = [
        f"{path}:{node.lineno} {node.name} ({_code_lines(node)} lines)"
        for path, tree in _sized_trees()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        if _code_lines(node) > MAX_FUNCTION
    ]
    assert long == []


def test_files_and_classes_are_short_enough_to_read_in_one_sitting():
    """At most 600 lines a file and 450 a class, benchmarks/ and tools/ included; in grpolab/rollout/, 500 and 300
    (docstrings of classes count)."""
    big = []
    for path, tree in _sized_trees():
        rollout = path.startswith("grpolab/rollout/")
        lines = len((REPO / path).read_text().splitlines())
        if lines > (ROLLOUT_FILE if rollout else MAX_FILE):
            big.append(f"{path}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                if size > (ROLLOUT_CLASS if rollout else MAX_CLASS):
                    big.append(f"{path}:{node.lineno} {node.name}: {size} lines")
    assert big == []


def test_the_size_limits_read_the_benchmarks_and_tools_too(tmp_path):
    paths = {path for path, _ in _sized_trees()}
    for folder in ("grpolab/rollout/", "benchmarks/", "benchmarks/trl_dropin/", "tools/", "tools/gpu_checks/"):
        assert any(p.startswith(folder) for p in paths), folder
    assert "tools/as-cpu" not in paths  # a bash script
    (tmp_path / "py").write_text("#!/usr/bin/env python3\nprint(1)\n")
    (tmp_path / "sh").write_text("#!/usr/bin/env bash\necho 1\n")
    assert [_is_python_script(tmp_path / n) for n in ("py", "sh")] == [True, False]


def test_a_training_step_is_at_most_40_lines():
    from grpolab.training.trainer import GRPOTrainer

    assert len(inspect.getsource(GRPOTrainer.step).splitlines()) <= MAX_STEP


def test_builders_below_training_take_sections_not_the_training_config():
    """A parameter typed TrainConfig only where a whole run is assembled: the trainer and its run, a sweep of
    runs, the commands."""
    assembling = ("training/", "analysis/sweep.py", "commands/", "config/")
    whole = [
        f"{path}:{node.lineno} {node.name}({arg.arg})"
        for path, tree in _trees()
        if not path.startswith(assembling)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for arg in node.args.args + node.args.kwonlyargs
        if arg.annotation is not None and "TrainConfig" in ast.unparse(arg.annotation)
    ]
    assert whole == []


def _option_name_lists(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines of list, tuple or set literals (or dict keys) of three or more strings, every one an option's name."""
    hits = []
    for node in ast.walk(tree):
        items = node.elts if isinstance(node, (ast.List, ast.Tuple, ast.Set)) else None
        if isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        if not items or len(items) < 3:
            continue
        if all(isinstance(i, ast.Constant) and isinstance(i.value, str) for i in items):
            if all(i.value in names for i in items):
                hits.append(node.lineno)
    return hits


def test_no_list_of_option_names_outside_the_config_package():
    names = set(fields.options(TrainConfig))
    lists = [
        f"{path}:{line}"
        for path, tree in _trees()
        # grpolab.trl is the table of TRL's fields and the options each becomes: it names them by design
        if not path.startswith(("config/", "trl/"))
        for line in _option_name_lists(tree, names)
    ]
    assert lists == []


def test_the_option_name_check_finds_a_list():
    tree = ast.parse('RESUME_MUST_MATCH = ("seed", "group_size", "lr")\nOTHER = ("a", "b", "c")\n')
    assert _option_name_lists(tree, set(fields.options(TrainConfig))) == [1]
