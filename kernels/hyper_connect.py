"""Hyper-Connections' backward of one sublayer's write, the next sublayer's read and that
sublayer's pre-norm, as one kernel that reads the streams once (``t2train/residual/hc/
compiled.py`` has the forward, the formulas and the PyTorch reference this equals), and
mHC's (``t2train/residual/mhc/compiled.py``), which differs where its read does (below).

Per token, with the write's input streams h_i, the sublayer output y, the read's input
streams h'_j = sum_i A_r[i, j] h_i + B_j y, their gradient G_j from after the pair, the read
x = sum_i A_m[i] h'_i and the normed input's gradient dc (the pre-norm c = x rho w, rho =
(mean x^2 + eps)^(-1/2)):

    dx = rho w dc - rho^3 mean(x w dc) x,   dw = sum over tokens of dc x rho
    dA_m[i] = h'_i . dx,   d_i0 = slope_i dA_m[i],   d_io = dL_io (o > 0, given)
    Gt_i = G_i + A_m[i] dx + r_i sum_o d_io F_o - (r_i^2 / h)(sum_o d_io L_io) h'_i
    dh_i = sum_j A_r[i, j] Gt_j,   dy = sum_j B_j Gt_j,   dA_r[i, j] = h_i . Gt_j,   dB_j = y . Gt_j
    dF_o = sum over tokens and streams of r_i d_io h'_i

Why a kernel: compiled, the weight gradients dF and dw are sums over tokens of terms that
need sums over h of the same rows (d_i0, rho); Inductor cannot fuse such a column reduction
into the pass that computes the row reduction it depends on, so each read the rows again,
and the norm's backward was a pass of its own between the sublayer and the pair's. Here one
program owns blocks of tokens and walks the hidden dim twice per block: the first sums what
dA_m needs (h'_i . w dc, h'_i . x, x . x, x . w dc: dx expanded), the second writes the
gradients and adds the block's shares of dF and dw to the program's own rows of partial
sums (its blocks in turn, so the sums' order is fixed: no atomics). h' and x are recomputed
in both walks from h and y (a layer keeps neither x nor h'); the second walk's reads of a
block's rows, just read by the first, come from the cache. Without a write (a layer's first
read) the streams are the state, passed through: dh = Gt.

The mappings' own math (tanh, the static weights and scales) is per token: ``connect_backward``
does it in PyTorch around the kernel, which takes and returns per-token numbers.

mHC (``_flat_pair_bwd``, ``flat_connect_backward``) has one RMS over the n h flattened
streams per token (the shrink term is (r^2 / (n h)) sum_k d_k p_k, the same for every
stream), a projection phi [m, n, h] with a row per stream (Gt_i += r sum_k d_k phi_ki), H_pre
= sigmoid(a_pre p_i + b_pre_i) (slope a_pre P_i (1 - P_i) onto output i < n), and its write's
A_r is H_res transposed. Its dphi = sum over tokens of r d_k h'_i is a GEMM of the kernel's
per-token coefficients r d [T, m] with the streams the read saw, beside the kernel: summed
per program as dF is, each program would re-read and re-write n m h fp32 partial sums (96 h
at n = 4) for every block of 4 tokens, several times the streams' own traffic.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from t2train.kernels.ops import kernel_op, tracing


@triton.jit
def _streams_tile(toks, cols, streams, hidden, plane):
    """Offsets of [tokens, n, hidden block] in a [n, tokens, hidden] tensor."""
    row = toks[:, None] * hidden + cols[None, :]
    return streams[None, :, None] * plane + row[:, None, :], row


@triton.jit
def _read_streams(H, Y, residual, gates, tile, row, ok3, ok, HAS_WRITE: tl.constexpr):
    """The write's input streams h [t, n, k], its output y [t, k] (0 without a write) and the
    read's input streams h' (rounded as the forward stored them), fp32."""
    h = tl.load(H + tile, mask=ok3, other=0.0).to(tl.float32)
    if HAS_WRITE:
        y = tl.load(Y + row, mask=ok, other=0.0).to(tl.float32)
        new = gates[:, :, None] * y[:, None, :] + tl.sum(
            residual[:, :, :, None] * h[:, :, None, :], 1
        )
        new = new.to(H.dtype.element_ty).to(tl.float32)
    else:
        y = h  # unused
        new = h
    return h, y, new


@triton.jit
def _normed_input(new, read, DN, W, row, cols, hidden, ok, dtype):
    """x = sum_i A_m[i] h'_i (rounded as the forward stored it), the normed input's
    gradient dc and w dc, each [t, k] fp32."""
    x = tl.sum(read[:, :, None] * new, 1).to(dtype).to(tl.float32)
    dn = tl.load(DN + row, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    return x, dn, dn * w


@triton.jit
def _token_block(
    block,
    tokens,
    n,
    RESIDUAL,
    GATES,
    READ,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WRITE: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):
    """A block's tokens, their per-stream offsets and mask, the read's weights [t, n], the
    offsets and mask of A_r [t, n, n] and the write's A_r and B [t, n] (the read's weights
    stand in without a write). ``TRANSPOSED``: RESIDUAL holds A_r[i, j] at [t, j, i]."""
    streams = tl.arange(0, BLOCK_N)
    toks = (block * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = toks < tokens
    per_stream = toks[:, None] * n + streams[None, :]
    stream_ok = t_ok[:, None] & (streams < n)[None, :]
    read = tl.load(READ + per_stream, mask=stream_ok, other=0.0)
    if TRANSPOSED:
        square = (toks[:, None, None] * n + streams[None, None, :]) * n + streams[None, :, None]
    else:
        square = per_stream[:, :, None] * n + streams[None, None, :]
    square_ok = stream_ok[:, :, None] & (streams < n)[None, None, :]
    if HAS_WRITE:
        gates = tl.load(GATES + per_stream, mask=stream_ok, other=0.0)
        residual = tl.load(RESIDUAL + square, mask=square_ok, other=0.0)
    else:  # unused
        gates = read
        residual = read
    return toks, t_ok, per_stream, stream_ok, square, square_ok, read, residual, gates


@triton.jit
def _read_sums(
    H,
    Y,
    DN,
    W,
    residual,
    gates,
    read,
    toks,
    t_ok,
    n,
    hidden,
    plane,
    eps,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_WRITE: tl.constexpr,
):
    """The first walk over a block's rows: the sums over h that dA_m[i] = h'_i . dx takes,
    with dx through the pre-norm (h'_i . (w dc), h'_i . x, x . x and x . (w dc)). Returns
    rho, the pull (dx = rho w dc - pull x) and dA_m [t, n]."""
    streams = tl.arange(0, BLOCK_N)
    new_scaled = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    new_x = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    x_x = tl.zeros([BLOCK_T], dtype=tl.float32)
    x_scaled = tl.zeros([BLOCK_T], dtype=tl.float32)
    for start in range(0, hidden, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        tile, row = _streams_tile(toks, cols, streams, hidden, plane)
        ok = t_ok[:, None] & (cols < hidden)[None, :]
        ok3 = (streams < n)[None, :, None] & ok[:, None, :]
        _, _, new = _read_streams(H, Y, residual, gates, tile, row, ok3, ok, HAS_WRITE)
        x, _, scaled_dn = _normed_input(new, read, DN, W, row, cols, hidden, ok, H.dtype.element_ty)
        new_scaled += tl.sum(new * scaled_dn[:, None, :], 2)
        new_x += tl.sum(new * x[:, None, :], 2)
        x_x += tl.sum(x * x, 1)
        x_scaled += tl.sum(x * scaled_dn, 1)
    rho = 1.0 / tl.sqrt(x_x / hidden + eps)
    pull = rho * rho * rho * x_scaled / hidden
    return rho, pull, rho[:, None] * new_scaled - pull[:, None] * new_x


@triton.jit
def _gradient_tile(
    H,
    Y,
    G,
    DN,
    W,
    residual,
    gates,
    read,
    rho,
    pull,
    toks,
    t_ok,
    cols,
    n,
    hidden,
    plane,
    BLOCK_N: tl.constexpr,
    HAS_WRITE: tl.constexpr,
):
    """The second walk on one hidden block: the streams (recomputed), x, dc and dx (in x's
    dtype), and G_i + A_m[i] dx, the read's own part of Gt [t, n, k]."""
    streams = tl.arange(0, BLOCK_N)
    tile, row = _streams_tile(toks, cols, streams, hidden, plane)
    ok = t_ok[:, None] & (cols < hidden)[None, :]
    ok3 = (streams < n)[None, :, None] & ok[:, None, :]
    h, y, new = _read_streams(H, Y, residual, gates, tile, row, ok3, ok, HAS_WRITE)
    x, dn, scaled_dn = _normed_input(new, read, DN, W, row, cols, hidden, ok, H.dtype.element_ty)
    dx = rho[:, None] * scaled_dn - pull[:, None] * x
    dx = dx.to(H.dtype.element_ty).to(tl.float32)  # x's gradient, in x's dtype
    g = tl.load(G + tile, mask=ok3, other=0.0).to(tl.float32)
    return h, y, new, x, dn, g + read[:, :, None] * dx[:, None, :], tile, row, ok, ok3


