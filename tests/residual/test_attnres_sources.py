"""AttnRes' sources in one buffer (``t2train/residual/attnres/sources.py``): each read gets
the earlier sources as one view of the buffer, and every source's producer gets the sum of
what the reads returned for it, as if the reads had stacked the sources themselves."""

import pytest
import torch

from t2train.residual.attnres import sources


def _read(query, stack):
    """A softmax mixture of the stack's rows (any function of all rows would do)."""
    weights = torch.softmax(stack @ query, dim=0)
    return (weights.unsqueeze(-1) * stack).sum(0)


def test_reads_see_the_sources_and_gradients_reach_their_producers():
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(3, 2, 4, generator=g, requires_grad=True) for _ in range(3)]
    queries = [torch.randn(4, generator=g) for _ in range(3)]
    weights = [torch.randn(3, 2, 4, generator=g) for _ in range(3)]

    def loss(reads):
        return sum((w * r).sum() for w, r in zip(weights, reads))

    # reference: each layer stacks the sources itself
    made = [leaf * 2 for leaf in leaves]  # producers between the leaves and the sources
    reads = []
    for i, query in enumerate(queries):
        reads.append(_read(query, torch.stack(made[: i + 1])))
    want = torch.autograd.grad(loss(reads), leaves)

    made = [leaf * 2 for leaf in leaves]
    buffer, earlier = sources.start([made[0]], capacity=3)
    reads = []
    for i, query in enumerate(queries):
        assert earlier.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        reads.append(_read(query, earlier))
        earlier = sources.extend(buffer, earlier, tuple(made[i + 1 : i + 2]))
    got = torch.autograd.grad(loss(reads), leaves)

    for ours, theirs in zip(got, want):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    assert all(grad.abs().sum() > 0 for grad in got)


def test_extending_by_nothing_returns_the_same_view():
    buffer, earlier = sources.start([torch.randn(2, 3)], capacity=2)
    assert sources.extend(buffer, earlier, ()) is earlier


def test_a_full_buffer_says_how_many_sources_it_holds():
    buffer, earlier = sources.start([torch.randn(2, 3), torch.randn(2, 3)], capacity=2)
    with pytest.raises(RuntimeError, match="holds 2 sources, 3 needed"):
        sources.extend(buffer, earlier, (torch.randn(2, 3),))
