"""The package layers hold: a package imports only from the packages below it.

Every import counts, including those inside functions (they are dependencies all the same).
The table is the architecture in one place (docs/architecture.md explains each layer). It is
checked here from the source rather than with import-linter because data/, kernels/ and
launch/ are installed as t2train.* from folders outside t2train/, which import-linter's graph
builder cannot see.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = {"t2train": "t2train", "t2train.data": "data", "t2train.kernels": "kernels",
                "t2train.launch": "launch"}

# High to low. A package may import from any package on a lower line; packages on one line are
# independent siblings and may not import each other.
LAYERS = [
    ["t2train.cli"],
    ["t2train.bench", "t2train.export"],
    ["t2train.train"],
    ["t2train.engine"],
    ["t2train.checkpoint", "t2train.monitor"],
    ["t2train.model"],
    ["t2train.parallel"],
    ["t2train.config"],
    ["t2train.residual"],
    ["t2train.nn"],
    ["t2train.kernels"],
]
# Outside the layers: what each may import of t2train (anything may import them).
STANDALONE = {
    "t2train.data": {"t2train.errors", "t2train.compat"},
    "t2train.launch": {"t2train.config", "t2train.errors", "t2train.signals",
                       "t2train.processes"},
    "t2train.signals": {"t2train.errors"},
    "t2train.processes": set(),
    "t2train.errors": set(),
    "t2train.compat": set(),
}
# Deliberate exceptions, each with its reason.
EXCEPTIONS = {
    ("t2train.launch", "t2train.cli"): "`python -m t2train.launch` hands over to the CLI",
}


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in SOURCE_ROOTS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(REPO / folder).with_suffix("").parts
                     if p != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


def _package(module: str) -> str:
    """The layer unit a module belongs to: ``t2train.<first part>``."""
    return ".".join(module.split(".")[:2])


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name == "t2train" or name.startswith("t2train.")}


def _rank(package: str):
    return next((i for i, line in enumerate(LAYERS) if package in line), None)


def _violation(source: str, target: str):
    if source == target or target == "t2train" or (source, target) in EXCEPTIONS:
        return None
    if source in STANDALONE:
        return None if target in STANDALONE[source] else "imports outside what it may use"
    if target in STANDALONE:
        return None
    high, low = _rank(source), _rank(target)
    if low < high:
        return "imports a higher layer"
    if low == high:
        return "imports an independent sibling"
    return None


def test_every_package_has_a_place():
    packages = {_package(module) for module in _modules()} - {"t2train"}
    placed = {p for line in LAYERS for p in line} | set(STANDALONE)
    assert packages - placed == set(), "add the new package to LAYERS or STANDALONE"
    assert placed - packages == set(), "the table names a package that no longer exists"


def test_imports_follow_the_layers():
    broken = []
    for module, path in sorted(_modules().items()):
        for imported in sorted(_imports(path)):
            why = _violation(_package(module), _package(imported))
            if why:
                broken.append(f"{module} -> {imported}: {why}")
    assert broken == [], "\n".join(broken)


def test_the_check_catches_an_upward_import():
    assert _violation("t2train.residual", "t2train.model") == "imports a higher layer"
    assert _violation("t2train.monitor", "t2train.checkpoint") == "imports an independent sibling"
    assert _violation("t2train.data", "t2train.model") == "imports outside what it may use"
    assert _violation("t2train.model", "t2train.residual") is None
