"""Four real ranks (gloo): 4-stage pipelines, TP x PP, data parallel with either optimizer,
and the depth cache's cached transfer (exact hop shapes) against naive resending (padded
hops), with their byte counts against the minimum each design's definition allows.

Runs 3 training steps per layout from the (1, 1, 1) run's step-0 checkpoint on the same
global batches (micro-batch 1, global batch 4, sequence 8, hidden 32, fp32).
"""

import pytest

from torchrun_helper import run_torchrun

pytestmark = pytest.mark.slow

DESIGNS = {
    "standard": "model.residual=standard",
    "ddl_dv4": "model.residual=ddl,model.ddl.dv=4",
    "ddl+shortswa": "model.residual=ddl,model.shortswa.window=4",
    "depth_attn": "model.residual=depth_attn,model.depth_attn.window=3",  # crosses 1-layer stages
    "attnres": "model.residual=attnres",
    "block_attnres": "model.residual=block_attnres,model.attnres.block_size=4",
}
DEEP = "model.num_layers=8"  # chunks of 1 (PP 4 x VPP 2, PP 2 x VPP 4) or 2 layers (PP 2 x VPP 2)
RECOMPUTE = {"depth_attn": ",model.recompute=full"}  # cached leaves as recompute inputs
CACHED = {name: DESIGNS[name] for name in ("attnres", "block_attnres", "depth_attn")}
CACHED["attnres+shortswa"] = "model.residual=attnres,model.shortswa.window=4"  # 3 sublayers
LAYOUTS = {name: "1x1x1,1x4x2,2x2x2,1x2x4" for name in CACHED}  # (PP, VPP) = (4,2) (2,2) (2,4)
LAYOUTS["attnres+shortswa"] = "1x1x1,1x4x2"
CACHE = {
    **{
        f"{name}_cached": (
            f"{LAYOUTS[name]}|{design},{DEEP},parallel.depth_cache=cached{RECOMPUTE.get(name, '')}"
        )
        for name, design in CACHED.items()
    },
    # Naive resending with every hop padded to the largest: the fallback hop shapes.
    **{
        f"{name}_naive": (
            f"1x1x1,1x4x2|{DESIGNS[name]},{DEEP},parallel.depth_cache=naive,"
            f"parallel.hop_shapes=padded{RECOMPUTE.get(name, '')}"
        )
        for name in ("attnres", "block_attnres", "depth_attn")
    },
}
DATA_PARALLEL = {
    f"{name}_{optimizer}": (
        f"1x1x1,2x1x1,1x2x1|{DESIGNS[name]},parallel.distributed_optimizer={optimizer == 'distopt'}"
    )
    for name in ("standard",)
    for optimizer in ("adam", "distopt")
}
RUNS = {
    **{name: f"1x1x1,2x2x1,1x4x1|{design}" for name, design in DESIGNS.items()},
    **CACHE,
    **DATA_PARALLEL,
}
SEQ, MICRO, HIDDEN, GLOBAL, BYTES = 8, 1, 32, 4, 4
WORKER_BASE = [
    "data.path=unused",
    "model.num_layers=4",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    f"model.seq_length={SEQ}",
    f"train.micro_batch_size={MICRO}",
    f"train.global_batch_size={GLOBAL}",
    "train.warmup_steps=1",
    "train.steps=3",
]  # as tests/workers/layout_equivalence.py


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("four")
    result = run_torchrun(
        "layout_equivalence.py",
        4,
        ["--scratch", str(scratch), "--runs", ";".join(RUNS.values())],
        scratch / "result.json",
        timeout=1800,
    )
    return {name: result["runs"][spec] for name, spec in RUNS.items()}


def _assert_same_losses(layouts: dict):
    reference = layouts["1x1x1"]["losses"]
    for layout, run in layouts.items():
        for step, (got, want) in enumerate(zip(run["losses"], reference)):
            assert abs(got - want) < 1e-5, f"{layout} step {step + 1}: {got} vs {want}"


