"""`ddl`'s write for compiled code: the gates, k's norm, k^T X and the rank-1 update as
PyTorch the compiler fuses into the pass that already does the residual add (and the next
sublayer's norm), with a hand-written backward that recomputes the fp32 quantities.

Autograd of the formula saves fp32 copies and derives a backward that reads the state more
often than it needs (``t2train bench bytes``: 23.1 units backward). Here the backward keeps
the bf16 tensors the layer keeps anyway (the state, the sublayer's input and its output) and
a few fp32 numbers per token (beta's logit, v, 1/|out|, k^T X, and the pre-norm's inverse
RMS, which the norm keeps too), and recomputes everything h-wide from them: one pass with the
row reductions over h (k^T dY and the gate logits' gradients) writing the output's gradient
and the state's part of its own gradient; the norm's backward adds the rest in its pass;
the weights' gradients are reductions over tokens of the sublayer's input alone (20.6 units
per sublayer against the kernels' 31.0).

beta's logit reads the normed input c = rstd x w (the pre-norm, ``SublayerResidual.pre_norm``):
written as rstd x^T u + b with u = w beta_w, its backward needs x and rstd, which the norm's
backward reads anyway, where the normed input's gradient would be another tensor to add in
and the weights' reduction would read c beside x.

The math, per state column j (d_v columns; one for the vector state), with
r = 1 / sqrt(|out|^2 + eps^2), k = r out, e_j = v_j - k^T X_j, Y_j = X_j + beta e_j k, and
g_j = dL/dY_j, a_j = k^T g_j:

    dX_j   = g_j - beta a_j k
    dbeta  = sum_j e_j a_j                   dv_j = beta a_j
    dk     = beta sum_j (e_j g_j - a_j X_j)
    dout   = r (dk - k (k^T dk)),    k^T dk = beta sum_j a_j (e_j - k^T X_j)
    dlogit_beta = dbeta beta (1 - beta / 2)  dlogit_v_j = dv_j v_j (1 - v_j / v_scale)

v's linear layer passes dlogit_v W_v on to x and sums dlogit_v x over tokens into W_v; beta's
logit s = rstd x^T u passes dlogit_beta rstd (u - s rstd x / h) on to x and sums
dlogit_beta rstd x over tokens into u, whose gradient is w times it for beta_w and beta_w
times it for the norm's weight.
"""

from __future__ import annotations

import struct

import torch
from torch import Tensor

from t2train.nn.functional import at_least_fp32


