"""fp32 where low precision would bend a gate: helpers for the residual designs.

Under bf16 (bf16 parameters, or fp32 parameters under autocast) a gate's logits, a softmax's
scores and a normalisation's statistics are computed in fp32 (docs/residuals.md, "Numerics").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from t2train.kernels.dispatch import Kernel, route
from t2train.nn.functional import at_least_fp32, rms_normalize


class _Fp32Linear(torch.autograd.Function):
    """x W^T + b computed in fp32 from low-precision x and W, saving x as it came (no fp32
    copy of the activation stays alive for the backward)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.with_bias = bias is not None
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(
                at_least_fp32(x),
                at_least_fp32(weight),
                None if bias is None else at_least_fp32(bias),
            )

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        with torch.autocast(x.device.type, enabled=False):
            grad_x = (grad @ at_least_fp32(weight)).to(x.dtype)
            rows = grad.reshape(-1, grad.shape[-1])
            grad_weight = (rows.T @ at_least_fp32(x).reshape(-1, x.shape[-1])).to(weight.dtype)
            grad_bias = rows.sum(0) if ctx.with_bias else None
        return grad_x, grad_weight, None if grad_bias is None else grad_bias.to(weight.dtype)


# The Triton kernel's limit (kernels/fp32_linear.py MAX_OUTPUTS; a test keeps them
# equal): gate logits have a few outputs, wider projections stay cuBLAS GEMMs.
GATE_MAX_OUTPUTS = 16


def fp32_linear(x: Tensor, linear: torch.nn.Linear) -> Tensor:
    """``linear(x)`` in fp32 whatever the dtypes of ``x`` and the weights, or autocast."""
    return fp32_logits(x, linear.weight, linear.bias)


def fp32_logits(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x W^T + b in fp32 (weight [outputs, h]); through the Triton kernel where ``T2_KERNELS``
    routes it (up to 16 outputs: gate logits)."""
    if weight.shape[0] > GATE_MAX_OUTPUTS:
        return linear_in_fp32(x, weight, bias)
    return route(FP32_LINEAR, x, weight)(x, weight, bias)


def linear_in_fp32(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The PyTorch reference of ``fp32_linear`` (and of its Triton kernel)."""
    return _Fp32Linear.apply(x, weight, bias)


FP32_LINEAR = Kernel("fp32_linear", "t2train.kernels.fp32_linear:fp32_linear", linear_in_fp32)


def rms_fp32_logits(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """RMSNorm(x) W^T + b in fp32, the RMSNorm weight-free (a learned norm weight g folds
    into W as W g), with no fp32 copy of x kept or written.

    In compiled code, r (x W^T) with r = 1 / RMS(x): the products summed over h, which the
    compiler fuses with the mean of squares into one pass reading x (a GEMM would read an
    fp32 copy of x written for it, and its backward write and read more: ``t2train bench
    bytes`` counted 126 units per sublayer for `hc` that way, 90 this way). Eagerly, where
    the products would be materialised, a GEMM recomputed in the backward: only x and W are
    kept for it, not the fp32 normalised x."""
    if torch.compiler.is_compiling():
        with torch.autocast(x.device.type, enabled=False):
            x32 = at_least_fp32(x)
            inverse_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
            y = summed_products(x32, at_least_fp32(weight)) * inverse_rms
            return y if bias is None else y + at_least_fp32(bias)
    return checkpoint(_rms_linear_in_fp32, x, weight, bias, eps, use_reentrant=False)


def summed_products(x: Tensor, weight: Tensor) -> Tensor:
    """x W^T for a few outputs (weight [outputs, h]) as products summed over h, one reduction
    per output: for compiled code, where the reductions (and the mean of squares) share one
    pass reading x, and the backward's x-gradient is a sum of pointwise terms the compiler
    adds into the pass that writes it. One reduction over [..., outputs, h] would neither
    share the pass nor keep its gradient from being written as an fp32 [..., h] tensor of
    its own (``t2train bench bytes``)."""
    return torch.stack([(x * w).sum(-1) for w in weight.unbind(0)], -1)


def _rms_linear_in_fp32(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    with torch.autocast(x.device.type, enabled=False):
        return linear_in_fp32(rms_normalize(x, eps), weight, bias)
