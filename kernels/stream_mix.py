"""Fused mHC (and HC) stream read and write, forward and backward (one pass over the stream each).

Exact counterparts of ``t2train.residual.mhc.layers.stream_read`` and ``stream_write``. Per token,
with the streams x_j (j < n, each of width h), the read logits p_j, the write logits q_i and
the mixing logits L (n x n):

    read:   w_j = sigma(p_j),         y = sum_j w_j x_j
    write:  R = SK(L),  P_i = 2 sigma(q_i),   y_i = sum_j R_ij x_j + P_i o

SK (Sinkhorn-Knopp as mHC's Eq. 9, t_max iterations): M_0 = exp(L - max L); per iteration the
columns, then the rows, are divided by their sums (A = M / c, c = column sums of M;
B = A / r, r = row sums of A). In fp32; results stored in the inputs' dtypes. Backward, with
G = dL/dy:

    read:   dx_j = w_j g,   dp_j = w_j (1 - w_j) <g, x_j>
    write:  dx_j = sum_i R_ij g_i,   do = sum_i P_i g_i,   dq_i = P_i (1 - P_i / 2) <g_i, o>,
            dR_ij = <g_i, x_j>, then back through the iterations, last first:
            dA = (dB - rowsum(dB * B)) / r,   dM = (dA - colsum(dA * A)) / c,   dL = dM * M_0

(the maximum gets no gradient: every normalisation cancels a common factor). The backward
reruns the iterations once, keeping only each one's sums c_t and r_t in registers, and
rebuilds the matrices in reverse from R: A_t = B_t r_t, and M_in(t) = A_t c_t is B_{t-1};
nothing but the inputs is saved between forward and backward.

Hyper-Connections (``RAW``) mix with weights given as they are: read w_j = p_j; write
y_i = sum_j R_ij x_j + P_i o with R and P as given (no sigmoid, no Sinkhorn), so the backward
ends at dR_ij = <g_i, x_j> and dP_i = <g_i, o>.

One program owns a block of tokens (their n x n iterations side by side) and loops over the
hidden dim in blocks, reading each stream once; the write's backward accumulates dR and dq
over the hidden blocks, then runs the Sinkhorn backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from t2train.kernels.ops import kernel_op, tracing


@triton.jit
def _normalise_rows(m, n_ok):
    """m [tokens, n, n] with its rows divided by their sums, and the sums [tokens, n]."""
    sums = tl.sum(m, 2)
    return m / tl.where(n_ok[None, :], sums, 1.0)[:, :, None], sums


@triton.jit
def _normalise_columns(m, n_ok):
    sums = tl.sum(m, 1)
    return m / tl.where(n_ok[None, :], sums, 1.0)[:, None, :], sums


@triton.jit
def _sinkhorn(m0, n_ok, iterations):
    m = m0
    for _ in range(iterations):
        m, _c = _normalise_columns(m, n_ok)
        m, _r = _normalise_rows(m, n_ok)
    return m


@triton.jit
def _sinkhorn_recorded(
    m0, n_ok, iterations, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr
):
    """``_sinkhorn``, also returning each iteration's column sums c_t and row sums r_t
    ([tokens, iteration, n] tiles)."""
    steps = tl.arange(0, BLOCK_I)[None, :, None]
    row_sums = tl.full([BLOCK_T, BLOCK_I, BLOCK_N], 1.0, tl.float32)
    column_sums = tl.full([BLOCK_T, BLOCK_I, BLOCK_N], 1.0, tl.float32)
    m = m0
    for t in range(iterations):
        m, c = _normalise_columns(m, n_ok)
        m, r = _normalise_rows(m, n_ok)
        row_sums = tl.where(steps == t, tl.where(n_ok[None, :], r, 1.0)[:, None, :], row_sums)
        column_sums = tl.where(steps == t, tl.where(n_ok[None, :], c, 1.0)[:, None, :], column_sums)
    return m, row_sums, column_sums


@triton.jit
def _sinkhorn_backward(m0, mixing, row_sums, column_sums, iterations, grad, BLOCK_I: tl.constexpr):
    """dL from dR through the unrolled iterations, last first. Each iteration's matrices are
    rebuilt from its output and recorded sums: A_t = B_t r_t, B_{t-1} = M_in(t) = A_t c_t."""
    steps = tl.arange(0, BLOCK_I)[None, :, None]
    b = mixing
    for back in range(iterations):
        t = iterations - 1 - back
        r = tl.sum(tl.where(steps == t, row_sums, 0.0), 1)
        c = tl.sum(tl.where(steps == t, column_sums, 0.0), 1)
        a = b * r[:, :, None]
        grad = (grad - tl.sum(grad * b, 2)[:, :, None]) / r[:, :, None]
        grad = (grad - tl.sum(grad * a, 1)[:, None, :]) / c[:, None, :]
        b = a * c[:, None, :]
    return grad * m0


@triton.jit
def _block(tokens, hidden, n, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tokens and their mask, the streams and their mask, and the offset from
    one stream to the next (64-bit: a stream can pass 2^31 elements)."""
    pid = tl.program_id(0).to(tl.int64)
    toks = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    streams = tl.arange(0, BLOCK_N)
    plane = (pid * 0 + tokens) * hidden
    return toks, toks < tokens, streams, streams < n, plane


