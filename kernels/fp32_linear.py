"""Gate logits: x W^T + b in fp32 from low-precision x and W, for a few outputs, forward and
backward, without an fp32 copy of x.

Exact counterpart of ``t2train.nn.precision.fp32_linear`` (DDL's beta and v logits): with x
[rows, h], W [n, h] and n <= ``MAX_OUTPUTS``,

    y = x W^T + b,  dx = g W,  dW = g^T x,  db = sum_rows g      (all in fp32)

On an H100 the reference spent more on its fp32 copies of x (forward and backward) and on
skinny fp32 GEMMs than the delta write itself (docs/gpu/h100-2026-11-26.md). Here one
program owns ``BLOCK_R`` rows and walks h once: the forward reads x once; the backward reads
x and W once, writes dx in x's dtype and its rows' partial dW and db (fp32), which PyTorch
sums over the programs. Products of bf16 values are exact in fp32, so a bf16 ``tl.dot`` with
fp32 accumulation is the fp32 computation up to the order of the sums.

With a weight-free RMSNorm in front (``rms_fp32_linear``: HC's dynamic weights, the norm's
learned weight folded into W), the forward also sums each row's squares from the same read
of x and scales by r = rsqrt(mean(x^2) + eps) afterwards, so the normalised x is never
written; the backward adds the RMS's share, a per-row multiple of x, to dx in the same pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from t2train.kernels.common import dot, fp32_dot, interpreting
from t2train.kernels.ops import kernel_op, tracing

MAX_OUTPUTS = 16  # wider projections are ordinary GEMMs: the reference's cuBLAS call


@triton.jit
def _fwd_kernel(
    X,
    W,
    B,
    Y,
    SUMSQ,
    rows,
    hidden,
    n_out,
    HAS_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_J: tl.constexpr,
    FP32_DOT: tl.constexpr,
    WITH_SUMSQ: tl.constexpr,
):
    offs_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_j = tl.arange(0, BLOCK_J)
    r_ok, j_ok = offs_r < rows, offs_j < n_out
    acc = tl.zeros([BLOCK_R, BLOCK_J], tl.float32)
    sumsq = tl.zeros([BLOCK_R], tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h[None, :] < hidden
        x = tl.load(
            X + offs_r[:, None] * hidden + offs_h[None, :], mask=r_ok[:, None] & h_ok, other=0.0
        )
        w = tl.load(
            W + offs_j[:, None] * hidden + offs_h[None, :], mask=j_ok[:, None] & h_ok, other=0.0
        )
        acc += dot(x, tl.trans(w), FP32_DOT)
        if WITH_SUMSQ:  # the row's sum of squares, for an RMS, from the same read of x
            sumsq += tl.sum(x.to(tl.float32) * x.to(tl.float32), 1)
    if WITH_SUMSQ:
        tl.store(SUMSQ + offs_r, sumsq, mask=r_ok)
    if HAS_BIAS:
        acc += tl.load(B + offs_j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_r[:, None] * n_out + offs_j[None, :], acc, mask=r_ok[:, None] & j_ok[None, :])


@triton.jit
def _bwd_kernel(
    X,
    W,
    G,
    COEF,
    DX,
    DW_PART,
    DB_PART,
    rows,
    hidden,
    n_out,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_J: tl.constexpr,
    WITH_COEF: tl.constexpr,
):
    """dx = g W (+ coef x per row: the RMS's share, ``WITH_COEF``), partial dW = g^T x."""
    block = tl.program_id(0).to(tl.int64)
    offs_r = block * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_j = tl.arange(0, BLOCK_J)
    r_ok, j_ok = offs_r < rows, offs_j < n_out
    g = tl.load(
        G + offs_r[:, None] * n_out + offs_j[None, :], mask=r_ok[:, None] & j_ok[None, :], other=0.0
    )  # fp32 [R, J]
    coef = tl.zeros([BLOCK_R], tl.float32)
    if WITH_COEF:
        coef = tl.load(COEF + offs_r, mask=r_ok, other=0.0)
    tl.store(DB_PART + block * n_out + offs_j, tl.sum(g, 0), mask=j_ok)
    for h0 in range(0, hidden, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h[None, :] < hidden
        x_at = offs_r[:, None] * hidden + offs_h[None, :]
        x = tl.load(X + x_at, mask=r_ok[:, None] & h_ok, other=0.0)
        w = tl.load(
            W + offs_j[:, None] * hidden + offs_h[None, :], mask=j_ok[:, None] & h_ok, other=0.0
        )
        # g is fp32: these products are IEEE fp32 (a literal True reaches ``dot`` as a runtime
        # value once compiled, so the casts are written out)
        dx = tl.dot(g, w.to(tl.float32), input_precision="ieee")
        if WITH_COEF:
            dx += coef[:, None] * x.to(tl.float32)
        tl.store(DX + x_at, dx.to(DX.dtype.element_ty), mask=r_ok[:, None] & h_ok)
        dw = tl.dot(tl.trans(g), x.to(tl.float32), input_precision="ieee")
        tl.store(
            DW_PART + (block * n_out + offs_j[:, None]) * hidden + offs_h[None, :],
            dw,
            mask=j_ok[:, None] & h_ok,
        )


def _blocks(n_out: int) -> dict:
    """tl.dot needs >= 16 on every side: the outputs are padded to 16 (masked)."""
    if interpreting():
        return dict(BLOCK_R=16, BLOCK_H=16, BLOCK_J=16)
    return dict(
        BLOCK_R=64, BLOCK_H=128, BLOCK_J=max(16, triton.next_power_of_2(n_out)), num_warps=4
    )


def _launch_forward(
    x: Tensor, weight: Tensor, bias: Tensor | None, y: Tensor, sumsq: Tensor | None
) -> None:
    """y = x W^T + b into ``y`` (fp32), and each row's sum of squares into ``sumsq``."""
    if tracing(x):
        return
    hidden, n_out = x.shape[-1], weight.shape[0]
    rows = x.numel() // hidden
    blocks = _blocks(n_out)
    # Mixed dtypes (fp32 weights under autocast) multiply in fp32, as the reference does.
    exact = fp32_dot(x.dtype) or x.dtype != weight.dtype
    _fwd_kernel[(triton.cdiv(rows, blocks["BLOCK_R"]),)](
        x,
        weight,
        weight if bias is None else bias,
        y,
        y if sumsq is None else sumsq,
        rows,
        hidden,
        n_out,
        HAS_BIAS=bias is not None,
        FP32_DOT=exact,
        WITH_SUMSQ=sumsq is not None,
        **blocks,
    )


def _outputs(x: Tensor, weight: Tensor) -> Tensor:
    return torch.empty(*x.shape[:-1], weight.shape[0], device=x.device, dtype=torch.float32)


@kernel_op("fp32_linear")
def _fp32_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x [..., h], weight [n, h], bias [n] or None -> fp32 [..., n]."""
    x, weight = x.contiguous(), weight.contiguous()
    y = _outputs(x, weight)
    _launch_forward(x, weight, bias, y, None)
    return y


@kernel_op("fp32_linear_sumsq")
def _fp32_linear_sumsq(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., h], weight [n, h] -> fp32 x W^T [..., n] and each row's sum of squares [...],
    from one read of x."""
    x, weight = x.contiguous(), weight.contiguous()
    u = _outputs(x, weight)
    sumsq = torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
    _launch_forward(x, weight, None, u, sumsq)
    return u, sumsq


@kernel_op("fp32_linear_backward")
def _fp32_linear_backward(
    x: Tensor, weight: Tensor, grad: Tensor, coef: Tensor | None
) -> list[Tensor]:
    """dx = g W (+ coef x per row), dW = g^T x, db = sum g, for the incoming g (in fp32)."""
    x, weight = x.contiguous(), weight.contiguous()
    dx = torch.empty_like(x)
    if tracing(x):
        return [dx, torch.empty_like(weight), weight.new_empty(weight.shape[0])]
    hidden, n_out = x.shape[-1], weight.shape[0]
    rows = x.numel() // hidden
    blocks = _blocks(n_out)
    programs = triton.cdiv(rows, blocks["BLOCK_R"])
    dw_part = torch.empty(programs, n_out, hidden, device=x.device, dtype=torch.float32)
    db_part = torch.empty(programs, n_out, device=x.device, dtype=torch.float32)
    grad = grad.float().contiguous()
    _bwd_kernel[(programs,)](
        x,
        weight,
        grad,
        grad if coef is None else coef.contiguous(),
        dx,
        dw_part,
        db_part,
        rows,
        hidden,
        n_out,
        WITH_COEF=coef is not None,
        **blocks,
    )
    return [dx, dw_part.sum(0).to(weight.dtype), db_part.sum(0).to(weight.dtype)]


def _save_x_and_weight(ctx, inputs: tuple, output) -> None:
    x, weight, *rest = inputs
    ctx.with_bias = bool(rest) and rest[0] is not None
    ctx.save_for_backward(x, weight)


def _linear_backward(ctx, grad: Tensor) -> tuple:
    dx, d_weight, d_bias = _fp32_linear_backward(*ctx.saved_tensors, grad, None)
    return dx, d_weight, d_bias if ctx.with_bias else None


def _sumsq_backward(ctx, d_u: Tensor, d_sumsq: Tensor) -> tuple:
    """The sum of squares' share of dx, 2 d_sumsq x per row, is added in the same pass."""
    dx, d_weight, _ = _fp32_linear_backward(*ctx.saved_tensors, d_u, 2 * d_sumsq)
    return dx, d_weight


_fp32_linear.register_autograd(_linear_backward, setup_context=_save_x_and_weight)
_fp32_linear_sumsq.register_autograd(_sumsq_backward, setup_context=_save_x_and_weight)


def fp32_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Triton ``t2train.nn.precision`` fp32 linear (same arguments, same result)."""
    if weight.shape[0] > MAX_OUTPUTS or weight.shape[-1] != x.shape[-1]:
        raise ValueError(
            f"weight {tuple(weight.shape)} for x {tuple(x.shape)}: the kernel "
            f"takes [n <= {MAX_OUTPUTS}, {x.shape[-1]}]"
        )
    return _fp32_linear(x, weight, bias)


def rms_fp32_linear(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """Triton ``t2train.nn.precision`` RMS-normalised fp32 linear (same arguments, same
    result)."""
    if weight.shape[0] > MAX_OUTPUTS or weight.shape[-1] != x.shape[-1]:
        raise ValueError(
            f"weight {tuple(weight.shape)} for x {tuple(x.shape)}: the kernel "
            f"takes [n <= {MAX_OUTPUTS}, {x.shape[-1]}]"
        )
    u, sumsq = _fp32_linear_sumsq(x, weight)
    y = u * torch.rsqrt(sumsq / x.shape[-1] + eps)[..., None]
    return y if bias is None else y + bias.float()
