"""`hc`'s dynamic hyper-connections for compiled code: one sublayer's write and the next
sublayer's width connection as one function, with a hand-written backward.

A layer's sublayers run ... -> read_k -> body_k -> write_k -> read_(k+1) -> body_(k+1) ...;
``connect`` computes write_k and read_(k+1) together (either alone at a layer's edges):

    H' = A_r^T H + B^T y          (write_k: A_r, B from sublayer k's logits)
    r_i = (mean h'_i^2 + eps)^(-1/2),   L_io = r_i h'_i^T F_o,   t_io = tanh(L_io)
    A_m[i] = A_m0[i] + s_a t_i0,   x = sum_i A_m[i] h'_i        (read_(k+1))
    c = x rho w,   rho = (mean x^2 + eps')^(-1/2)               (sublayer k + 1's pre-norm)

with F [n + 2, h] the folded projections of sublayer k + 1 (``folded_projections``) and w
its pre-norm's weight: the pair hands the sublayer its normed input, so that the norm's
backward joins the pair's and x is rebuilt from the streams rather than kept. The
logits L [n, ..., n + 2] are handed on for sublayer k + 1's write, which takes from them
A_r[i, j] = A_r0[i, j] + s_a t_i(1+j) and B[i] = B0[i] + s_b t_i(n+1).

Why this shape: every per-token quantity (the n inverse RMS, the n (n + 2) logits, the
mappings, their gradients) is its own [..., 1] tensor and every stream its own [..., h]
one, so each node is pointwise over [..., h] or a reduction over h of one token, and
Inductor fuses the write, the norms, the projections and the read into one pass over the
streams, and the backward of the pair (the read's, the norms', the write's) into one more
(it cannot fuse through [..., n, n + 2]- or [n, ..., h]-shaped tensors: a kernel of
another size sits between). The backward reads the new streams the pair wrote, which a
layer keeps anyway as the next write's input. A layer's first read hands the state back
through itself, so that the first write's gradient of the state reaches its backward and
is added there rather than in a pass of its own. ``t2train bench bytes``: 61.0 units per
sublayer as two functions, 52.0 as one (with ``INDUCTOR_OPTIONS``, ``hc/__init__.py``),
50.0 with the write's output gradient stacked after the state's (``_write_backward``), 44.1
with a read's backward in a Triton kernel (``HC_CONNECT_BACKWARD``, where the GPU runs the
kernels), 40.1 with the pre-norm in the pair.

Backward, with G = dL/dH' from after the pair and dc the normed input's gradient:

    dx = rho w dc - rho^3 mean(x w dc) x,   dw = sum over tokens of dc x rho
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

from t2train.kernels import dispatch
from t2train.nn.functional import at_least_fp32
from t2train.residual.unrolled import weighted_terms


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
    """Sublayer k + 1's width connection: its folded projections, its read's weights and
    its pre-norm's weight (the read hands on the normed input)."""

    folded: Tensor  # [n + 2, h], fp32
    static_alpha: Tensor  # [n, n + 1]
    alpha_scale: Tensor  # [1]
    norm_weight: Tensor  # [h]


def _column(t: Tensor, i: int, o: int) -> Tensor:
    """Entry o of stream i's per-token numbers, [n, ..., m] -> [..., 1]."""
    return t[i, ..., o : o + 1]


def _columns(t: Tensor) -> list:
    """Each stream's per-token numbers, [n, ..., m] -> [i][o] of [..., 1]."""
    return [[_column(t, i, o) for o in range(t.shape[-1])] for i in range(t.shape[0])]


def _write_weights(write: Write, tanh: list) -> tuple[list, list]:
    """A_r[i][j] and B[j], each [..., 1], fp32, from the tanh of the logits ([i][o])."""
    n = len(tanh)
    alpha = at_least_fp32(write.static_alpha)
    beta = at_least_fp32(write.static_beta)
    s_a, s_b = at_least_fp32(write.alpha_scale), at_least_fp32(write.beta_scale)
    residual = [[alpha[i, 1 + j] + s_a * tanh[i][1 + j] for j in range(n)] for i in range(n)]
    gates = [beta[j] + s_b * tanh[j][n + 1] for j in range(n)]
    return residual, gates


