"""The teaching core stays small enough to read: module and function sizes, and no lab imports."""

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "src" / "tutorial_utils"
MODULES = sorted(CORE.rglob("*.py"))


def _limit(path: Path) -> int:
    return 150 if path.parent.name == "workers" else 250


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(CORE)))
def test_a_core_module_is_short_and_so_are_its_functions(path):
    source = path.read_text()
    assert len(source.splitlines()) <= _limit(path), f"{path.name} is over {_limit(path)} lines"
    tree = ast.parse(source)
    long = [f"{node.name}: {node.end_lineno - node.lineno + 1} lines" for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > 50]
    assert not long, f"{path.name}: functions over 50 lines: {long}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(CORE)))
def test_the_core_never_imports_the_lab(path):
    tree = ast.parse(path.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n == "lab" or n.startswith("lab.")]


def test_the_size_check_sees_the_modules():
    assert len(MODULES) > 30 and any(p.parent.name == "workers" for p in MODULES)
