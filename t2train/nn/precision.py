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
    into W as W g), recomputed in the backward: only x and W are kept for it, not the fp32
    normalised x (2 units per unit of x) that a compiled layer's partitioner would keep.

    In a compiled layer Inductor fuses the norm, the casts and the recompute: on an H200
    (2026-11-30, HC's n = 4 streams at 125m, forward+backward) ``torch.compile`` of this
    computation took 0.91 ms, eager 3.47 ms, and a Triton kernel that walked x once 6.03 ms."""
    return checkpoint(_rms_linear_in_fp32, x, weight, bias, eps, use_reentrant=False)


def _rms_linear_in_fp32(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    with torch.autocast(x.device.type, enabled=False):
        return linear_in_fp32(rms_normalize(x, eps), weight, bias)
