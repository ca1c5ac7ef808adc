"""The package layers hold: a package imports only from the packages below it.

Every import counts, in every form: inside functions, relative (``from ..model import gpt``),
of a submodule through its package (``from t2train import model``), and by name in a string
(``importlib.import_module("t2train.train.loop")``, or a table of module names that the
registry and the kernel dispatch import on first use: any string that names a t2train module
is an import of it). An import of a standalone package (``launch``, ``data``, ...) counts with
everything that package reaches, so a higher layer cannot be routed through one.

The table is the architecture in one place (docs/architecture.md explains each layer). It is
checked here from the source rather than with import-linter because data/, kernels/ and
launch/ are installed as t2train.* from folders outside t2train/, which import-linter's graph
builder cannot see. The collectors are tested on planted violations at the end.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = {
    "t2train": "t2train",
    "t2train.data": "data",
    "t2train.kernels": "kernels",
    "t2train.launch": "launch",
}

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
# Outside the layers: what each may import of t2train (anything may import them, and then
# counts as importing what they reach).
STANDALONE = {
    "t2train.data": {"t2train.errors", "t2train.compat"},
    "t2train.launch": {
        "t2train.config",
        "t2train.errors",
        "t2train.signals",
        "t2train.processes",
        "t2train.ports",
        "t2train.run_lock",
    },
    "t2train.signals": {"t2train.errors"},
    "t2train.run_lock": {"t2train.errors"},
    "t2train.processes": set(),
    "t2train.ports": set(),
    "t2train.errors": set(),
    "t2train.version": set(),
    "t2train.compat": set(),
}
# Deliberate exceptions, each with its reason.
EXCEPTIONS = {
    ("t2train.launch", "t2train.cli"): "`python -m t2train.launch` hands over to the CLI",
}


def _modules(repo: Path = REPO) -> dict[str, Path]:
    """Module name -> source file, for every module of every source root under ``repo``."""
    modules = {}
    for package, folder in SOURCE_ROOTS.items():
        for path in (repo / folder).rglob("*.py"):
            parts = [
                p for p in path.relative_to(repo / folder).with_suffix("").parts if p != "__init__"
            ]
            modules[".".join([package, *parts])] = path
    return modules


def _package(module: str) -> str:
    """The layer unit a module belongs to: ``t2train.<first part>``."""
    return ".".join(module.split(".")[:2])


def _absolute(node: ast.ImportFrom, module: str, path: Path) -> str:
    """The absolute module an ``from X import ...`` names, resolving relative levels."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _named_module(text: str, known: set[str]):
    """The t2train module a string names (``a.b.c`` or ``a.b.c:attribute``), or None."""
    name = text.partition(":")[0]
    return name if name in known else None


def _run_as_programs(tree: ast.AST) -> set[int]:
    """ids of the strings that follow ``"-m"`` in a command list: a module run in a child
    process (``[sys.executable, "-m", "t2train.cli", ...]``) shares nothing with its caller
    but the command line, so it is not an import."""
    programs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)):
            for flag, name in zip(node.elts, node.elts[1:]):
                if isinstance(flag, ast.Constant) and flag.value == "-m":
                    programs.add(id(name))
    return programs


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    """Every t2train module ``module`` (at ``path``) imports, in any form."""
    names = set()
    tree = ast.parse(path.read_text())
    programs = _run_as_programs(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, path)
            names.add(source)
            # ``from t2train import model`` imports the submodule t2train.model
            names.update(
                f"{source}.{alias.name}"
                for alias in node.names
                if f"{source}.{alias.name}" in known
            )
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in programs
        ):
            named = _named_module(node.value, known)
            if named:
                names.add(named)
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


def _package_graph(repo: Path = REPO) -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> the 'module -> module' lines that make the edge."""
    modules = _modules(repo)
    known = set(modules)
    graph: dict[str, dict[str, list[str]]] = {}
    for module, path in sorted(modules.items()):
        for imported in sorted(_imports(path, module, known)):
            edges = graph.setdefault(_package(module), {})
            edges.setdefault(_package(imported), []).append(f"{module} -> {imported}")
    return graph


def _reach(graph: dict, start: str) -> set[str]:
    """Every package ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for target in graph.get(todo.pop(), {}):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def _violations(repo: Path = REPO) -> list[str]:
    graph = _package_graph(repo)
    broken = []
    for source, targets in sorted(graph.items()):
        for target, lines in sorted(targets.items()):
            why = _violation(source, target)
            if why:
                broken += [f"{line}: {why}" for line in lines]
            elif target in STANDALONE and source not in STANDALONE:
                for beyond in sorted(_reach(graph, target) - {source, target}):
                    why = _violation(source, beyond)
                    if why:
                        broken += [f"{line}: {why} ({beyond}) through {target}" for line in lines]
    return broken


