"""Gate logits: x W^T + b in fp32 from low-precision x and W, for a few outputs, forward and
backward, without an fp32 copy of x.

Exact counterpart of ``t2train.nn.precision.fp32_linear`` (DDL's beta and v logits): with x
[rows, h], W [n, h] and n <= ``MAX_OUTPUTS``,

    y = x W^T + b,  dx = g W,  dW = g^T x,  db = sum_rows g      (all in fp32)

On an H100 the reference spent more on its fp32 copies of x (forward and backward) and on
skinny fp32 GEMMs than the delta write itself (docs/gpu/h100-2026-11-26.md). Here one
program owns ``BLOCK_R`` rows and walks h once: the forward reads x once; the backward reads
x and W once, writes dx in x's dtype and its rows' partial dW and db (fp32), which PyTorch
sums over the programs.

Each output is its own pass over the tile in registers (``N_OUT`` unrolled): n fp32
multiply-adds per element of x, the work there is. A ``tl.dot`` needs 16 on every side, so
it padded one output to 16, and in IEEE fp32 (the gradient is fp32) it runs on the CUDA
cores: 16 times the work for DDL's one-output gates, and the backward kernels were most of
`ddl`'s cost on an H200 (21 of its 25 ms of Triton time per 125m step,
docs/gpu/h200-2026-11-30.md). Products of bf16 or fp16 values are exact in fp32, so this is
the fp32 computation up to the order of the sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from t2train.kernels.common import interpreting
from t2train.kernels.ops import kernel_op, tracing

MAX_OUTPUTS = 16  # wider projections are ordinary GEMMs: the reference's cuBLAS call


@triton.jit
def _fwd_kernel(
    X,
    W,
    B,
    Y,
    rows,
    hidden,
    N_OUT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    offs_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_j = tl.arange(0, BLOCK_J)
    r_ok, j_ok = offs_r < rows, offs_j < N_OUT
    acc = tl.zeros([BLOCK_R, BLOCK_J], tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < hidden
        x = tl.load(
            X + offs_r[:, None] * hidden + offs_h[None, :],
            mask=r_ok[:, None] & h_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        for j in tl.static_range(N_OUT):
            w = tl.load(W + j * hidden + offs_h, mask=h_ok, other=0.0).to(tl.float32)
            y = tl.sum(x * w[None, :], 1)
            acc = tl.where(offs_j[None, :] == j, acc + y[:, None], acc)
    if HAS_BIAS:
        acc += tl.load(B + offs_j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_r[:, None] * N_OUT + offs_j[None, :], acc, mask=r_ok[:, None] & j_ok[None, :])


@triton.jit
def _bwd_kernel(
    X,
    W,
    G,
    DX,
    DW_PART,
    DB_PART,
    rows,
    hidden,
    N_OUT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """dx = g W, this program's partial dW = g^T x and db = sum g over its rows."""
    block = tl.program_id(0).to(tl.int64)
    offs_r = block * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < rows
    for j in tl.static_range(N_OUT):
        g = tl.load(G + offs_r * N_OUT + j, mask=r_ok, other=0.0)
        tl.store(DB_PART + block * N_OUT + j, tl.sum(g, 0))
    for h0 in range(0, hidden, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < hidden
        x_at = offs_r[:, None] * hidden + offs_h[None, :]
        x_ok = r_ok[:, None] & h_ok[None, :]
        x = tl.load(X + x_at, mask=x_ok, other=0.0).to(tl.float32)
        dx = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
        for j in tl.static_range(N_OUT):
            g = tl.load(G + offs_r * N_OUT + j, mask=r_ok, other=0.0)  # fp32 [R]
            w = tl.load(W + j * hidden + offs_h, mask=h_ok, other=0.0).to(tl.float32)
            dx += g[:, None] * w[None, :]
            dw = tl.sum(g[:, None] * x, 0)
            tl.store(DW_PART + (block * N_OUT + j) * hidden + offs_h, dw, mask=h_ok)
        tl.store(DX + x_at, dx.to(DX.dtype.element_ty), mask=x_ok)


def _tiles() -> dict:
    if interpreting():
        return dict(BLOCK_R=16, BLOCK_H=16)
    return dict(BLOCK_R=64, BLOCK_H=128, num_warps=4)


def _launch_forward(x: Tensor, weight: Tensor, bias: Tensor | None, y: Tensor) -> None:
    """y = x W^T + b into ``y`` (fp32)."""
    if tracing(x):
        return
    hidden, n_out = x.shape[-1], weight.shape[0]
    rows = x.numel() // hidden
    tiles = _tiles()
    _fwd_kernel[(triton.cdiv(rows, tiles["BLOCK_R"]),)](
        x,
        weight,
        weight if bias is None else bias,
        y,
        rows,
        hidden,
        N_OUT=n_out,
        HAS_BIAS=bias is not None,
        BLOCK_J=triton.next_power_of_2(n_out),  # the outputs' accumulator, masked
        **tiles,
    )


def _outputs(x: Tensor, weight: Tensor) -> Tensor:
    return torch.empty(*x.shape[:-1], weight.shape[0], device=x.device, dtype=torch.float32)


@kernel_op("fp32_linear")
def _fp32_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x [..., h], weight [n, h], bias [n] or None -> fp32 [..., n]."""
    x, weight = x.contiguous(), weight.contiguous()
    y = _outputs(x, weight)
    _launch_forward(x, weight, bias, y)
    return y


@kernel_op("fp32_linear_backward")
def _fp32_linear_backward(x: Tensor, weight: Tensor, grad: Tensor) -> list[Tensor]:
    """dx = g W, dW = g^T x, db = sum g, for the incoming g (in fp32)."""
    x, weight = x.contiguous(), weight.contiguous()
    dx = torch.empty_like(x)
    if tracing(x):
        return [dx, torch.empty_like(weight), weight.new_empty(weight.shape[0])]
    hidden, n_out = x.shape[-1], weight.shape[0]
    rows = x.numel() // hidden
    tiles = _tiles()
    programs = triton.cdiv(rows, tiles["BLOCK_R"])
    dw_part = torch.empty(programs, n_out, hidden, device=x.device, dtype=torch.float32)
    db_part = torch.empty(programs, n_out, device=x.device, dtype=torch.float32)
    grad = grad.float().contiguous()
    _bwd_kernel[(programs,)](
        x,
        weight,
        grad,
        dx,
        dw_part,
        db_part,
        rows,
        hidden,
        N_OUT=n_out,
        **tiles,
    )
    return [dx, dw_part.sum(0).to(weight.dtype), db_part.sum(0).to(weight.dtype)]


def _save_x_and_weight(ctx, inputs: tuple, output) -> None:
    x, weight, bias = inputs
    ctx.with_bias = bias is not None
    ctx.save_for_backward(x, weight)


def _linear_backward(ctx, grad: Tensor) -> tuple:
    dx, d_weight, d_bias = _fp32_linear_backward(*ctx.saved_tensors, grad)
    return dx, d_weight, d_bias if ctx.with_bias else None


_fp32_linear.register_autograd(_linear_backward, setup_context=_save_x_and_weight)


def fp32_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Triton ``t2train.nn.precision`` fp32 linear (same arguments, same result)."""
    if weight.shape[0] > MAX_OUTPUTS or weight.shape[-1] != x.shape[-1]:
        raise ValueError(
            f"weight {tuple(weight.shape)} for x {tuple(x.shape)}: the kernel "
            f"takes [n <= {MAX_OUTPUTS}, {x.shape[-1]}]"
        )
    return _fp32_linear(x, weight, bias)