@pytest.mark.parametrize("name", DESIGNS)
def test_tp2_pp2_and_pp4_match_single_process(runs, name):
    _assert_same_losses(runs[name])


@pytest.mark.parametrize("name", DATA_PARALLEL)
def test_data_parallel_with_tp_or_pp_matches(runs, name):
    _assert_same_losses(runs[name])


@pytest.mark.parametrize("name", CACHE)
def test_cached_and_naive_transfer_match(runs, name):
    _assert_same_losses(runs[name])


def _config(name: str, layout: str):
    from t2train.config.loader import load_config

    tp, pp, vpp = (int(n) for n in layout.split("x"))
    overrides = RUNS[name].split("|")[1].split(",")
    return load_config(
        overrides=[
            *WORKER_BASE,
            f"parallel.tensor={tp}",
            f"parallel.pipeline={pp}",
            f"parallel.virtual_pipeline={vpp}",
            *overrides,
        ]
    )


def _pipelined():
    return [
        (name, layout)
        for name, spec in RUNS.items()
        for layout in spec.split("|")[0].split(",")
        if layout.split("x")[1] != "1"
    ]


@pytest.mark.parametrize("name, layout", _pipelined())
def test_what_is_sent_is_the_minimum(runs, name, layout):
    """A real run's counters, summed over ranks: data bytes equal the minimum written from the
    design's definition (tests/hop_minimum.py) for every hop of every micro-batch, each way;
    exact hops put just the data on the wire, padded ones the largest hop every time."""
    from hop_minimum import minimum_hop_units

    config = _config(name, layout)
    parallel = config.parallel
    units = minimum_hop_units(
        config.model,
        parallel.pipeline,
        parallel.virtual_pipeline,
        cached=parallel.caches_depth_units(),
    )
    wire = units if parallel.hop_shapes == "exact" else [max(units)] * len(units)
    per_unit = SEQ * MICRO * HIDDEN * BYTES * (GLOBAL // MICRO) * parallel.tensor
    traffic = runs[name][layout]["traffic"]
    for direction in ("forward", "backward"):
        assert traffic[f"pipeline/{direction}_data_bytes"] == sum(units) * per_unit, direction
        assert traffic[f"pipeline/{direction}_wire_bytes"] == sum(wire) * per_unit, direction
    assert traffic["pipeline/forward_hops"] == len(units) * GLOBAL // MICRO * parallel.tensor


@pytest.mark.parametrize("design", ["attnres", "block_attnres"])
def test_cached_sends_less_than_naive(runs, design):
    naive = runs[f"{design}_naive"]["1x4x2"]["traffic"]
    cached = runs[f"{design}_cached"]["1x4x2"]["traffic"]
    print(
        f"{design}: forward bytes per step naive {naive['pipeline/forward_wire_bytes']:.0f} "
        f"on the wire ({naive['pipeline/forward_data_bytes']:.0f} data), cached "
        f"{cached['pipeline/forward_wire_bytes']:.0f}"
    )
    assert cached["pipeline/forward_wire_bytes"] < naive["pipeline/forward_data_bytes"]


@pytest.mark.parametrize("name, layout", [(name, "1x4x2") for name in CACHE])
def test_plan_predicts_the_measured_bytes(runs, name, layout):
    """`t2train plan`'s data and wire bytes equal a real run's counters, naive and cached."""
    from t2train.bench.plan import plan_layout

    config = _config(name, layout)
    plan = plan_layout(config, vocab_size=128, world_size=4)
    hops = plan.hops_in_use(config.parallel.caches_depth_units())
    traffic = runs[name][layout]["traffic"]
    for direction in ("forward", "backward"):
        assert plan.step_bytes(hops, wire=False) == traffic[f"pipeline/{direction}_data_bytes"]
        assert plan.step_bytes(hops, wire=True) == traffic[f"pipeline/{direction}_wire_bytes"]
