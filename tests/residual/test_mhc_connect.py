"""`mhc`'s write and next read for compiled code (``t2train/residual/mhc/compiled.py``): the
forward and its hand-written backward against autograd of the mHC formulas (arXiv
2512.24880, Eq. 7-9), written out again here, in fp64 with weights off their init: a layer's
first read alone, a write and the next read together, a layer's last write alone; and
likely slips in such a backward, each caught by the same comparison."""

import pytest
import torch

from t2train.kernels import dispatch
from t2train.residual.mhc import compiled
from t2train.residual.mhc.compiled import Read, Write, connect

N, TOKENS, H, EPS, PRE_NORM_EPS, ITERATIONS = 3, (3, 2), 8, 1e-2, 1e-3, 4
M = N * N + 2 * N  # H~pre, H~post, H~res (row-major)


def _rand(g, *shape, scale=1.0, shift=0.0):
    return (shift + scale * torch.randn(*shape, generator=g, dtype=torch.float64)).requires_grad_()


def _sublayer(g, hidden):
    """One sublayer's parameters: phi [m, n h], the gates a [3], the biases b [m] and its
    pre-norm's weight."""
    return [
        _rand(g, M, N * hidden, scale=0.3 * (H / hidden) ** 0.5),
        _rand(g, 3, scale=0.5, shift=1.0),
        _rand(g, M, scale=0.5),
        _rand(g, hidden, scale=0.5, shift=1.0),
    ]


def _case(seed=0, tokens=TOKENS, hidden=H):
    g = torch.Generator().manual_seed(seed)
    state, out = _rand(g, N, *tokens, hidden), _rand(g, *tokens, hidden)
    return [state, out, *_sublayer(g, hidden), *_sublayer(g, hidden)]


def _sinkhorn(logits):
    """Eq. 9: M(0) = exp(H~res), M(t) = T_r(T_c(M(t - 1))), T_c dividing each column by its
    sum, T_r each row."""
    by_columns = lambda m: m / m.sum(-2, keepdim=True)  # noqa: E731
    by_rows = lambda m: m / m.sum(-1, keepdim=True)  # noqa: E731
    m = torch.exp(logits)
    for _ in range(ITERATIONS):
        m = by_rows(by_columns(m))
    return m


def _paper_read(state, phi, gates, bias, weight):
    """Eq. 7-8 on the stream flattened stream after stream: the sublayer's normed input,
    H_post and H_res."""
    flat = state.movedim(0, -2).flatten(-2)  # [..., n h]
    normed = flat / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + EPS)
    raw = normed @ phi.T
    pre = torch.sigmoid(gates[0] * raw[..., :N] + bias[:N])
    post = 2 * torch.sigmoid(gates[1] * raw[..., N : 2 * N] + bias[N : 2 * N])
    res = _sinkhorn((gates[2] * raw[..., 2 * N :] + bias[2 * N :]).unflatten(-1, (N, N)))
    x = sum(pre[..., j, None] * state[j] for j in range(N))
    x_normed = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + PRE_NORM_EPS) * weight
    return x_normed, post, res


def _paper_write(state, out, post, res):
    """x_(l+1) = H_res x_l + H_post^T F: stream i takes sum_j H_res[i, j] x_j + H_post[i] F."""
    return torch.stack(
        [
            sum(res[..., i, j, None] * state[j] for j in range(N)) + post[..., i, None] * out
            for i in range(N)
        ]
    )


def _paper_pair(state, out, *weights):
    first_normed, post, res = _paper_read(state, *weights[:4])
    new = _paper_write(state, out, post, res)
    return new, first_normed, *_paper_read(new, *weights[4:])


def _mappings(projected, gates, bias):
    post = 2 * torch.sigmoid(gates[1] * projected[..., N : 2 * N] + bias[N : 2 * N])
    res = _sinkhorn((gates[2] * projected[..., 2 * N :] + bias[2 * N :]).unflatten(-1, (N, N)))
    return post, res


def _read(phi, gates, bias, weight):
    return Read(phi, gates[:1], bias[:N], weight)


def _fused_pair(state, out, *weights):
    first, second = weights[:4], weights[4:]
    state, _, first_normed, projected, _ = connect(
        state, EPS, read=_read(*first), norm_eps=PRE_NORM_EPS
    )
    post, res = _mappings(projected, *first[1:3])
    new, _, x_normed, projected, _ = connect(
        state, EPS, write=Write(out, res, post), read=_read(*second), norm_eps=PRE_NORM_EPS
    )
    return new, first_normed, x_normed, *_mappings(projected, *second[1:3])


def _fused_last_write(state, out, *first):
    state, _, normed, projected, _ = connect(state, EPS, read=_read(*first), norm_eps=PRE_NORM_EPS)
    post, res = _mappings(projected, *first[1:3])
    (new,) = connect(state, EPS, write=Write(out, res, post))
    return new, normed


def _gradients(outputs, leaves, dtype=None):
    g = torch.Generator().manual_seed(7)
    upstream = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in outputs]
    return torch.autograd.grad(
        outputs, leaves, [u.to(dtype or o.dtype) for u, o in zip(upstream, outputs)]
    )


