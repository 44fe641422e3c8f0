"""The layout of python/fastddp stays layered (issue 27): no module imports, directly or
through others, a module that imports it back, counting imports deferred into functions and
those under ``if TYPE_CHECKING``; and no source file grows past 450 lines.

The graph is read from the sources with ``ast``, nothing is imported. ``from X import Y`` is
an edge to module ``X.Y`` where that is a module of the package, else to ``X``; the implicit
import of a module's parent packages is not an edge (a package's ``__init__`` importing its
own modules is how a package is built). Run as a script on another checkout:
``python3 tests/python/test_import_graph.py /path/to/checkout/python``.
"""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = "fastddp"
SOURCE_ROOT = Path(__file__).resolve().parents[2] / "python"
MAX_LINES = 450
# setup.py's extension: a module (a leaf) whether or not it is built in this checkout.
EXTENSIONS = ("fastddp._C",)


def modules(root: Path) -> dict[str, Path]:
    """Every Python module of the package under ``root``, by dotted name."""
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The package's modules that one import statement names."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:  # relative: from the module's own package upwards
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source.split(".")[0] != PACKAGE:
        return []
    return [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
            for alias in node.names]


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its file."""
    found = modules(root)
    known = set(found) | set(EXTENSIONS)
    graph: dict[str, set[str]] = {}
    for name, path in found.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = set()
        for node in ast.walk(tree):
            edges.update(_imported(node, name, path.name == "__init__.py", known))
        graph[name] = {e for e in edges if e in known and e != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None when the graph has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def long_files(root: Path, limit: int = MAX_LINES) -> list[str]:
    return [f"{path.relative_to(root)}: {n} lines" for path in modules(root).values()
            if (n := len(path.read_text().splitlines())) > limit]


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph(SOURCE_ROOT)
    assert len(graph) > 20, sorted(graph)  # the package was found
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_source_file_over_the_limit() -> None:
    assert long_files(SOURCE_ROOT) == []


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize("files, cycle", [
    # A deferred import, a TYPE_CHECKING import and `from package import module`.
    ({"fastddp/__init__.py": "", "fastddp/a.py": "def f():\n    from fastddp import b\n",
      "fastddp/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from fastddp.a import f\n"},
     ["fastddp.a", "fastddp.b", "fastddp.a"]),
    # Through a subpackage's __init__, with a relative import.
    ({"fastddp/__init__.py": "", "fastddp/sub/__init__.py": "from .x import X\n",
      "fastddp/sub/x.py": "import fastddp.sub\nX = 1\n"},
     ["fastddp.sub", "fastddp.sub.x", "fastddp.sub"]),
])
def test_the_checker_finds_a_cycle(tmp_path: Path, files: dict[str, str], cycle: list) -> None:
    _write(tmp_path, files)
    assert find_cycle(import_graph(tmp_path)) == cycle


def test_the_checker_ignores_parent_packages_and_names(tmp_path: Path) -> None:
    # sub.x's parent package fastddp.sub imports it; `from fastddp.sub.x import X` names a
    # value, not a module, so the edge is to sub.x; `import fastddp` from a leaf is fine.
    _write(tmp_path, {"fastddp/__init__.py": "from fastddp.sub import X\n",
                      "fastddp/sub/__init__.py": "from fastddp.sub.x import X\n",
                      "fastddp/sub/x.py": "import torch\nX = 1\n",
                      "fastddp/demo.py": "import fastddp\n"})
    graph = import_graph(tmp_path)
    assert graph["fastddp.sub"] == {"fastddp.sub.x"} and graph["fastddp.sub.x"] == set()
    assert graph["fastddp.demo"] == {"fastddp"} and find_cycle(graph) is None
    (tmp_path / "fastddp/sub/x.py").write_text("X = 1\n" * (MAX_LINES + 1))
    assert long_files(tmp_path) == [f"fastddp/sub/x.py: {MAX_LINES + 1} lines"]


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else SOURCE_ROOT
    found = find_cycle(import_graph(root))
    print("import cycle: " + " -> ".join(found) if found else "no import cycle")
    print("\n".join(long_files(root)) or f"no file over {MAX_LINES} lines")
    sys.exit(1 if found or long_files(root) else 0)
