"""`hc`'s stream read and write for compiled code (``t2train/residual/unrolled.py``,
``t2train/residual/hc/compiled.py``): forward and hand-written backward against autograd of
the Hyper-Connections formulas, written out again here, in fp64 with weights off their init:
the read alone (a layer's first), a write and the next read together, a write alone; and
the same backward with its Triton kernel (``t2train/kernels/hyper_connect.py``, interpreter,
fp32)."""

import pytest
import torch

from t2train.kernels import dispatch
from t2train.residual.hc.compiled import Read, Write, connect
from t2train.residual.hc.functional import folded_projections
from t2train.residual.unrolled import stream_write_fused

N, TOKENS, H, EPS, PRE_NORM_EPS = 3, (3, 2), 8, 1e-2, 1e-3


def _rand(g, *shape, scale=1.0):
    return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).requires_grad_()


def _width_case(seed=0, tokens=TOKENS, hidden=H):
    g = torch.Generator().manual_seed(seed)
    return [
        _rand(g, N, *tokens, hidden),  # the streams
        _rand(g, hidden, N + 1),  # W_a = [W_m, W_r]
        _rand(g, hidden),  # W_b
        _rand(g, hidden, scale=0.5),  # the stream norm's weight
        _rand(g, N, N + 1),  # static [A_m | A_r]
        _rand(g, N),  # static B
        _rand(g, 1),  # s_a
        _rand(g, 1),  # s_b
        _rand(g, hidden, scale=0.5),  # the sublayer's pre-norm's weight
    ]


def _paper_width(state, w_a, w_b, norm_weight, static_alpha, static_beta, s_a, s_b, pre):
    """DHC (Eq. 10-13 of arXiv 2409.19606): H~ = RMSNorm(H) per stream, A_m, A_r =
    s_a tanh(H~ W_a) + static, B = s_b tanh(H~ W_b) + static; x = sum_i A_m[i] h_i, and
    the sublayer reads RMSNorm(x) with its own weight."""
    normed = state / torch.sqrt(state.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight
    alpha = static_alpha + s_a * torch.tanh(normed @ w_a).movedim(0, -2)  # [..., n, n + 1]
    beta = static_beta + s_b * torch.tanh(normed @ w_b).movedim(0, -1)  # [..., n]
    x = sum(alpha[..., i, 0, None] * state[i] for i in range(N))
    x_normed = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + PRE_NORM_EPS) * pre
    return x_normed, alpha[..., 0], alpha[..., 1:], beta


def _read_part(w_a, w_b, norm_weight, static_alpha, s_a, pre):
    return Read(folded_projections(w_a, w_b, norm_weight), static_alpha, s_a, pre)


def _fused_width(state, w_a, w_b, norm_weight, static_alpha, static_beta, s_a, s_b, pre):
    """The read alone (a layer's first), its logits turned into the write's A_r and B."""
    read_part = _read_part(w_a, w_b, norm_weight, static_alpha, s_a, pre)
    _, _, x_normed, logits, read = connect(state, EPS, read=read_part, norm_eps=PRE_NORM_EPS)
    residual = static_alpha[:, 1:] + s_a * torch.tanh(logits[..., 1 : N + 1]).movedim(0, -2)
    beta = static_beta + s_b * torch.tanh(logits[..., N + 1]).movedim(0, -1)
    return x_normed, read, residual, beta


def _paper_write(state, residual, beta, out):
    """H' = A_r^T H + B^T T: stream j takes sum_i A_r[i, j] h_i + B_j out."""
    return torch.stack(
        [
            sum(residual[..., i, j, None] * state[i] for i in range(N)) + beta[..., j, None] * out
            for j in range(N)
        ]
    )


def _write_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        _rand(g, N, *TOKENS, H),
        _rand(g, *TOKENS, N, N),
        _rand(g, *TOKENS, N),
        _rand(g, *TOKENS, H),
    ]


