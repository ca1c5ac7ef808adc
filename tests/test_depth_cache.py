"""The depth cache's gradient routing, in one process: two chunks of one micro-batch."""

import torch

from t2train.parallel.depth_cache import DepthCache, HopPlan


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
