"""`mhc` for compiled code: one sublayer's write and the next sublayer's read as one
function, with a hand-written backward (``hc/compiled.py`` does the same for `hc`).

A layer's sublayers run ... -> read_k -> body_k -> write_k -> read_(k+1) -> body_(k+1) ...;
``connect`` computes write_k and read_(k+1) together (either alone at a layer's edges):

    h'_i = sum_j M_ij h_j + B_i y                 (write_k: M = H_res, B = H_post per token)
    r = (sum_i |h'_i|^2 / (n h) + eps)^(-1/2),  p_k = r sum_i h'_i . phi_ki   (all n^2 + 2n)
    P_i = sigmoid(a_pre p_i + b_pre_i),   x = sum_i P_i h'_i                   (read_(k+1))
    c = x rho w,   rho = (mean x^2 + eps')^(-1/2)              (sublayer k + 1's pre-norm)

The normed projection p [..., n^2 + 2n] is handed on: sublayer k + 1's write takes its H_post
and H_res from it (``mapping_logits``, Sinkhorn: narrow per-token work outside). Every
per-token number is its own [..., 1] tensor and every stream its own [..., h] one, so the
compiler makes the write, the flat norm, the n^2 + 2n products, the read and the pre-norm
one pass over the streams (its row reductions over h fit a block), where the read and the
products were passes of their own. x is rebuilt from the streams in the backward, not kept.

Backward, with G_i = dL/dh'_i from after the pair, dc the normed input's gradient and dp_k
the projection's from the write that uses it:

    dx = rho w dc - rho^3 mean(x w dc) x,   dP_i = h'_i . dx
    d_i = dp_i + a_pre P_i (1 - P_i) dP_i (i < n),   d_k = dp_k (k >= n)
    G_i += P_i dx + r sum_k d_k phi_ki - (r^2 / (n h)) (sum_k d_k p_k) h'_i
    dphi_ki = sum over tokens of r d_k h'_i
    dh_j = sum_i M_ij G_i,   dy = sum_i B_i G_i,   dM_ij = h_j . G_i,   dB_i = y . G_i

Where the GPU runs the kernels, the backward of a read (with the write before it) is one
Triton kernel that reads the streams once and dphi one GEMM beside it
(``MHC_CONNECT_BACKWARD``, ``t2train/kernels/hyper_connect.py``); ``t2train bench bytes``:
59.2 -> 44.3 units per sublayer (the PyTorch backward made the read's sums and the gradients
two passes, wrote the pair's G out for the first read's pass, and dphi and the pre-norm's
dw passes of their own).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from t2train.kernels import dispatch
from t2train.nn.functional import at_least_fp32
from t2train.residual.hc.compiled import (
    accumulator,
    composed_backward,
    connect_function_backward,
    connected,
    finish_read,
    norm_backward,
    written_streams,
    written_streams_backward,
)
from t2train.residual.unrolled import weighted_terms


class Write(NamedTuple):
    """Sublayer k's write: its output y [..., h] and its mappings, fp32 per token."""

    out: Tensor
    mixing: Tensor  # H_res [..., n, n]: new stream i = sum_j mixing[i, j] h_j + ...
    gains: Tensor  # H_post [..., n]


class Read(NamedTuple):
    """Sublayer k + 1's width connection and its pre-norm's weight."""

    projection: Tensor  # phi [n^2 + 2n, n h]
    pre_gate: Tensor  # a_pre [1]
    pre_bias: Tensor  # b_pre [n]
    norm_weight: Tensor  # [h]


def _column(t: Tensor, k: int) -> Tensor:
    """[..., m] -> [..., 1], entry k."""
    return t[..., k : k + 1]


def _mix_weights(write: Write, n: int) -> tuple[list, list]:
    """``written_streams``' weights: A_r[i][j] = M_ji (new stream j reads stream i), B_j."""
    residual = [[write.mixing[..., j, i : i + 1] for j in range(n)] for i in range(n)]
    return residual, [_column(write.gains, j) for j in range(n)]