def _assert_same(got, want, leaves, tolerance=1e-10):
    """Outputs equal, then every leaf's gradient for random upstream gradients."""
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for grad, ref, leaf in zip(_gradients(got, leaves), _gradients(want, leaves), leaves):
        assert ref.abs().max() > 1e-3, leaf.shape  # every gradient is exercised
        torch.testing.assert_close(grad, ref, rtol=tolerance, atol=tolerance)


def test_a_write_and_the_next_read_match_autograd_of_the_formula():
    leaves = _case()
    _assert_same(list(_fused_pair(*leaves)), list(_paper_pair(*leaves)), leaves)


def test_a_layers_last_write_matches_autograd_of_the_formula():
    leaves = _case()[:6]
    want = _paper_pair(*leaves, *leaves[2:])[:2]
    _assert_same(list(_fused_last_write(*leaves)), list(want), leaves)


def test_the_read_weights_are_h_pre_for_diagnostics():
    state, _, phi, gates, bias, weight = _case()[:6]
    *_, read_weights = connect(state, EPS, read=_read(phi, gates, bias, weight), norm_eps=1e-3)
    flat = state.movedim(0, -2).flatten(-2)
    raw = flat / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + EPS) @ phi.T
    torch.testing.assert_close(read_weights, torch.sigmoid(gates[0] * raw[..., :N] + bias[:N]))
    assert not read_weights.requires_grad


def test_gradcheck_of_a_write_and_the_next_read():
    leaves = [t.detach().clone().requires_grad_() for t in _case(seed=2)]
    assert torch.autograd.gradcheck(lambda *a: _fused_pair(*a), leaves)


def _pull_over_h(*args):
    """The flat norm's pull on the handed-on projection's gradients divided by h (one
    stream's size) instead of n h."""
    total, grads = REAL_READ_BACKWARD(*args)
    streams, _, _, projected, inverse_rms, _, grad_projection, _ = args
    d = (projected * grad_projection).sum(-1, keepdim=True)  # the dp part of sum_k d_k p_k
    extra = (N - 1) * inverse_rms**2 / (N * H) * d
    return [t - extra * s for t, s in zip(total, streams.unbind(0))], grads


def _mixing_transposed(state, write, grad):
    return REAL_WRITE_BACKWARD(state, write._replace(mixing=write.mixing.mT), grad)


def _gate_gradient_dropped(*args):
    total, (grad_phi, grad_gate, grad_bias, grad_weight) = REAL_READ_BACKWARD(*args)
    return total, (grad_phi, torch.zeros_like(grad_gate), grad_bias, grad_weight)


REAL_READ_BACKWARD = compiled._read_backward
REAL_WRITE_BACKWARD = compiled._write_backward


@pytest.mark.parametrize(
    "name, slip",
    [
        ("_read_backward", _pull_over_h),
        ("_write_backward", _mixing_transposed),
        ("_read_backward", _gate_gradient_dropped),
    ],
)
def test_likely_slips_in_the_backward_fail_the_comparison(monkeypatch, name, slip):
    monkeypatch.setattr(compiled, name, slip)
    leaves = _case()
    got, want = _fused_pair(*leaves), _paper_pair(*leaves)
    grads, expected = _gradients(list(got), leaves), _gradients(list(want), leaves)
    assert max((a - b).abs().max().item() for a, b in zip(grads, expected)) > 1e-4


def test_the_backward_kernel_matches_autograd_of_the_formula(monkeypatch):
    """A layer's first read and a write with the next read, their backward in the Triton
    kernel (dphi a GEMM beside it), in fp32 against fp64 autograd of the formulas: 15 tokens
    are 4 blocks shared by 2 programs (each adds a second block to its partial sum of the
    pre-norm's dw) and h = 200 is two hidden blocks of 128, the second part masked."""
    case = _case(seed=3, tokens=(3, 5), hidden=200)
    leaves = [t.detach().float().requires_grad_() for t in case]
    monkeypatch.setenv("T2_KERNELS", "triton")
    dispatch.reset_launches()
    got = list(_fused_pair(*leaves))
    grads = _gradients(got, leaves, torch.float32)
    assert dict(dispatch.launches) == {"mhc_connect_backward": 2}
    expected = _gradients(list(_paper_pair(*case)), case)
    for grad, ref in zip(grads, expected):
        assert ref.abs().max() > 1e-3, ref.shape  # every gradient is exercised
        torch.testing.assert_close(grad.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max())


@pytest.mark.gpu
def test_the_backward_kernel_in_bf16_matches_the_reference(monkeypatch):
    """On a GPU at hidden 2048: the kernel's gradients against the PyTorch reference's, both
    from the same bf16 inputs, within bf16's tolerance of the largest value."""
    case = [t.detach().to("cuda", torch.bfloat16) for t in _case(tokens=(64, 2), hidden=2048)]
    results = {}
    for choice in ("triton", "torch"):
        monkeypatch.setenv("T2_KERNELS", choice)
        leaves = [t.clone().requires_grad_() for t in case]
        results[choice] = _gradients(list(_fused_pair(*leaves)), leaves)
    for ours, theirs in zip(results["triton"], results["torch"]):
        scale = theirs.float().abs().max()
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=0, atol=2e-2 * scale)