def test_every_package_has_a_place():
    packages = {_package(module) for module in _modules()} - {"t2train"}
    placed = {p for line in LAYERS for p in line} | set(STANDALONE)
    assert packages - placed == set(), "add the new package to LAYERS or STANDALONE"
    assert placed - packages == set(), "the table names a package that no longer exists"


def test_imports_follow_the_layers():
    broken = _violations()
    assert broken == [], "\n".join(broken)


def _tool_imports(path: Path) -> list[str]:
    """``path``'s imports of the checkout's tools (``tools.*``), in any import form."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = (
            [node.module or ""]
            if isinstance(node, ast.ImportFrom) and node.level == 0
            else [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else []
        )
        found += [
            f"{path}:{node.lineno}: {name}" for name in names if name.split(".")[0] == "tools"
        ]
    return found


def test_the_package_does_not_import_the_checkouts_tools(tmp_path):
    """tools/ (the GPU check) is not installed: an installed module that imported it would
    fail outside a checkout. Tools import the package, never the other way round."""
    found = [line for path in _modules().values() for line in _tool_imports(path)]
    assert found == [], "\n".join(found)
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from tools.gpu_check import plan\nimport tools\n")
    assert len(_tool_imports(planted)) == 2


def test_the_check_catches_an_upward_import():
    assert _violation("t2train.residual", "t2train.model") == "imports a higher layer"
    assert _violation("t2train.monitor", "t2train.checkpoint") == "imports an independent sibling"
    assert _violation("t2train.data", "t2train.model") == "imports outside what it may use"
    assert _violation("t2train.model", "t2train.residual") is None


# Planted violations: a tiny tree per form an upward import can take. Each one passed the
# collector that kept only absolute ``import``/``from`` statements.
_CLEAN_TREE = {
    "t2train/__init__.py": "",
    "t2train/cli.py": "from t2train.launch import plan\n",
    "t2train/model/__init__.py": "",
    "t2train/model/gpt.py": "from t2train.residual import design\n",
    "t2train/residual/__init__.py": "",
    "t2train/residual/design.py": "import torch\n",
    "t2train/train/__init__.py": "",
    "t2train/train/loop.py": "",
    "launch/__init__.py": "",
    "launch/__main__.py": "from t2train import cli\n",
    "launch/plan.py": "from t2train.config import schema\n",
    "t2train/config/__init__.py": "",
    "t2train/config/schema.py": "",
    "data/__init__.py": "",
    "kernels/__init__.py": "",
    "kernels/dispatch.py": "",
}

PLANTED = {
    "relative": ("t2train/residual/design.py", "from ..model import gpt\n"),
    "relative, submodule": ("t2train/residual/design.py", "from .. import model\n"),
    "submodule through its package": ("t2train/residual/design.py", "from t2train import model\n"),
    "string import": (
        "t2train/residual/design.py",
        "import importlib\n\ndef load():\n"
        "    return importlib.import_module('t2train.train.loop')\n",
    ),
    "registry table of module names": (
        "kernels/dispatch.py",
        "TABLE = {'x': ('t2train.residual.design', 'DESIGN')}\n",
    ),
    "module:attribute string": ("kernels/dispatch.py", "WHERE = 't2train.model.gpt:GPT'\n"),
    "higher layer through launch": (
        "t2train/residual/design.py",
        "from t2train.launch import plan\n",
    ),
    "cli through launch": ("t2train/model/gpt.py", "import t2train.launch.plan\n"),
}


def _tree(root: Path, files: dict) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_planted_tree_is_clean_without_a_violation(tmp_path):
    assert _violations(_tree(tmp_path, _CLEAN_TREE)) == []


def test_every_planted_violation_is_caught(tmp_path):
    missed = []
    for form, (name, text) in PLANTED.items():
        root = _tree(
            tmp_path / form.replace(" ", "_").replace(",", "").replace(":", "_"),
            _CLEAN_TREE | {name: text},
        )
        if not _violations(root):
            missed.append(form)
    assert missed == []


def test_a_docstring_or_a_child_process_is_not_an_import(tmp_path):
    text = (
        '"""Read ``t2train.model.gpt`` for the model."""\nimport sys\n'
        'COMMAND = [sys.executable, "-m", "t2train.cli", "export"]\n'
    )
    assert _violations(_tree(tmp_path, _CLEAN_TREE | {"kernels/dispatch.py": text})) == []
