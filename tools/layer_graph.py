"""Draw grpolab's package graph from its code: one box per package, placed by layer (the longest chain of imports
below it), one arrow per package it imports (imports inside functions count), and the modules each holds. The
scripts in tools/ are one box more, ``tools``: they may use any package, and no package may import them.

    python tools/layer_graph.py docs/layers.png

The layers are derived, not listed: a package sits one row above the highest package it imports. The order that
tests/test_layers.py states is the same order read top to bottom.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "grpolab"
TOOLS = ROOT.parent / "tools"


def face_names(root: Path = ROOT) -> dict[str, str]:
    """The names ``grpolab/__init__.py`` hands out as ``grpolab.NAME`` (its lazy ``__getattr__``), each with the
    package it takes them from: ``grpolab.train`` is ``commands``'s."""
    init = root / "__init__.py"
    out: dict[str, str] = {}
    if not init.is_file():
        return out
    for node in ast.walk(ast.parse(init.read_text())):
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)):
            continue
        names = [e.value for e in getattr(node.test.comparators[0], "elts", []) if isinstance(e, ast.Constant)]
        for inner in ast.walk(node):
            if isinstance(inner, ast.ImportFrom) and inner.module and inner.module.startswith("grpolab"):
                package = inner.module.split(".")[1] if "." in inner.module else inner.names[0].name
                out |= dict.fromkeys(names, package)
    return out


def tool_names(tools: Path = TOOLS) -> set[str]:
    """What a module imports from tools/ when tools/ is on ``sys.path``: its scripts and packages by name."""
    if not tools.is_dir():
        return set()
    return {p.stem for p in tools.glob("*.py")} | {d.name for d in tools.iterdir() if (d / "__init__.py").is_file()}


def tool_modules(tools: Path = TOOLS) -> list[Path]:
    """Every Python file of tools/, its packages' too."""
    return sorted(p for p in tools.rglob("*.py") if "__pycache__" not in p.parts) if tools.is_dir() else []


def module_imports(path: Path, face: dict[str, str] | None = None, tools: set[str] = frozenset()) -> set[str]:
    """The grpolab packages the module at ``path`` uses: ``import grpolab.x.y`` and ``from grpolab.x import y``
    (-> ``x``), ``from grpolab import x``, and ``grpolab.x`` or ``grpolab.NAME`` reached as an attribute after
    ``import grpolab`` (``face``: :func:`face_names`); and ``tools`` if it imports one of the names in ``tools``
    (:func:`tool_names`)."""
    face = face or {}
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "grpolab" else [f"grpolab.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "grpolab":
            names = [f"grpolab.{face.get(node.attr, node.attr)}"]
        out |= {n.split(".")[1] for n in names if n.startswith("grpolab.")}
        if any(n.split(".")[0] in tools for n in names):
            out.add("tools")
    return {p for p in out if not p.startswith("_")}  # not grpolab.__file__, grpolab.__version__


def package_graph(root: Path = ROOT, tools: Path = TOOLS) -> tuple[dict[str, set[str]], dict[str, list[str]]]:
    """package -> the grpolab packages its modules import, and package -> its modules' names; tools/ as the package
    ``tools``."""
    graph: dict[str, set[str]] = {}
    modules: dict[str, list[str]] = {}
    face = face_names(root)
    packages = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
    for path in tool_modules(tools):
        graph.setdefault("tools", set()).update(module_imports(path, face) & packages)
        name = path.relative_to(tools).as_posix().removesuffix(".py").removesuffix("/__init__")
        if "/" not in name:  # a script or a package, not each of a package's modules
            modules.setdefault("tools", []).append(name)
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if len(parts) < 2:
            continue
        package = parts[0]
        graph.setdefault(package, set())
        name = "/".join(parts[1:]).removesuffix(".py")
        if name != "__init__":
            modules.setdefault(package, []).append(name.removesuffix("/__init__"))
        graph[package] |= (module_imports(path, face, tool_names(tools)) & (packages | {"tools"})) - {package}
    return graph, modules


def layers(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each package's row: 0 for one that imports no other, else one above the highest it imports."""
    row: dict[str, int] = {}

    def visit(p: str, seen: tuple[str, ...] = ()) -> int:
        if p in seen:
            raise ValueError(f"import cycle: {' -> '.join((*seen, p))}")
        if p not in row:
            row[p] = 1 + max((visit(q, (*seen, p)) for q in graph[p] if q in graph), default=-1)
        return row[p]

    for p in graph:
        visit(p)
    return row


def draw(out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    graph, modules = package_graph()
    row = layers(graph)
    height = max(row.values()) + 1
    by_row: dict[int, list[str]] = {}
    for p in sorted(graph, key=lambda p: (row[p], p)):
        by_row.setdefault(row[p], []).append(p)
    fig, ax = plt.subplots(figsize=(15, 1.5 * height + 1))
    pos = {}
    for r, packages in by_row.items():
        for i, p in enumerate(packages):
            pos[p] = ((i + 1) / (len(packages) + 1), r)
    for p, targets in graph.items():
        for q in targets:
            (x0, y0), (x1, y1) = pos[p], pos[q]
            ax.annotate("", xy=(x1, y1 + 0.22), xytext=(x0, y0 - 0.22),
                        arrowprops=dict(arrowstyle="-|>", mutation_scale=9, color="0.6", lw=0.7, shrinkA=2, shrinkB=2))  # fmt: skip
    for p, (x, y) in pos.items():
        names = ", ".join(modules.get(p, []))
        wrapped = "\n".join(names[i : i + 42] for i in range(0, len(names), 42))
        ax.text(x, y, f"{p}\n", ha="center", va="bottom", fontsize=11, weight="bold",
                bbox=dict(boxstyle="round,pad=0.3", fc="#e8f0fe", ec="#3367d6"))  # fmt: skip
        ax.text(x, y - 0.05, wrapped, ha="center", va="top", fontsize=6.5, color="0.25")
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.8, height - 0.3)
    ax.axis("off")
    ax.set_title(
        "grpolab's packages and tools/: each imports only from the rows below it (arrows: imports)", fontsize=12
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}: {len(graph)} packages in {height} layers")


if __name__ == "__main__":
    draw(sys.argv[1] if len(sys.argv) > 1 else "docs/layers.png")
