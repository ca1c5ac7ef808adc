"""Triton gate logits (fp32 x W^T + b from low-precision x and W) vs the formula written out
(interpreter on CPU)."""

from types import SimpleNamespace

import pytest
import torch

from t2train.kernels.fp32_linear import MAX_OUTPUTS, fp32_linear
from t2train.nn.precision import GATE_MAX_OUTPUTS

from kernel_checks import DEVICE, assert_matches, run_kernels


def _inputs(n_out, dtype, tokens=(5, 7), hidden=40, bias=True):
    g = torch.Generator().manual_seed(4)
    make = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype)  # noqa: E731
    return make(*tokens, hidden), make(n_out, hidden) * 0.3, make(n_out) if bias else None


def _logits(x, weight, bias):
    """The paper's gate logits: x W^T + b, summed in fp32 (the inputs arrive as fp32)."""
    y = (x[..., None, :] * weight).sum(-1)
    return y if bias is None else y + bias


def _kernel(x, weight, bias):
    from t2train.nn import precision

    # what fp32_linear reads of an nn.Linear, holding the leaves under test
    linear = SimpleNamespace(weight=weight, bias=bias, out_features=weight.shape[0])
    return precision.fp32_linear(x, linear)


# 35 rows (not a multiple of the 16-row tiles), h = 40 (not a multiple of 16), outputs from
# the beta gate's 1 to the limit, odd and not a power of two
@pytest.mark.parametrize("n_out", [1, 4, 5, MAX_OUTPUTS])
def test_fp32(n_out):
    assert_matches(_kernel, _logits, _inputs(n_out, torch.float32), torch.float32, "fp32_linear")


def test_without_bias():
    assert_matches(
        _kernel, _logits, _inputs(3, torch.float32, bias=False), torch.float32, "fp32_linear"
    )


def test_fp16_inputs_give_fp32_logits():
    x, weight, bias = _inputs(4, torch.float16)
    out = run_kernels(_kernel, x, weight, bias)
    assert out.dtype == torch.float32
    assert_matches(_kernel, _logits, (x, weight, bias), torch.float16, "fp32_linear")


@pytest.mark.gpu
def test_bf16():
    assert_matches(_kernel, _logits, _inputs(4, torch.bfloat16), torch.bfloat16, "fp32_linear")


def test_fp32_weights_with_low_precision_activations():
    """Under autocast the weights stay fp32: they are not rounded to x's dtype."""
    x, _, _ = _inputs(2, torch.float16)
    weight, bias = (t.float() for t in _inputs(2, torch.float32)[1:])
    weight = weight + 1e-4  # below fp16's resolution near 0.3: rounding it would show
    out = run_kernels(fp32_linear, x, weight, bias)
    torch.testing.assert_close(out, _logits(x.float(), weight, bias), atol=1e-5, rtol=1e-5)


def test_the_gate_limit_is_the_kernels():
    assert GATE_MAX_OUTPUTS == MAX_OUTPUTS
    with pytest.raises(ValueError, match="n <= 16"):
        fp32_linear(torch.zeros(2, 8), torch.zeros(MAX_OUTPUTS + 1, 8), None)