def _logits(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """x W^T + b for a few outputs (weight [outputs, h]), as one product summed over h per
    output: reductions the compiler fuses into the pass that reads x."""
    x, weight, bias = at_least_fp32(x), at_least_fp32(weight), at_least_fp32(bias)
    return torch.stack([(x * w).sum(-1) for w in weight.unbind(0)], -1) + bias


def _columns(state: Tensor, matrix: bool) -> tuple[Tensor, ...]:
    """The state's columns, each [..., h]: every per-column step is then a [tokens, h] pass
    like the output's, which the compiler puts in one loop with the output's and the next
    read's (a [d_v, tokens, h] step would be a loop of its own)."""
    return state.unbind(0) if matrix else (state,)


def _stacked(columns: list[Tensor], matrix: bool) -> Tensor:
    return torch.stack(columns) if matrix else columns[0]


class _Gates:
    """The write's per-token fp32 quantities: the gates, k's inverse norm and k^T X, and the
    pre-norm's inverse RMS with beta's logit less its bias."""

    def __init__(self, columns, x, norm_w, norm_eps, out, beta_w, beta_b, v_w, v_b, k_eps, v_scale):
        xf = at_least_fp32(x)
        # the pre-norm's inverse RMS written as torch's RMSNorm decomposes (the same ops,
        # dims and constant): the compiler then computes and keeps it once for both
        self.rstd = torch.rsqrt(  # [..., 1]
            torch.ops.aten.add.Scalar(xf.pow(2).mean([xf.dim() - 1], keepdim=True), norm_eps)
        )
        # beta's logit reads the normed input x rstd w: here x (w beta_w) summed over h,
        # times rstd, so that no h-wide tensor but x enters its backward
        self.beta_dot = self.rstd * (xf * _beta_direction(norm_w, beta_w)).sum(-1, keepdim=True)
        self.beta = _beta(self.beta_dot, beta_b)  # [..., 1]
        self.v = v_scale * torch.sigmoid(_logits(x, v_w, v_b))  # [..., d_v]
        self.r = torch.rsqrt(at_least_fp32(out).pow(2).sum(-1, keepdim=True) + k_eps * k_eps)
        self.k = at_least_fp32(out) * self.r
        # k^T X_j, one [..., 1] per column: no narrow concatenation between these reductions
        # and the pass that uses them
        self.kx = [(self.k * at_least_fp32(column)).sum(-1, keepdim=True) for column in columns]


def _beta(beta_dot: Tensor, beta_b: Tensor) -> Tensor:
    return 2 * torch.sigmoid(beta_dot + at_least_fp32(beta_b))


def _beta_direction(norm_w: Tensor, beta_w: Tensor) -> Tensor:
    """u = w beta_w: beta's logit is rstd x^T u + b."""
    return at_least_fp32(norm_w) * at_least_fp32(beta_w[0])


class _DeltaWrite(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state, x, norm_w, norm_eps, out, beta_w, beta_b, v_w, v_b, k_eps, v_scale):
        read_state = x is None  # v's logits read the state itself (d_v = 1)
        x = state if read_state else x
        matrix = state.dim() == out.dim() + 1
        columns = _columns(state, matrix)
        q = _Gates(columns, x, norm_w, norm_eps, out, beta_w, beta_b, v_w, v_b, k_eps, v_scale)
        ctx.save_for_backward(
            state,
            None if read_state else x,
            out,
            norm_w,
            beta_w,
            beta_b,
            v_w,
            q.beta_dot,
            q.rstd,
            q.v,
            q.r,
            *q.kx,
        )
        ctx.v_scale = v_scale
        written = [
            at_least_fp32(column) + q.beta * (q.v[..., j : j + 1] - kx) * q.k
            for j, (column, kx) in enumerate(zip(columns, q.kx))
        ]
        return _stacked([column.to(state.dtype) for column in written], matrix)

    @staticmethod
    def backward(ctx, grad):
        state, x, out, norm_w, beta_w, beta_b, v_w, beta_dot, rstd, v, r, *kxs = ctx.saved_tensors
        beta = _beta(beta_dot, beta_b)
        read_state = x is None
        x = state if read_state else x
        matrix = state.dim() == out.dim() + 1
        columns, grads = _columns(state, matrix), _columns(grad, matrix)
        # bf16 times fp32 is computed in fp32. No explicit upcast of a saved bf16 tensor: the
        # partitioner would share it with the forward's and save the fp32 copy.
        k = out * r
        e = [v[..., j : j + 1] - kx for j, kx in enumerate(kxs)]  # the errors, [..., 1] each
        a = [(k * g).sum(-1, keepdim=True) for g in grads]  # k^T g, per column
        # the gate logits' gradients as row reductions of their own (sum_j e_j a_j and
        # beta a_j, each times its sigmoid's slope): one buffer each, so that the pointwise
        # passes reading them stay under the compiler's limit of reads for recomputing
        beta_slope = beta * (1 - beta / 2)
        error_g = sum(e_j * g for e_j, g in zip(e, grads))
        beta_logit = (k * error_g * beta_slope).sum(-1, keepdim=True)  # [..., 1]
        v_slope = beta * v * (1 - v / ctx.v_scale)  # [..., d_v]
        v_logit = [  # [..., 1] per column
            (k * g * v_slope[..., j : j + 1]).sum(-1, keepdim=True) for j, g in enumerate(grads)
        ]
        grad_state = [g - beta * a_j * k for a_j, g in zip(a, grads)]
        dk = beta * sum(e_j * g - a_j * column for e_j, g, a_j, column in zip(e, grads, a, columns))
        k_dk = beta * sum(a_j * (e_j - kx_j) for a_j, e_j, kx_j in zip(a, e, kxs))
        grad_out = r * (dk - k * k_dk)
        # beta's logit rstd x^T u: d/dx = rstd (u - (rstd x^T u) rstd x / h)
        u = _beta_direction(norm_w, beta_w)
        x_hat = x * rstd
        grad_x = beta_logit * rstd * (u - beta_dot * x_hat / x.shape[-1])
        grad_x = grad_x + sum(logit * w for logit, w in zip(v_logit, v_w))
        tokens = list(range(out.dim() - 1))
        grad_u = (beta_logit * x_hat).sum(tokens)
        grad_v_w = torch.stack([(logit * x).sum(tokens) for logit in v_logit])
        # the state's part rounded before x's is added: their sum reads more tensors than
        # the compiler inlines, so it is written out, and written in the state's dtype
        grad_state = [column.to(state.dtype) for column in grad_state]
        if read_state:
            grad_state[0] = grad_state[0] + grad_x.to(state.dtype)
        return (
            _stacked(grad_state, matrix),
            None if read_state else grad_x.to(x.dtype),
            (grad_u * at_least_fp32(beta_w[0])).to(norm_w.dtype),
            None,
            grad_out.to(out.dtype),
            (grad_u * at_least_fp32(norm_w)).unsqueeze(0).to(beta_w.dtype),
            beta_logit.sum(tokens).to(beta_w.dtype),
            grad_v_w.to(v_w.dtype),
            torch.stack([logit.sum(tokens) for logit in v_logit]).squeeze(-1).to(v_w.dtype),
            None,
            None,
        )


def delta_write_fused(
    state: Tensor,
    x: Tensor,
    norm: torch.nn.RMSNorm,
    out: Tensor,
    beta_proj: torch.nn.Linear,
    v_proj: torch.nn.Linear,
    k_eps: float,
    v_scale: float,
) -> Tensor:
    """``delta_write(state, out, beta_proj(norm(x)), v_proj(x), k_eps, v_scale)`` with the
    logits in fp32, for compiled code (see the module's docstring)."""
    return _DeltaWrite.apply(
        state,
        None if x is state else x,  # one tensor may not be two inputs of a traced Function
        norm.weight,
        norm_eps(norm),
        out,
        beta_proj.weight,
        beta_proj.bias,
        v_proj.weight,
        v_proj.bias,
        k_eps,
        v_scale,
    )


def norm_eps(norm: torch.nn.RMSNorm) -> float:
    """The epsilon ``torch.nn.RMSNorm`` adds, as its operator adds it: rounded to fp32 (and
    fp32's machine epsilon when it has none). The same constant makes the compiler's common
    subexpressions find the norm's inverse RMS in ``_Gates``' and keep one of them."""
    eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
    return struct.unpack("f", struct.pack("f", eps))[0]
