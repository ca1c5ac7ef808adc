"""Nothing outside t2train/residual/ names a residual design or the local mixer.

The trainer, planner, monitoring, checkpointing, kernels, data and launch code reach designs
through the ``ResidualDesign`` interface and the registry, so adding a design is one file
there (docs/residuals.md, "How to add a design"). Scanned, from the syntax tree (the same on
every Python version, f-strings included): identifiers and every string literal but
docstrings (docstrings and comments may mention designs), compound names included (``hc_read``,
``ddl_widths``: a name is found as any run of a word's underscore-separated parts). Presets
and tests may name them. The collector is tested on planted names at the end.
"""

from __future__ import annotations

import ast
from pathlib import Path

from t2train.residual import mixer, registered

REPO = Path(__file__).resolve().parents[1]
SCANNED = ["t2train", "data", "kernels", "launch"]
EXEMPT = REPO / "t2train" / "residual"
ENGLISH = ("standard_error",)  # statistics' term, not the baseline design


def _names() -> set[str]:
    return set(registered()) | {mixer().name, mixer().section}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the module's, classes' and functions' docstring nodes."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                found.add(id(first.value))
    return found


def _code_tokens(path: Path):
    """(line, text) of identifiers and string literals (f-strings' literal parts included),
    docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str) and id(node) not in docstrings:
                yield line, repr(node.value)
            continue
        # identifiers: Name.id, Attribute.attr, def/class names, arguments, keywords, imports
        for _, value in ast.iter_fields(node):
            for text in value if isinstance(value, list) else [value]:
                if isinstance(text, str):
                    yield line, text


def _mentions(text: str, names: set[str]) -> set[str]:
    text = text.strip("'\"")  # a string literal comes quoted by repr()
    for phrase in ENGLISH:
        text = text.replace(phrase, " ")
    for separator in ".=+/,-:":
        text = text.replace(separator, " ")
    found = set()
    for word in text.split():
        parts = word.split("_")
        for name in names:
            run = name.split("_")
            if any(parts[i : i + len(run)] == run for i in range(len(parts))):
                found.add(name)
    return found


def _found(paths, names: set[str]) -> list[str]:
    found = []
    for path in paths:
        for line, text in _code_tokens(path):
            for name in sorted(_mentions(text, names)):
                found.append(f"{path}:{line}: {name} ({text[:60]})")
    return found


def test_no_design_is_named_outside_the_residual_package():
    paths = [
        path.relative_to(REPO)
        for folder in SCANNED
        for path in sorted((REPO / folder).rglob("*.py"))
        if EXEMPT not in path.parents
    ]
    found = _found([REPO / path for path in paths], _names())
    assert found == [], "\n".join(found)


# Each planted snippet names ``ddl`` in code; the collector that took every string starting
# a line for a docstring missed the first two, and on Python 3.12 (f-strings tokenized in
# parts) the f-strings.
PLANTED = {
    "a multi-line dict keyed by design": 'TABLE = {\n    "ddl": 1,\n}\n',
    "a call argument on its own line": 'run(\n    "ddl",\n    2,\n)\n',
    "a bare string statement after code": 'x = 1\n"ddl"\n',
    "an f-string's literal part": 'label = f"{x}+ddl"\n',
    "an f-string inside a call on its own line": 'run(\n    f"model.residual=ddl {x}",\n)\n',
    "an identifier": "def ddl():\n    pass\n",
    "an attribute": "x = config.ddl\n",
    "a keyword argument": "run(ddl=1)\n",
    "an import": "from t2train.residual import ddl\n",
    "a compound identifier": "ddl_widths = (1, 4)\n",
    "a compound string": 'table["fused_ddl_write"]\n',
    "a file name": 'run("tests/kernels/test_ddl_kernel.py")\n',
}


def test_every_planted_name_is_found(tmp_path):
    missed = []
    for index, (form, text) in enumerate(PLANTED.items()):
        sample = tmp_path / f"sample_{index}.py"
        sample.write_text(text)
        if not _found([sample], {"ddl"}):
            missed.append(form)
    assert missed == []


def test_a_word_containing_a_name_is_not_the_name(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('addle = 1\nladder = "shc_ddlx"\nstandard_error = 0.1\n')
    assert _found([sample], {"ddl", "hc", "standard"}) == []


def test_docstrings_and_comments_may_name_a_design(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""ddl is described here."""\n\n\nclass A:\n    """ddl, again."""\n\n'
        '    def f(self):\n        """And ddl."""\n        return 1  # ddl\n'
    )
    assert _found([sample], {"ddl"}) == []