def _read_weights(read: Read, normed_projection: list) -> list:
    """P_i = sigmoid(a_pre p_i + b_pre_i), [..., 1] fp32."""
    gate, bias = at_least_fp32(read.pre_gate), at_least_fp32(read.pre_bias)
    return [torch.sigmoid(gate * p + bias[i]) for i, p in enumerate(normed_projection[: len(bias)])]


def _rows(read: Read, n: int) -> Tensor:
    """phi [m, n h] as [m, n, h], fp32."""
    return at_least_fp32(read.projection).view(read.projection.shape[0], n, -1)


class _Connect(torch.autograd.Function):
    """Tensors flat after ``state``: the write's three (if any), then the read's four."""

    @staticmethod
    def forward(ctx, state, eps, norm_eps, has_write, has_read, *tensors):
        write = Write(*tensors[:3]) if has_write else None
        read = Read(*tensors[len(tensors) - 4 :]) if has_read else None
        n, h = state.shape[0], state.shape[-1]
        streams = list(state.unbind(0))
        if write is not None:
            streams = written_streams(state, write.out, *_mix_weights(write, n))
        ctx.has_write, ctx.has_read, ctx.norm_eps = has_write, has_read, norm_eps
        # read alone: the state passes through, so that the gradient of the write that reads
        # it next reaches this backward (added there, not in a pass of its own)
        outputs = [torch.stack(streams) if write is not None else state.view_as(state)]
        if read is None:
            ctx.save_for_backward(state, *tensors)
            return tuple(outputs)
        wide = [at_least_fp32(s) for s in streams]
        inverse_rms = torch.rsqrt(weighted_terms(wide, wide).sum(-1, keepdim=True) / (n * h) + eps)
        # one reduction over h per output, each reading all n streams
        projected = [
            inverse_rms * weighted_terms(wide, list(row)).sum(-1, keepdim=True)
            for row in _rows(read, n)
        ]
        normed_projection = torch.cat(projected, -1)
        saved = (state, *tensors, normed_projection, inverse_rms)
        weights = _read_weights(read, projected)
        return finish_read(
            ctx, outputs, write, streams, weights, read, norm_eps, saved, normed_projection
        )

    @staticmethod
    def backward(ctx, grad_streams, *grads):
        parts = (Write, Read, MHC_CONNECT_BACKWARD, _write_backward)
        return connect_function_backward(ctx, grad_streams, grads, *parts)


def connect_backward(
    state: Tensor,
    write: Optional[Write],
    read: Read,
    norm_eps: float,
    streams: Tensor,
    normed_projection: Tensor,
    inverse_rms: Tensor,
    grad_streams: Tensor,
    grad_normed: Tensor,
    grad_projection: Tensor,
) -> tuple:
    """The backward of a write (if any) and the next read: the state's gradient, the write's
    inputs' gradients (none without a write) and the read's. ``streams``: what the read saw
    (the new streams, or the state without a write); ``normed_projection`` [..., m] and
    ``inverse_rms`` [..., 1] its forward's; the gradients of the new streams, of the normed
    input and of the projection handed on."""
    return composed_backward(
        _read_backward,
        _write_backward,
        state,
        write,
        read,
        norm_eps,
        streams,
        normed_projection,
        inverse_rms,
        grad_streams,
        grad_normed,
        grad_projection,
    )


