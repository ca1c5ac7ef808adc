"""Triton two-phase Block AttnRes vs ``t2train.residual.attnres.functional.depth_mix``
(interpreter). The sources come as the trainer passes them: the earlier layers' sources as
one stack, this layer's as stacks of one."""

import pytest
import torch

from t2train.residual.attnres.functional import depth_mix
from t2train.residual.attnres.layers import mix_sources

from kernel_checks import DEVICE, assert_matches

EPS = 1e-6


def _inputs(n_sources, dtype, tokens=(3, 2), hidden=24):
    g = torch.Generator().manual_seed(3)
    make = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype)  # noqa: E731
    query = make(hidden)
    sources = [make(*tokens, hidden) * (1 + n) for n in range(n_sources)]
    return query, make(*tokens, hidden), *sources


def _stacks(sources):
    """The first sources as one stack (the earlier layers'), the last one alone."""
    earlier = [torch.stack(sources[:-1])] if len(sources) > 1 else []
    return earlier + [sources[-1].unsqueeze(0)]


def _earlier_and_new(sources):
    """The first sources as one stack (the earlier layers'), the last one as a new source."""
    return torch.stack(sources[:-1]), [sources[-1]]


def _check(n_sources, with_partial, dtype):
    def kernel(query, partial, *sources):
        return mix_sources(query, _stacks(sources), partial if with_partial else None, EPS)

    def reference(query, partial, *sources):
        values = list(sources) + ([partial] if with_partial else [])
        return depth_mix(query, [v.unsqueeze(0) for v in values], EPS)

    assert_matches(kernel, reference, _inputs(n_sources, dtype), dtype, "depth_mix")


@pytest.mark.parametrize("with_partial", [True, False], ids=["partial", "block_start"])
@pytest.mark.parametrize("n_sources", [1, 3])
def test_fp32(n_sources, with_partial):
    _check(n_sources, with_partial, torch.float32)


@pytest.mark.parametrize("with_partial", [True, False], ids=["partial", "block_start"])
def test_fp32_over_several_slices_of_h(monkeypatch, with_partial):
    """Tiles narrower than h, as on a GPU at any real width: every loop over h runs twice."""
    from t2train.kernels import depth_mix as kernels

    monkeypatch.setattr(kernels, "BLOCK_ELEMENTS", 64)
    assert kernels._phase1_blocks(4, 1, 24)["BLOCK_H"] < 24
    _check(3, with_partial, torch.float32)