def _assert_same_gradients(got, want, leaves, tolerance=1e-10):
    """Outputs equal, then the gradients of every leaf for random upstream gradients."""
    g = torch.Generator().manual_seed(7)
    upstream = [torch.randn(w.shape, generator=g, dtype=w.dtype) for w in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tolerance * 1e-2, atol=tolerance * 1e-2)
    grads = torch.autograd.grad(got, leaves, upstream)
    expected = torch.autograd.grad(want, leaves, upstream)
    for grad, ref, leaf in zip(grads, expected, leaves):
        assert ref.abs().max() > 1e-3, leaf.shape  # every gradient is exercised
        torch.testing.assert_close(grad, ref, rtol=tolerance, atol=tolerance)


def test_width_connection_matches_autograd_of_the_formula():
    leaves = _width_case()
    x, read, residual, beta = _fused_width(*leaves)
    want = _paper_width(*leaves)
    torch.testing.assert_close(read, want[1], rtol=1e-12, atol=1e-12)
    assert not read.requires_grad  # the read weights are for diagnostics
    _assert_same_gradients([x, residual, beta], [want[0], want[2], want[3]], leaves)


def test_stream_write_matches_autograd_of_the_formula():
    leaves = _write_case()
    _assert_same_gradients([stream_write_fused(*leaves)], [_paper_write(*leaves)], leaves)


@pytest.mark.parametrize("which", ["width", "write"])
def test_gradcheck_in_fp64(which):
    if which == "width":
        leaves, fn = _width_case(seed=1), lambda *a: [_fused_width(*a)[i] for i in (0, 2, 3)]
    else:
        leaves, fn = _write_case(seed=1), stream_write_fused
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    assert torch.autograd.gradcheck(fn, leaves)


def test_the_comparison_sees_the_norms_gradient():
    """A likely slip in a hand-written backward, leaving out the gradient through the stream
    norm's 1 / RMS, moves the streams' gradient by more than the tolerance above."""
    leaves = _width_case()
    state, *rest = leaves
    upstream = torch.randn(*TOKENS, H, dtype=torch.float64)

    def x_of(rms_grad: bool):
        rms = torch.sqrt(state.pow(2).mean(-1, keepdim=True) + EPS)
        normed = state / (rms if rms_grad else rms.detach()) * rest[2]
        alpha = rest[3] + rest[5] * torch.tanh(normed @ rest[0]).movedim(0, -2)
        x = sum(alpha[..., i, 0, None] * state[i] for i in range(N))
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + PRE_NORM_EPS) * rest[7]

    (fused,) = torch.autograd.grad(_fused_width(*leaves)[0], state, upstream)
    (slip,) = torch.autograd.grad(x_of(rms_grad=False), state, upstream)
    (paper,) = torch.autograd.grad(x_of(rms_grad=True), state, upstream)
    torch.testing.assert_close(fused, paper, rtol=1e-10, atol=1e-10)
    assert (fused - slip).abs().max() > 1e-4


def _pair_case(seed=0, tokens=TOKENS, hidden=H):
    """Sublayer k's write (its output, its weights, the logits of its read) and sublayer
    k + 1's read weights."""
    g = torch.Generator().manual_seed(seed)
    first, second = _width_case(seed, tokens, hidden), _width_case(seed + 10, tokens, hidden)
    return [first[0], _rand(g, *tokens, hidden), *first[1:], *second[1:]]


WEIGHTS = len(_width_case()) - 1  # of one sublayer


def _paper_pair(state, out, *weights):
    """Sublayer k reads, its write takes its A_r and B, sublayer k + 1 reads the new state:
    the new state, both sublayers' normed inputs, k + 1's A_r and B."""
    first_normed, _, residual, beta = _paper_width(state, *weights[:WEIGHTS])
    new = _paper_write(state, residual, beta, out)
    x_normed, read, residual, beta = _paper_width(new, *weights[WEIGHTS:])
    return new, first_normed, x_normed, residual, beta


def _first_read(state, first):
    """A layer's first read: the state it hands back, its normed input and its logits."""
    read_part = _read_part(*first[:4], first[5], first[7])
    state, _, normed, logits, _ = connect(state, EPS, read=read_part, norm_eps=PRE_NORM_EPS)
    return state, normed, logits


