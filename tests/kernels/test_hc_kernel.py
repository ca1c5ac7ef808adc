"""Triton HC stream read and write (the mHC stream kernels with the weights as given) vs the
paper's formulas written out (interpreter on CPU)."""

import pytest
import torch

from t2train.kernels import dispatch

from kernel_checks import DEVICE, assert_matches


def _inputs(n, dtype, tokens=(3, 5), hidden=40):
    """Streams [n, s, b, h], the sublayer output, and fp32 weights as the model computes them:
    read weights, the n x n residual mixing and beta, off their identity-like init."""
    g = torch.Generator().manual_seed(6)
    make = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    state, out = (
        make(*shape).to(DEVICE, dtype) for shape in ((n, *tokens, hidden), (*tokens, hidden))
    )
    read = (make(*tokens, n) * 0.5 + 1).to(DEVICE)
    residual = (torch.eye(n) + 0.3 * make(*tokens, n, n)).to(DEVICE)
    beta = (1 + 0.3 * make(*tokens, n)).to(DEVICE)
    return state, out, read, residual, beta


def _paper_read(state, read):
    """x = sum_i A_m[i] h_i (Hyper-Connections, Eq. 3: the width connection's read)."""
    return sum(read[..., i, None] * state[i] for i in range(state.shape[0]))


def _paper_write(state, residual, beta, out):
    """h'_j = sum_i A_r[i, j] h_i + B[j] T(x) (Eq. 4-5: the residual mix, then the depth
    connection writes the sublayer output into every stream with weight B[j])."""
    n = state.shape[0]
    return torch.stack(
        [
            sum(residual[..., i, j, None] * state[i] for i in range(n)) + beta[..., j, None] * out
            for j in range(n)
        ]
    )


def _read(state, read):
    from t2train.residual.hc.layers import HC_READ

    return dispatch.route(HC_READ, state)(state, read)


def _write(state, residual, beta, out):
    from t2train.residual.hc.layers import HC_WRITE

    return dispatch.route(HC_WRITE, state, out)(state, residual, beta, out)


@pytest.mark.parametrize("n", [4, 3, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matches_the_paper(n, dtype):
    state, out, read, residual, beta = _inputs(n, dtype)
    assert_matches(_read, _paper_read, (state, read), dtype, "hc_read")
    assert_matches(_write, _paper_write, (state, residual, beta, out), dtype, "hc_write")


@pytest.mark.gpu
def test_bf16():
    state, out, read, residual, beta = _inputs(4, torch.bfloat16, hidden=2048)
    assert_matches(_read, _paper_read, (state, read), torch.bfloat16, "hc_read")
    assert_matches(_write, _paper_write, (state, residual, beta, out), torch.bfloat16, "hc_write")


def test_the_write_mixes_columns_not_rows():
    """Stream j takes column j of A_r: with a non-symmetric A_r the transposed mix differs."""
    from kernel_checks import run_kernels

    state, out, _, residual, beta = _inputs(3, torch.float32)
    got = run_kernels(_write, state, residual, beta, out)
    torch.testing.assert_close(got, _paper_write(state, residual, beta, out))
    assert (got - _paper_write(state, residual.transpose(-1, -2), beta, out)).abs().max() > 0.1