@triton.jit
def _add_to_partial(part, share, mask, later):
    """The program's partial sum at ``part`` plus ``share`` (its first block, ``later``
    false, writes it)."""
    earlier = tl.load(part, mask=mask & later, other=0.0)
    tl.store(part, earlier + share, mask=mask)


@triton.jit
def _store_write_gradients(
    total,
    h,
    y,
    residual,
    gates,
    d_residual,
    d_gates,
    DH,
    DY,
    tile,
    row,
    ok3,
    ok,
    HAS_WRITE: tl.constexpr,
):
    """Gt rounded as autograd would add it; dh = A_r Gt and dy = B . Gt stored, dA_r += h . Gt
    and dB += y . Gt (a block's sums over h); without a write dh = Gt."""
    total = total.to(DH.dtype.element_ty).to(tl.float32)
    if HAS_WRITE:
        d_h = tl.sum(residual[:, :, :, None] * total[:, None, :, :], 2)
        tl.store(DH + tile, d_h.to(DH.dtype.element_ty), mask=ok3)
        d_y = tl.sum(gates[:, :, None] * total, 1)
        tl.store(DY + row, d_y.to(DY.dtype.element_ty), mask=ok)
        d_residual += tl.sum(h[:, :, None, :] * total[:, None, :, :], 3)
        d_gates += tl.sum(y[:, None, :] * total, 2)
    else:
        tl.store(DH + tile, total.to(DH.dtype.element_ty), mask=ok3)
    return d_residual, d_gates


