"""No import cycles among the project's modules, deferred imports included: an import
inside a function or under ``TYPE_CHECKING`` still ties two modules together, so each one
is an edge of the graph checked here."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder in the checkout -> installed package name (pyproject.toml's package-dir)
FOLDERS = {
    "coevolve": "coevolve",
    "services": "coevolve.services",
    "shared": "coevolve.shared",
    "bench": "coevolve.bench",
}


class Module:
    """One source file under its installed name."""

    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.path = path
        self.is_package = path.name == "__init__.py"
        self.tree = ast.parse(path.read_text(), str(path))

    @property
    def package(self) -> str:
        """The package a relative import of this module starts from."""
        return self.name if self.is_package else self.name.rpartition(".")[0]


def project_modules(root: Path, folders: dict[str, str]) -> dict[str, Module]:
    """Every module of ``folders`` (under ``root``) by installed name."""
    modules: dict[str, Module] = {}
    for folder, package in folders.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            modules[name] = Module(name, path)
    return modules


def source_of(node: ast.ImportFrom, package: str) -> str:
    """The absolute name of the module ``node`` imports from, for code in ``package``."""
    base = node.module or ""
    if not node.level:
        return base
    anchor = package.split(".")
    anchor = anchor[: len(anchor) - node.level + 1]
    return ".".join([*anchor, base] if base else anchor)


def imports_of(module: Module) -> Iterator[tuple[str, list[str]]]:
    """(absolute module named, names taken from it) for every import statement anywhere in
    ``module``; ``import a.b`` takes no names."""
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            yield source_of(node, module.package), [alias.name for alias in node.names]


def reexported_from(package: Module, name: str) -> str | None:
    """The module a package's ``__init__`` takes ``name`` from with a top-level
    ``from M import name``, if it does."""
    for node in package.tree.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return source_of(node, package.package)
    return None


def resolve(modules: dict[str, Module], base: str, name: str | None) -> str | None:
    """The project module ``from base import name`` (or ``import base``) depends on."""
    if name is not None and f"{base}.{name}" in modules:
        return f"{base}.{name}"
    seen: set[str] = set()
    while name is not None and base in modules and modules[base].is_package and base not in seen:
        seen.add(base)
        source = reexported_from(modules[base], name)
        if source is None or source not in modules:
            break
        base = source
    return base if base in modules else None


def import_graph(modules: dict[str, Module]) -> dict[str, set[str]]:
    """Module -> the project modules it imports.

    Python runs ``a/b/__init__.py`` before any ``a.b.c``; that implicit import is no edge
    here, or every package that re-exports a submodule would sit in a cycle with it. An
    explicit ``from a.b import x`` is an edge to the module that defines ``x``: to
    ``a.b.x`` when that is a submodule, to the submodule ``__init__`` re-exports ``x`` from
    when it does, else to ``a.b`` itself, whose own imports then count as its edges.
    """
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for module in modules.values():
        for base, names in imports_of(module):
            for name in names or [None]:
                target = resolve(modules, base, name)
                if target is not None and target != module.name:
                    graph[module.name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def shown(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    edges = [f"  {a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return f"{len(component)} modules:\n" + "\n".join(edges)


def test_the_project_has_no_import_cycles() -> None:
    modules = project_modules(ROOT, FOLDERS)
    assert len(modules) > 150
    graph = import_graph(modules)
    found = cycles(graph)
    assert found == [], "import cycles:\n" + "\n".join(shown(c, graph) for c in found)


@pytest.mark.parametrize(
    ("files", "folders", "edges", "found"),
    [
        pytest.param(
            {
                "pkg/__init__.py": "",
                "pkg/a.py": "from top.pkg.b import g\n",
                "pkg/b.py": "def g():\n    from . import a\n",
                "pkg/c.py": "import typing\nif typing.TYPE_CHECKING:\n    import top.pkg.a\n",
            },
            {"pkg": "top.pkg"},
            {"top.pkg.c": {"top.pkg.a"}},
            [["top.pkg.a", "top.pkg.b"]],
            id="a deferred import closes a cycle",
        ),
        pytest.param(
            {
                "pkg/__init__.py": "from .inner import f\nCONSTANT = 1\n",
                "pkg/inner.py": "def f(): ...\n",
                "pkg/user.py": "from pkg import f\n",
                "pkg/other.py": "from pkg import CONSTANT\nfrom pkg import user\n",
            },
            {"pkg": "pkg"},
            {"pkg.user": {"pkg.inner"}, "pkg.other": {"pkg", "pkg.user"}},
            [],
            id="a re-export is followed to its module",
        ),
    ],
)
def test_the_edges_and_cycles_of_a_small_tree(
    tmp_path: Path,
    files: dict[str, str],
    folders: dict[str, str],
    edges: dict[str, set[str]],
    found: list[list[str]],
) -> None:
    """``files`` written under ``tmp_path`` and read as ``folders`` say: these modules
    import exactly ``edges``' modules, and the graph has the cycles ``found``."""
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    graph = import_graph(project_modules(tmp_path, folders))
    assert {name: graph[name] for name in edges} == edges
    assert cycles(graph) == found
