"""Hyper-Connections' backward of one sublayer's write, the next sublayer's read and that
sublayer's pre-norm, as one kernel that reads the streams once (``t2train/residual/hc/
compiled.py`` has the forward, the formulas and the PyTorch reference this equals).

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
"""

from __future__ import annotations

import functools
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
def _pair_bwd(
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
    DF_PART,
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
):
    pid = tl.program_id(0)
    streams = tl.arange(0, BLOCK_N)
    outputs = tl.arange(0, BLOCK_M)
    n_ok, m_ok = streams < n, outputs < m
    plane = (pid.to(tl.int64) * 0 + tokens) * hidden  # 64-bit: a stream can pass 2^31
    for block in range(pid, blocks, programs):
        toks = (block * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        t_ok = toks < tokens
        per_stream = toks[:, None] * n + streams[None, :]
        stream_ok = t_ok[:, None] & n_ok[None, :]
        read = tl.load(READ + per_stream, mask=stream_ok, other=0.0)
        slope = tl.load(SLOPE + per_stream, mask=stream_ok, other=0.0)
        rms = tl.load(RMS + per_stream, mask=stream_ok, other=0.0)
        square = per_stream[:, :, None] * n + streams[None, None, :]
        square_ok = stream_ok[:, :, None] & n_ok[None, None, :]
        if HAS_WRITE:
            gates = tl.load(GATES + per_stream, mask=stream_ok, other=0.0)
            residual = tl.load(RESIDUAL + square, mask=square_ok, other=0.0)
        else:  # unused
            gates = read
            residual = read
        # first walk: the sums over h that dA_m[i] = h'_i . dx takes, with dx through the
        # pre-norm: h'_i . (w dc), h'_i . x, x . x and x . (w dc)
        new_scaled = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        new_x = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        x_x = tl.zeros([BLOCK_T], dtype=tl.float32)
        x_scaled = tl.zeros([BLOCK_T], dtype=tl.float32)
        for start in range(0, hidden, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            tile, row = _streams_tile(toks, cols, streams, hidden, plane)
            ok = t_ok[:, None] & (cols < hidden)[None, :]
            ok3 = n_ok[None, :, None] & ok[:, None, :]
            _, _, new = _read_streams(H, Y, residual, gates, tile, row, ok3, ok, HAS_WRITE)
            x, _, scaled_dn = _normed_input(
                new, read, DN, W, row, cols, hidden, ok, H.dtype.element_ty
            )
            new_scaled += tl.sum(new * scaled_dn[:, None, :], 2)
            new_x += tl.sum(new * x[:, None, :], 2)
            x_x += tl.sum(x * x, 1)
            x_scaled += tl.sum(x * scaled_dn, 1)
        rho = 1.0 / tl.sqrt(x_x / hidden + eps)
        pull = rho * rho * rho * x_scaled / hidden  # dx = rho w dc - pull x
        d_read = rho[:, None] * new_scaled - pull[:, None] * new_x
        tl.store(DREAD + per_stream, d_read, mask=stream_ok)
        # the logits' gradients d [t, n, m], r d, and the norms' terms (r^2 / h) sum_o d L
        logit = per_stream[:, :, None] * m + outputs[None, None, :]
        logit_ok = stream_ok[:, :, None] & m_ok[None, None, :]
        logits = tl.load(LOGITS + logit, mask=logit_ok, other=0.0)
        d_logits = tl.load(DLOGITS + logit, mask=logit_ok, other=0.0)
        d_logits = tl.where(outputs[None, None, :] == 0, (slope * d_read)[:, :, None], d_logits)
        scaled = rms[:, :, None] * d_logits
        shrink = rms * rms / hidden * tl.sum(d_logits * logits, 2)
        # second walk: the gradients, and the block's share of dF
        d_residual = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_N], dtype=tl.float32)
        d_gates = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for start in range(0, hidden, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            col_ok = cols < hidden
            tile, row = _streams_tile(toks, cols, streams, hidden, plane)
            ok = t_ok[:, None] & col_ok[None, :]
            ok3 = n_ok[None, :, None] & ok[:, None, :]
            h, y, new = _read_streams(H, Y, residual, gates, tile, row, ok3, ok, HAS_WRITE)
            x, dn, scaled_dn = _normed_input(
                new, read, DN, W, row, cols, hidden, ok, H.dtype.element_ty
            )
            dx = rho[:, None] * scaled_dn - pull[:, None] * x
            dx = dx.to(H.dtype.element_ty).to(tl.float32)  # x's gradient, in x's dtype
            g = tl.load(G + tile, mask=ok3, other=0.0).to(tl.float32)
            f_offsets = outputs[:, None] * hidden + cols[None, :]
            f_ok = m_ok[:, None] & col_ok[None, :]
            f = tl.load(F + f_offsets, mask=f_ok, other=0.0)
            total = g + read[:, :, None] * dx[:, None, :] - shrink[:, :, None] * new
            total += tl.sum(scaled[:, :, :, None] * f[None, None, :, :], 2)
            total = total.to(DH.dtype.element_ty).to(tl.float32)  # as autograd would add them
            # the block's shares of dF (rows < m) and of the norm's dw (row m)
            part = DF_PART + pid.to(tl.int64) * (m + 1) * hidden + f_offsets
            earlier = tl.load(part, mask=f_ok & (block > pid), other=0.0)
            share = tl.sum(tl.sum(scaled[:, :, :, None] * new[:, :, None, :], 1), 0)
            tl.store(part, earlier + share, mask=f_ok)
            part_w = DF_PART + (pid.to(tl.int64) * (m + 1) + m) * hidden + cols
            earlier_w = tl.load(part_w, mask=col_ok & (block > pid), other=0.0)
            tl.store(part_w, earlier_w + tl.sum(dn * x * rho[:, None], 0), mask=col_ok)
            if HAS_WRITE:
                d_h = tl.sum(residual[:, :, :, None] * total[:, None, :, :], 2)
                tl.store(DH + tile, d_h.to(DH.dtype.element_ty), mask=ok3)
                d_y = tl.sum(gates[:, :, None] * total, 1)
                tl.store(DY + row, d_y.to(DY.dtype.element_ty), mask=ok)
                d_residual += tl.sum(h[:, :, None, :] * total[:, None, :, :], 3)
                d_gates += tl.sum(y[:, None, :] * total, 2)
            else:
                tl.store(DH + tile, total.to(DH.dtype.element_ty), mask=ok3)
        if HAS_WRITE:
            tl.store(DRESIDUAL + square, d_residual, mask=square_ok)
            tl.store(DGATES + per_stream, d_gates, mask=stream_ok)


BLOCK_T = 4  # tokens per block


def _blocks(n: int, m: int, hidden: int) -> dict:
    block_n = max(2, triton.next_power_of_2(n))
    block_m = max(2, triton.next_power_of_2(m))
    # the widest tile is [tokens, n, m, hidden block]
    block_h = min(triton.next_power_of_2(hidden), max(16, 8192 // (BLOCK_T * block_n * block_m)))
    return dict(BLOCK_T=BLOCK_T, BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_H=block_h, num_warps=4)


def _programs(blocks: int, device: torch.device) -> int:
    """Programs that share the blocks: a few per SM on a GPU (each holds its partial sums of
    dF and the norm's dw, [m + 1, h] fp32), or at most 2 in the interpreter, so that a test
    walks several blocks in one program."""
    if device.type != "cuda":
        return min(blocks, 2)
    return min(blocks, 2 * torch.cuda.get_device_properties(device).multi_processor_count)


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
    """The wide part of the backward: state, grad_streams [n, ..., h]; out, grad_normed
    [..., h]; the pre-norm's weight [h] and eps; folded [m, h] fp32; per token, fp32 and
    contiguous: residual [T, n, n], gates, read, slope (s_a (1 - tanh^2) of the read's
    logit), inverse_rms [T, n], logits, grad_logits [T, n, m]. Returns the state's gradient,
    the output's (empty without a write), dA_m [T, n], dA_r [T, n, n] and dB [T, n] (empty
    without a write), dF [m, h] and the pre-norm's dw [h], both fp32."""
    n, hidden = state.shape[0], state.shape[-1]
    tokens, m = read.shape[0], folded.shape[0]
    has_write = out is not None
    narrow = functools.partial(torch.empty, device=state.device, dtype=torch.float32)
    grad_state = torch.empty_like(state, memory_format=torch.contiguous_format)
    grad_out = torch.empty_like(out) if out is not None else state.new_empty(0)
    grad_read = narrow(tokens, n)
    grad_residual = narrow(tokens if has_write else 0, n, n)
    grad_gates = narrow(tokens if has_write else 0, n)
    grad_folded, grad_norm_weight = narrow(m, hidden), narrow(hidden)
    results = [grad_state, grad_out, grad_read, grad_residual, grad_gates]
    results += [grad_folded, grad_norm_weight]
    if tracing(state):
        return results
    blocks = triton.cdiv(tokens, BLOCK_T)
    programs = _programs(blocks, state.device)
    partial = narrow(programs, m + 1, hidden)
    state, grad_streams, grad_normed = (t.contiguous() for t in (state, grad_streams, grad_normed))
    _pair_bwd[(programs,)](
        state,
        out.contiguous() if out is not None else state,
        grad_streams,
        grad_normed,
        norm_weight.contiguous(),
        folded.contiguous(),
        residual if residual is not None else read,
        gates if gates is not None else read,
        read,
        slope,
        inverse_rms,
        logits,
        grad_logits,
        grad_state,
        grad_out if out is not None else grad_state,
        grad_read,
        grad_residual,
        grad_gates,
        partial,
        tokens,
        hidden,
        n,
        m,
        norm_eps,
        blocks,
        programs,
        HAS_WRITE=has_write,
        **_blocks(n, m, hidden),
    )
    torch.sum(partial[:, :m], 0, out=grad_folded)
    torch.sum(partial[:, m], 0, out=grad_norm_weight)
    return results


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
