"""What a Hugging Face export asks of the residual package (``t2train export hf``).

* ``is_llama(model)``: the baseline design without the local mixer is the Llama
  architecture, which transformers loads with no code of ours;
* every other design and combination runs through one standalone modeling file, written
  next to the weights. ``modeling_source()`` assembles it from ``hf_modeling.py`` (the
  config, the shared blocks, the decoder), each design's export part, ``hf.py`` in the
  design's folder beside its training modules, and the ``functional`` modules both import:
  torch-only functions holding each design's math, which the training modules call too,
  so the math is written once;
  ``config_fields(model)`` are the fields its config reads, ``modeling_designs()`` the
  designs it implements, ``modeling_module()`` the assembled file imported in-process.

Parameter names need no table per design: an export part names a design's own parameters
as the training modules do (``attn_residual.beta_proj.weight``,
``layer_entry.linear_q.weight``, ``stream.final_query``); the exporter renames only the
shared Megatron parts (attention, MLP, norms, embedding, head).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import linecache
import sys
import types
from dataclasses import asdict
from pathlib import Path

from t2train.residual import BASELINE, design_folder, get_design, mixer, mixer_on, registered

PACKAGE = Path(__file__).parents[1]  # t2train/
MODELING_FILE = Path(__file__).with_name("hf_modeling.py")
FUNCTIONAL = "functional"  # the name of a module of torch-only math the file copies
SHARED_MATH = "# --- the math the trainer calls: t2train's functional modules " + "-" * 28
DESIGNS_LINE = "DESIGNS: dict = {}"  # in hf_modeling.py; the parts' code goes after it
EXPORTED = "EXPORTED"  # a part's table: model.residual -> (stream, residual, layer entry)


def is_llama(model) -> bool:
    """``model`` (a ``ModelConfig``) is a plain pre-norm Transformer: Llama's math."""
    return model.residual == BASELINE and not mixer_on(model)


def config_fields(model) -> dict:
    """The residual design, its options (its ``model.<section>``) and the local attention
    window (0 = off), as the modeling file's ``T2TrainConfig`` reads them."""
    design = get_design(model.residual)
    options = asdict(getattr(model, design.section)) if design.section else {}
    return {
        "residual": model.residual,
        "residual_options": options,
        "local_window": getattr(model, mixer().section).window,
    }


def export_parts() -> list[Path]:
    """The export part of each registered design's folder that has one, each after the parts
    it imports (it uses their names); otherwise in registry order."""
    folders = dict.fromkeys(design_folder(name).rsplit(".", 1)[-1] for name in registered())
    parts = {
        folder: path
        for folder in folders
        if (path := _module_path(f"t2train.residual.{folder}.hf")).exists()
    }
    ordered: list[str] = []

    def place(folder: str, importers: tuple[str, ...]) -> None:
        if folder in ordered:
            return
        if folder in importers:
            cycle = " -> ".join([*importers, folder])
            raise RuntimeError(f"export parts import each other in a cycle: {cycle}")
        for needed in _parts_imported(parts[folder]):
            if needed not in parts:
                raise RuntimeError(
                    f"{parts[folder]}: imports the export part of {needed!r}, which no "
                    "registered design has"
                )
            place(needed, (*importers, folder))
        ordered.append(folder)

    for folder in parts:
        place(folder, ())
    return [parts[folder] for folder in ordered]


def _parts_imported(path: Path) -> list[str]:
    """The folders whose export part ``path`` imports (``t2train.residual.<folder>.hf``)."""
    pieces = [module.split(".") for module in _t2train_imports(path)]
    return [p[2] for p in pieces if p[:2] == ["t2train", "residual"] and p[3:] == ["hf"]]


def _t2train_imports(path: Path) -> list[str]:
    """The t2train modules ``path`` imports from (``from t2train... import``)."""
    modules = [
        node.module or ""
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ImportFrom)
    ]
    return [module for module in modules if module.startswith("t2train")]


def _exported(tree: ast.Module, path: Path) -> ast.Assign:
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
            EXPORTED
        ]:
            return node
    raise RuntimeError(f"{path}: no {EXPORTED} table")


def _table_keys(table: ast.Assign) -> list[str]:
    """The design names ``EXPORTED = {"name": ..., ...}`` maps."""
    if not isinstance(table.value, ast.Dict):
        raise RuntimeError(f"line {table.lineno}: {EXPORTED} must be a dict literal")
    return [str(key.value) for key in table.value.keys if isinstance(key, ast.Constant)]


def modeling_designs() -> set[str]:
    """The designs the modeling file implements: the keys of the parts' ``EXPORTED`` (read
    from their source: importing them needs transformers)."""
    return {
        name
        for path in export_parts()
        for name in _table_keys(_exported(ast.parse(path.read_text()), path))
    }


def _is_functional(module: str) -> bool:
    """A ``functional`` module: torch-only math the trainer calls, copied into the file."""
    return module.startswith("t2train.") and module.rsplit(".", 1)[-1] == FUNCTIONAL


def _defined_in_the_file(node: ast.ImportFrom, path: Path) -> bool:
    """An import of ``hf_modeling``, of another part or of a functional module: names the
    assembled file defines. Any other t2train import could not be resolved where the file
    is loaded."""
    module = node.module or ""
    if node.level or not module.startswith("t2train"):
        return False
    last = module.rsplit(".", 1)[-1]
    folder_part = module.startswith("t2train.residual.") and module.count(".") == 3 and last == "hf"
    if module == "t2train.residual.hf_modeling" or folder_part or _is_functional(module):
        return True
    raise RuntimeError(
        f"{path}: imports {module}; an export part may import only torch, the standard "
        "library, hf_modeling, other designs' export parts and functional modules"
    )


