"""The package's import graph has no cycles (imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import grpolab

ROOT = Path(grpolab.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the grpolab modules it imports (``from grpolab.x import y`` counts y when y is a module)."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" for a in node.names]
            for t in targets:
                if t.startswith("grpolab"):
                    r = resolve(t)
                    if r and r != m:
                        graph[m].add(r)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_imports_inside_functions():
    g = import_graph()
    assert "grpolab.data.dialogues" in g["grpolab.data.task"]  # imported inside task_data
    assert "grpolab.data.answers" in g["grpolab.rewards.builtin"]


def test_grpolab_has_no_import_cycles():
    assert cycles(import_graph()) == []


def test_answer_parsing_is_a_leaf_and_the_trainer_imports_no_probe():
    g = import_graph()
    assert g["grpolab.data.answers"] == set()
    # the probes watch the step (grpolab.training.observers); the trainer does not know them
    assert not {m for m in g["grpolab.training.trainer"] if m.startswith("grpolab.probes")}
    # environments sit below the trainer: nothing of the trainer's in them
    for m in [m for m in g if m.startswith("grpolab.env")]:
        assert not {"grpolab.training.trainer", "grpolab.rollout.collect", "grpolab.training.update"} & g[m], m
