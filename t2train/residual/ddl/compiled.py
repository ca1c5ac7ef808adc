"""`ddl`'s write for compiled code: the gates, k's norm, k^T X and the rank-1 update as
PyTorch the compiler fuses into the pass that already does the residual add (and the next
sublayer's norm), with a hand-written backward that recomputes the fp32 quantities.

Autograd of the formula saves fp32 copies and derives a backward that reads the state more
often than it needs (``t2train bench bytes``: 23.1 units backward). Here the backward keeps
the bf16 tensors the layer keeps anyway (the state, the sublayer's input, its normed input
and its output) and a few fp32 numbers per token (beta, v, 1/|out|, k^T X), and recomputes
everything h-wide from them: one pass with the row reductions over h (k^T dY and the gate
logits' gradients) writing the output's gradient; the state's and the gate inputs' gradients
are pointwise terms the compiler adds into the norm's backward pass; the gate weights'
gradients are reductions over tokens (22.1 units per sublayer against the kernels' 31.0).

The math, per state column j (d_v columns; one for the vector state), with
r = 1 / sqrt(|out|^2 + eps^2), k = r out, e_j = v_j - k^T X_j, Y_j = X_j + beta e_j k, and
g_j = dL/dY_j, a_j = k^T g_j:

    dX_j   = g_j - beta a_j k
    dbeta  = sum_j e_j a_j                   dv_j = beta a_j
    dk     = beta sum_j (e_j g_j - a_j X_j)
    dout   = r (dk - k (k^T dk)),    k^T dk = beta sum_j a_j (e_j - k^T X_j)
    dlogit_beta = dbeta beta (1 - beta / 2)  dlogit_v_j = dv_j v_j (1 - v_j / v_scale)

and the logits' linear layers pass dlogit w on to their inputs and sum dlogit x over tokens
into their weights.
"""

from __future__ import annotations

import torch
from torch import Tensor

from t2train.nn.functional import at_least_fp32


def _logits(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """x W^T + b for a few outputs (weight [outputs, h]), as one product summed over h per
    output: reductions the compiler fuses into the pass that reads x."""
    x, weight, bias = at_least_fp32(x), at_least_fp32(weight), at_least_fp32(bias)
    return torch.stack([(x * w).sum(-1) for w in weight.unbind(0)], -1) + bias


def _columns(t: Tensor, matrix: bool) -> Tensor:
    """A per-token [..., d_v] tensor as one [..., 1] per state column ([d_v, ..., 1])."""
    return t.movedim(-1, 0).unsqueeze(-1) if matrix else t


def _column_sum(t: Tensor, matrix: bool) -> Tensor:
    return t.sum(0) if matrix else t


class _Gates:
    """The write's per-token fp32 quantities: the gates, k's inverse norm and k^T X."""

    def __init__(self, state, x, normed, out, beta_w, beta_b, v_w, v_b, k_eps, v_scale):
        self.beta = 2 * torch.sigmoid(_logits(normed, beta_w, beta_b))  # [..., 1]
        self.v = v_scale * torch.sigmoid(_logits(x, v_w, v_b))  # [..., d_v]
        self.r = torch.rsqrt(at_least_fp32(out).pow(2).sum(-1, keepdim=True) + k_eps * k_eps)
        self.kx = (at_least_fp32(out) * self.r * at_least_fp32(state)).sum(-1, keepdim=True)


class _DeltaWrite(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state, x, normed, out, beta_w, beta_b, v_w, v_b, k_eps, v_scale):
        read_state = x is None  # v's logits read the state itself (d_v = 1)
        x = state if read_state else x
        q = _Gates(state, x, normed, out, beta_w, beta_b, v_w, v_b, k_eps, v_scale)
        ctx.save_for_backward(
            state, None if read_state else x, normed, out, beta_w, v_w, q.beta, q.v, q.r, q.kx
        )
        ctx.v_scale = v_scale
        matrix = state.dim() == out.dim() + 1
        k = at_least_fp32(out) * q.r
        error = _columns(q.v, matrix) - q.kx
        return (at_least_fp32(state) + q.beta * error * k).to(state.dtype)

    @staticmethod
    def backward(ctx, grad):
        state, x, normed, out, beta_w, v_w, beta, v, r, kx = ctx.saved_tensors
        read_state = x is None
        x = state if read_state else x
        matrix = state.dim() == out.dim() + 1
        # bf16 times fp32 is computed in fp32. No explicit upcast of a saved bf16 tensor: the
        # partitioner would share it with the forward's and save the fp32 copy.
        k, g = out * r, grad
        error = _columns(v, matrix) - kx
        a = (k * g).sum(-1, keepdim=True)  # k^T g, per column
        # the gate logits' gradients as row reductions of their own (sum_j e_j a_j and
        # beta a_j, each times its sigmoid's slope): one buffer each, so that the pointwise
        # passes reading them stay under the compiler's limit of reads for recomputing
        beta_slope = beta * (1 - beta / 2)
        beta_logit = (k * _column_sum(error * g, matrix) * beta_slope).sum(-1, keepdim=True)
        v_slope = _columns(v * (1 - v / ctx.v_scale), matrix)
        v_logit = (k * g * (beta * v_slope)).sum(-1, keepdim=True)  # [d_v?, ..., 1]
        v_logit = v_logit.squeeze(-1).movedim(0, -1) if matrix else v_logit  # [..., d_v]
        grad_state = g - beta * a * k
        dk = beta * _column_sum(error * g - a * state, matrix)
        k_dk = beta * _column_sum(a * (error - kx), matrix)
        grad_out = r * (dk - k * k_dk)
        grad_normed = beta_logit * beta_w[0]
        grad_x = sum(v_logit[..., j : j + 1] * w for j, w in enumerate(v_w))
        tokens = list(range(out.dim() - 1))
        grad_beta_w = (beta_logit * normed).sum(tokens).unsqueeze(0)
        grad_v_w = torch.stack([(v_logit[..., j : j + 1] * x).sum(tokens) for j in range(len(v_w))])
        if read_state:
            grad_state = grad_state + grad_x
        return (
            grad_state.to(state.dtype),
            None if read_state else grad_x.to(x.dtype),
            grad_normed.to(normed.dtype),
            grad_out.to(out.dtype),
            grad_beta_w.to(beta_w.dtype),
            beta_logit.sum(tokens).to(beta_w.dtype),
            grad_v_w.to(v_w.dtype),
            v_logit.sum(tokens).to(v_w.dtype),
            None,
            None,
        )


def delta_write_fused(
    state: Tensor,
    x: Tensor,
    normed: Tensor,
    out: Tensor,
    beta_proj: torch.nn.Linear,
    v_proj: torch.nn.Linear,
    k_eps: float,
    v_scale: float,
) -> Tensor:
    """``delta_write(state, out, beta_proj(normed), v_proj(x), k_eps, v_scale)`` with the
    logits in fp32, for compiled code (see the module's docstring)."""
    return _DeltaWrite.apply(
        state,
        None if x is state else x,  # one tensor may not be two inputs of a traced Function
        normed,
        out,
        beta_proj.weight,
        beta_proj.bias,
        v_proj.weight,
        v_proj.bias,
        k_eps,
        v_scale,
    )