def _module_path(module: str) -> Path:
    """The source file of ``module``, found as an import finds it (a design's folder may sit
    on ``t2train.residual.__path__`` beside the package's own); where it is missing, the path
    it would have in the package (the caller names it)."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:  # a parent package is missing
        spec = None
    if spec is None or spec.origin is None:
        return PACKAGE.parent.joinpath(*module.split(".")).with_suffix(".py")
    return Path(spec.origin)


def functional_modules(parts: list[Path]) -> list[Path]:
    """The functional modules the frame and ``parts`` import, each after the functional
    modules it imports. One may import only torch, the standard library and other
    functional modules (it is copied as it is)."""
    ordered: list[Path] = []

    def place(module: str, importers: tuple[str, ...]) -> None:
        path = _module_path(module)
        if path in ordered:
            return
        if module in importers:
            raise RuntimeError(f"functional modules import each other in a cycle: {module}")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = (
                    [alias.name for alias in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                for name in names:
                    top = name.split(".")[0]
                    if _is_functional(name):
                        place(name, (*importers, module))
                    elif top != "torch" and top not in sys.stdlib_module_names:
                        raise RuntimeError(
                            f"{path}: imports {name}; a functional module may import only "
                            "torch, the standard library and other functional modules"
                        )
        ordered.append(path)

    for path in [MODELING_FILE, *parts]:
        for module in _t2train_imports(path):
            if _is_functional(module):
                place(module, ())
    return ordered


Imports = list[ast.Import | ast.ImportFrom]


def _split(path: Path) -> tuple[Imports, int, ast.Module, str]:
    """A module's imports the file needs (not those of names it defines), the number of its
    lines up to its last import, its tree and its text."""
    text = path.read_text()
    tree = ast.parse(text)
    imports: Imports = []
    code_start = 0
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            code_start = node.end_lineno or node.lineno
            if isinstance(node, ast.Import) or not _defined_in_the_file(node, path):
                imports.append(node)
    return imports, code_start, tree, text


def _label(path: Path) -> str:
    """The path a section of the file names: from the repository root where it is inside."""
    return (
        path.relative_to(PACKAGE.parent).as_posix() if path.is_relative_to(PACKAGE) else str(path)
    )


def _part(path: Path) -> tuple[Imports, str]:
    """A part's imports, and its code after them with ``EXPORTED`` added to ``DESIGNS``."""
    imports, code_start, tree, text = _split(path)
    lines, table = text.splitlines(), _exported(tree, path)
    code = (
        lines[code_start : table.lineno - 1]
        + [f"DESIGNS.update({ast.get_source_segment(text, table.value)})"]
        + lines[table.end_lineno or table.lineno :]
    )
    designs = ", ".join(_table_keys(table))
    return imports, "\n".join([f"# --- {designs}: {_label(path)}", *code]).strip()


def _functional(path: Path) -> tuple[Imports, str]:
    imports, code_start, _, text = _split(path)
    code = text.splitlines()[code_start:]
    return imports, "\n".join([f"# --- {_label(path)}", *code]).strip()


def _import_block(imports: Imports) -> list[str]:
    """The imports, merged per module: ``__future__``, the standard library, then the rest."""
    modules: dict[str, dict] = {}  # "" for plain imports
    for node in imports:
        names = [
            alias.name + (f" as {alias.asname}" if alias.asname else "") for alias in node.names
        ]
        key = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
        modules.setdefault(key, {}).update(dict.fromkeys(names))

    def lines(stdlib: bool) -> list[str]:
        is_stdlib = lambda name: name.split(".")[0] in sys.stdlib_module_names  # noqa: E731
        plain = [
            f"import {name}" for name in sorted(modules.get("", {})) if is_stdlib(name) == stdlib
        ]
        return plain + [
            f"from {module} import {', '.join(sorted(names))}"
            for module, names in sorted(modules.items())
            if module not in ("", "__future__") and is_stdlib(module) == stdlib
        ]

    future = (
        [f"from __future__ import {', '.join(modules['__future__'])}"]
        if "__future__" in modules
        else []
    )
    groups = [group for group in (future, lines(True), lines(False)) if group]
    return [line for group in groups for line in [*group, ""]][:-1]


def modeling_source() -> str:
    """The standalone modeling file: ``hf_modeling.py`` with its imports and the inserted
    modules' merged, the functional modules' code after the imports and the parts' code
    after its ``DESIGNS`` line."""
    imports, last, tree, frame = _split(MODELING_FILE)
    lines = frame.splitlines()
    first = next(node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom)))
    parts = export_parts()
    functions, part_codes = [], []
    for path in functional_modules(parts):
        needed, code = _functional(path)
        imports += needed
        functions.append(code)
    for path in parts:
        needed, code = _part(path)
        imports += needed
        part_codes.append(code)
    designs = next(i for i, line in enumerate(lines) if line.startswith(DESIGNS_LINE)) + 1
    return (
        "\n".join(
            lines[: first.lineno - 1]
            + _import_block(imports)
            + ["", "", SHARED_MATH, "", ""]
            + ["\n\n\n".join(functions)]
            + lines[last:designs]
            + ["", ""]
            + ["\n\n\n".join(part_codes)]
            + lines[designs:]
        )
        + "\n"
    )


@functools.lru_cache(maxsize=None)
def modeling_module() -> types.ModuleType:
    """The assembled modeling file, imported in-process (exported models load the file
    written next to them)."""
    name = "t2train_modeling"
    source, filename = modeling_source(), "<t2train_modeling>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module  # transformers looks classes' modules up by name
    exec(compile(source, filename, "exec"), module.__dict__)
    return module
