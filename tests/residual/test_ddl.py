"""Deep Delta Learning's operator identities (arXiv 2601.00417, Sec. 2)."""

import pytest
import torch

from t2train.residual.ddl import delta_update, normalized_direction


def _inputs(dv: int, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    columns = () if dv == 1 else (dv,)  # the matrix state is stored column-major
    state = torch.randn(*columns, 3, 2, 16, generator=g, dtype=dtype)
    k = normalized_direction(torch.randn(3, 2, 16, generator=g, dtype=dtype), eps=0.0)
    v = torch.randn(*columns, 3, 2, 1, generator=g, dtype=dtype)
    return state, k.to(dtype), v


def _readout(state, k):
    return (k * state).sum(-1, keepdim=True)


@pytest.mark.parametrize("dv", [1, 4])
def test_beta_zero_is_identity(dv):
    state, k, v = _inputs(dv)
    beta = torch.zeros(3, 2, 1, dtype=state.dtype)
    assert torch.equal(delta_update(state, k, beta, v), state)


@pytest.mark.parametrize("dv", [1, 4])
def test_beta_one_overwrites_the_readout_with_v(dv):
    state, k, v = _inputs(dv)
    new = delta_update(state, k, torch.ones(3, 2, 1, dtype=state.dtype), v)
    torch.testing.assert_close(_readout(new, k), v, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dv", [1, 4])
def test_beta_two_reflects(dv):
    """With v = 0 the update is the Householder reflection I - 2kk^T: applied twice, identity."""
    state, k, _ = _inputs(dv)
    zero, two = torch.zeros_like(_readout(state, k)), torch.full((3, 2, 1), 2.0,
                                                                   dtype=state.dtype)
    once = delta_update(state, k, two, zero)
    torch.testing.assert_close(_readout(once, k), -_readout(state, k))  # k-component flipped
    torch.testing.assert_close(delta_update(once, k, two, zero), state)


def test_k_normalisation_is_guarded_at_zero():
    k = normalized_direction(torch.zeros(4, 8), eps=1e-5)
    assert torch.equal(k, torch.zeros(4, 8))
    unit = normalized_direction(torch.randn(4, 8) * 10, eps=1e-5)
    torch.testing.assert_close(unit.norm(dim=-1), torch.ones(4), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dv", [1, 4])
def test_update_passes_gradcheck_in_fp64(dv):
    state, k, v = _inputs(dv)
    beta = torch.rand(3, 2, 1, dtype=torch.float64) * 2
    args = [t.clone().requires_grad_() for t in (state, k, beta, v)]
    assert torch.autograd.gradcheck(delta_update, args)
