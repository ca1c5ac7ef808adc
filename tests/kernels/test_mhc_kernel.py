"""Triton mHC stream read and write vs ``t2train.residual.mhc`` (interpreter on CPU): outputs
and the gradients of every input, the write's through the unrolled Sinkhorn iterations."""

import pytest
import torch
from kernel_checks import DEVICE, assert_matches

from t2train.residual.mhc import read_streams, stream_read, stream_write, write_streams

TOKENS = (2, 2)  # [s, b]: the interpreter runs one program per token


def _inputs(n, dtype, hidden=40, spread=2.0):
    g = torch.Generator().manual_seed(3)
    make = lambda *shape, scale=1.0: (scale * torch.randn(*shape, generator=g)).to(  # noqa: E731
        DEVICE, dtype)
    return (make(n, *TOKENS, hidden), make(*TOKENS, hidden), make(*TOKENS, n),
            make(*TOKENS, n, n, scale=spread))


@pytest.mark.parametrize("n", [4, 3, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_read_matches_reference(n, dtype):
    state, _, pre, _ = _inputs(n, dtype)
    assert_matches(read_streams, stream_read, (state, pre), dtype, "stream_read")


@pytest.mark.parametrize("n, iterations, hidden", [(4, 20, 40), (3, 7, 24), (1, 3, 16),
                                                   (4, 5, 600)])
def test_write_matches_reference(n, iterations, hidden):
    """fp32 at 1e-5; hidden 600 loops over two blocks of the hidden dim."""
    assert_matches(lambda *t: write_streams(*t, iterations),
                   lambda *t: stream_write(*t, iterations), _inputs(n, torch.float32, hidden),
                   torch.float32, "stream_write")


def test_write_fp16():
    assert_matches(lambda *t: write_streams(*t, 4), lambda *t: stream_write(*t, 4),
                   _inputs(4, torch.float16, spread=1.0), torch.float16, "stream_write")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4, 1])
def test_bf16(n):
    state, out, post, res = _inputs(n, torch.bfloat16, hidden=2048)
    assert_matches(read_streams, stream_read, (state, post), torch.bfloat16, "stream_read")
    assert_matches(lambda *t: write_streams(*t, 20), lambda *t: stream_write(*t, 20),
                   (state, out, post, res), torch.bfloat16, "stream_write")


def test_shapes_are_checked():
    from t2train.kernels.stream_mix import stream_write as fused

    state, out, post, res = _inputs(4, torch.float32)
    with pytest.raises(ValueError, match="res_logit"):
        fused(state, out, post, res[..., :3], 2)


def test_references_pass_gradcheck():
    inputs = [t[:, :1].double().requires_grad_() if t.dim() == 4 and t.shape[0] == 3
              else t[:1].double().requires_grad_() for t in _inputs(3, torch.float32, hidden=3)]
    assert torch.autograd.gradcheck(lambda *t: stream_write(*t, 6), inputs)
    assert torch.autograd.gradcheck(stream_read, (inputs[0], inputs[2]))
