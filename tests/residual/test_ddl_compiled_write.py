"""`ddl`'s write for compiled code (``t2train/residual/ddl/compiled.py``): its forward and its
hand-written backward against autograd of the formula, written out again here (the gate beta
read from the pre-norm of x, its weight among the leaves), in fp64 with weights off their
init, for the vector state (d_v = 1, v read from the state itself) and the matrix state
(d_v = 4, v read from a separate compressed input)."""

from types import SimpleNamespace

import pytest
import torch

from t2train.residual.ddl.compiled import delta_write_fused

H, K_EPS, V_SCALE = 16, 0.3, 4.0  # a k_eps that matters at this |out|
NORM_EPS = 0.5  # matters at |x| ~ 1; exact in fp32, as torch's RMSNorm rounds its epsilon


def _formula(state, x, norm_w, out, beta_w, beta_b, v_w, v_b):
    """X_j + beta (v_j - k^T X_j) k, k = out / sqrt(|out|^2 + eps^2), beta = 2 sigmoid(.) of
    the pre-norm c = x / sqrt(mean(x^2) + eps) w, v = v_scale sigmoid(.) of x, in the inputs'
    precision (fp64 here)."""
    normed = x / torch.sqrt((x * x).mean(-1, keepdim=True) + NORM_EPS) * norm_w
    beta = 2 * torch.sigmoid(normed @ beta_w.T + beta_b)
    v = V_SCALE * torch.sigmoid(x @ v_w.T + v_b)
    k = out / torch.sqrt((out * out).sum(-1, keepdim=True) + K_EPS**2)
    if state.dim() == out.dim() + 1:  # column j of the [d_v, ..., h] state gets v[..., j]
        v = v.permute(-1, *range(v.dim() - 1)).unsqueeze(-1)
    return state + beta * (v - (k * state).sum(-1, keepdim=True)) * k


def _case(dv: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).requires_grad_()

    state = rand(*(() if dv == 1 else (dv,)), 3, 2, H)
    x = state if dv == 1 else rand(3, 2, H)  # d_v = 1: v reads the state itself
    out = rand(3, 2, H, scale=0.2)  # |out| ~ k_eps
    norm = torch.nn.RMSNorm(H, eps=NORM_EPS).double()
    beta_proj, v_proj = torch.nn.Linear(H, 1).double(), torch.nn.Linear(H, dv).double()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(H, generator=g))
        for linear in (beta_proj, v_proj):
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=g))
            linear.bias.copy_(torch.randn(linear.bias.shape, generator=g))
    return state, x, norm, out, beta_proj, v_proj


def _leaves(state, x, norm, out, beta_proj, v_proj):
    inputs = [state, norm.weight, out] if x is state else [state, x, norm.weight, out]
    return inputs + [beta_proj.weight, beta_proj.bias, v_proj.weight, v_proj.bias]


@pytest.mark.parametrize("dv", [1, 4])
def test_compiled_write_matches_autograd_of_the_formula(dv):
    state, x, norm, out, beta_proj, v_proj = case = _case(dv)
    written = delta_write_fused(state, x, norm, out, beta_proj, v_proj, K_EPS, V_SCALE)
    params = (beta_proj.weight, beta_proj.bias, v_proj.weight, v_proj.bias)
    expected = _formula(state, x, norm.weight, out, *params)
    torch.testing.assert_close(written, expected, rtol=1e-12, atol=1e-12)

    upstream = torch.randn_like(expected)
    leaves = _leaves(*case)
    grads = torch.autograd.grad(written, leaves, upstream)
    want = torch.autograd.grad(expected, leaves, upstream)
    for got, ref, leaf in zip(grads, want, leaves):
        assert ref.abs().max() > 1e-3, leaf.shape  # every gradient is exercised
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dv", [1, 4])
def test_compiled_write_passes_gradcheck_in_fp64(dv):
    state, x, norm, out, beta_proj, v_proj = _case(dv, seed=1)
    shared = x is state

    def write(*leaves):
        s, *rest = leaves
        xi, nw, o, bw, bb, vw, vb = (s, *rest) if shared else rest
        # it reads the modules' weights: hand it the leaves under test
        n = SimpleNamespace(weight=nw, eps=NORM_EPS)
        beta, v = SimpleNamespace(weight=bw, bias=bb), SimpleNamespace(weight=vw, bias=vb)
        return delta_write_fused(s, xi, n, o, beta, v, K_EPS, V_SCALE)

    leaves = _leaves(state, x, norm, out, beta_proj, v_proj)
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    assert torch.autograd.gradcheck(write, leaves)
