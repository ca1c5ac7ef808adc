"""Fused Deep Delta Learning write, forward and backward (one pass over the state).

Exact counterpart of ``t2train.residual.ddl.layers.delta_write``: per token, with the sublayer
output k~, gate logits a (beta) and b_j (v) and the state columns X_j (d_v of them),

    r = (|k~|^2 + eps^2)^-1/2,  k = r k~,  beta = 2 sigma(a),  v_j = v_scale sigma(b_j)
    e_j = v_j - k . X_j,        X_j' = X_j + beta e_j k

in fp32, stored in the state's dtype. Backward, with G_j = dL/dX_j' and c_j = k . G_j:

    dX_j = G_j - beta c_j k,    dk = beta sum_j (e_j G_j - c_j X_j),  dk~ = r (dk - (k . dk) k)
    da = beta (1 - beta/2) sum_j e_j c_j,   db_j = beta c_j v_j (1 - sigma(b_j))

One program owns one token: its whole row of every column, so the state is read once and
written once (the backward reads X and G and writes dX).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from t2train.kernels.ops import kernel_op, tracing


@triton.jit
def _load_row(
    X_RAW,
    K_RAW,
    BETA,
    VLOG,
    row,
    rows,
    hidden,
    dv,
    eps2,
    v_scale,
    BLOCK_H: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """State columns x [BLOCK_V, BLOCK_H], k~, r, k, beta, sigma(b), v and e for one token."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_j = tl.arange(0, BLOCK_V)
    h_ok = offs_h < hidden
    tile = offs_j[:, None] * rows * hidden + row * hidden + offs_h[None, :]
    tile_ok = (offs_j[:, None] < dv) & h_ok[None, :]
    x = tl.load(X_RAW + tile, mask=tile_ok, other=0.0).to(tl.float32)
    k_raw = tl.load(K_RAW + row * hidden + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(k_raw * k_raw, 0) + eps2)
    k = k_raw * r
    beta = 2.0 * tl.sigmoid(tl.load(BETA + row).to(tl.float32))
    sig_v = tl.sigmoid(
        tl.load(VLOG + row * dv + offs_j, mask=offs_j < dv, other=0.0).to(tl.float32)
    )
    err = v_scale * sig_v - tl.sum(x * k[None, :], 1)
    return x, tile, tile_ok, k, r, beta, sig_v, err


