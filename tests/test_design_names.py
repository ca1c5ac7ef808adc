"""Nothing outside t2train/residual/ names a residual design or the local mixer.

The trainer, planner, monitoring, checkpointing, kernels, data and launch code reach designs
through the ``ResidualDesign`` interface and the registry, so adding a design is one file
there (docs/residuals.md, "How to add a design"). Scanned: identifiers and string literals in
code (docstrings and comments may mention designs). Presets and tests may name them.
"""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

from t2train.residual import mixer, registered

REPO = Path(__file__).resolve().parents[1]
SCANNED = ["t2train", "data", "kernels", "launch"]
EXEMPT = REPO / "t2train" / "residual"


def _names() -> set[str]:
    return set(registered()) | {mixer().name, mixer().section}


def _code_tokens(path: Path):
    """(line, text) of identifiers and non-docstring string literals."""
    tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
    previous = tokenize.NEWLINE
    for token in tokens:
        if token.type == tokenize.NAME:
            yield token.start[0], token.string
        elif token.type == tokenize.STRING and previous not in (tokenize.NEWLINE, tokenize.NL,
                                                                tokenize.INDENT,
                                                                tokenize.DEDENT):
            yield token.start[0], token.string
        if token.type not in (tokenize.COMMENT,):
            previous = token.type


def _mentions(text: str, names: set[str]) -> set[str]:
    words = set(text.strip("'\"fbr").replace(".", " ").replace("=", " ").replace("+", " ")
                .replace("/", " ").replace(",", " ").split())
    return words & names


def test_no_design_is_named_outside_the_residual_package():
    names = _names()
    found = []
    for folder in SCANNED:
        for path in sorted((REPO / folder).rglob("*.py")):
            if EXEMPT in path.parents:
                continue
            for line, text in _code_tokens(path):
                for name in sorted(_mentions(text, names)):
                    found.append(f"{path.relative_to(REPO)}:{line}: {name} ({text[:60]})")
    assert found == [], "\n".join(found)


def test_the_scan_sees_a_name_in_code_but_not_in_a_docstring(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('"""ddl is described here."""\n\nif residual == "ddl":\n    x = 1\n')
    assert [text for _, text in _code_tokens(sample) if _mentions(text, {"ddl"})] == ['"ddl"']