def written_streams(state: Tensor, out: Tensor, residual: list, gates: list) -> list:
    """The new streams h'_j = sum_i A_r[i][j] h_i + B_j y, each in the state's dtype, from
    per-token weights [..., 1] (fp32): one [..., h] tensor per stream (``connect``'s shape)."""
    n = state.shape[0]
    new = []
    for j in range(n):
        total = gates[j] * out  # bf16 times fp32 is computed in fp32
        for i in range(n):
            total = total + residual[i][j] * state[i]
        new.append(total.to(state.dtype))
    return new


def _read_weights(read: Read, tanh: list) -> list:
    """A_m[i], [..., 1] fp32."""
    alpha, s_a = at_least_fp32(read.static_alpha), at_least_fp32(read.alpha_scale)
    return [alpha[i, 0] + s_a * tanh[i][0] for i in range(len(tanh))]


class _Connect(torch.autograd.Function):
    """Tensors flat after ``state``: the write's six (if any), then the read's four."""

    @staticmethod
    def forward(ctx, state, eps, norm_eps, has_write, has_read, *tensors):
        write = Write(*tensors[:6]) if has_write else None
        read = Read(*tensors[len(tensors) - 4 :]) if has_read else None
        n = state.shape[0]
        streams = list(state.unbind(0))
        if write is not None:
            tanh = [[torch.tanh(c) for c in row] for row in _columns(write.logits)]
            residual, gates = _write_weights(write, tanh)
            streams = written_streams(state, write.out, residual, gates)
        ctx.has_write, ctx.has_read, ctx.norm_eps = has_write, has_read, norm_eps
        # read alone: the state passes through, so that the gradient of the write that reads
        # it next reaches this backward (added there, not in a pass of its own)
        outputs = [torch.stack(streams) if write is not None else state.view_as(state)]
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
        logits = torch.stack([torch.cat(row, -1) for row in rows])  # [n, ..., n + 2]
        saved = (state, *tensors, logits, torch.stack(inverse_rms))
        return finish_read(ctx, outputs, write, streams, weights, read, norm_eps, saved, logits)

    @staticmethod
    def backward(ctx, grad_streams, *grads):
        parts = (Write, Read, HC_CONNECT_BACKWARD, _write_backward)
        return connect_function_backward(ctx, grad_streams, grads, *parts)


def connect_function_backward(ctx, grad_streams, grads, write_type, read_type, kernel, write_back):
    """The backward of a write and a read as one autograd function (``hc``'s and ``mhc``'s,
    their saved tensors as ``finish_read`` keeps them): a write alone in ``write_back`` (one
    pass already: a kernel adds nothing), else ``kernel`` (routed to Triton or its reference)
    for the write, if any, and the read."""
    state, *saved = ctx.saved_tensors
    write_parts, read_parts = len(write_type._fields), len(read_type._fields)
    if not ctx.has_read:  # a layer's last write
        grad = list(grad_streams.unbind(0))
        grad_state, write_grads = write_back(state, write_type(*saved[:write_parts]), grad)
        return (grad_state, None, None, None, None, *write_grads)
    write = write_type(*saved[:write_parts]) if ctx.has_write else None
    streams = saved.pop() if ctx.has_write else state
    inverse_rms, handed_on = saved.pop(), saved.pop()
    _, grad_normed, grad_handed_on, _ = grads
    grad_state, write_grads, read_grads = dispatch.route(kernel, state)(
        state,
        write,
        read_type(*saved[-read_parts:]),
        ctx.norm_eps,
        streams,
        handed_on,
        inverse_rms,
        grad_streams,
        grad_normed,
        grad_handed_on,
    )
    return (grad_state, None, None, None, None, *write_grads, *read_grads)


