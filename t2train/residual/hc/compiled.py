"""`hc`'s dynamic hyper-connections for compiled code: one sublayer's write and the next
sublayer's width connection as one function, with a hand-written backward.

A layer's sublayers run ... -> read_k -> body_k -> write_k -> read_(k+1) -> body_(k+1) ...;
``connect`` computes write_k and read_(k+1) together (either alone at a layer's edges):

    H' = A_r^T H + B^T y          (write_k: A_r, B from sublayer k's logits)
    r_i = (mean h'_i^2 + eps)^(-1/2),   L_io = r_i h'_i^T F_o,   t_io = tanh(L_io)
    A_m[i] = A_m0[i] + s_a t_i0,   x = sum_i A_m[i] h'_i        (read_(k+1))

with F [n + 2, h] the folded projections of sublayer k + 1 (``folded_projections``). The
logits L [n, ..., n + 2] are handed on for sublayer k + 1's write, which takes from them
A_r[i, j] = A_r0[i, j] + s_a t_i(1+j) and B[i] = B0[i] + s_b t_i(n+1).

Why this shape: every per-token quantity of the forward (the n inverse RMS, the n (n + 2)
logits, the mappings) is its own [..., 1] tensor, so each node is pointwise over [..., h] or
a reduction over h of one token, and Inductor fuses the write, the norms, the projections
and the read into one pass over the streams (it cannot fuse through [..., n, n + 2]-shaped
tensors: a kernel of another size sits between). The backward is written over the stacked
[n, ..., h] streams instead, where each gradient of the streams is one expression the
compiler adds the other terms into. It reads the new streams the pair wrote, which a layer
keeps anyway as the next write's input (``t2train bench bytes``: the pair moved 61.0 units
per sublayer as two functions, 57.1 as one).

Backward, with G = dL/dH' from after the pair and dx the read's gradient:

    dA_m[i] = h'_i^T dx,   d_i0 = s_a (1 - t_i0^2) dA_m[i],   d_io = dL_io (o > 0, given)
    G_i += A_m[i] dx + r_i sum_o d_io F_o - (r_i^2 / h) (sum_o d_io L_io) h'_i
    dh_i = sum_j A_r[i, j] G_j,   dy = sum_j B_j G_j
    dA_r[i, j] = h_i^T G_j,   dB_j = y^T G_j
    dF_o = sum over tokens and streams of r_i d_io h'_i
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from t2train.nn.functional import at_least_fp32


class Write(NamedTuple):
    """Sublayer k's write: its output y [..., h], its logits [n, ..., n + 2] (from the
    read that preceded it) and its static weights and scales."""

    out: Tensor
    logits: Tensor
    static_alpha: Tensor  # [n, n + 1]: A_m0 | A_r0
    static_beta: Tensor  # [n]
    alpha_scale: Tensor  # [1]
    beta_scale: Tensor  # [1]


class Read(NamedTuple):
    """Sublayer k + 1's width connection: its folded projections and its read's weights."""

    folded: Tensor  # [n + 2, h], fp32
    static_alpha: Tensor  # [n, n + 1]
    alpha_scale: Tensor  # [1]


def _column(t: Tensor, i: int, o: int) -> Tensor:
    """Entry o of stream i's per-token numbers, [n, ..., m] -> [..., 1]."""
    return t[i, ..., o : o + 1]


def _write_weights(write: Write, n: int) -> tuple[list, list]:
    """A_r[i][j] and B[j], each [..., 1], fp32."""
    tanh = [[torch.tanh(_column(write.logits, i, o)) for o in range(n + 2)] for i in range(n)]
    alpha = at_least_fp32(write.static_alpha)
    beta = at_least_fp32(write.static_beta)
    s_a, s_b = at_least_fp32(write.alpha_scale), at_least_fp32(write.beta_scale)
    residual = [[alpha[i, 1 + j] + s_a * tanh[i][1 + j] for j in range(n)] for i in range(n)]
    gates = [beta[j] + s_b * tanh[j][n + 1] for j in range(n)]
    return residual, gates


def _written(state: Tensor, write: Write, residual: list, gates: list) -> list:
    """The new streams h'_j = sum_i A_r[i, j] h_i + B_j y, each in the state's dtype."""
    n = state.shape[0]
    new = []
    for j in range(n):
        total = gates[j] * write.out  # bf16 times fp32 is computed in fp32
        for i in range(n):
            total = total + residual[i][j] * state[i]
        new.append(total.to(state.dtype))
    return new


