"""Triton DDL write vs ``t2train.residual.ddl.layers.delta_write`` (interpreter on CPU)."""

import pytest
import torch

from t2train.residual.ddl.functional import delta_write
from t2train.residual.ddl.layers import write_delta

from kernel_checks import DEVICE, assert_matches

K_EPS, V_SCALE = 1e-5, 4.0


def _inputs(dv, dtype, tokens=(3, 2), hidden=40, tiny=True):
    g = torch.Generator().manual_seed(2)
    make = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype)  # noqa: E731
    state = make(*tokens, hidden) if dv == 1 else make(dv, *tokens, hidden)
    out = make(*tokens, hidden)
    if tiny:  # |k~| ~ eps: the guard matters (and dk~ ~ 1/eps overflows fp16)
        out[0, 0] *= 1e-6
    return state, out, make(*tokens, 1), make(*tokens, dv)


def _check(dv, dtype):
    assert_matches(
        lambda *t: write_delta(*t, K_EPS, V_SCALE),
        lambda *t: delta_write(*t, K_EPS, V_SCALE),
        _inputs(dv, dtype, tiny=dtype == torch.float32),
        dtype,
        "delta_write",
    )


@pytest.mark.parametrize("dv", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matches_reference(dv, dtype):
    _check(dv, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dv", [1, 4])
def test_bf16(dv):
    _check(dv, torch.bfloat16)


def test_reference_passes_gradcheck():
    inputs = [t.double().requires_grad_() for t in _inputs(4, torch.float32, (2, 1), 6, tiny=False)]
    assert torch.autograd.gradcheck(lambda *t: delta_write(*t, 1e-3, V_SCALE), inputs)