def finish_read(ctx, outputs: list, write, streams, weights, read, norm_eps, saved, handed_on):
    """The end of a connect's forward: x = sum_i w_i h'_i, its pre-norm, what the backward
    keeps (``saved``, and the new streams after a write) and the outputs. x is not saved (the
    backward rebuilds it from the streams) and has no gradient of its own: the sublayer reads
    the normed input; the read weights are for diagnostics."""
    x = weighted_terms(streams, weights).to(streams[0].dtype)
    normed = torch.nn.functional.rms_norm(x, x.shape[-1:], read.norm_weight, norm_eps)
    ctx.save_for_backward(*saved, *(outputs if write is not None else []))
    read_weights = torch.cat(weights, -1)
    ctx.mark_non_differentiable(x, read_weights)
    return (*outputs, x, normed, handed_on, read_weights)


def connect_backward(
    state: Tensor,
    write: Optional[Write],
    read: Read,
    norm_eps: float,
    streams: Tensor,
    logits: Tensor,
    inv_rms: Tensor,
    grad_streams: Tensor,
    grad_normed: Tensor,
    grad_logits: Tensor,
) -> tuple:
    """The backward of a write (if any) and the next read: the state's gradient, the write's
    inputs' gradients (none without a write) and the read's. ``streams``: what the read saw
    (the new streams, or the state without a write), ``logits`` [n, ..., n + 2] and
    ``inv_rms`` [n, ..., 1] (the streams' inverse RMS) its forward's; the gradients of the
    new streams, of the normed input and of the logits handed on."""
    return composed_backward(
        _read_backward,
        _write_backward,
        state,
        write,
        read,
        norm_eps,
        streams,
        logits,
        inv_rms,
        grad_streams,
        grad_normed,
        grad_logits,
    )


def composed_backward(read_back, write_back, state, write, read, norm_eps, streams, *rest):
    """A connect's backward in PyTorch: ``read_back``'s (given ``streams``, the read's
    handed-on numbers and inverse RMS, the gradients of the normed input and of the handed-on
    numbers, and G_j, the new streams' gradient) and then ``write_back``'s, if there is a
    write. G_j is one [..., h] tensor per stream, as in the forward, so that the compiler
    makes the read's and the write's backward one pass (a stacked [n, ..., h] expression
    would be a kernel of another size)."""
    handed_on, inverse_rms, grad_streams, grad_normed, grad_handed_on = rest
    grad, read_grads = read_back(
        streams,
        read,
        norm_eps,
        handed_on,
        inverse_rms,
        grad_normed,
        grad_handed_on,
        list(grad_streams.unbind(0)),
    )
    if write is None:
        return torch.stack([g.to(state.dtype) for g in grad]), (), read_grads
    grad_state, write_grads = write_back(state, write, grad)
    return grad_state, write_grads, read_grads


# The backward above with its wide part (everything over the streams) in one Triton kernel
# that reads the streams once and sums the projections' gradient in the same pass
# (``t2train/kernels/hyper_connect.py``): compiled, that sum is a pass of its own.
HC_CONNECT_BACKWARD = dispatch.Kernel(
    "hc_connect_backward", "t2train.kernels.hyper_connect:connect_backward", connect_backward
)


def accumulator(t: Tensor) -> torch.dtype:
    """Sums of bf16 products in fp32 (fp64 stays fp64)."""
    return torch.promote_types(t.dtype, torch.float32)


def norm_backward(x: Tensor, weight: Tensor, eps: float, grad_normed: Tensor):
    """The pre-norm's backward as autograd computes torch's ``rms_norm``'s: x's gradient (in
    x's dtype) and the weight's per-token terms (fp32; their sum over tokens is its
    gradient)."""
    xf, grad = at_least_fp32(x), at_least_fp32(grad_normed)
    inverse_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    scaled = grad * weight
    grad_x = scaled * inverse_rms - (inverse_rms**3 * (scaled * xf).mean(-1, keepdim=True)) * xf
    return grad_x.to(x.dtype), grad * (xf * inverse_rms)