def test_fp16():
    _check(3, True, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("with_partial", [True, False], ids=["partial", "block_start"])
def test_bf16(with_partial):
    _check(3, with_partial, torch.bfloat16)


def test_phase_1_batches_the_block_queries():
    """S queries at once equal S separate mixtures; the LSE is the softmax normaliser. The
    earlier sources are the first rows of a larger buffer whose other rows are not read."""
    from t2train.kernels.depth_mix import phase_1

    query, _, *sources = _inputs(5, torch.float32)
    queries = torch.stack([query, -query, 0.5 * query])
    buffer = torch.full((6, *sources[0].shape), float("nan"))
    buffer[:4] = torch.stack(sources[:4])
    outs, lse = phase_1(queries, [buffer[:4], sources[4].unsqueeze(0)], EPS)
    stacked = torch.stack(sources)
    for s, q in enumerate(queries):
        torch.testing.assert_close(outs[s], depth_mix(q, [stacked], EPS), atol=1e-5, rtol=1e-5)
    keys = stacked * torch.rsqrt(stacked.pow(2).mean(-1, keepdim=True) + EPS)
    torch.testing.assert_close(lse, torch.logsumexp(keys @ queries.T, 0).permute(2, 0, 1))


@pytest.mark.parametrize("rounded", [False, True], ids=["fp32_mixture", "rounded"])
def test_phase_1_hands_the_sources_on_and_adds_their_later_gradient(rounded):
    """Phase 1 as a layer calls it: each query's O a tensor of its own (its gradient read
    where it is), and the earlier layers' sources (a stack) and the layer's own come back as
    they came, the gradient each gets after the read added, row by row, to the read's own in
    the backward kernel."""
    from t2train.kernels import dispatch
    from t2train.residual.attnres.functional import block_phase_1
    from t2train.residual.attnres.layers import BLOCK_PHASE_1

    def flat(outputs):  # one tensor, so that each output gets its own upstream gradient
        return torch.cat([t.float().flatten() for t in torch.utils._pytree.tree_leaves(outputs)])

    def kernel(queries, *sources):
        earlier, new = torch.stack(sources[:2]), list(sources[2:])
        phase_1 = dispatch.route(BLOCK_PHASE_1, queries, earlier, *new)
        return flat(phase_1(queries, earlier, new, EPS, rounded=rounded))

    def reference(queries, *sources):
        earlier, new = torch.stack(sources[:2]), list(sources[2:])
        stacks = [earlier] + [source.unsqueeze(0) for source in new]
        out, lse = block_phase_1(queries, stacks, EPS, rounded=rounded)
        return flat((*out.unbind(0), lse, earlier, *new))

    query, _, *sources = _inputs(4, torch.float32)
    queries = torch.stack([query, -query, 0.5 * query])
    assert_matches(kernel, reference, [queries, *sources], torch.float32, "block_phase_1")


def test_phase_2_hands_the_partial_sum_on_and_adds_its_later_gradient():
    """Phase 2 as a layer calls it: the partial sum comes back as it came, and the gradient
    it gets after the read is added to the read's own in the backward kernel."""
    from t2train.kernels import dispatch
    from t2train.residual.attnres.functional import block_phase_1
    from t2train.residual.attnres.layers import BLOCK_PHASE_2

    def flat(outputs):  # one tensor, so that each output gets its own upstream gradient
        return torch.cat([t.float().flatten() for t in outputs])

    def merged(query, partial, *sources):
        out, lse = block_phase_1(query[None], [torch.stack(sources)], EPS)
        return partial, query, out[0], lse[0]

    def kernel(*inputs):
        args = merged(*inputs)
        return flat(dispatch.route(BLOCK_PHASE_2, args[0], args[2])(*args, EPS))

    def reference(*inputs):
        args = merged(*inputs)
        return flat((depth_mix(args[1], [torch.stack(inputs[2:]), args[0][None]], EPS), args[0]))

    assert_matches(kernel, reference, _inputs(3, torch.float32), torch.float32, "block_phase_2")


def test_reference_passes_gradcheck():
    inputs = [t.double().requires_grad_() for t in _inputs(3, torch.float32, (2, 1), 6)]
    assert torch.autograd.gradcheck(lambda q, *v: depth_mix(q, _stacks(v), EPS), inputs)


def test_a_block_read_with_its_mixture_rounded():
    """A block read as the layer runs it: phase 1 keeping each mixture in the sources' dtype
    (``rounded``), phase 2 merging it with the partial sum. The kernels against the
    references in fp16, and the result within two roundings of the exact fp32 mixture of
    the sources and the partial sum (one for the kept mixture, one for the result)."""
    from t2train.residual.attnres.layers import BLOCK_PHASE_1, BLOCK_PHASE_2

    def read(phase_1, phase_2, query, partial, *sources):
        outs, lse, *_ = phase_1(query[None], *_earlier_and_new(sources), EPS, rounded=True)
        assert outs[0].dtype == partial.dtype
        merged, _ = phase_2(partial, query, outs[0], lse[0], EPS)
        return merged

    inputs = _inputs(3, torch.float16)
    kernels = (BLOCK_PHASE_1.triton_function(), BLOCK_PHASE_2.triton_function())
    got = read(*kernels, *inputs)
    want = read(BLOCK_PHASE_1.reference, BLOCK_PHASE_2.reference, *inputs)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    query, partial, *sources = (t.float() for t in inputs)
    exact = depth_mix(query, [v.unsqueeze(0) for v in [*sources, partial]], EPS)
    bound = 2 * 2.0**-10 * exact.abs().amax(-1, keepdim=True)  # fp16: 10 mantissa bits
    assert ((want.float() - exact).abs() <= bound).all()