@triton.jit
def _per_stream(PTR, toks, t_ok, streams, n_ok, n):
    """[tokens, n] values (fp32; 0 outside) of a [tokens, n] tensor."""
    ok = t_ok[:, None] & n_ok[None, :]
    return tl.load(PTR + toks[:, None] * n + streams[None, :], mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _entry(values, streams, j):
    """values[:, j] of [tokens, n] values."""
    return tl.sum(tl.where(streams[None, :] == j, values, 0.0), 1)


@triton.jit
def _column(matrices, streams, j):
    """matrices[:, :, j] of [tokens, n, n] matrices."""
    return tl.sum(tl.where(streams[None, None, :] == j, matrices, 0.0), 2)


@triton.jit
def _read_weights(PRE, toks, t_ok, streams, n_ok, n, RAW: tl.constexpr):
    """The read weights [tokens, n]: sigma(p) (mHC), or p as given (RAW: HC's alpha)."""
    pre = _per_stream(PRE, toks, t_ok, streams, n_ok, n)
    return pre if RAW else tl.where(n_ok[None, :], tl.sigmoid(pre), 0.0)


@triton.jit
def _read_fwd(
    X,
    PRE,
    Y,
    tokens,
    hidden,
    n,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    RAW: tl.constexpr,
):
    toks, t_ok, streams, n_ok, plane = _block(tokens, hidden, n, BLOCK_T, BLOCK_N)
    w = _read_weights(PRE, toks, t_ok, streams, n_ok, n, RAW)
    for start in range(0, hidden, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        row = toks[:, None] * hidden + cols[None, :]
        ok = t_ok[:, None] & (cols < hidden)[None, :]
        y = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
        row_j = row
        for j in range(0, n):
            x_j = tl.load(X + row_j, mask=ok, other=0.0).to(tl.float32)
            y += _entry(w, streams, j)[:, None] * x_j
            row_j += plane
        tl.store(Y + row, y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _read_bwd(
    X,
    PRE,
    G,
    DX,
    DPRE,
    tokens,
    hidden,
    n,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    RAW: tl.constexpr,
):
    toks, t_ok, streams, n_ok, plane = _block(tokens, hidden, n, BLOCK_T, BLOCK_N)
    w = _read_weights(PRE, toks, t_ok, streams, n_ok, n, RAW)
    dw = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for start in range(0, hidden, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        row = toks[:, None] * hidden + cols[None, :]
        ok = t_ok[:, None] & (cols < hidden)[None, :]
        g = tl.load(G + row, mask=ok, other=0.0).to(tl.float32)
        row_j = row
        for j in range(0, n):
            x_j = tl.load(X + row_j, mask=ok, other=0.0).to(tl.float32)
            tl.store(
                DX + row_j, (_entry(w, streams, j)[:, None] * g).to(DX.dtype.element_ty), mask=ok
            )
            dw += tl.where(streams[None, :] == j, tl.sum(x_j * g, 1)[:, None], 0.0)
            row_j += plane
    d_pre = dw if RAW else dw * w * (1.0 - w)
    tl.store(
        DPRE + toks[:, None] * n + streams[None, :],
        d_pre.to(DPRE.dtype.element_ty),
        mask=t_ok[:, None] & n_ok[None, :],
    )


@triton.jit
def _write_inputs(POST, RES, toks, t_ok, streams, n_ok, n, RAW: tl.constexpr):
    """M_0 = exp(L - max L) [tokens, n, n] (0 outside n x n) and P = 2 sigma(q) [tokens, n];
    RAW (HC): the mixing matrix and P as given."""
    ok = n_ok[None, :, None] & n_ok[None, None, :]
    offsets = toks[:, None, None] * n * n + streams[None, :, None] * n + streams[None, None, :]
    logits = tl.load(RES + offsets, mask=t_ok[:, None, None] & ok, other=0.0).to(tl.float32)
    post = _per_stream(POST, toks, t_ok, streams, n_ok, n)
    if RAW:
        return logits, post
    largest = tl.max(tl.max(tl.where(ok, logits, float("-inf")), 2), 1)
    m0 = tl.where(ok, tl.exp(logits - largest[:, None, None]), 0.0)
    return m0, tl.where(n_ok[None, :], 2.0 * tl.sigmoid(post), 0.0)


@triton.jit
def _write_fwd(
    X,
    OUT,
    POST,
    RES,
    Y,
    tokens,
    hidden,
    n,
    iterations,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    RAW: tl.constexpr,
):
    toks, t_ok, streams, n_ok, plane = _block(tokens, hidden, n, BLOCK_T, BLOCK_N)
    m0, post = _write_inputs(POST, RES, toks, t_ok, streams, n_ok, n, RAW)
    mixing = _sinkhorn(m0, n_ok, iterations)  # RAW: no iterations
    for start in range(0, hidden, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        row = toks[:, None] * hidden + cols[None, :]
        ok = t_ok[:, None] & (cols < hidden)[None, :]
        o = tl.load(OUT + row, mask=ok, other=0.0).to(tl.float32)
        y = post[:, :, None] * o[:, None, :]
        row_j = row
        for j in range(0, n):
            x_j = tl.load(X + row_j, mask=ok, other=0.0).to(tl.float32)
            y += _column(mixing, streams, j)[:, :, None] * x_j[:, None, :]
            row_j += plane
        tile = streams[None, :, None] * plane + row[:, None, :]
        tl.store(Y + tile, y.to(Y.dtype.element_ty), mask=n_ok[None, :, None] & ok[:, None, :])


@triton.jit
def _write_bwd(
    X,
    OUT,
    POST,
    RES,
    G,
    DX,
    DOUT,
    DPOST,
    DRES,
    tokens,
    hidden,
    n,
    iterations,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_I: tl.constexpr,
    RAW: tl.constexpr,
):
    toks, t_ok, streams, n_ok, plane = _block(tokens, hidden, n, BLOCK_T, BLOCK_N)
    m0, post = _write_inputs(POST, RES, toks, t_ok, streams, n_ok, n, RAW)
    mixing, row_sums, column_sums = _sinkhorn_recorded(
        m0, n_ok, iterations, BLOCK_T, BLOCK_N, BLOCK_I
    )
    d_mixing = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_N], dtype=tl.float32)
    d_post = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for start in range(0, hidden, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        row = toks[:, None] * hidden + cols[None, :]
        ok = t_ok[:, None] & (cols < hidden)[None, :]
        tile = streams[None, :, None] * plane + row[:, None, :]
        g = tl.load(G + tile, mask=n_ok[None, :, None] & ok[:, None, :], other=0.0).to(tl.float32)
        o = tl.load(OUT + row, mask=ok, other=0.0).to(tl.float32)
        tl.store(DOUT + row, tl.sum(post[:, :, None] * g, 1).to(DOUT.dtype.element_ty), mask=ok)
        d_post += tl.sum(g * o[:, None, :], 2)
        row_j = row
        for j in range(0, n):
            x_j = tl.load(X + row_j, mask=ok, other=0.0).to(tl.float32)
            dx_j = tl.sum(_column(mixing, streams, j)[:, :, None] * g, 1)
            tl.store(DX + row_j, dx_j.to(DX.dtype.element_ty), mask=ok)
            d_mixing += tl.where(
                streams[None, None, :] == j, tl.sum(g * x_j[:, None, :], 2)[:, :, None], 0.0
            )
            row_j += plane
    if not RAW:  # through P = 2 sigma(q) and the Sinkhorn iterations
        d_post = d_post * post * (1.0 - 0.5 * post)
        d_mixing = _sinkhorn_backward(
            m0, mixing, row_sums, column_sums, iterations, d_mixing, BLOCK_I
        )
    _store_per_token(DPOST, DRES, d_post, d_mixing, toks, t_ok, streams, n_ok, n)


@triton.jit
def _store_per_token(P, M, per_stream, matrices, toks, t_ok, streams, n_ok, n):
    """[tokens, n] values into P and [tokens, n, n] matrices into M (both [T, n(, n)])."""
    tl.store(
        P + toks[:, None] * n + streams[None, :],
        per_stream.to(P.dtype.element_ty),
        mask=t_ok[:, None] & n_ok[None, :],
    )
    offsets = toks[:, None, None] * n * n + streams[None, :, None] * n + streams[None, None, :]
    tl.store(
        M + offsets,
        matrices.to(M.dtype.element_ty),
        mask=t_ok[:, None, None] & n_ok[None, :, None] & n_ok[None, None, :],
    )


@triton.jit
def _mappings_fwd(
    POST, RES, GAINS, MIXING, tokens, n, iterations, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr
):
    toks, t_ok, streams, n_ok, _ = _block(tokens, 1, n, BLOCK_T, BLOCK_N)
    m0, gains = _write_inputs(POST, RES, toks, t_ok, streams, n_ok, n, False)
    mixing = _sinkhorn(m0, n_ok, iterations)
    _store_per_token(GAINS, MIXING, gains, mixing, toks, t_ok, streams, n_ok, n)


@triton.jit
def _mappings_bwd(
    POST,
    RES,
    DGAINS,
    DMIXING,
    DPOST,
    DRES,
    tokens,
    n,
    iterations,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    toks, t_ok, streams, n_ok, _ = _block(tokens, 1, n, BLOCK_T, BLOCK_N)
    m0, gains = _write_inputs(POST, RES, toks, t_ok, streams, n_ok, n, False)
    mixing, row_sums, column_sums = _sinkhorn_recorded(
        m0, n_ok, iterations, BLOCK_T, BLOCK_N, BLOCK_I
    )
    d_mixing, d_gains = _write_inputs(DGAINS, DMIXING, toks, t_ok, streams, n_ok, n, True)
    d_res = _sinkhorn_backward(m0, mixing, row_sums, column_sums, iterations, d_mixing, BLOCK_I)
    d_post = d_gains * gains * (1.0 - 0.5 * gains)
    _store_per_token(DPOST, DRES, d_post, d_res, toks, t_ok, streams, n_ok, n)


BLOCK_T = 8  # tokens per program


def _launch(n: int, hidden: int) -> dict:
    block_n = max(2, triton.next_power_of_2(n))
    block_h = min(triton.next_power_of_2(hidden), max(16, 4096 // (BLOCK_T * block_n)))
    return dict(BLOCK_T=BLOCK_T, BLOCK_N=block_n, BLOCK_H=block_h, num_warps=4)


def _grid(tokens: int) -> tuple:
    return (triton.cdiv(tokens, BLOCK_T),)


def _check(state: Tensor, **others: tuple) -> None:
    """Each named (tensor, expected shape) against the state [n, s, b, h]."""
    for name, (t, expected) in others.items():
        if tuple(t.shape) != expected:
            raise ValueError(
                f"state {tuple(state.shape)} and {name} {tuple(t.shape)} disagree "
                f"(expected {expected})"
            )


# The public functions below hand the operators contiguous logits: a copy made outside the
# operator is saved for the backward (not made again there), and a compiled layer can fuse it
# into the projection that produced them. The state is made contiguous inside (only the first
# layer's, a broadcast embedding, is not), so the broadcast is what is saved.
@kernel_op("stream_read")
def _stream_read(state: Tensor, pre_logit: Tensor, raw: bool) -> Tensor:
    """state [n, s, b, h]; pre_logit [s, b, n] (raw: the weights themselves) -> [s, b, h]."""
    state, pre_logit = state.contiguous(), pre_logit.contiguous()
    n, hidden = state.shape[0], state.shape[-1]
    tokens = state[0].numel() // hidden
    y = torch.empty(state.shape[1:], dtype=state.dtype, device=state.device)
    if tracing(state):
        return y
    _read_fwd[_grid(tokens)](state, pre_logit, y, tokens, hidden, n, RAW=raw, **_launch(n, hidden))
    return y


@kernel_op("stream_read_backward")
def _stream_read_backward(
    state: Tensor, pre_logit: Tensor, grad: Tensor, raw: bool
) -> list[Tensor]:
    state, pre_logit, grad = state.contiguous(), pre_logit.contiguous(), grad.contiguous()
    n, hidden = state.shape[0], state.shape[-1]
    tokens = state[0].numel() // hidden
    d_state, d_pre = torch.empty_like(state), torch.empty_like(pre_logit)
    if tracing(state):
        return [d_state, d_pre]
    _read_bwd[_grid(tokens)](
        state, pre_logit, grad, d_state, d_pre, tokens, hidden, n, RAW=raw, **_launch(n, hidden)
    )
    return [d_state, d_pre]


def _save_read(ctx, inputs: tuple, output: Tensor) -> None:
    *tensors, ctx.raw = inputs
    ctx.save_for_backward(*tensors)


def _read_grads(ctx, grad: Tensor) -> tuple:
    return (*_stream_read_backward(*ctx.saved_tensors, grad, ctx.raw), None)


_stream_read.register_autograd(_read_grads, setup_context=_save_read)


@kernel_op("stream_write")
def _stream_write(
    state: Tensor, out: Tensor, post_logit: Tensor, res_logit: Tensor, iterations: int, raw: bool
) -> Tensor:
    """state [n, s, b, h]; out [s, b, h]; post_logit [s, b, n]; res_logit [s, b, n, n]; raw:
    P and the mixing matrix as given (no sigmoid, no Sinkhorn)."""
    inputs = [t.contiguous() for t in (state, out, post_logit, res_logit)]
    n, hidden = state.shape[0], state.shape[-1]
    tokens = out.numel() // hidden
    y = torch.empty_like(inputs[0])
    if tracing(state):
        return y
    _write_fwd[_grid(tokens)](
        *inputs, y, tokens, hidden, n, iterations, RAW=raw, **_launch(n, hidden)
    )
    return y


@kernel_op("stream_write_backward")
def _stream_write_backward(
    state: Tensor,
    out: Tensor,
    post_logit: Tensor,
    res_logit: Tensor,
    grad: Tensor,
    iterations: int,
    raw: bool,
) -> list[Tensor]:
    inputs = [t.contiguous() for t in (state, out, post_logit, res_logit)]
    n, hidden = state.shape[0], state.shape[-1]
    tokens = state[0].numel() // hidden
    grads = [torch.empty_like(t) for t in inputs]
    if tracing(state):
        return grads
    _write_bwd[_grid(tokens)](
        *inputs,
        grad.contiguous(),
        *grads,
        tokens,
        hidden,
        n,
        iterations,
        BLOCK_I=triton.next_power_of_2(max(iterations, 1)),
        RAW=raw,
        **_launch(n, hidden),
    )
    return grads


def _save_write(ctx, inputs: tuple, output: Tensor) -> None:
    *tensors, ctx.iterations, ctx.raw = inputs
    ctx.save_for_backward(*tensors)


def _write_grads(ctx, grad: Tensor) -> tuple:
    return (*_stream_write_backward(*ctx.saved_tensors, grad, ctx.iterations, ctx.raw), None, None)


_stream_write.register_autograd(_write_grads, setup_context=_save_write)


@kernel_op("stream_mappings")
def _stream_mappings(post_logit: Tensor, res_logit: Tensor, iterations: int) -> list[Tensor]:
    """post_logit [..., n], res_logit [..., n, n], contiguous -> 2 sigma(post_logit) and
    SK(res_logit), in their dtypes."""
    return _per_token(_mappings_fwd, post_logit, res_logit, (), iterations)


@kernel_op("stream_mappings_backward")
def _stream_mappings_backward(
    post_logit: Tensor, res_logit: Tensor, grad_gains: Tensor, grad_mixing: Tensor, iterations: int
) -> list[Tensor]:
    grads = (grad_gains.contiguous(), grad_mixing.contiguous())
    blocks = dict(BLOCK_I=triton.next_power_of_2(max(iterations, 1)))
    return _per_token(_mappings_bwd, post_logit, res_logit, grads, iterations, **blocks)


def _per_token(kernel, post_logit, res_logit, extra: tuple, iterations: int, **blocks) -> list:
    """Launches a per-token kernel of the write's mappings: the logits and ``extra`` in, two
    results shaped as the logits out (a token's n x n iterations in registers)."""
    n = post_logit.shape[-1]
    results = [torch.empty_like(post_logit), torch.empty_like(res_logit)]
    if tracing(post_logit):
        return results
    tokens = post_logit.numel() // max(n, 1)
    block_n = max(2, triton.next_power_of_2(n))
    kernel[_grid(tokens)](
        post_logit,
        res_logit,
        *extra,
        *results,
        tokens,
        n,
        iterations,
        BLOCK_T=BLOCK_T,
        BLOCK_N=block_n,
        num_warps=1,
        **blocks,
    )
    return results


def _save_mappings(ctx, inputs: tuple, output) -> None:
    *tensors, ctx.iterations = inputs
    ctx.save_for_backward(*tensors)


def _mappings_grads(ctx, grads: list) -> tuple:
    post_logit, res_logit = ctx.saved_tensors
    grad_gains, grad_mixing = grads
    grad_gains = grad_gains if grad_gains is not None else torch.zeros_like(post_logit)
    grad_mixing = grad_mixing if grad_mixing is not None else torch.zeros_like(res_logit)
    grads = _stream_mappings_backward(
        post_logit, res_logit, grad_gains, grad_mixing, ctx.iterations
    )
    return (*grads, None)


_stream_mappings.register_autograd(_mappings_grads, setup_context=_save_mappings)


def write_mappings(post_logit: Tensor, res_logit: Tensor, iterations: int) -> tuple:
    """Triton ``t2train.residual.mhc.functional.write_mappings`` (same arguments, same
    results): one narrow pass per token, forward and backward (the backward reruns the
    iterations)."""
    if tuple(res_logit.shape) != (*post_logit.shape, post_logit.shape[-1]):
        raise ValueError(
            f"post_logit {tuple(post_logit.shape)} and res_logit {tuple(res_logit.shape)} "
            "disagree (expected post_logit [..., n] and res_logit [..., n, n])"
        )
    gains, mixing = _stream_mappings(post_logit.contiguous(), res_logit.contiguous(), iterations)
    return gains, mixing


def stream_read(state: Tensor, pre_logit: Tensor) -> Tensor:
    """Triton ``t2train.residual.mhc.layers.stream_read`` (same arguments, same result)."""
    n, s, b, _ = state.shape
    _check(state, pre_logit=(pre_logit, (s, b, n)))
    return _stream_read(state, pre_logit.contiguous(), False)


def stream_write(
    state: Tensor, out: Tensor, post_logit: Tensor, res_logit: Tensor, iterations: int
) -> Tensor:
    """Triton ``t2train.residual.mhc.layers.stream_write`` (same arguments, same result)."""
    n, s, b, h = state.shape
    _check(
        state,
        out=(out, (s, b, h)),
        post_logit=(post_logit, (s, b, n)),
        res_logit=(res_logit, (s, b, n, n)),
    )
    return _stream_write(
        state, out, post_logit.contiguous(), res_logit.contiguous(), iterations, False
    )


def width_read(state: Tensor, weights: Tensor) -> Tensor:
    """Triton ``t2train.residual.hc.layers.width_read``: sum_i weights[..., i] h_i, the weights as
    given (HC's read)."""
    n, s, b, _ = state.shape
    _check(state, weights=(weights, (s, b, n)))
    return _stream_read(state, weights.contiguous(), True)


def depth_write(state: Tensor, residual: Tensor, beta: Tensor, out: Tensor) -> Tensor:
    """Triton ``t2train.residual.hc.layers.depth_write``: h'_j = sum_i residual[..., i, j] h_i +
    beta[..., j] out (HC's write: stream j takes column j, the transpose of mHC's row)."""
    n, s, b, h = state.shape
    _check(state, out=(out, (s, b, h)), beta=(beta, (s, b, n)), residual=(residual, (s, b, n, n)))
    return _stream_write(
        state, out, beta.contiguous(), residual.transpose(-1, -2).contiguous(), 0, True
    )
