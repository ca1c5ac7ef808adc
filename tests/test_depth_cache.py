"""The depth cache's gradient routing, in one process: two chunks of one micro-batch."""

from dataclasses import replace

import pytest
import torch

from t2train.parallel.depth_cache import DepthCache
from t2train.parallel.hop_plan import HopPlan, plan_hops


def test_gradient_of_a_cached_unit_reaches_its_owner_once():
    x = torch.randn(4, 2, 3, requires_grad=True)
    weight_a, weight_b = torch.randn(3), torch.randn(3)

    # Reference: both chunks read x directly.
    ((x * weight_a).sum() + (x.tanh() * weight_b).sum()).backward()
    expected, x.grad = x.grad.clone(), None

    cache = DepthCache()
    produced = x * 1.0  # the unit as the owner chunk produces it
    owned = cache.own(0, 7, produced)
    first_chunk_out = (owned * weight_a).sum()
    later = cache.read(0, 7)  # a later chunk on the same rank
    assert later is not owned and later.is_leaf and later.data_ptr() == produced.data_ptr()
    later_chunk_out = (later.tanh() * weight_b).sum()
    cache.drop(0)
    assert len(cache) == 0  # nothing kept once the last chunk has read it

    # Backward visits the later chunk first, then the owner's: each graph runs once.
    later_chunk_out.backward()
    assert x.grad is None
    first_chunk_out.backward()
    torch.testing.assert_close(x.grad, expected)


def test_hop_plan_without_virtual_stages_sends_everything():
    ids = lambda layers: list(range(layers + 1))  # noqa: E731 - a growing source list
    naive = HopPlan(ids, pipeline=4, chunks=4, layers_per_chunk=2, cached=False)
    cached = HopPlan(ids, pipeline=4, chunks=4, layers_per_chunk=2, cached=True)
    assert naive.hop_units() == cached.hop_units() == [3, 5, 7]
    assert naive.padded_units == 7


MINIMUM_DESIGNS = {  # name: overrides (8 layers: chunks of 1, 2 or 4 layers)
    "attnres": ["model.residual=attnres"],
    "attnres+shortswa": ["model.residual=attnres", "model.shortswa.window=4"],
    "block_attnres S=2": ["model.residual=block_attnres", "model.attnres.block_size=2"],
    "block_attnres S=4": ["model.residual=block_attnres", "model.attnres.block_size=4"],
    "block_attnres+shortswa S=4": [
        "model.residual=block_attnres",
        "model.attnres.block_size=4",
        "model.shortswa.window=4",
    ],
    "depth_attn K=2": ["model.residual=depth_attn", "model.depth_attn.window=2"],
    "depth_attn K=3": ["model.residual=depth_attn", "model.depth_attn.window=3"],
    "depth_attn K=L+1": ["model.residual=depth_attn", "model.depth_attn.window=9"],
    "ddl d_v=4": ["model.residual=ddl", "model.ddl.dv=4"],
    "standard": ["model.residual=standard"],
}
MINIMUM_LAYOUTS = [(2, 2), (4, 2), (2, 4), (4, 1)]  # (PP, VPP); 8 layers


def _hop_plans(overrides, pipeline, virtual):
    from t2train.config.loader import load_config

    config = load_config(
        overrides=[
            "data.path=unused",
            "model.num_layers=8",
            "model.hidden_size=32",
            "model.num_attention_heads=4",
            "model.seq_length=8",
            f"parallel.pipeline={pipeline}",
            f"parallel.virtual_pipeline={virtual}",
            *overrides,
        ]
    )
    run = plan_hops(config)  # the run's plan, as the engine makes it
    return config.model, {
        (cached, shapes): replace(run, cached=cached, shapes=shapes)
        for cached in (False, True)
        for shapes in ("exact", "padded")
    }


@pytest.mark.parametrize("design", MINIMUM_DESIGNS)
def test_every_hop_carries_exactly_the_minimum(design):
    """HopPlan's hops equal the minimum written from each design's definition
    (``tests/hop_minimum.py``): cached hops carry exactly what the receiver lacks, naive
    hops what the rest of the model reads; exact hops put just that on the wire."""
    from hop_minimum import minimum_hop_units

    for layout in MINIMUM_LAYOUTS:
        model, plans = _hop_plans(MINIMUM_DESIGNS[design], *layout)
        for cached in (False, True):
            minimum = minimum_hop_units(model, *layout, cached=cached)
            assert plans[cached, "exact"].hop_units() == minimum, (layout, cached)
            assert plans[cached, "exact"].wire_hop_units() == minimum, (layout, cached)
            assert plans[cached, "padded"].wire_hop_units() == [max(minimum)] * len(minimum)


def test_a_hop_unit_is_the_sequence_or_a_tensor_ranks_slice_of_it():
    from t2train.config.loader import load_config

    def rows(*overrides):
        config = load_config(
            overrides=["data.path=unused", "model.seq_length=8", "parallel.tensor=2", *overrides]
        )
        return plan_hops(config).unit_rows

    assert rows() == 8
    assert rows("parallel.sequence_parallel=true") == 4
