"""Triton mHC stream read and write vs mHC's equations written out here (interpreter on CPU):
outputs and the gradients of every input, the write's through the unrolled Sinkhorn-Knopp
iterations. Nothing of ``t2train`` computes the expectation, so a mistake written into both
the kernel and the design's PyTorch reference fails here."""

import pytest
import torch

from t2train.residual.mhc.functional import stream_read, stream_write
from t2train.residual.mhc.layers import read_streams, write_streams, write_weights

from kernel_checks import DEVICE, assert_matches, run_kernels

TOKENS = (2, 2)  # [s, b]: the interpreter runs one program per token


def _inputs(n, dtype, hidden=40, spread=2.0):
    g = torch.Generator().manual_seed(3)
    make = lambda *shape, scale=1.0: (scale * torch.randn(*shape, generator=g)).to(  # noqa: E731
        DEVICE, dtype
    )
    return (
        make(n, *TOKENS, hidden),
        make(*TOKENS, hidden),
        make(*TOKENS, n),
        make(*TOKENS, n, n, scale=spread),
    )


def _paper_read(state, pre_logit):
    """The sublayer's input H_pre x_l = sum_j sigma(H~pre_j) x_j (Eq. 3 and Eq. 8)."""
    return sum(torch.sigmoid(pre_logit[..., j, None]) * state[j] for j in range(state.shape[0]))


def _paper_sinkhorn(logits, iterations):
    """Eq. 9: M(0) = exp(H~res); M(t) = T_r(T_c(M(t-1))), T_c then T_r dividing each column,
    then each row, by its sum; H_res = M(t_max)."""
    m = torch.exp(logits)
    for _ in range(iterations):
        m = m / m.sum(-2, keepdim=True)
        m = m / m.sum(-1, keepdim=True)
    return m


def _paper_write(state, out, post_logit, res_logit, iterations):
    """x_{l+1} = H_res x_l + H_post^T F: stream i becomes sum_j H_res[i, j] x_j +
    2 sigma(H~post_i) F (Eq. 3 and Eq. 8)."""
    mixing = _paper_sinkhorn(res_logit, iterations)
    n = state.shape[0]
    return torch.stack(
        [
            sum(mixing[..., i, j, None] * state[j] for j in range(n))
            + 2 * torch.sigmoid(post_logit[..., i, None]) * out
            for i in range(n)
        ]
    )


@pytest.mark.parametrize("n", [4, 3, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_read_is_the_papers(n, dtype):
    state, _, pre, _ = _inputs(n, dtype)
    assert_matches(read_streams, _paper_read, (state, pre), dtype, "stream_read")


@pytest.mark.parametrize(
    "n, iterations, hidden", [(4, 20, 40), (3, 7, 24), (1, 3, 16), (4, 5, 600)]
)
def test_write_is_the_papers(n, iterations, hidden):
    """fp32 at 1e-5; hidden 600 loops over two blocks of the hidden dim."""
    assert_matches(
        lambda *t: write_streams(*t, iterations),
        lambda *t: _paper_write(*t, iterations),
        _inputs(n, torch.float32, hidden),
        torch.float32,
        "stream_write",
    )


def _side_by_side(gains, mixing):
    return torch.cat([gains, mixing.flatten(-2)], -1)


@pytest.mark.parametrize("n, iterations", [(4, 20), (3, 7), (1, 3)])
def test_write_mappings_are_the_papers(n, iterations):
    """H_post = 2 sigma(H~post) and H_res = SK(H~res) alone (compiled code's write takes
    them as given), fp32, the gradients through the iterations."""
    _, _, post, res = _inputs(n, torch.float32)
    assert_matches(
        lambda *t: _side_by_side(*write_weights(*t, iterations)),
        lambda post, res: _side_by_side(2 * torch.sigmoid(post), _paper_sinkhorn(res, iterations)),
        (post, res),
        torch.float32,
        "mhc_write_mappings",
    )


def test_write_fp16():
    assert_matches(
        lambda *t: write_streams(*t, 4),
        lambda *t: _paper_write(*t, 4),
        _inputs(4, torch.float16, spread=1.0),
        torch.float16,
        "stream_write",
    )


def test_the_sinkhorn_order_and_the_mixing_orientation_are_the_papers():
    """With 2 iterations on logits spread over ~8, rows (normalised last) sum to 1 exactly and
    columns do not: the other order, or the transposed mixing, would be off by far more than
    the tolerance."""
    state, out, post, res = _inputs(4, torch.float32, spread=4.0)
    got = run_kernels(write_streams, state, out, post, res, 2)
    want = _paper_write(state, out, post, res, 2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    mixing = _paper_sinkhorn(res, 2)
    torch.testing.assert_close(mixing.sum(-1), torch.ones(*TOKENS, 4), atol=1e-6, rtol=0)
    assert (mixing.sum(-2) - 1).abs().max() > 1e-2

    def other_order(logits, iterations):
        m = torch.exp(logits)
        for _ in range(iterations):
            m = m / m.sum(-1, keepdim=True)
            m = m / m.sum(-2, keepdim=True)
        return m

    swapped = other_order(res, 2)
    assert (
        torch.einsum("sbij,jsbh->isbh", swapped, state)
        - torch.einsum("sbij,jsbh->isbh", mixing, state)
    ).abs().max() > 1e-2
    transposed = torch.einsum("sbji,jsbh->isbh", mixing, state)
    assert (transposed - torch.einsum("sbij,jsbh->isbh", mixing, state)).abs().max() > 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4, 1])
def test_bf16(n):
    state, out, post, res = _inputs(n, torch.bfloat16, hidden=2048)
    assert_matches(read_streams, _paper_read, (state, post), torch.bfloat16, "stream_read")
    assert_matches(
        lambda *t: write_streams(*t, 20),
        lambda *t: _paper_write(*t, 20),
        (state, out, post, res),
        torch.bfloat16,
        "stream_write",
    )


def test_shapes_are_checked():
    from t2train.kernels.stream_mix import stream_write as fused

    state, out, post, res = _inputs(4, torch.float32)
    with pytest.raises(ValueError, match="res_logit"):
        fused(state, out, post, res[..., :3], 2)


def test_references_are_the_papers_and_pass_gradcheck():
    """The design's PyTorch reference (what runs without the kernels) equals the written-out
    equations in fp64, and its gradients are right (gradcheck)."""
    inputs = [
        t[:, :1].double().requires_grad_()
        if t.dim() == 4 and t.shape[0] == 3
        else t[:1].double().requires_grad_()
        for t in _inputs(3, torch.float32, hidden=3)
    ]
    torch.testing.assert_close(
        stream_write(*inputs, 6), _paper_write(*inputs, 6), atol=1e-12, rtol=0
    )
    torch.testing.assert_close(
        stream_read(inputs[0], inputs[2]), _paper_read(inputs[0], inputs[2]), atol=1e-12, rtol=0
    )
    assert torch.autograd.gradcheck(lambda *t: stream_write(*t, 6), inputs)
    assert torch.autograd.gradcheck(stream_read, (inputs[0], inputs[2]))