def _read_backward(
    seen: Tensor, read: Read, norm_eps, logits, inverse_rms, grad_normed, grad_logits, grad
):
    """G_i += the read's, the norms' and the projections' terms (each in the streams'
    dtype, as autograd would add them), and the read's parameters' gradients; x, the read,
    rebuilt from the streams it saw (``seen``, [n, ..., h]) for its norm's backward."""
    streams = list(seen.unbind(0))
    n, h = len(streams), streams[0].shape[-1]
    tokens = list(range(streams[0].dim() - 1))
    tanh = [[torch.tanh(_column(logits, i, 0))] for i in range(n)]  # A_m's alone
    s_a = at_least_fp32(read.alpha_scale)
    read_weights = _read_weights(read, tanh)
    x = weighted_terms(streams, read_weights).to(streams[0].dtype)
    grad_x, norm_terms = norm_backward(x, read.norm_weight, norm_eps, grad_normed)
    grad_read = [  # dA_m[i]
        (s * grad_x).sum(-1, keepdim=True, dtype=accumulator(s)) for s in streams
    ]
    d = [  # the logits' gradients, d_io
        [s_a * (1 - tanh[i][0] * tanh[i][0]) * grad_read[i]]
        + [_column(grad_logits, i, o) for o in range(1, n + 2)]
        for i in range(n)
    ]
    coefficients = [[inverse_rms[i] * d_io for d_io in d[i]] for i in range(n)]  # r_i d_io
    total = []
    for i in range(n):
        logit_terms = weighted_terms([_column(logits, i, o) for o in range(n + 2)], d[i])
        term = grad[i] + read_weights[i] * grad_x
        term = term - (inverse_rms[i] * inverse_rms[i] / h * logit_terms) * streams[i]
        term = term + weighted_terms(list(read.folded.unbind(0)), coefficients[i])
        total.append(term.to(streams[i].dtype))
    grad_folded = torch.stack(
        [
            weighted_terms(streams, [coefficients[i][o] for i in range(n)]).sum(tokens)
            for o in range(n + 2)
        ]
    )
    # the sums over tokens as one reduction of the per-token numbers: dA_m[i], then the
    # scale's terms t_i0 dA_m[i]
    per_token = grad_read + [tanh[i][0] * grad_read[i] for i in range(n)]
    sums = torch.cat(per_token, -1).sum(tokens)
    grad_static = torch.cat([sums[:n, None], sums.new_zeros(n, n)], -1)
    grad_scale = sums[n:].sum()
    return total, (
        grad_folded.to(read.folded.dtype),
        grad_static.to(read.static_alpha.dtype),
        grad_scale.reshape(1).to(read.alpha_scale.dtype),
        norm_terms.sum(tokens).to(read.norm_weight.dtype),
    )


