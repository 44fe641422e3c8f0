"""The layout of python/fastddp stays layered (issue 27): no module imports, directly or
through others, a module that imports it back, counting imports deferred into functions and
those under ``if TYPE_CHECKING``. The packages (issue 53): none imports another's private modules or names (a name with a leading
underscore, or anything under one), the shared foundation aside (FOUNDATION), and no
package imports, directly or through others, a package that imports it back. The DDP core
(CORE) reaches, directly or through others, nothing but itself and the foundation: the extras
are built on it, never under it.

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
# setup.py's extension: a module (a leaf) whether or not it is built in this checkout.
EXTENSIONS = ("fastddp._C",)
# The shared foundation under the packages: the extension and the top-level helpers, which
# every package may use (private by name, as they are no user's API).
FOUNDATION = ("fastddp._C", "fastddp._group_ops", "fastddp._compat", "fastddp._build",
              "fastddp._libstdcxx")
# The DDP core (issue 53): the class and the hooks. The extras (tuning, launch, diloco,
# integrations, selfcheck, link) use it through its public names.
CORE = ("fastddp.ddp", "fastddp.hooks")


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


def subpackages(names) -> set[str]:
    """The package's subpackages (``fastddp.hooks``) among dotted module names: those with
    modules under them."""
    return {".".join(n.split(".")[:2]) for n in names if n.count(".") >= 2}


def package_of(module: str, subs: set[str]) -> str:
    """``fastddp.hooks`` for ``fastddp.hooks._auto`` (``subs``: subpackages()); the root
    ``fastddp`` for its own top-level modules (``fastddp.__main__``, ``fastddp._C``)."""
    head = ".".join(module.split(".")[:2])
    return head if head in subs else PACKAGE


def _private(dotted: str) -> bool:
    """A module or name under another package with a leading underscore anywhere below the
    package (``fastddp.hooks._auto``, ``fastddp.launch.patch._set_ddp_names``), outside the
    foundation."""
    if any(dotted == f or dotted.startswith(f + ".") for f in FOUNDATION):
        return False
    return any(part.startswith("_") and not part.startswith("__")
               for part in dotted.split(".")[1:])


def private_imports(root: Path) -> list[str]:
    """``module: name`` for every private module or name of another package that a module
    imports (``from X import _y``, ``import X._y``, or ``alias._y`` on a module imported as
    ``alias``), deferred imports included."""
    found = modules(root)
    subs = subpackages(found)
    bad = []
    for name, path in found.items():
        own = package_of(name, subs)

        def check(dotted: str) -> None:
            if package_of(dotted, subs) != own and _private(dotted):
                bad.append(f"{name}: {dotted}")

        tree = ast.parse(path.read_text(), filename=str(path))
        aliases: dict[str, str] = {}  # local name -> the dotted module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == PACKAGE:
                        aliases[a.asname or PACKAGE] = a.name if a.asname else PACKAGE
                        check(a.name)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module and \
                    node.module.split(".")[0] == PACKAGE:
                for a in node.names:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    check(f"{node.module}.{a.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in aliases:
                check(f"{aliases[node.value.id]}.{node.attr}")
    return sorted(set(bad))


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the other packages its modules import. The root package is left out: its
    ``__init__`` imports every package (that is how the package is built), and a module that
    imports ``fastddp`` uses the product's public API as a user does."""
    subs = subpackages(graph)
    packages: dict[str, set[str]] = {}
    for module, edges in graph.items():
        own = package_of(module, subs)
        if own == PACKAGE:
            continue
        packages.setdefault(own, set()).update(
            p for e in edges if (p := package_of(e, subs)) not in (own, PACKAGE)
            and e not in FOUNDATION)
    return packages


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph(SOURCE_ROOT)
    assert len(graph) > 20, sorted(graph)  # the package was found
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_package_imports_another_packages_private_names() -> None:
    assert private_imports(SOURCE_ROOT) == []


def test_no_package_imports_a_package_that_imports_it_back() -> None:
    graph = import_graph(SOURCE_ROOT)
    packages = package_graph(graph)
    assert {"fastddp.ddp", "fastddp.hooks", "fastddp.launch", "fastddp.diloco"} <= set(packages)
    cycle = find_cycle(packages)
    assert cycle is None, "packages in a circle: " + " -> ".join(cycle)


def reached_from(graph: dict[str, set[str]], starts: tuple[str, ...]) -> set[str]:
    """The modules that the modules under ``starts`` import, directly or through others."""
    stack = [m for m in graph if m.startswith(starts)]
    seen: set[str] = set()
    while stack:
        for name in graph.get(stack.pop(), ()):
            if name not in seen:
                seen.add(name)
                stack.append(name)
    return seen


def test_the_core_imports_no_extra() -> None:
    graph = import_graph(SOURCE_ROOT)
    reached = reached_from(graph, CORE)
    assert "fastddp.hooks.catalog" in reached  # the core's own imports were followed
    outside = sorted(m for m in reached
                     if not m.startswith(CORE) and not m.startswith(FOUNDATION))
    assert outside == []


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


def test_the_checker_finds_private_imports_and_package_circles(tmp_path: Path) -> None:
    # b imports a's private module, a private name, and reaches one through an alias; a's
    # own modules may use each other's private names; the foundation is anyone's. a imports
    # b through one module and b imports a through another: a circle of packages, though
    # no module circle.
    _write(tmp_path, {"fastddp/__init__.py": "", "fastddp/_group_ops.py": "",
                      "fastddp/a/__init__.py": "", "fastddp/a/_impl.py": "def _f(): pass\n",
                      "fastddp/a/api.py": "from fastddp.a._impl import _f\n"
                                          "from fastddp.b.top import T\n_g = 1\n",
                      "fastddp/b/__init__.py": "",
                      "fastddp/b/top.py": "from fastddp import _group_ops\nT = 1\n",
                      "fastddp/b/other.py": "from fastddp.a import _impl\n"
                                            "from fastddp.a.api import _f\n"
                                            "import fastddp.a.api as api\n"
                                            "def g():\n    return api._g\n"})
    assert private_imports(tmp_path) == ["fastddp.b.other: fastddp.a._impl",
                                         "fastddp.b.other: fastddp.a.api._f",
                                         "fastddp.b.other: fastddp.a.api._g"]
    graph = import_graph(tmp_path)
    assert find_cycle(graph) is None
    assert find_cycle(package_graph(graph)) == ["fastddp.a", "fastddp.b", "fastddp.a"]


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else SOURCE_ROOT
    found = find_cycle(import_graph(root))
    print("import cycle: " + " -> ".join(found) if found else "no import cycle")
    private = private_imports(root)
    print("\n".join(private) or "no private import across packages")
    circle = find_cycle(package_graph(import_graph(root)))
    print("packages in a circle: " + " -> ".join(circle) if circle else "no package circle")
    sys.exit(1 if found or private or circle else 0)
