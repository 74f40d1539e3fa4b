"""The layout the project is defined by: imports run protocol <- dispatch <- backends <- rldispatch, never back;
no two modules import each other, however indirectly; every package's docstring examples run."""
from __future__ import annotations

import ast
import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "dispatch", "backends", "rldispatch")
# what each package may import from the project (itself included)
ALLOWED = {
    "protocol": {"protocol"},
    "dispatch": {"protocol", "dispatch"},
    "backends": {"protocol", "dispatch", "backends"},
    "rldispatch": set(PACKAGES),
}


def _project_imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level project package) of every import in a file, function-level imports included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, n.split(".")[0]) for n in names if n.split(".")[0] in PACKAGES]
    return found


def test_no_import_runs_against_the_layering():
    bad = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for line, target in _project_imports(path):
                if target not in ALLOWED[package]:
                    bad.append(f"{path.relative_to(REPO)}:{line} imports {target}")
    assert not bad, "imports against protocol <- dispatch <- backends <- rldispatch:\n" + "\n".join(bad)


def test_the_layering_check_sees_function_level_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\n\ndef g():\n    from backends.base import Engine\n    import dispatch.plan\n")
    assert _project_imports(f) == [(4, "backends"), (5, "dispatch")]


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> the project modules it imports (function-level and relative imports included).

    An import names its module: ``from a.b import c`` is an edge to ``a.b.c`` where that is a module, else to ``a.b``.
    The parent packages Python initialises on the way are not edges: a package's ``__init__`` importing its own
    submodules, which import one another by full name, is the usual layout, not a cycle."""
    files = {_module_name(root, p): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in files.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {known(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]).strip(".") if node.level \
                    else node.module or ""
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else known(base) for a in node.names}
        graph[name] = targets - {None, name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def test_no_import_cycle_among_the_project_modules():
    cycles = _cycles(_import_graph(REPO, PACKAGES))
    assert not cycles, "modules that import each other (move what they share to where it belongs):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_cycle_check_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from p import a\n")  # a package importing its submodule: no cycle
    (pkg / "a.py").write_text("import p.b\n")
    (pkg / "b.py").write_text("def f():\n    from p.sub.c import X\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import a\nX = 1\n")
    (pkg / "d.py").write_text("from p.sub import c\nimport os\n")
    graph = _import_graph(tmp_path, ("p",))
    assert graph == {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p.sub.c"}, "p.sub": set(), "p.sub.c": {"p.a"},
                     "p.d": {"p.sub.c"}}
    assert _cycles(graph) == [["p.a", "p.b", "p.sub.c"]]
    (pkg / "sub" / "c.py").write_text("X = 1\n")
    assert _cycles(_import_graph(tmp_path, ("p",))) == []


def _modules(package: str) -> list[str]:
    pkg = importlib.import_module(package)
    return [package] + [m.name for m in pkgutil.walk_packages(pkg.__path__, prefix=f"{package}.")
                        if not m.name.endswith("__main__")]


@pytest.mark.parametrize("package", PACKAGES)
def test_docstring_examples_of_every_package(package):
    attempted, failures = 0, []
    for name in _modules(package):
        result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
        attempted += result.attempted
        if result.failed:
            failures.append(f"{name}: {result.failed} of {result.attempted} examples failed")
    assert not failures, "\n".join(failures)
    assert attempted > 0, f"{package} has no runnable docstring example"
