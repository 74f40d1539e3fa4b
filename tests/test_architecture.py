"""The layout the project is defined by: imports run protocol <- dispatch <- backends <- rldispatch, never back;
every package's docstring examples run."""
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