@triton.jit
def _connect_bwd(
    H,
    Y,
    G,
    DN,
    W,
    F,
    RESIDUAL,
    GATES,
    READ,
    SLOPE,
    RMS,
    LOGITS,
    DLOGITS,
    DH,
    DY,
    DREAD,
    DRESIDUAL,
    DGATES,
    COEFFICIENTS,
    PART,
    tokens,
    hidden,
    n,
    m,
    eps,
    blocks,
    programs,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_WRITE: tl.constexpr,
    FLAT: tl.constexpr,
):
    """HC (not ``FLAT``): per-stream norms and logits [t, n, m], the projections F [m, h]
    shared by the streams, dF summed here (rows < m of a program's partial sums, dw row m).
    mHC (``FLAT``): one norm per token, the projection [t, m] with phi [m, n, h], r d [t, m]
    stored for dphi's GEMM (COEFFICIENTS), dw the one row of partial sums."""
    pid = tl.program_id(0)
    streams = tl.arange(0, BLOCK_N)
    outputs = tl.arange(0, BLOCK_M)
    plane = (pid.to(tl.int64) * 0 + tokens) * hidden  # 64-bit: a stream can pass 2^31
    for block in range(pid, blocks, programs):
        toks, t_ok, per_stream, stream_ok, square, square_ok, read, residual, gates = _token_block(
            block, tokens, n, RESIDUAL, GATES, READ, BLOCK_T, BLOCK_N, HAS_WRITE, FLAT
        )
        slope = tl.load(SLOPE + per_stream, mask=stream_ok, other=0.0)
        rho, pull, d_read = _read_sums(
            H,
            Y,
            DN,
            W,
            residual,
            gates,
            read,
            toks,
            t_ok,
            n,
            hidden,
            plane,
            eps,
            BLOCK_T,
            BLOCK_N,
            BLOCK_H,
            HAS_WRITE,
        )
        tl.store(DREAD + per_stream, d_read, mask=stream_ok)
        # the logits' gradients d, r d, and the norms' terms (r^2 / h) sum_o d L per stream
        # (HC), or the projection's and (r^2 / (n h)) sum_k d_k p_k per token (mHC: output
        # i < n adds the read's, through H_pre's sigmoid)
        if FLAT:
            rms = tl.load(RMS + toks, mask=t_ok, other=0.0)
            flat = toks[:, None] * m + outputs[None, :]
            flat_ok = t_ok[:, None] & (outputs < m)[None, :]
            logits = tl.load(LOGITS + flat, mask=flat_ok, other=0.0)
            d_logits = tl.load(DLOGITS + flat, mask=flat_ok, other=0.0)
            onto = streams[None, :, None] == outputs[None, None, :]
            d_logits += tl.sum(tl.where(onto, (slope * d_read)[:, :, None], 0.0), 1)
            scaled = rms[:, None] * d_logits
            tl.store(COEFFICIENTS + flat, scaled, mask=flat_ok)
            shrink = (rms * rms / (n * hidden) * tl.sum(d_logits * logits, 1))[:, None]
            part = PART + pid.to(tl.int64) * hidden
            norm_row = part
        else:
            rms = tl.load(RMS + per_stream, mask=stream_ok, other=0.0)
            logit = per_stream[:, :, None] * m + outputs[None, None, :]
            logit_ok = stream_ok[:, :, None] & (outputs < m)[None, None, :]
            logits = tl.load(LOGITS + logit, mask=logit_ok, other=0.0)
            d_logits = tl.load(DLOGITS + logit, mask=logit_ok, other=0.0)
            d_logits = tl.where(outputs[None, None, :] == 0, (slope * d_read)[:, :, None], d_logits)
            scaled = rms[:, :, None] * d_logits
            shrink = rms * rms / hidden * tl.sum(d_logits * logits, 2)
            part = PART + pid.to(tl.int64) * (m + 1) * hidden
            norm_row = part + m * hidden
        # the second walk: the gradients, and the block's shares of the weight gradients
        d_residual = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_N], dtype=tl.float32)
        d_gates = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for start in range(0, hidden, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            h, y, new, x, dn, total, tile, row, ok, ok3 = _gradient_tile(
                H,
                Y,
                G,
                DN,
                W,
                residual,
                gates,
                read,
                rho,
                pull,
                toks,
                t_ok,
                cols,
                n,
                hidden,
                plane,
                BLOCK_N,
                HAS_WRITE,
            )
            if FLAT:  # Gt_i += r sum_k d_k phi_ki, output by output: no [t, m, n, k] tile
                phi_ok = (streams < n)[:, None] & (cols < hidden)[None, :]
                for k in range(m):
                    d_k = tl.sum(tl.where(outputs[None, :] == k, scaled, 0.0), 1)
                    rows = (k * n + streams[:, None]) * hidden + cols[None, :]
                    phi = tl.load(F + rows, mask=phi_ok, other=0.0).to(tl.float32)
                    total += d_k[:, None, None] * phi[None, :, :]
            else:  # Gt_i += r_i sum_o d_io F_o, and the block's share of dF
                f_offsets = outputs[:, None] * hidden + cols[None, :]
                f_ok = (outputs < m)[:, None] & (cols < hidden)[None, :]
                f = tl.load(F + f_offsets, mask=f_ok, other=0.0).to(tl.float32)
                total += tl.sum(scaled[:, :, :, None] * f[None, None, :, :], 2)
                share = tl.sum(tl.sum(scaled[:, :, :, None] * new[:, :, None, :], 1), 0)
                _add_to_partial(part + f_offsets, share, f_ok, block > pid)
            total -= shrink[:, :, None] * new
            share_w = tl.sum(dn * x * rho[:, None], 0)
            _add_to_partial(norm_row + cols, share_w, cols < hidden, block > pid)
            d_residual, d_gates = _store_write_gradients(
                total,
                h,
                y,
                residual,
                gates,
                d_residual,
                d_gates,
                DH,
                DY,
                tile,
                row,
                ok3,
                ok,
                HAS_WRITE,
            )
        if HAS_WRITE:  # mHC's dH_res[j, i] = dA_r[i, j]
            tl.store(DRESIDUAL + square, d_residual, mask=square_ok)
            tl.store(DGATES + per_stream, d_gates, mask=stream_ok)


BLOCK_T = 4  # tokens per block


def _blocks(n: int, m: int, hidden: int, flat: bool) -> dict:
    block_n = max(2, triton.next_power_of_2(n))
    block_m = max(2, triton.next_power_of_2(m))
    # the widest tile is [tokens, n, m, hidden block] (HC's projections), or [tokens, n, n,
    # hidden block] (the write's gradient; mHC's projections go output by output)
    widest = BLOCK_T * block_n * (block_n if flat else block_m)
    block_h = min(triton.next_power_of_2(hidden), max(16, 8192 // widest))
    return dict(BLOCK_T=BLOCK_T, BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_H=block_h, num_warps=4)


def _programs(blocks: int, device: torch.device) -> int:
    """Programs that share the blocks: a few per SM on a GPU (each holds its partial sums,
    hc's of dF and the norm's dw, [m + 1, h] fp32, mHC's of dw), or at most 2 in the
    interpreter, so that a test walks several blocks in one program."""
    if device.type != "cuda":
        return min(blocks, 2)
    return min(blocks, 2 * torch.cuda.get_device_properties(device).multi_processor_count)


def _stream_gradients(state: Tensor, out: Optional[Tensor], tokens: int) -> list[Tensor]:
    """What both kernels return first: the state's gradient, the output's (empty without a
    write), dA_m [T, n], dA_r [T, n, n] and dB [T, n] (empty without a write)."""
    n, written = state.shape[0], tokens if out is not None else 0
    return [
        torch.empty_like(state, memory_format=torch.contiguous_format),
        torch.empty_like(out) if out is not None else state.new_empty(0),
        state.new_empty(tokens, n, dtype=torch.float32),
        state.new_empty(written, n, n, dtype=torch.float32),
        state.new_empty(written, n, dtype=torch.float32),
    ]


def _launch(state, out, wide: list, per_token: list, results: list, partial, norm_eps, flat):
    """The kernel (mHC's read if ``flat``) over the streams [n, ..., h] and the output (if
    any): ``wide`` (the gradients of the streams and of the normed input, the pre-norm's
    weight, the projections), ``per_token`` (the write's A_r and B, or None, then the read's
    numbers), into ``results`` (the stream gradients first, then mHC's coefficients) and the
    programs' ``partial`` sums."""
    n, hidden = state.shape[0], state.shape[-1]
    residual, gates, read = per_token[:3]
    tokens, m = read.shape[0], wide[-1].shape[0]
    wide = [t.contiguous() for t in wide]
    grad_state, grad_out = results[:2]
    _connect_bwd[(partial.shape[0],)](
        state.contiguous(),
        out.contiguous() if out is not None else state,
        *wide,
        residual if residual is not None else read,
        gates if gates is not None else read,
        *per_token[2:],
        grad_state,
        grad_out if out is not None else grad_state,
        *results[2:],
        *(() if flat else (partial,)),  # no coefficients: the partial sums stand in
        partial,
        tokens,
        hidden,
        n,
        m,
        norm_eps,
        triton.cdiv(tokens, BLOCK_T),
        partial.shape[0],
        HAS_WRITE=out is not None,
        FLAT=flat,
        **_blocks(n, m, hidden, flat),
    )


@kernel_op("stream_connect_backward")
def _pair_backward(
    state: Tensor,
    out: Optional[Tensor],
    grad_streams: Tensor,
    grad_normed: Tensor,
    norm_weight: Tensor,
    norm_eps: float,
    folded: Tensor,
    residual: Optional[Tensor],
    gates: Optional[Tensor],
    read: Tensor,
    slope: Tensor,
    inverse_rms: Tensor,
    logits: Tensor,
    grad_logits: Tensor,
) -> list[Tensor]:
    """HC's wide part of the backward: state, grad_streams [n, ..., h]; out, grad_normed
    [..., h]; the pre-norm's weight [h] and eps; folded [m, h] fp32; per token, fp32 and
    contiguous: residual [T, n, n], gates, read, slope (s_a (1 - tanh^2) of the read's
    logit), inverse_rms [T, n], logits, grad_logits [T, n, m]. Returns the state's gradient,
    the output's (empty without a write), dA_m [T, n], dA_r [T, n, n] and dB [T, n] (empty
    without a write), dF [m, h] and the pre-norm's dw [h], both fp32."""
    hidden, tokens, m = state.shape[-1], read.shape[0], folded.shape[0]
    results = _stream_gradients(state, out, tokens)
    grad_folded, grad_norm_weight = folded.new_empty(m, hidden), folded.new_empty(hidden)
    if tracing(state):
        return [*results, grad_folded, grad_norm_weight]
    partial = folded.new_empty(_programs(triton.cdiv(tokens, BLOCK_T), state.device), m + 1, hidden)
    per_token = [residual, gates, read, slope, inverse_rms, logits, grad_logits]
    wide = [grad_streams, grad_normed, norm_weight, folded]
    _launch(state, out, wide, per_token, results, partial, norm_eps, flat=False)
    torch.sum(partial[:, :m], 0, out=grad_folded)
    torch.sum(partial[:, m], 0, out=grad_norm_weight)
    return [*results, grad_folded, grad_norm_weight]


@kernel_op("flat_stream_connect_backward")
def _flat_pair_backward(
    state: Tensor,
    out: Optional[Tensor],
    grad_streams: Tensor,
    grad_normed: Tensor,
    norm_weight: Tensor,
    norm_eps: float,
    projection: Tensor,
    mixing: Optional[Tensor],
    gains: Optional[Tensor],
    read: Tensor,
    slope: Tensor,
    inverse_rms: Tensor,
    projected: Tensor,
    grad_projected: Tensor,
) -> list[Tensor]:
    """mHC's wide part of the backward: as ``_pair_backward``, with projection phi
    [m, n h] (the parameter's dtype), the write's H_res [T, n, n] and H_post [T, n] (fp32),
    slope a_pre P (1 - P) [T, n] (H_pre = P), the flat norm's inverse_rms [T] and the normed
    projection and its gradient [T, m]. Returns the stream gradients (dH_res [T, n, n] in
    H_res' layout), r d [T, m] (dphi's coefficients) and the pre-norm's dw [h], fp32."""
    hidden, tokens, m = state.shape[-1], read.shape[0], projection.shape[0]
    results = _stream_gradients(state, out, tokens)
    coefficients, grad_norm_weight = projected.new_empty(tokens, m), projected.new_empty(hidden)
    if tracing(state):
        return [*results, coefficients, grad_norm_weight]
    partial = projected.new_empty(_programs(triton.cdiv(tokens, BLOCK_T), state.device), hidden)
    per_token = [mixing, gains, read, slope, inverse_rms, projected, grad_projected]
    wide = [grad_streams, grad_normed, norm_weight, projection]
    _launch(state, out, wide, per_token, [*results, coefficients], partial, norm_eps, flat=True)
    torch.sum(partial, 0, out=grad_norm_weight)
    return [*results, coefficients, grad_norm_weight]


def _per_token(t: Tensor) -> Tensor:
    """[n, ..., k] -> [T, n, k] fp32, contiguous."""
    return t.movedim(0, -2).reshape(-1, t.shape[0], t.shape[-1]).float().contiguous()


def _to_streams(t: Tensor, like: Tensor) -> Tensor:
    """[T, n, k] -> [n, ..., k] shaped as ``like``."""
    return t.reshape(*like.shape[1:-1], like.shape[0], t.shape[-1]).movedim(-2, 0)


def _write_mappings(write) -> tuple[Tensor, Tensor, Tensor]:
    """The tanh of the write's logits [T, n, m], its A_r [T, n, n] and B [T, n], fp32."""
    n = write.static_beta.shape[0]
    tanh = torch.tanh(_per_token(write.logits))
    alpha, s_a = write.static_alpha.float(), write.alpha_scale.float()
    residual = alpha[:, 1:] + s_a * tanh[..., 1 : n + 1]
    gates = write.static_beta.float() + write.beta_scale.float() * tanh[..., n + 1]
    return tanh, residual.contiguous(), gates.contiguous()


def _write_gradients(write, tanh, grad_out, grad_residual, grad_gates) -> tuple:
    """The write's inputs' gradients from dA_r and dB per token: y's, its logits' (the
    tanh's derivative applied), its static weights' and its scales'."""
    n = write.static_beta.shape[0]
    s_a, s_b = write.alpha_scale.float(), write.beta_scale.float()
    slopes = 1 - tanh**2
    grad_logits = torch.cat(
        [
            grad_residual.new_zeros(grad_residual.shape[0], n, 1),
            s_a * slopes[..., 1 : n + 1] * grad_residual,
            s_b * slopes[..., n + 1 :] * grad_gates[..., None],
        ],
        -1,
    )
    grad_static = torch.cat([grad_residual.new_zeros(n, 1), grad_residual.sum(0)], -1)
    return (
        grad_out,
        _to_streams(grad_logits, write.logits).to(write.logits.dtype),
        grad_static.to(write.static_alpha.dtype),
        grad_gates.sum(0).to(write.static_beta.dtype),
        (tanh[..., 1 : n + 1] * grad_residual).sum().reshape(1).to(write.alpha_scale.dtype),
        (tanh[..., n + 1] * grad_gates).sum().reshape(1).to(write.beta_scale.dtype),
    )


def connect_backward(
    state, write, read, norm_eps, streams, logits, inv_rms, grad_streams, grad_normed, grad_logits
):
    """``hc``'s ``connect_backward`` (same arguments, same results) with its wide part in the
    kernel above. ``streams`` (the read's input) is recomputed from the state and the write's
    output; without a write it is the state."""
    n, logits = state.shape[0], _per_token(logits)
    tanh = torch.tanh(logits)
    alpha, s_a = read.static_alpha.float(), read.alpha_scale.float()
    read_weights = (alpha[:, 0] + s_a * tanh[..., 0]).contiguous()
    slope = (s_a * (1 - tanh[..., 0] ** 2)).contiguous()
    mappings = None if write is None else _write_mappings(write)
    grads = _pair_backward(
        streams if write is None else state,
        None if write is None else write.out,
        grad_streams,
        grad_normed,
        read.norm_weight,
        norm_eps,
        read.folded.float(),
        None if mappings is None else mappings[1],
        None if mappings is None else mappings[2],
        read_weights,
        slope,
        _per_token(inv_rms)[..., 0].contiguous(),
        logits,
        _per_token(grad_logits),
    )
    grad_state, grad_out, grad_read, grad_residual, grad_gates, grad_folded, grad_weight = grads
    grad_static = torch.cat([grad_read.sum(0)[:, None], grad_read.new_zeros(n, n)], -1)
    read_grads = (
        grad_folded.to(read.folded.dtype),
        grad_static.to(read.static_alpha.dtype),
        (tanh[..., 0] * grad_read).sum().reshape(1).to(read.alpha_scale.dtype),
        grad_weight.to(read.norm_weight.dtype),
    )
    if mappings is None:  # no write
        return grad_state, (), read_grads
    write_grads = _write_gradients(write, mappings[0], grad_out, grad_residual, grad_gates)
    return grad_state, write_grads, read_grads


def flat_connect_backward(
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
):
    """mHC's ``connect_backward`` (same arguments, same results) with its wide part in the
    kernel above, and dphi_ki = sum over tokens of r d_k h'_i as one GEMM of the kernel's
    coefficients with the streams the read saw (``streams``: the new streams a layer keeps,
    or the state): summed in the kernel, each program's partial dphi would be n (n^2 + 2n) h
    fp32 numbers, re-read and re-written for every block of tokens."""
    n, hidden = state.shape[0], state.shape[-1]
    m = read.projection.shape[0]
    projected = normed_projection.reshape(-1, m).float().contiguous()
    gate, bias = read.pre_gate.float(), read.pre_bias.float()
    pre = torch.sigmoid(gate * projected[:, :n] + bias)
    pre_slope = pre * (1 - pre)
    mixing = gains = None  # the kernel reads A_r[i, j] = H_res[j, i] (stream j reads i)
    if write is not None:
        mixing = write.mixing.reshape(-1, n, n).float().contiguous()
        gains = write.gains.reshape(-1, n).float().contiguous()
    grads = _flat_pair_backward(
        streams if write is None else state,
        None if write is None else write.out,
        grad_streams,
        grad_normed,
        read.norm_weight,
        norm_eps,
        read.projection.contiguous(),
        mixing,
        gains,
        pre.contiguous(),
        (gate * pre_slope).contiguous(),
        inverse_rms.reshape(-1).float().contiguous(),
        projected,
        grad_projection.reshape(-1, m).float().contiguous(),
    )
    grad_state, grad_out, grad_read, grad_mixing, grad_gains, coefficients, grad_weight = grads
    tokens = coefficients.shape[0]
    by_stream = streams.reshape(n, tokens, hidden)
    grad_rows = torch.matmul(coefficients.t().to(streams.dtype), by_stream)  # [n, m, h]
    grad_pre = pre_slope * grad_read  # d(a_pre p_i + b_pre_i)
    read_grads = (
        grad_rows.transpose(0, 1).reshape(read.projection.shape).to(read.projection.dtype),
        (grad_pre * projected[:, :n]).sum().reshape(1).to(read.pre_gate.dtype),
        grad_pre.sum(0).to(read.pre_bias.dtype),
        grad_weight.to(read.norm_weight.dtype),
    )
    if write is None:
        return grad_state, (), read_grads
    write_grads = (
        grad_out,
        grad_mixing.reshape(write.mixing.shape).to(write.mixing.dtype),
        grad_gains.reshape(write.gains.shape).to(write.gains.dtype),
    )
    return grad_state, write_grads, read_grads