def _read_weights(read: Read, tanh: list) -> list:
    """A_m[i], [..., 1] fp32."""
    alpha, s_a = at_least_fp32(read.static_alpha), at_least_fp32(read.alpha_scale)
    return [alpha[i, 0] + s_a * tanh[i][0] for i in range(len(tanh))]


def _weighted(weights: list, tensors: list) -> Tensor:
    total = weights[0] * tensors[0]
    for weight, tensor in zip(weights[1:], tensors[1:]):
        total = total + weight * tensor
    return total


class _Connect(torch.autograd.Function):
    """Tensors flat after ``state``: the write's six (if any), then the read's three."""

    @staticmethod
    def forward(ctx, state, eps, has_write, has_read, *tensors):
        write = Write(*tensors[:6]) if has_write else None
        read = Read(*tensors[len(tensors) - 3 :]) if has_read else None
        n = state.shape[0]
        streams = list(state.unbind(0))
        if write is not None:
            residual, gates = _write_weights(write, n)
            streams = _written(state, write, residual, gates)
        ctx.has_write, ctx.has_read = has_write, has_read
        outputs = [torch.stack(streams)] if write is not None else []
        if read is None:
            ctx.save_for_backward(state, *tensors)
            return tuple(outputs)
        inverse_rms = [
            torch.rsqrt(at_least_fp32(s).pow(2).mean(-1, keepdim=True) + eps) for s in streams
        ]
        rows = [
            [inverse_rms[i] * (streams[i] * f).sum(-1, keepdim=True) for f in read.folded]
            for i in range(n)
        ]
        weights = _read_weights(read, [[torch.tanh(row[0])] for row in rows])
        x = _weighted(weights, streams).to(state.dtype)
        logits = torch.stack([torch.cat(row, -1) for row in rows])  # [n, ..., n + 2]
        ctx.save_for_backward(state, *tensors, logits, torch.stack(inverse_rms), *outputs)
        read_weights = torch.cat(weights, -1)
        ctx.mark_non_differentiable(read_weights)  # for diagnostics only
        return (*outputs, x, logits, read_weights)

    @staticmethod
    def backward(ctx, *grads):
        state, *saved = ctx.saved_tensors
        # Written over the stacked [n, ..., h] streams (one weight per stream broadcast over
        # h): each gradient of the streams is one expression, into which the compiler adds
        # the other terms; a stack of n per-stream results would be written and copied.
        grad_streams = grads[0] if ctx.has_write else None
        read_grads: tuple = ()
        if ctx.has_read:
            streams = saved.pop() if ctx.has_write else state
            inverse_rms, logits = saved.pop(), saved.pop()
            read = Read(*saved[-3:])
            grad_streams_read, read_grads = _read_backward(
                streams, read, logits, inverse_rms, grads[-3], grads[-2]
            )
            # in the state's dtype, as autograd would add the two: the write's backward reads
            # it three times (the output's gradient, the mixing gradients, the state's)
            grad_streams = (
                grad_streams_read if grad_streams is None else grad_streams + grad_streams_read
            ).to(state.dtype)
        if not ctx.has_write:
            return (grad_streams, None, None, None, *read_grads)
        grad_state, write_grads = _write_backward(state, Write(*saved[:6]), grad_streams)
        return (grad_state, None, None, None, *write_grads, *read_grads)


def _accumulator(t: Tensor) -> torch.dtype:
    """Sums of bf16 products in fp32 (fp64 stays fp64)."""
    return torch.promote_types(t.dtype, torch.float32)


def _per_stream(static: Tensor, column: int, like: Tensor) -> Tensor:
    """static[:, column] as [n, 1, ..., 1] against [n, ..., 1]-shaped per-token weights."""
    return at_least_fp32(static[:, column]).view(-1, *[1] * (like.dim() - 1))


