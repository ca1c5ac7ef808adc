"""Every residual design, alone and with the local ShortSWA mixer, gives the same training
losses in every parallel layout.

Real 2-rank torchrun runs on gloo: TP=2 (with and without sequence parallelism), PP=2 (1F1B)
and PP=2 x VPP=2 (interleaved) each train 3 steps from the (1, 1, 1) run's step-0
checkpoint on the same global batches, then evaluate once with the final parameters.
Depth windows and attention-residual blocks cross the 1-layer interleaved chunks.

Which variants run in which layout is ``tests/variants.py``'s rule (each layout one design
of each kind of stream state, the mixer on one; every design in some layout), plus the
option variants below that change what crosses a stage.
"""

import pytest

from t2train.residual import registered

from torchrun_helper import run_torchrun
from variants import spread

pytestmark = pytest.mark.slow

REFERENCE = "1x1x1"
LAYOUTS = ["2x1x1", "2x1x1s", "1x2x1", "1x2x2"]  # TPxPPxVPP; s: sequence parallel
# Options that give a 4-layer model something to carry across stages (by variant, else by
# design): a depth window that slides, blocks that close inside a stage (a block size must
# divide the sublayers: 8 alone, 12 with the mixer).
OPTIONS = {
    "depth_attn": ["model.depth_attn.window=3"],
    "block_attnres": ["model.attnres.block_size=4"],
    "block_attnres+shortswa": ["model.attnres.block_size=3"],
}
MIXER_WINDOW = "model.shortswa.window=4"
# Option variants of a design's stream that the rule's default options do not show, in the
# layouts where they matter: DDL's d_v = 4 columns (its expander needs whole sequences, so
# no sequence parallelism), full recompute of a depth window, HC's static connections
# under selective recompute (the policy keeps the all-reduced projections, redoes the
# sequence-parallel collectives).
EXTRAS = {
    "ddl_dv4": (["model.residual=ddl", "model.ddl.dv=4"], ["2x1x1", "1x2x2"]),
    "recompute": (
        ["model.residual=depth_attn", "model.depth_attn.window=3", "model.recompute=full"],
        ["1x2x2"],
    ),
    "hc_static": (
        ["model.residual=hc", "model.hc.dynamic=false", "model.recompute=selective"],
        ["2x1x1s"],
    ),
}


def _overrides(variant: str) -> list[str]:
    design, plus, _ = variant.partition("+")
    options = OPTIONS.get(variant, OPTIONS.get(design, []))
    return [f"model.residual={design}", *options, *([MIXER_WINDOW] if plus else [])]


def _models() -> dict[str, tuple[list[str], list[str]]]:
    """name -> (overrides, layouts it runs in besides the reference)."""
    models: dict[str, tuple[list[str], list[str]]] = {}
    for layout, variants in spread(LAYOUTS).items():
        for variant in variants:
            models.setdefault(variant, (_overrides(variant), []))[1].append(layout)
    return {**models, **EXTRAS}


MODELS = _models()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("layouts")


@pytest.fixture(scope="module")
def losses(scratch):
    runs = ";".join(
        f"{','.join([REFERENCE, *layouts])}|{','.join(overrides)}"
        for overrides, layouts in MODELS.values()
    )
    result = run_torchrun(
        "layout_equivalence.py",
        2,
        ["--scratch", str(scratch), "--runs", runs],
        scratch / "result.json",
        timeout=1200,
    )
    return {run.split("|")[1]: layouts for run, layouts in result["runs"].items()}


def test_every_design_runs_in_some_layout():
    designs = {overrides[0].partition("=")[2] for overrides, _ in MODELS.values()}
    assert designs == set(registered())


@pytest.mark.parametrize("model", MODELS)
def test_layouts_match_single_process(losses, model):
    overrides, layouts = MODELS[model]
    runs = {layout: run["losses"] for layout, run in losses[",".join(overrides)].items()}
    assert sorted(runs) == sorted([REFERENCE, *layouts])
    reference = runs[REFERENCE]
    assert len(reference) == 4  # 3 training steps, then a forward with the final parameters
    for layout, losses in runs.items():
        for step, (got, want) in enumerate(zip(losses, reference)):
            assert abs(got - want) < 1e-5, f"{layout} step {step + 1}: {got} vs {want}"


def test_sequence_parallel_on_cpu_gives_no_cuda_advice(losses, scratch):
    """megatron-core's CUDA_DEVICE_MAX_CONNECTIONS advice is for GPUs (library_noise.py)."""
    log = (scratch / "result.log").read_text()
    assert any("2x1x1s" in layouts for layouts in losses.values())
    assert "CUDA_DEVICE_MAX" not in log, log[-3000:]
