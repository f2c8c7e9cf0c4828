"""No import cycles inside ``poise``, found statically (nothing is imported); and the package
layers of pyproject.toml's ``[tool.importlinter]`` hold (:func:`test_the_import_contracts_hold`).

Every ``import``/``from ... import`` of a ``poise`` module counts, wherever it stands: at
module level, inside a function (a lazy import only hides a cycle) or under ``if
TYPE_CHECKING:`` (a cycle in the types is still two modules that cannot be read apart).

An edge goes to the module named: ``from poise.x import y`` is an import of the submodule
``poise.x.y`` when there is one, else of ``poise.x`` (its ``__init__``). Importing
``poise.x.y`` also runs ``poise/x/__init__.py`` first, so there is an edge to ``poise.x`` as
well, but only from modules outside ``poise.x``: inside it, the package is already being
initialised, so a package whose ``__init__`` re-exports a child that imports a sibling is
no cycle. A child that imports a name (not a module) from its own package's ``__init__``
is one, and is counted: that name may not be defined yet.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

import poise

ROOT = Path(poise.__file__).parent
Graph = dict[str, dict[str, int]]  # module -> {imported module: line of the first such import}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _named(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> Iterable[str]:
    """The poise modules one import statement names."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in modules:  # ``import poise.x.y`` of a module we know
                name = name.rpartition(".")[0]
            if name:
                yield name
        return
    if node.level:  # relative: from the module's own package, one level up per extra dot
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    if base not in modules:
        return
    for alias in node.names:
        child = f"{base}.{alias.name}"
        yield child if child in modules else base


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> Iterable[str]:
    """The poise modules one import statement runs: those it names, and their packages that do
    not hold ``module`` (see the module docstring)."""
    for name in _named(node, module, is_package, modules):
        yield name
        package = name.rpartition(".")[0]
        while package and not (module == package or module.startswith(package + ".")):
            yield package
            package = package.rpartition(".")[0]


def import_graph(root: Path = ROOT) -> Graph:
    """Every poise module and the poise modules it imports, by parsing the sources under ``root``."""
    paths = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(paths)
    graph: Graph = {}
    for module, path in paths.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _imported(node, module, path.name == "__init__.py", modules):
                    if target != module:
                        edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def describe_cycle(graph: Graph, component: list[str]) -> str:
    """One cycle through the component's first module, as ``a (line 3) -> b (line 9) -> a``."""
    members = set(component)
    start = component[0]
    # breadth-first from start, inside the component, until an edge leads back to start
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    path.reverse()
                    steps = [f"{a} (line {graph[a][b]})" for a, b in zip(path, [*path[1:], start], strict=True)]
                    return " -> ".join([*steps, start])
                if target in members and target not in parents and target != start:
                    parents[target] = node
                    nxt.append(target)
        frontier = nxt
    raise AssertionError(f"{component} is not strongly connected")


def test_no_import_cycles():
    graph = import_graph()
    cycles = [describe_cycle(graph, c) for c in strongly_connected(graph)]
    assert not cycles, "import cycles: " + "; ".join(cycles)



def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "poise" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "poise"


def test_graph_resolves_submodules_relative_and_lazy_imports(tmp_path):
    root = _write(tmp_path, {
        "__init__.py": "",
        "pkg/__init__.py": "from poise.pkg.child import thing\n",
        "pkg/child.py": "from poise import other\nthing = 1\n",
        "pkg/sib.py": "from . import child\nfrom .child import thing\n",
        "other.py": "def f():\n    import poise.leaf.deep\n",
        "leaf/__init__.py": "",
        "leaf/deep.py": "",
        "typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from poise.pkg import sib\n",
    })
    graph = import_graph(root)
    assert graph["poise.pkg"] == {"poise.pkg.child": 1}
    assert graph["poise.pkg.child"] == {"poise.other": 1}
    assert graph["poise.pkg.sib"] == {"poise.pkg.child": 1}
    assert graph["poise.other"] == {"poise.leaf.deep": 2, "poise.leaf": 2}  # leaf's __init__ runs first
    assert graph["poise.typed"] == {"poise.pkg.sib": 3, "poise.pkg": 3}
    # pkg re-exports child, which imports a module outside pkg: no cycle
    assert strongly_connected(graph) == []


@pytest.mark.parametrize(
    ("files", "cycle"),
    [
        # a lazy import back into a package whose __init__ re-exports the importer's module
        ({"pkg/__init__.py": "from poise.pkg.child import thing\n",
          "pkg/child.py": "thing = 1\ndef f():\n    from poise.other import g\n",
          "other.py": "from poise.pkg import thing\n"},
         "poise.other (line 1) -> poise.pkg (line 1) -> poise.pkg.child (line 3) -> poise.other"),
        # user -> pkg.leaf runs pkg/__init__.py, which imports user: a cycle, though nothing names pkg
        ({"pkg/__init__.py": "def f():\n    from poise.user import g\n",
          "pkg/leaf.py": "",
          "user.py": "from poise.pkg.leaf import x\n"},
         "poise.pkg (line 2) -> poise.user (line 1) -> poise.pkg"),
    ],
)
def test_a_cycle_is_named_with_its_lines(tmp_path, files, cycle):
    graph = import_graph(_write(tmp_path, {"__init__.py": "", **files}))
    (component,) = strongly_connected(graph)
    assert describe_cycle(graph, component) == cycle


def test_units_and_the_launch_package_init_import_nothing_from_poise():
    # poise.units is the leaf every layer parses rates with; poise/launch/__init__.py stays empty
    # so that a node's agent importing launch.elastic does not load the cluster job's code too
    graph = import_graph()
    assert graph["poise.units"] == {} and graph["poise.launch"] == {}


def test_the_import_contracts_hold():
    # import-linter (the dev extra) checks pyproject.toml's contracts: each package imports only
    # the layers below it, and only the Session's builder and the CLI import poise.emulate
    lint = Path(sys.executable).parent / "lint-imports"
    assert lint.exists(), f"{lint} is missing: install the dev extra (pip install -e '.[dev]')"
    proc = subprocess.run([str(lint), "--no-cache"], cwd=ROOT.parent, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"lint-imports failed:\n{proc.stdout[-8000:]}{proc.stderr[-2000:]}"