def _fused_pair(state, out, *weights):
    first, second = weights[:WEIGHTS], weights[WEIGHTS:]
    state, first_normed, logits = _first_read(state, first)
    write = Write(out, logits, first[3], first[4], first[5], first[6])
    read_part = _read_part(*second[:4], second[5], second[7])
    new, _, x_normed, logits, _ = connect(
        state, EPS, write=write, read=read_part, norm_eps=PRE_NORM_EPS
    )
    residual = second[3][:, 1:] + second[5] * torch.tanh(logits[..., 1 : N + 1]).movedim(0, -2)
    beta = second[4] + second[6] * torch.tanh(logits[..., N + 1]).movedim(0, -1)
    return new, first_normed, x_normed, residual, beta


def _fused_last_write(state, out, *weights):
    state, normed, logits = _first_read(state, weights)
    (new,) = connect(state, EPS, write=Write(out, logits, *weights[3:7]))
    return new, normed


def test_a_write_and_the_next_read_match_autograd_of_the_formula():
    leaves = _pair_case()
    _assert_same_gradients(list(_fused_pair(*leaves)), list(_paper_pair(*leaves)), leaves)


def test_a_layers_last_write_matches_autograd_of_the_formula():
    leaves = _pair_case()[: 2 + WEIGHTS]
    want = _paper_pair(*leaves, *leaves[2:])[:2]
    _assert_same_gradients(list(_fused_last_write(*leaves)), list(want), leaves)


def test_gradcheck_of_a_write_and_the_next_read():
    leaves = [t.detach().clone().requires_grad_() for t in _pair_case(seed=2)]
    assert torch.autograd.gradcheck(lambda *a: _fused_pair(*a), leaves)


def test_the_backward_kernel_matches_autograd_of_the_formula(monkeypatch):
    """A layer's first read and a write with the next read, their backward in the Triton
    kernel, in fp32 against fp64 autograd of the formulas: 15 tokens are 4 blocks shared by
    2 programs (each adds a second block to its partial sums of dF) and h = 80 is two hidden
    blocks, the second part masked."""
    case = _pair_case(seed=3, tokens=(3, 5), hidden=80)
    leaves = [t.detach().float().requires_grad_() for t in case]
    monkeypatch.setenv("T2_KERNELS", "triton")
    dispatch.reset_launches()
    got = list(_fused_pair(*leaves))
    want = [t.float() for t in _paper_pair(*case)]
    g = torch.Generator().manual_seed(7)
    upstream = [torch.randn(w.shape, generator=g, dtype=torch.float64) for w in want]
    grads = torch.autograd.grad(got, leaves, [u.float() for u in upstream])
    assert dict(dispatch.launches) == {"hc_connect_backward": 2}
    expected = torch.autograd.grad(_paper_pair(*case), case, upstream)
    for grad, ref in zip(grads, expected):
        assert ref.abs().max() > 1e-3, ref.shape  # every gradient is exercised
        torch.testing.assert_close(grad.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max())


@pytest.mark.gpu
def test_the_backward_kernel_in_bf16_matches_the_reference(monkeypatch):
    """On a GPU at hidden 2048: the kernel's gradients against the PyTorch reference's, both
    from the same bf16 inputs, within bf16's tolerance of the largest value."""
    case = [t.detach().to("cuda", torch.bfloat16) for t in _pair_case(tokens=(64, 2), hidden=2048)]
    g = torch.Generator().manual_seed(7)
    shapes = [o.shape for o in _paper_pair(*_pair_case(tokens=(64, 2), hidden=2048))]
    upstream = [torch.randn(shape, generator=g).to("cuda", torch.bfloat16) for shape in shapes]
    results = {}
    for choice in ("triton", "torch"):
        monkeypatch.setenv("T2_KERNELS", choice)
        leaves = [t.clone().requires_grad_() for t in case]
        results[choice] = torch.autograd.grad(list(_fused_pair(*leaves)), leaves, upstream)
    for ours, theirs in zip(results["triton"], results["torch"]):
        scale = theirs.float().abs().max()
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=0, atol=2e-2 * scale)