@triton.jit
def _fwd_kernel(
    X,
    K_RAW,
    BETA,
    VLOG,
    Y,
    rows,
    hidden,
    dv,
    eps2,
    v_scale,
    BLOCK_H: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # 64-bit offsets: states can pass 2^31 elements
    x, tile, tile_ok, k, r, beta, sig_v, err = _load_row(
        X, K_RAW, BETA, VLOG, row, rows, hidden, dv, eps2, v_scale, BLOCK_H, BLOCK_V
    )
    y = x + (beta * err)[:, None] * k[None, :]
    tl.store(Y + tile, y.to(Y.dtype.element_ty), mask=tile_ok)


@triton.jit
def _bwd_kernel(
    X,
    K_RAW,
    BETA,
    VLOG,
    G,
    DX,
    DK,
    DBETA,
    DVLOG,
    rows,
    hidden,
    dv,
    eps2,
    v_scale,
    BLOCK_H: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x, tile, tile_ok, k, r, beta, sig_v, err = _load_row(
        X, K_RAW, BETA, VLOG, row, rows, hidden, dv, eps2, v_scale, BLOCK_H, BLOCK_V
    )
    g = tl.load(G + tile, mask=tile_ok, other=0.0).to(tl.float32)
    c = tl.sum(g * k[None, :], 1)
    tl.store(
        DX + tile, (g - (beta * c)[:, None] * k[None, :]).to(DX.dtype.element_ty), mask=tile_ok
    )
    dk = beta * tl.sum(err[:, None] * g - c[:, None] * x, 0)
    dk_raw = r * (dk - tl.sum(k * dk, 0) * k)
    offs_h = tl.arange(0, BLOCK_H)
    tl.store(DK + row * hidden + offs_h, dk_raw.to(DK.dtype.element_ty), mask=offs_h < hidden)
    dbeta = beta * (1.0 - 0.5 * beta) * tl.sum(err * c, 0)
    tl.store(DBETA + row, dbeta.to(DBETA.dtype.element_ty))
    offs_j = tl.arange(0, BLOCK_V)
    dvlog = beta * c * v_scale * sig_v * (1.0 - sig_v)
    tl.store(DVLOG + row * dv + offs_j, dvlog.to(DVLOG.dtype.element_ty), mask=offs_j < dv)


def _launch(hidden: int, dv: int) -> dict:
    block_h = triton.next_power_of_2(hidden)
    block_v = triton.next_power_of_2(dv)
    return dict(
        BLOCK_H=block_h, BLOCK_V=block_v, num_warps=min(16, max(4, block_h * block_v // 1024))
    )


@kernel_op("delta_write")
def _delta_write(
    state: Tensor, out: Tensor, beta_logit: Tensor, v_logit: Tensor, k_eps: float, v_scale: float
) -> Tensor:
    """state [s, b, h] or [d_v, s, b, h]; out [s, b, h]; beta_logit [s, b, 1];
    v_logit [s, b, d_v]."""
    state, out, beta_logit, v_logit = (t.contiguous() for t in (state, out, beta_logit, v_logit))
    hidden, dv = out.shape[-1], v_logit.shape[-1]
    rows = out.numel() // hidden
    y = torch.empty_like(state)
    if tracing(state):
        return y
    _fwd_kernel[(rows,)](
        state,
        out,
        beta_logit,
        v_logit,
        y,
        rows,
        hidden,
        dv,
        k_eps * k_eps,
        v_scale,
        **_launch(hidden, dv),
    )
    return y


@kernel_op("delta_write_backward")
def _delta_write_backward(
    state: Tensor,
    out: Tensor,
    beta_logit: Tensor,
    v_logit: Tensor,
    grad: Tensor,
    k_eps: float,
    v_scale: float,
) -> list[Tensor]:
    state, out, beta_logit, v_logit, grad = (
        t.contiguous() for t in (state, out, beta_logit, v_logit, grad)
    )
    hidden, dv = out.shape[-1], v_logit.shape[-1]
    rows = out.numel() // hidden
    grads = [torch.empty_like(t) for t in (state, out, beta_logit, v_logit)]
    if tracing(state):
        return grads
    _bwd_kernel[(rows,)](
        state,
        out,
        beta_logit,
        v_logit,
        grad,
        *grads,
        rows,
        hidden,
        dv,
        k_eps * k_eps,
        v_scale,
        **_launch(hidden, dv),
    )
    return grads


def _save_inputs(ctx, inputs: tuple, output: Tensor) -> None:
    *tensors, ctx.k_eps, ctx.v_scale = inputs
    ctx.save_for_backward(*tensors)


def _backward(ctx, grad: Tensor) -> tuple:
    return (*_delta_write_backward(*ctx.saved_tensors, grad, ctx.k_eps, ctx.v_scale), None, None)


_delta_write.register_autograd(_backward, setup_context=_save_inputs)


def delta_write(
    state: Tensor, out: Tensor, beta_logit: Tensor, v_logit: Tensor, k_eps: float, v_scale: float
) -> Tensor:
    """Triton ``t2train.residual.ddl.layers.delta_write`` (same arguments, same result)."""
    expected = (v_logit.shape[-1], *out.shape) if state.dim() == out.dim() + 1 else out.shape
    if state.shape != expected or beta_logit.shape[-1] != 1:
        raise ValueError(
            f"state {tuple(state.shape)}, out {tuple(out.shape)}, beta_logit "
            f"{tuple(beta_logit.shape)}, v_logit {tuple(v_logit.shape)} disagree"
        )
    return _delta_write(state, out, beta_logit, v_logit, k_eps, v_scale)
