"""Every registered design follows the checklist of ``t2train/residual/README.md``: its
folder's files, a row in each per-design test table that lists designs by hand, and in each
design table of ``docs/residuals.md``; and the checklist names no path that is gone.

The tables are read from the test files' syntax trees (not imported: they import helpers
from their own folders), so a design added to the registry and nowhere else fails here,
naming the step it skipped. The families that take their designs from ``tests/variants.py``
or check the registry themselves (layouts, resume, export, ``VARIANTS``) need no row here.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from t2train.residual import BASELINE, design_folder, registered

REPO = Path(__file__).resolve().parents[1]
CHECKLIST = REPO / "t2train" / "residual" / "README.md"
DESIGN_DOC = REPO / "docs" / "residuals.md"

# Designs whose formula test is a file of its own rather than a row of
# tests/residual/test_paper_math.py's CASES (the n-stream designs: their streams are not one
# decoder state, so the shared decoder harness does not fit them).
FORMULAS_ELSEWHERE = {
    "hc": "tests/residual/test_hyper_connections.py",
    "mhc": "tests/residual/test_hyper_connections.py",
}
# docs/residuals.md's design tables, by their header: the rows must name these designs.
DOC_TABLES = {
    "| design | what it changes |": set(registered()),
    "| design | extra parameters under TP |": set(registered()),
    "| design | alone | with the mixer": set(registered()) - {BASELINE},  # beyond `standard`
}


def _assigned_dict(path: Path, name: str) -> dict[str, ast.expr]:
    """The entries (key -> value node) of the dict literal assigned to ``name`` at the top of
    the module ``path``; ``**`` entries are left out."""
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            assert isinstance(node.value, ast.Dict), f"{path}: {name} is not a dict literal"
            return {
                ast.literal_eval(key): value
                for key, value in zip(node.value.keys, node.value.values)
                if key is not None
            }
    raise AssertionError(f"{path}: no {name} = {{...}} at the top of the module")


def _design_of_overrides(value: ast.expr) -> str:
    """The design a CASES row selects: ``model.residual=<name>`` in its overrides (the
    first element of the row), else the baseline."""
    assert isinstance(value, ast.Tuple) and isinstance(value.elts[0], ast.List)
    for override in value.elts[0].elts:
        text = ast.literal_eval(override) if isinstance(override, ast.Constant) else ""
        if text.startswith("model.residual="):
            return text.split("=", 1)[1]
    return BASELINE


def _table_designs(markdown: str, header: str) -> set[str]:
    """The design names in backticks in the first column of the table whose header row
    starts with ``header`` (``ddl.dv=1`` names ``ddl``)."""
    lines = markdown.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(header)]
    assert len(starts) == 1, f"{DESIGN_DOC.name}: {len(starts)} tables start with {header!r}"
    names = set()
    for line in lines[starts[0] + 2 :]:
        if not line.startswith("|"):
            break
        first = line.split("|")[1]
        names |= {re.split(r"[.= ]", token)[0] for token in re.findall(r"`([^`]+)`", first)}
    return names


@pytest.mark.parametrize("design", registered())
def test_the_folder_holds_the_declaration_math_modules_and_export_part(design):
    folder = REPO / Path(*design_folder(design).split("."))
    needed = ["__init__.py", "layers.py", "hf.py"] + ["functional.py"] * (design != BASELINE)
    missing = [name for name in needed if not (folder / name).is_file()]
    assert not missing, f"{design}: checklist step 1, {folder.relative_to(REPO)} lacks {missing}"


def test_every_design_has_its_formula_written_out_again():
    cases = _assigned_dict(REPO / "tests/residual/test_paper_math.py", "CASES")
    in_cases = {_design_of_overrides(row) for row in cases.values()}
    for design, path in FORMULAS_ELSEWHERE.items():
        assert design in (REPO / path).read_text(), f"{path} does not test {design}"
    missing = set(registered()) - in_cases - set(FORMULAS_ELSEWHERE)
    assert not missing, f"checklist step 4: no row in test_paper_math.py's CASES for {missing}"


def test_every_design_has_its_flops_counted_by_hand():
    rows = _assigned_dict(REPO / "tests/monitor/test_mfu.py", "EXTRA_FORWARD_FLOPS")
    counted = {ast.literal_eval(row.elts[0]) for row in rows.values() if isinstance(row, ast.Tuple)}
    missing = set(registered()) - {BASELINE} - counted  # the baseline: STANDARD_TRAIN_FLOPS
    assert not missing, f"checklist step 4: no hand count in test_mfu.py for {missing}"


@pytest.mark.parametrize("header", DOC_TABLES)
def test_every_design_has_its_row_in_the_design_tables(header):
    named = _table_designs(DESIGN_DOC.read_text(), header)
    missing = DOC_TABLES[header] - named
    assert not missing, f"checklist step 5: docs/residuals.md's table {header!r} lacks {missing}"
    assert named <= set(registered()) | {"shortswa"}, named - set(registered())


def test_every_path_the_checklist_names_exists():
    paths = {
        token
        for token in re.findall(r"`([^`\s]+)`", CHECKLIST.read_text())
        if re.match(r"(t2train|tests|docs|kernels)/", token) and "<" not in token
    }
    assert len(paths) > 10, paths
    gone = sorted(path for path in paths if not (REPO / path).exists())
    assert not gone, f"t2train/residual/README.md names paths that do not exist: {gone}"


def test_the_checks_catch_a_design_that_skipped_a_step(monkeypatch):
    """A design registered and nowhere else is missing from every table above."""
    from t2train import residual

    monkeypatch.setitem(residual._DESIGNS, "toy", ("t2train.residual.standard", "DESIGN"))
    monkeypatch.setattr(
        sys.modules[__name__], "DOC_TABLES", {h: set(residual.registered()) for h in DOC_TABLES}
    )
    for check in (
        test_every_design_has_its_formula_written_out_again,
        test_every_design_has_its_flops_counted_by_hand,
    ):
        with pytest.raises(AssertionError, match="toy"):
            check()
    for header in DOC_TABLES:
        with pytest.raises(AssertionError, match="toy"):
            test_every_design_has_its_row_in_the_design_tables(header)