def _read_backward(streams, read: Read, logits, inverse_rms, grad_x, grad_logits):
    """The streams' gradient [n, ..., h] (fp32) through the read, the norms and the
    projections, and the read's parameters' gradients."""
    n, h = streams.shape[0], streams.shape[-1]
    tokens = list(range(1, streams.dim() - 1))
    tanh = torch.tanh(logits)  # [n, ..., n + 2]
    s_a = at_least_fp32(read.alpha_scale)
    grad_read = (streams * grad_x).sum(-1, keepdim=True, dtype=_accumulator(streams))  # dA_m
    d = torch.cat(  # the logits' gradients
        [s_a * (1 - tanh[..., :1] * tanh[..., :1]) * grad_read, grad_logits[..., 1:]], -1
    )
    read_weights = _per_stream(read.static_alpha, 0, grad_read) + s_a * tanh[..., :1]
    coefficients = inverse_rms * d  # r_i d_io
    grad = (
        read_weights * grad_x
        - (inverse_rms * inverse_rms / h * (d * logits).sum(-1, keepdim=True)) * streams
    )
    for o, f in enumerate(read.folded.unbind(0)):
        grad = grad + coefficients[..., o : o + 1] * f
    reduced = [0, *tokens]  # the streams and the tokens
    grad_folded = torch.stack(
        [(coefficients[..., o : o + 1] * streams).sum(reduced) for o in range(n + 2)]
    )
    grad_static = torch.cat(
        [grad_read.sum(tokens)[..., 0:1].reshape(n, 1), grad_read.new_zeros(n, n)], -1
    )
    grad_scale = (grad_read * tanh[..., :1]).sum()
    return grad, (
        grad_folded.to(read.folded.dtype),
        grad_static.to(read.static_alpha.dtype),
        grad_scale.reshape(1).to(read.alpha_scale.dtype),
    )


def _write_backward(state, write: Write, grad_new):
    """The state's gradient (its dtype) through h'_j = sum_i A_r[i, j] h_i + B_j y, and the
    write's inputs' gradients: y's, its logits' (the tanh's derivative applied) and its
    parameters'."""
    n = state.shape[0]
    tokens = list(range(1, state.dim() - 1))
    tanh = torch.tanh(write.logits)  # [n, ..., n + 2]
    s_a, s_b = at_least_fp32(write.alpha_scale), at_least_fp32(write.beta_scale)
    grads = grad_new.unbind(0)
    # A_r[:, j] and B as [n, ..., 1]
    residual = [
        _per_stream(write.static_alpha, 1 + j, tanh) + s_a * tanh[..., 1 + j : 2 + j]
        for j in range(n)
    ]
    gates = _per_stream(write.static_beta[:, None], 0, tanh) + s_b * tanh[..., n + 1 :]
    grad_state = _weighted(residual, list(grads))
    grad_out = _weighted([gates[j] for j in range(n)], list(grads))
    grad_residual = torch.stack(  # [n (i), ..., n (j)]
        [(state * g).sum(-1, dtype=_accumulator(state)) for g in grads], -1
    )
    grad_gates = torch.stack(  # [n (j), ..., 1]
        [(write.out * g).sum(-1, keepdim=True, dtype=_accumulator(state)) for g in grads]
    )
    grad_logits = torch.cat(
        [
            torch.zeros_like(grad_gates),
            s_a * (1 - tanh[..., 1 : n + 1] ** 2) * grad_residual,
            s_b * (1 - tanh[..., n + 1 :] ** 2) * grad_gates,
        ],
        -1,
    )
    grad_static = torch.cat([grad_residual.new_zeros(n, 1), grad_residual.sum(tokens)], -1)
    return grad_state.to(state.dtype), (
        grad_out.to(write.out.dtype),
        grad_logits.to(write.logits.dtype),
        grad_static.to(write.static_alpha.dtype),
        grad_gates.sum(tokens).reshape(n).to(write.static_beta.dtype),
        (tanh[..., 1 : n + 1] * grad_residual).sum().reshape(1).to(write.alpha_scale.dtype),
        (tanh[..., n + 1 :] * grad_gates).sum().reshape(1).to(write.beta_scale.dtype),
    )


def connect(
    state: Tensor, eps: float, write: Optional[Write] = None, read: Optional[Read] = None
) -> tuple:
    """Sublayer k's write and sublayer k + 1's read of the streams [n, ..., h], either alone:
    (the new streams, if ``write``) + (x [..., h] in the state's dtype, the logits [n, ...,
    n + 2] for sublayer k + 1's write, A_m [..., n] for diagnostics (not differentiable),
    if ``read``)."""
    tensors = (*(write or ()), *(read or ()))
    return _Connect.apply(state, eps, write is not None, read is not None, *tensors)
