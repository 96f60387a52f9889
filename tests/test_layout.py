"""The package's shape: short functions, a teaching core that stands on its own, no cycles."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "tutorial_utils"
MODULES = sorted(PACKAGE.rglob("*.py"))
# The teaching core: everything but the measuring code and the exercises' solutions.
CORE = [p for p in MODULES if p.relative_to(PACKAGE).parts[0] not in ("bench", "solutions")]


def _imports(path: Path) -> list[str]:
    """The absolute names of the modules ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    here = ["tutorial_utils", *path.relative_to(PACKAGE).with_suffix("").parts]
    if here[-1] == "__init__":
        here.append("")  # a package's own relative imports start from the package itself
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    for n in (n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)):
        base = ".".join(here[:-n.level]) if n.level else ""
        module = ".".join(x for x in (base, n.module or "") if x)
        # `from . import records` imports a module, `from .config import opt` a name of one
        names += [f"{module}.{a.name}" for a in n.names] if n.module is None else [module]
    return names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_functions_fit_on_a_screen(path):
    tree = ast.parse(path.read_text())
    long = [f"{node.name}: {node.end_lineno - node.lineno + 1} lines" for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > 50]
    assert not long, f"{path.name}: functions over 50 lines: {long}"


@pytest.mark.parametrize("path", CORE, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_teaching_core_needs_neither_the_benchmarks_nor_the_book_tooling(path):
    bad = [n for n in _imports(path) if n.startswith(("tutorial_utils.bench",
           "tutorial_utils.solutions")) or n.split(".")[0] in ("tools", "nbtools")]
    assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def test_no_module_imports_itself_back_through_another():
    graph = {}
    for path in MODULES:
        name = ".".join(["tutorial_utils", *path.relative_to(PACKAGE).with_suffix("").parts])
        name = name.removesuffix(".__init__")
        graph[name] = {n for n in _imports(path) if n in {
            ".".join(["tutorial_utils", *p.relative_to(PACKAGE).with_suffix("").parts])
            .removesuffix(".__init__") for p in MODULES} and n != name}

    def reaches(start, goal, seen):
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n}))
                   for n in graph.get(start, ()))

    cycles = sorted(m for m in graph if reaches(m, m, {m}))
    assert not cycles, f"import cycles through {cycles}"


def test_the_checks_see_the_package():
    assert len(MODULES) > 30 and any(p.parent.name == "workers" for p in CORE)
    assert "tutorial_utils.trainer" in _imports(PACKAGE / "train.py")
    assert "tutorial_utils.jsonl" in _imports(PACKAGE / "launch.py")


def test_the_training_step_and_the_models_package_import_nothing_of_the_package():
    # Every chapter and benchmark imports them: whatever they imported would load into all.
    step = [n for n in _imports(PACKAGE / "step.py") if n.startswith("tutorial_utils")]
    assert not step, f"step.py imports {step}; it stands on torch alone"
    assert _imports(PACKAGE / "models" / "__init__.py") == [], "import each network's module"
