"""Four real ranks (gloo): 4-stage pipelines, TP x PP, data parallel with either optimizer,
and the depth cache's cached transfer against naive resending, with its byte counts.

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
DEEP = "model.num_layers=8"  # 4 stages x 2 virtual stages of one layer each
RECOMPUTE = {"depth_attn": ",model.recompute=full"}  # cached leaves as recompute inputs
CACHE = {
    f"{name}_{mode}": (f"1x1x1,1x4x2|{DESIGNS[name]},{DEEP},parallel.depth_cache={mode}"
                       f"{RECOMPUTE.get(name, '')}")
    for name in ("attnres", "block_attnres", "depth_attn") for mode in ("naive", "cached")
}
DATA_PARALLEL = {
    f"{name}_{optimizer}": (f"1x1x1,2x1x1,1x2x1|{DESIGNS[name]},"
                            f"parallel.distributed_optimizer={optimizer == 'distopt'}")
    for name in ("standard",) for optimizer in ("adam", "distopt")
}
RUNS = {**{name: f"1x1x1,2x2x1,1x4x1|{design}" for name, design in DESIGNS.items()},
        **CACHE, **DATA_PARALLEL}
SEQ, MICRO, HIDDEN, MICRO_BATCHES, BYTES = 8, 1, 32, 4, 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("four")
    result = run_torchrun("layout_equivalence.py", 4,
                          ["--scratch", str(scratch), "--runs", ";".join(RUNS.values())],
                          scratch / "result.json", timeout=1800)
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


def _per_step_bytes(units: int, hops_per_micro_batch: int) -> int:
    return units * SEQ * MICRO * HIDDEN * BYTES * hops_per_micro_batch * MICRO_BATCHES


@pytest.mark.parametrize("name", CACHE)
def test_hop_bytes_match_the_formula(runs, name):
    """units x s x b x h x bytes per hop; 7 hops per micro-batch for 8 chunks, both ways."""
    run = runs[name]["1x4x2"]
    expected = _per_step_bytes(run["padded_units"], hops_per_micro_batch=7)
    assert run["traffic"]["pipeline/forward_bytes"] == expected
    assert run["traffic"]["pipeline/backward_bytes"] == expected
    assert run["traffic"]["pipeline/forward_hops"] == 7 * MICRO_BATCHES


def test_attention_residual_units_per_hop():
    """The formula itself: Full AttnRes naive hops grow with depth, cached ones do not."""
    from t2train.parallel.depth_cache import HopPlan
    from t2train.residual.attnres import source_unit_ids

    def plan(cached, block_size=1):  # two sublayers (attention, MLP) per layer
        return HopPlan(lambda layers: source_unit_ids(2 * layers, block_size), pipeline=4,
                       chunks=8, layers_per_chunk=1, cached=cached)

    # Into chunk c: the embedding and 2 sources per finished layer.
    assert plan(False).hop_units() == [1 + 2 * c for c in range(1, 8)]
    # Cached: rank c mod 4 kept its sources from chunk c - 4; only the 6 newer ones come.
    assert plan(True).hop_units() == [3, 5, 7, 6, 6, 6, 6]
    # Blocks of 4 sublayers (2 layers): completed blocks, plus the partial after odd layers.
    assert plan(False, 4).hop_units() == [2, 2, 3, 3, 4, 4, 5]
    assert plan(True, 4).hop_units() == [2, 2, 3, 2, 2, 2, 2]


@pytest.mark.parametrize("design", ["attnres", "block_attnres"])
def test_cached_sends_less_than_naive(runs, design):
    naive = runs[f"{design}_naive"]["1x4x2"]["traffic"]["pipeline/forward_bytes"]
    cached = runs[f"{design}_cached"]["1x4x2"]["traffic"]["pipeline/forward_bytes"]
    print(f"{design}: forward bytes per step naive {naive:.0f}, cached {cached:.0f}")
    assert cached < naive


@pytest.mark.parametrize("name", CACHE)
def test_plan_predicts_the_measured_bytes(runs, name):
    """`t2train plan`'s hop bytes equal a real run's counters, naive and cached."""
    from t2train.config.loader import load_config
    from t2train.bench.plan import plan_layout

    overrides = CACHE[name].split("|")[1].split(",")
    config = load_config(overrides=[
        "data.path=unused", "model.hidden_size=32", "model.num_attention_heads=4",
        f"model.seq_length={SEQ}", f"train.micro_batch_size={MICRO}", "train.global_batch_size=4",
        "train.warmup_steps=1", "train.steps=3", "parallel.pipeline=4",
        "parallel.virtual_pipeline=2", *overrides])
    plan = plan_layout(config, vocab_size=128, world_size=4)
    hops = plan.cached if config.parallel.depth_cache == "cached" else plan.naive
    traffic = runs[name]["1x4x2"]["traffic"]
    assert plan.step_bytes(hops) == traffic["pipeline/forward_bytes"]
    assert plan.step_bytes(hops) == traffic["pipeline/backward_bytes"]
