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
import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

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
    folder = Path(importlib.import_module(design_folder(design)).__file__).parent
    needed = ["__init__.py", "layers.py", "hf.py"] + ["functional.py"] * (design != BASELINE)
    missing = [name for name in needed if not (folder / name).is_file()]
    assert not missing, f"{design}: checklist step 1, {folder} lacks {missing}"


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


# --- a toy design added by the checklist alone --------------------------------------------

TOY = {  # t2train/residual/toy/, as step 1 of the checklist asks: x <- x + g f(Norm(x))
    "__init__.py": '''
"""`toy`: a learned scalar gate per sublayer, x <- x + g f(Norm(x)), g starting at 1."""
from t2train.residual.declaration import BODY, ResidualDesign, Traffic
from t2train.residual.sublayers import sublayer_names


def gates(model):  # one per sublayer
    return model.num_layers * len(sublayer_names(model))


def flops(model):  # g times the output: h multiplications per sublayer
    return gates(model) * model.hidden_size


def minimum_traffic(_model, _layer):  # standard's: the gate is one number
    return Traffic(BODY.forward + 4, BODY.backward + 4)


DESIGN = ResidualDesign(
    name="toy",
    layers="t2train.residual.toy.layers",
    stream="HiddenStateStream",
    sublayer="GatedResidual",
    reference="a toy of the design checklist",
    extra_parameters=lambda model, *_: gates(model),
    extra_flops_per_token=flops,
    minimum_traffic=minimum_traffic,
)
''',
    "functional.py": '''
"""The toy's math, once: the gated write."""
from torch import Tensor


def gated_write(state: Tensor, out: Tensor, gate: Tensor) -> Tensor:
    return state + gate * out
''',
    "layers.py": '''
"""The toy's training modules; its stream is standard's (designs may share code)."""
import torch
from torch import nn

from t2train.residual.base import SublayerResidual
from t2train.residual.standard.layers import HiddenStateStream as HiddenStateStream
from t2train.residual.toy.functional import gated_write


class GatedResidual(SublayerResidual):
    def __init__(self, config, model, layer_number=1, position=0):
        super().__init__(config, model, layer_number, position)
        self.gate = nn.Parameter(torch.ones(1))

    def read(self, state):
        return state

    def write(self, state, x, normed, out):
        return gated_write(state, out, self.gate.to(out.dtype))


KERNELS = ()
''',
    "hf.py": '''
"""The toy's export part: its parameters named as in layers.py, its math functional.py's."""
import torch
from torch import nn

from t2train.residual.hf_modeling import T2TrainConfig
from t2train.residual.standard.hf import HiddenStateStream
from t2train.residual.toy.functional import gated_write


class GatedResidual(nn.Module):
    def __init__(self, config: T2TrainConfig, layer: int, position: int):
        super().__init__()
        self.gate = nn.Parameter(torch.ones(1))

    def read(self, state):
        return state

    def write(self, state, x, normed, out):
        return gated_write(state, out, self.gate)


EXPORTED = {"toy": (HiddenStateStream, GatedResidual, None)}
''',
}


@pytest.fixture
def toy_design(tmp_path, monkeypatch):
    """The toy's folder, made beside the package's own (``t2train.residual.toy`` imports it
    from here) and its one registry line; both gone afterwards."""
    from t2train import residual
    from t2train.residual.hf import modeling_module

    folder = tmp_path / "toy"
    folder.mkdir()
    for name, source in TOY.items():
        (folder / name).write_text(source.lstrip())
    monkeypatch.setattr(residual, "__path__", [*residual.__path__, str(tmp_path)])
    monkeypatch.setitem(residual._DESIGNS, "toy", ("t2train.residual.toy", "DESIGN"))
    modeling_module.cache_clear()  # assembled from the registered designs' export parts
    yield folder
    modeling_module.cache_clear()
    for module in [m for m in sys.modules if m.startswith("t2train.residual.toy")]:
        del sys.modules[module]


def test_a_toy_design_added_by_the_checklist_trains_and_exports(
    toy_design, megatron_world, shakespeare, tmp_path
):
    """Steps 1 and 2 alone (four files and a registry line, no edit elsewhere): the config
    takes it, the counts are the declaration's, it learns through the trainer (its gates
    move), and its export computes the trained model's logits."""
    from test_export import _hf_model
    from test_training import TINY, _train

    from t2train.config.loader import load_config
    from t2train.export.hf import hf_state_dict
    from t2train.export.load import load_model, open_checkpoint
    from t2train.model.flops import forward_flops_per_token, plain_forward_flops_per_token
    from t2train.residual.hf import modeling_source

    model = load_config(overrides=["data.path=unused", *TINY, "model.residual=toy"]).model
    assert forward_flops_per_token(model, 128) - plain_forward_flops_per_token(model, 128) == 4 * 64
    run_dir = tmp_path / "run"
    steps = ["train.steps=30", "train.eval_interval=30", "checkpoint.interval=30"]
    summary = _train(shakespeare, run_dir, "model.residual=toy", *steps)
    assert summary.val_losses[30] < summary.val_losses[0] - 0.5, summary.val_losses

    loaded = load_model(open_checkpoint(run_dir), device="cpu", dtype=torch.float32).model.eval()
    gates = {n: p.item() for n, p in loaded.named_parameters() if n.endswith(".gate")}
    assert len(gates) == 4 and all(g != 1.0 for g in gates.values()), gates

    assert "class GatedResidual" in modeling_source()
    state = hf_state_dict(loaded.state_dict(), model)
    hf_model = _hf_model(model, state, vocab=state["model.embed_tokens.weight"].shape[0])
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = loaded(tokens, torch.arange(16).expand(2, 16), None)
        theirs = hf_model(tokens).logits
    torch.testing.assert_close(theirs, ours[..., : theirs.shape[-1]], atol=1e-5, rtol=1e-5)
    test_the_folder_holds_the_declaration_math_modules_and_export_part("toy")