def _read_backward(
    streams: Tensor,
    read: Read,
    norm_eps: float,
    normed_projection: Tensor,
    inverse_rms: Tensor,
    grad_normed: Tensor,
    grad_projection: Tensor,
    grad: list,
) -> tuple[list, tuple]:
    """G_i += the read's, the pre-norm's, the flat norm's and the products' terms (each in
    the streams' dtype, as autograd would add them), and the read's parameters' gradients."""
    n, h = streams.shape[0], streams.shape[-1]
    tokens = list(range(streams.dim() - 2))
    outputs = normed_projection.shape[-1]
    each = list(streams.unbind(0))  # [..., h] per stream, in the streams' dtype
    projected = [_column(normed_projection, k) for k in range(outputs)]
    weights = _read_weights(read, projected)
    x = weighted_terms(each, weights).to(streams.dtype)
    grad_x, norm_terms = norm_backward(x, read.norm_weight, norm_eps, grad_normed)
    grad_weights = [(s * grad_x).sum(-1, keepdim=True, dtype=accumulator(s)) for s in each]
    grad_pre = [w * (1 - w) * g for w, g in zip(weights, grad_weights)]  # d of a_pre p + b
    gate = at_least_fp32(read.pre_gate)
    d = [_column(grad_projection, k) for k in range(outputs)]
    d[:n] = [d_i + gate * g for d_i, g in zip(d[:n], grad_pre)]
    coefficients = [inverse_rms * d_k for d_k in d]  # r d_k
    shrink = inverse_rms * inverse_rms / (n * h) * weighted_terms(projected, d)
    rows = _rows(read, n)
    total = []
    for i in range(n):
        term = grad[i] + weights[i] * grad_x - shrink * each[i]
        term = term + weighted_terms(list(rows[:, i]), coefficients)
        total.append(term.to(streams.dtype))
    # dphi as a sum over tokens of every output's coefficient times a token's streams
    by_token = streams.movedim(0, -2).unsqueeze(-3)  # [..., 1, n, h]
    grad_rows = (torch.cat(coefficients, -1)[..., None, None] * by_token).sum(tokens)
    # the sums over tokens as one reduction of the per-token numbers: b_pre's, then a_pre's
    per_token = grad_pre + [g * p for g, p in zip(grad_pre, projected)]
    sums = torch.cat(per_token, -1).sum(tokens)
    return total, (
        grad_rows.reshape(read.projection.shape).to(read.projection.dtype),
        sums[n:].sum().reshape(1).to(read.pre_gate.dtype),
        sums[:n].to(read.pre_bias.dtype),
        norm_terms.sum(tokens).to(read.norm_weight.dtype),
    )


def _write_backward(state: Tensor, write: Write, grad: list) -> tuple[Tensor, tuple]:
    """The state's gradient and the write's inputs' (y, H_res, H_post per token)."""
    n = state.shape[0]
    residual, gains = _mix_weights(write, n)
    grad_state, grad_out, grad_residual, grad_gains = written_streams_backward(
        state, write.out, residual, gains, grad
    )
    # dM_ij = h_j . G_i = grad_residual[j][i]
    grad_mixing = torch.cat([grad_residual[j][i] for i in range(n) for j in range(n)], -1)
    return grad_state, (
        grad_out,
        grad_mixing.unflatten(-1, (n, n)).to(write.mixing.dtype),
        torch.cat(grad_gains, -1).to(write.gains.dtype),
    )


# The backward above with its wide part (everything over the streams but dphi) in one
# Triton kernel that reads the streams once (``t2train/kernels/hyper_connect.py``) and
# dphi as one GEMM beside it.
MHC_CONNECT_BACKWARD = dispatch.Kernel(
    "mhc_connect_backward",
    "t2train.kernels.hyper_connect:flat_connect_backward",
    connect_backward,
)


def connect(state: Tensor, eps: float, **parts) -> tuple:
    """`hc`'s ``connect`` for mHC: the same results, except that the read hands on the
    normed projection p [..., n^2 + 2n] (fp32) for sublayer k + 1's write and H_pre [..., n]
    (diagnostics) in place of the logits and A_m; ``eps``: the flat norm's; ``parts``:
    ``write`` (a ``Write``), ``read`` (a ``Read``) and ``norm_eps``, as there."""
    return connected(_Connect, state, eps, **parts)