def _write_backward(state, write: Write, grad: list):
    """The state's gradient (its dtype) through h'_j = sum_i A_r[i, j] h_i + B_j y, given
    G_j, and the write's inputs' gradients: y's, its logits' (the tanh's derivative
    applied) and its parameters'."""
    n = state.shape[0]
    tokens = list(range(state.dim() - 2))
    # the mappings rebuilt from the tanh of the stacked logits, not as the forward built
    # them: the partitioner would keep the forward's n^2 + n fp32 numbers per token beside
    # the logits
    tanh = _columns(torch.tanh(write.logits))
    residual, gates = _write_weights(write, tanh)
    s_a, s_b = at_least_fp32(write.alpha_scale), at_least_fp32(write.beta_scale)
    grad_state, grad_out, grad_residual, grad_gates = written_streams_backward(
        state, write.out, residual, gates, grad
    )
    zero = torch.zeros_like(grad_gates[0])
    grad_logits = torch.stack(
        [
            torch.cat(
                [zero]
                + [s_a * (1 - tanh[i][1 + j] ** 2) * grad_residual[i][j] for j in range(n)]
                + [s_b * (1 - tanh[i][n + 1] ** 2) * grad_gates[i]],
                -1,
            )
            for i in range(n)
        ]
    )
    # the sums over tokens as one reduction of the per-token numbers: dA_r (row by row),
    # dB, then the scales' terms t dA_r and t dB
    per_token = (
        [grad_residual[i][j] for i in range(n) for j in range(n)]
        + grad_gates
        + [tanh[i][1 + j] * grad_residual[i][j] for i in range(n) for j in range(n)]
        + [tanh[j][n + 1] * grad_gates[j] for j in range(n)]
    )
    sums = torch.cat(per_token, -1).sum(tokens)
    square = n * n
    grad_static = torch.cat([sums.new_zeros(n, 1), sums[:square].view(n, n)], -1)
    grad_alpha_scale = sums[square + n : 2 * square + n].sum()
    grad_beta_scale = sums[2 * square + n :].sum()
    return grad_state, (
        grad_out,
        grad_logits.to(write.logits.dtype),
        grad_static.to(write.static_alpha.dtype),
        sums[square : square + n].to(write.static_beta.dtype),
        grad_alpha_scale.reshape(1).to(write.alpha_scale.dtype),
        grad_beta_scale.reshape(1).to(write.beta_scale.dtype),
    )


def written_streams_backward(state: Tensor, out: Tensor, residual: list, gates: list, grad):
    """``written_streams``' backward given G_j (one [..., h] tensor per stream): the state's
    gradient dh_i = sum_j A_r[i][j] G_j ([n, ..., h]) and the output's dy = sum_j B_j G_j,
    in their dtypes, and dA_r[i][j] = h_i . G_j and dB_j = y . G_j ([..., 1], fp32)."""
    n = state.shape[0]
    inputs = list(state.unbind(0))
    # the output's gradient stacked after the state's: Inductor writes a result where it is
    # first stored, and apart it was stored just before its GEMM, too far from the pass
    # that reads G to share it (2 units)
    grads = torch.stack(
        [weighted_terms(grad, residual[i]).to(state.dtype) for i in range(n)]
        + [weighted_terms(grad, gates).to(state.dtype)]
    )
    grad_state, grad_out = grads[:n], grads[n].to(out.dtype)
    total = accumulator(state)
    grad_residual = [
        [(inputs[i] * g).sum(-1, keepdim=True, dtype=total) for g in grad] for i in range(n)
    ]
    grad_gates = [(out * g).sum(-1, keepdim=True, dtype=total) for g in grad]
    return grad_state, grad_out, grad_residual, grad_gates


def connect(
    state: Tensor,
    eps: float,
    write: Optional[Write] = None,
    read: Optional[Read] = None,
    norm_eps: Optional[float] = None,
) -> tuple:
    """Sublayer k's write and sublayer k + 1's read of the streams [n, ..., h], either alone:
    (the new streams, or without ``write`` the state, through which the next write must
    read it) + (x [..., h] in the state's dtype (not differentiable: the sublayer reads the
    next), x normed by sublayer k + 1's pre-norm (RMSNorm with ``read.norm_weight`` and
    ``norm_eps``), the logits [n, ..., n + 2] for sublayer k + 1's write, A_m [..., n] for
    diagnostics (not differentiable), if ``read``). ``eps``: the streams' norms'."""
    return connected(_Connect, state, eps, write, read, norm_eps)


def connected(function, state: Tensor, eps: float, write=None, read=None, norm_eps=None) -> tuple:
    """``function`` (a write and a read as one autograd function) applied to the streams,
    the write's tensors (if any) and then the read's (if any)."""
    if read is not None and norm_eps is None:
        raise ValueError("connect: a read needs norm_eps, the eps of its sublayer's pre-norm")
    tensors = (*(write or ()), *(read or ()))
    return function.apply(state, eps, norm_eps, write is not None, read is not None, *tensors)
