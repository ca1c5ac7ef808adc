"""Two-phase Block Attention Residuals (arXiv 2603.15031 Sec. 4.2), forward and backward.

Exact counterpart of ``t2train.residual.attnres.functional.depth_mix`` over the completed
sources v_n (embedding and block sums: the rows of stacks [k, ..., h], read in place through
a table of their addresses) and the current block's partial sum p:

Phase 1 (the S pseudo-queries w_s of a block at once, one read of the sources):

    z_sn = (w_s . v_n) rsqrt(mean(v_n^2) + eps),  O_s = sum_n softmax_n(z_s)_n v_n,
    LSE_s = logsumexp_n z_sn                                     (fp32)

Phase 2 (per sublayer, elementwise in the token): with z_p the partial sum's logit,

    out = (e^LSE O + e^z_p p) / (e^LSE + e^z_p)

Backward of phase 1, with w = softmax, dO_s and dLSE_s incoming and r_n the rsqrt:

    dz_sn = w_sn (dO_s . v_n - dO_s . O_s + dLSE_s)
    dv_n = sum_s (w_sn dO_s + dz_sn r_n w_s) - (r_n^2 / h) (sum_s dz_sn z_sn) v_n
    dw_s = sum_tokens sum_n dz_sn r_n v_n

Phase 2's backward is the same algebra for two sources. Each phase is one kernel that reads
its inputs once from memory: phase 1's backward takes a token's scores' gradients over all
of h, then its dv over the same rows again (just read, in cache). Query gradients are summed
over blocks of ``ROWS`` tokens (phase 1 into a partial sum per block, phase 2 in registers),
then over blocks by PyTorch.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from t2train.kernels.common import interpreting
from t2train.kernels.ops import kernel_op, tracing


@triton.jit
def _source_rows(SOURCES, V, n_src, BLOCK_N: tl.constexpr, ALIGNED: tl.constexpr):
    """The N sources' base pointers [BLOCK_N], read from the table of their addresses
    (``SOURCES``: int64 data pointers; ``V``: the first source, for the element type), so
    the sources are read where they are, never stacked into one tensor. ``ALIGNED``: every
    address is a multiple of 16 bytes, which the compiler cannot see in loaded pointers (it
    then vectorises the loads, as for a pointer argument)."""
    offs_n = tl.arange(0, BLOCK_N)
    address = tl.load(SOURCES + offs_n, mask=offs_n < n_src, other=0)
    bases = address.to(tl.pointer_type(V.dtype.element_ty))
    if ALIGNED:
        bases = tl.multiple_of(bases, 16)
    return bases


@triton.jit
def _phase1_logits(
    SOURCES,
    V,
    Q,
    do_bases,
    row,
    hidden,
    n_src,
    n_q,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    WITH_DO: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """r [BLOCK_N], z [BLOCK_N, BLOCK_S] and (WITH_DO) dO . v [BLOCK_N, BLOCK_S] for one token
    (``do_bases``: the S rows of dO, as ``_source_rows`` gives them)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_s = tl.arange(0, BLOCK_S)
    bases = _source_rows(SOURCES, V, n_src, BLOCK_N, ALIGNED)
    sumsq = tl.zeros([BLOCK_N], tl.float32)
    dots = tl.zeros([BLOCK_N, BLOCK_S], tl.float32)
    dov = tl.zeros([BLOCK_N, BLOCK_S], tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h[None, :] < hidden
        v = tl.load(
            bases[:, None] + row * hidden + offs_h[None, :],
            mask=(offs_n[:, None] < n_src) & h_ok,
            other=0.0,
        ).to(tl.float32)
        q = tl.load(
            Q + offs_s[:, None] * hidden + offs_h[None, :],
            mask=(offs_s[:, None] < n_q) & h_ok,
            other=0.0,
        ).to(tl.float32)
        sumsq += tl.sum(v * v, 1)
        dots += tl.sum(v[:, None, :] * q[None, :, :], 2)
        if WITH_DO:
            do = tl.load(
                do_bases[:, None] + row * hidden + offs_h[None, :],
                mask=(offs_s[:, None] < n_q) & h_ok,
                other=0.0,
            ).to(tl.float32)
            dov += tl.sum(v[:, None, :] * do[None, :, :], 2)
    r = 1.0 / tl.sqrt(sumsq / hidden + eps)
    return r, dots * r[:, None], dov


@triton.jit
def _phase1_fwd_kernel(
    SOURCES,
    V,
    Q,
    OUTS,
    O,
    LSE,
    rows,
    hidden,
    n_src,
    n_q,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ALIGNED: tl.constexpr,
    OUT_ALIGNED: tl.constexpr,
):
    """One token. Query s's O is written to its own tensor, through OUTS, a table of the S
    outputs' addresses like SOURCES (``O``: the first, for the element type)."""
    row = tl.program_id(0).to(tl.int64)  # 64-bit offsets
    offs_n = tl.arange(0, BLOCK_N)
    offs_s = tl.arange(0, BLOCK_S)
    bases = _source_rows(SOURCES, V, n_src, BLOCK_N, ALIGNED)
    out_bases = _source_rows(OUTS, O, n_q, BLOCK_S, OUT_ALIGNED)
    r, z, _ = _phase1_logits(
        SOURCES,
        V,
        Q,
        out_bases,
        row,
        hidden,
        n_src,
        n_q,
        eps,
        BLOCK_N,
        BLOCK_S,
        BLOCK_H,
        False,
        ALIGNED,
    )
    z = tl.where(offs_n[:, None] < n_src, z, float("-inf"))
    m = tl.max(z, 0)
    p = tl.exp(z - m[None, :])
    total = tl.sum(p, 0)
    w = p / total[None, :]
    tl.store(LSE + offs_s * rows + row, m + tl.log(total), mask=offs_s < n_q)
    for h0 in range(0, hidden, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h[None, :] < hidden
        v = tl.load(
            bases[:, None] + row * hidden + offs_h[None, :],
            mask=(offs_n[:, None] < n_src) & h_ok,
            other=0.0,
        ).to(tl.float32)
        o = tl.sum(w[:, :, None] * v[:, None, :], 0)
        tl.store(
            out_bases[:, None] + row * hidden + offs_h[None, :],
            o.to(O.dtype.element_ty),
            mask=(offs_s[:, None] < n_q) & h_ok,
        )


@triton.jit
def _phase1_bwd_kernel(
    SOURCES,
    V,
    Q,
    LSE,
    DOS,
    DO,
    DLSE,
    DV,
    DQ_PART,
    ADDED,
    rows,
    hidden,
    n_src,
    n_q,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    ALIGNED: tl.constexpr,
    ADDED_ALIGNED: tl.constexpr,
    DO_ALIGNED: tl.constexpr,
):
    """ROWS tokens, one after another: the scores' gradients over all of h (a first loop),
    then dv and the query gradient slice by slice (a second loop over the same token's rows,
    just read), the query gradient summed over the ROWS tokens into DQ_PART [blocks, S, h].
    Each source's dv has its gradient from after the read added, read through ADDED, a
    table of addresses like SOURCES (0: none); the S outputs' gradients are read where they
    are, through DOS (``DO``: the first)."""
    block = tl.program_id(0).to(tl.int64)
    bases = _source_rows(SOURCES, V, n_src, BLOCK_N, ALIGNED)
    do_bases = _source_rows(DOS, DO, n_q, BLOCK_S, DO_ALIGNED)
    added_bases = _source_rows(ADDED, DV, n_src, BLOCK_N, ADDED_ALIGNED)
    offs_n = tl.arange(0, BLOCK_N)
    offs_s = tl.arange(0, BLOCK_S)
    n_ok, s_ok = offs_n < n_src, offs_s < n_q
    ok = n_ok[:, None] & s_ok[None, :]
    added_ok = tl.load(ADDED + offs_n, mask=n_ok, other=0) != 0
    for i in range(ROWS):
        row = block * ROWS + i
        if row < rows:
            r, z, dov = _phase1_logits(
                SOURCES,
                V,
                Q,
                do_bases,
                row,
                hidden,
                n_src,
                n_q,
                eps,
                BLOCK_N,
                BLOCK_S,
                BLOCK_H,
                True,
                ALIGNED,
            )
            lse = tl.load(LSE + offs_s * rows + row, mask=s_ok, other=0.0)
            dlse = tl.load(DLSE + offs_s * rows + row, mask=s_ok, other=0.0)
            w = tl.where(ok, tl.exp(z - lse[None, :]), 0.0)
            dz = w * (dov - tl.sum(w * dov, 0)[None, :] + dlse[None, :])
            dzr = dz * r[:, None]
            coef = r * r / hidden * tl.sum(dz * z, 1)
            for h0 in range(0, hidden, BLOCK_H):
                offs_h = h0 + tl.arange(0, BLOCK_H)
                h_ok = offs_h[None, :] < hidden
                v_mask = n_ok[:, None] & h_ok
                v = tl.load(
                    bases[:, None] + row * hidden + offs_h[None, :], mask=v_mask, other=0.0
                ).to(tl.float32)
                q = tl.load(
                    Q + offs_s[:, None] * hidden + offs_h[None, :],
                    mask=s_ok[:, None] & h_ok,
                    other=0.0,
                ).to(tl.float32)
                do = tl.load(
                    do_bases[:, None] + row * hidden + offs_h[None, :],
                    mask=s_ok[:, None] & h_ok,
                    other=0.0,
                ).to(tl.float32)
                added = tl.load(
                    added_bases[:, None] + row * hidden + offs_h[None, :],
                    mask=added_ok[:, None] & v_mask,
                    other=0.0,
                ).to(tl.float32)
                dv = (
                    tl.sum(w[:, :, None] * do[None, :, :] + dzr[:, :, None] * q[None, :, :], 1)
                    - coef[:, None] * v
                    + added
                )
                tl.store(
                    DV + (offs_n[:, None] * rows + row) * hidden + offs_h[None, :],
                    dv.to(DV.dtype.element_ty),
                    mask=v_mask,
                )
                dq = DQ_PART + (block * n_q + offs_s[:, None]) * hidden + offs_h[None, :]
                dq_mask = s_ok[:, None] & h_ok
                if i == 0:  # the block's first token starts its partial sum
                    summed = tl.zeros([BLOCK_S, BLOCK_H], tl.float32)
                else:
                    summed = tl.load(dq, mask=dq_mask, other=0.0)
                tl.store(dq, summed + tl.sum(dzr[:, :, None] * v[:, None, :], 0), mask=dq_mask)


@triton.jit
def _phase2_row(P, Q, O, LSE, row, hidden, eps, BLOCK_H: tl.constexpr):
    """p, q, O, the rsqrt r_p, the logit z_p, the weight of p and the merged output."""
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < hidden
    p = tl.load(P + row * hidden + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    q = tl.load(Q + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    o = tl.load(O + row * hidden + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(p * p, 0) / hidden + eps)
    z = tl.sum(q * p, 0) * r
    gamma = tl.sigmoid(z - tl.load(LSE + row))  # e^z / (e^LSE + e^z)
    return offs_h, h_ok, p, q, o, r, z, gamma, o + gamma * (p - o)


@triton.jit
def _phase2_fwd_kernel(
    P, Q, O, LSE, Y, rows, hidden, eps, BLOCK_H: tl.constexpr, ROWS: tl.constexpr
):
    for i in range(ROWS):
        row = tl.program_id(0).to(tl.int64) * ROWS + i
        if row < rows:
            offs_h, h_ok, p, q, o, r, z, gamma, y = _phase2_row(
                P, Q, O, LSE, row, hidden, eps, BLOCK_H
            )
            tl.store(Y + row * hidden + offs_h, y.to(Y.dtype.element_ty), mask=h_ok)


@triton.jit
def _phase2_bwd_kernel(
    P,
    Q,
    O,
    LSE,
    G,
    DP_LATER,
    DP,
    DO,
    DLSE,
    DQ_PART,
    rows,
    hidden,
    eps,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_LATER: tl.constexpr,
):
    block = tl.program_id(0).to(tl.int64)
    dq = tl.zeros([BLOCK_H], tl.float32)
    for i in range(ROWS):
        row = block * ROWS + i
        if row < rows:
            offs_h, h_ok, p, q, o, r, z, gamma, y = _phase2_row(
                P, Q, O, LSE, row, hidden, eps, BLOCK_H
            )
            g = tl.load(G + row * hidden + offs_h, mask=h_ok, other=0.0).to(tl.float32)
            dz = gamma * tl.sum(g * (p - y), 0)  # and dLSE = -dz
            dp = gamma * g + dz * r * (q - z * r / hidden * p)
            if HAS_LATER:  # the partial sum's gradient from after the read
                dp += tl.load(DP_LATER + row * hidden + offs_h, mask=h_ok, other=0.0).to(tl.float32)
            tl.store(DP + row * hidden + offs_h, dp.to(DP.dtype.element_ty), mask=h_ok)
            do = (1.0 - gamma) * g
            tl.store(DO + row * hidden + offs_h, do.to(DO.dtype.element_ty), mask=h_ok)
            tl.store(DLSE + row, -dz)
            dq += dz * r * p
    offs_h = tl.arange(0, BLOCK_H)
    tl.store(DQ_PART + block * hidden + offs_h, dq, mask=offs_h < hidden)


BLOCK_ELEMENTS = 8192  # a phase-1 tile [sources, queries, h slice] at most, in elements


def _phase1_blocks(n_src: int, n_q: int, hidden: int) -> dict:
    block_n, block_s = triton.next_power_of_2(n_src), triton.next_power_of_2(n_q)
    block_h = max(16, min(triton.next_power_of_2(hidden), BLOCK_ELEMENTS // (block_n * block_s)))
    return dict(BLOCK_N=block_n, BLOCK_S=block_s, BLOCK_H=block_h)


ROWS = 4 if interpreting() else 32


def _phase2_blocks(hidden: int) -> dict:
    block_h = triton.next_power_of_2(hidden)
    return dict(BLOCK_H=block_h, ROWS=ROWS, num_warps=min(16, max(4, block_h // 512)))


def _address_table(
    stacks: list, device: torch.device, flag: str = "ALIGNED", rows: Optional[list] = None
) -> tuple[Tensor, dict]:
    """The data pointers of the stacks' rows (the sources) as an int64 tensor on their device
    (the kernels' table), and whether all are 16-byte aligned (a fresh tensor is; a view may
    not be), as the kernel's ``flag``. A stack given as None (``rows``: each stack's count)
    has address 0 for each of its rows: nothing to read."""
    addresses = []
    for index, stack in enumerate(stacks):
        if stack is None:
            assert rows is not None, "a stack given as None needs its count of rows"
            addresses += [0] * rows[index]
            continue
        size = stack.stride(0) * stack.element_size()
        addresses += [stack.data_ptr() + row * size for row in range(stack.shape[0])]
    table = torch.tensor(addresses, dtype=torch.int64, device=device)
    return table, {flag: all(address % 16 == 0 for address in addresses)}


def _checked(stacks: list[Tensor]) -> list[Tensor]:
    """The stacks, each contiguous, after checking that their sources match."""
    stacks = [t.contiguous() for t in stacks]
    first = stacks[0]
    if any(
        (t.shape[1:], t.dtype, t.device) != (first.shape[1:], first.dtype, first.device)
        for t in stacks
    ):
        raise ValueError(
            "phase 1: the sources must share one shape, dtype and device, got stacks "
            f"{[(tuple(t.shape), t.dtype) for t in stacks]}"
        )
    return stacks


def _rows_table(rows: list[Tensor], device: torch.device, flag: str) -> tuple[Tensor, dict]:
    """The kernels' table of S tensors' addresses, each [..., h] (a query's O or its gradient)."""
    return _address_table([row.unsqueeze(0) for row in rows], device, flag)


@kernel_op("block_phase_1")
def _phase_1(queries: Tensor, stacks: list[Tensor], eps: float, rounded: bool) -> list[Tensor]:
    """queries [S, h], the N sources (the rows of the stacks, each [k, ..., h]) -> the S
    queries' O, each a tensor of its own [..., h], then LSE [S, ...], both fp32; ``rounded``:
    O in the sources' dtype (what a layer keeps: a read with no phase 2 returns it as it is,
    and phase 2 reads half the bytes; otherwise a pass of its own would convert it). The
    kernels read each source where it is (a table of their addresses): no stacked copy is
    made, and none is saved for the backward (the sources are the stream's, alive anyway).
    Each O apart, as the layer hands them to different reads: the backward reads their
    gradients where they are (as one [S, ...] tensor, they were copied into it)."""
    queries = queries.contiguous()
    stacks = _checked(stacks)
    first = stacks[0][0]
    out_dtype = first.dtype if rounded else torch.float32
    n_q = queries.shape[0]
    outs = [torch.empty_like(first, dtype=out_dtype) for _ in range(n_q)]
    lse = torch.empty((n_q, *first.shape[:-1]), device=queries.device, dtype=torch.float32)
    if tracing(queries):
        return [*outs, lse]
    n_src, hidden = sum(t.shape[0] for t in stacks), first.shape[-1]
    rows = first.numel() // hidden
    table, aligned = _address_table(stacks, queries.device)
    out_table, out_aligned = _rows_table(outs, queries.device, "OUT_ALIGNED")
    _phase1_fwd_kernel[(rows,)](
        table,
        first,
        queries,
        out_table,
        outs[0],
        lse,
        rows,
        hidden,
        n_src,
        n_q,
        eps,
        **_phase1_blocks(n_src, n_q, hidden),
        **aligned,
        **out_aligned,
    )
    return [*outs, lse]


@kernel_op("block_phase_1_backward")
def _phase_1_backward(
    queries: Tensor,
    stacks: list[Tensor],
    lse: Tensor,
    d_outs: list[Tensor],
    d_lse: Tensor,
    eps: float,
    added: list[Optional[Tensor]],
) -> tuple[Tensor, Tensor]:
    """dQ [S, h] and the sources' gradients as one [N, ..., h] buffer, each stack's with its
    ``added`` (its gradient from after the read, shaped like it; None: nothing) added;
    ``d_outs``: the S queries' O's gradients, each [..., h]."""
    queries = queries.contiguous()
    stacks = _checked(stacks)
    first = stacks[0][0]
    n_src = sum(t.shape[0] for t in stacks)
    d_sources = torch.empty((n_src, *first.shape), device=lse.device, dtype=first.dtype)
    if tracing(queries):
        return torch.empty_like(queries), d_sources
    hidden, n_q = first.shape[-1], queries.shape[0]
    rows = first.numel() // hidden
    # O's gradient read as it comes (bf16 when O was rounded): an fp32 copy would be a pass
    # of its own, and each kernel would read twice the bytes
    d_outs, d_lse = [d.contiguous() for d in d_outs], d_lse.float().contiguous()
    table, aligned = _address_table(stacks, queries.device)
    do_table, do_aligned = _rows_table(d_outs, queries.device, "DO_ALIGNED")
    added = [None if t is None else t.contiguous() for t in added]
    counts = [t.shape[0] for t in stacks]
    added_table, added_aligned = _address_table(added, lse.device, "ADDED_ALIGNED", counts)
    blocks = triton.cdiv(rows, ROWS)
    dq_part = torch.empty(blocks, n_q, hidden, device=lse.device, dtype=torch.float32)
    _phase1_bwd_kernel[(blocks,)](
        table,
        first,
        queries,
        lse,
        do_table,
        d_outs[0],
        d_lse,
        d_sources,
        dq_part,
        added_table,
        rows,
        hidden,
        n_src,
        n_q,
        eps,
        ROWS=ROWS,
        **_phase1_blocks(n_src, n_q, hidden),
        **aligned,
        **added_aligned,
        **do_aligned,
    )
    return dq_part.sum(0).to(queries.dtype), d_sources


def _save_phase_1(ctx, inputs: tuple, output: list) -> None:
    queries, stacks, ctx.eps, _rounded = inputs
    ctx.save_for_backward(queries, output[-1], *stacks)


def _phase_1_grads(ctx, grads: list) -> tuple:
    """The stacks' gradients are handed to autograd as views of one buffer."""
    queries, lse, *stacks = ctx.saved_tensors
    *d_outs, d_lse = grads
    nothing = [None] * len(stacks)
    d_queries, d_sources = _phase_1_backward(queries, stacks, lse, d_outs, d_lse, ctx.eps, nothing)
    return d_queries, list(d_sources.split([t.shape[0] for t in stacks])), None, None


_phase_1.register_autograd(_phase_1_grads, setup_context=_save_phase_1)


class _HandingOn(torch.autograd.Function):
    """Phase 1 over the earlier sources (a stack) and single new ones, each returned as it
    came for the caller to hand on.

    A layer reads sources (the earlier layers', its own) and hands them on, so they get a
    gradient from the read and one from after it. Handed on as inputs, autograd adds the
    two in a pass of its own (3 units per source); handed on through the read, the
    gradient from after it arrives in the read's backward, whose kernel adds it while it
    writes the read's (1 unit more read). The new sources are taken and returned in their
    own shape: as rows of stacks, their gradients would be copied into and out of them.
    Outputs: the S queries' O (each its own tensor), LSE, the earlier sources, the new ones."""

    @staticmethod
    def forward(ctx, eps: float, rounded: bool, queries: Tensor, earlier: Tensor, *new: Tensor):
        *outs, lse = _phase_1(queries, _stacked(earlier, new), eps, rounded)
        ctx.eps = eps
        ctx.save_for_backward(queries, lse, earlier, *new)
        handed_on = (earlier.view_as(earlier), *(source.view_as(source) for source in new))
        return (*outs, lse, *handed_on)

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]):
        queries, lse, earlier, *new = ctx.saved_tensors
        n_q = queries.shape[0]
        d_outs, d_lse, (d_earlier, *d_new) = grads[:n_q], grads[n_q], grads[n_q + 1 :]
        if d_lse is None:
            d_lse = torch.zeros_like(lse)
        added = [d_earlier, *(None if d is None else d.unsqueeze(0) for d in d_new)]
        d_queries, d_sources = _phase_1_backward(
            queries, _stacked(earlier, new), lse, list(d_outs), d_lse, ctx.eps, added
        )
        count = earlier.shape[0]
        return None, None, d_queries, d_sources[:count], *d_sources[count:].unbind(0)


def _stacked(earlier: Tensor, new) -> list[Tensor]:
    return [earlier, *(source.unsqueeze(0) for source in new)]


@kernel_op("block_phase_2")
def _phase_2(partial: Tensor, query: Tensor, out: Tensor, lse: Tensor, eps: float) -> Tensor:
    """partial [..., h], query [h], O [..., h] and LSE [...] of phase 1 -> merged [..., h]."""
    partial, query, out, lse = (t.contiguous() for t in (partial, query, out, lse))
    hidden = partial.shape[-1]
    rows = partial.numel() // hidden
    merged = torch.empty_like(partial)
    if tracing(partial):
        return merged
    _phase2_fwd_kernel[(triton.cdiv(rows, ROWS),)](
        partial, query, out, lse, merged, rows, hidden, eps, **_phase2_blocks(hidden)
    )
    return merged


@kernel_op("block_phase_2_backward")
def _phase_2_backward(
    partial: Tensor,
    query: Tensor,
    out: Tensor,
    lse: Tensor,
    grad: Tensor,
    eps: float,
    later: Optional[Tensor],
) -> list[Tensor]:
    """The gradients of p, the query, O and LSE; p's with ``later`` (its gradient from after
    the read, None: nothing) added."""
    partial, query, out, lse, grad = (t.contiguous() for t in (partial, query, out, lse, grad))
    hidden = partial.shape[-1]
    rows = partial.numel() // hidden
    d_partial, d_out, d_lse = (torch.empty_like(t) for t in (partial, out, lse))
    if tracing(partial):
        return [d_partial, torch.empty_like(query), d_out, d_lse]
    blocks = triton.cdiv(rows, ROWS)
    dq_part = torch.empty(blocks, hidden, device=out.device, dtype=torch.float32)
    _phase2_bwd_kernel[(blocks,)](
        partial,
        query,
        out,
        lse,
        grad,
        d_partial if later is None else later.contiguous(),
        d_partial,
        d_out,
        d_lse,
        dq_part,
        rows,
        hidden,
        eps,
        **_phase2_blocks(hidden),
        HAS_LATER=later is not None,
    )
    return [d_partial, dq_part.sum(0).to(query.dtype), d_out, d_lse]


def _save_phase_2(ctx, inputs: tuple, output: Tensor) -> None:
    *tensors, ctx.eps = inputs
    ctx.save_for_backward(*tensors)


def _phase_2_grads(ctx, grad: Tensor) -> tuple:
    return (*_phase_2_backward(*ctx.saved_tensors, grad, ctx.eps, None), None)


_phase_2.register_autograd(_phase_2_grads, setup_context=_save_phase_2)


class _PartialHandedOn(torch.autograd.Function):
    """Phase 2, and the partial sum returned as it came for the caller to hand on (the
    write adds the output to it): its gradient from after the read then arrives in phase
    2's backward, whose kernel adds it (1 unit read) where autograd would add the two in a
    pass of its own (3 units)."""

    @staticmethod
    def forward(ctx, eps: float, partial: Tensor, query: Tensor, out: Tensor, lse: Tensor):
        ctx.eps = eps
        ctx.save_for_backward(partial, query, out, lse)
        return _phase_2(partial, query, out, lse, eps), partial.view_as(partial)

    @staticmethod
    def backward(ctx, grad: Optional[Tensor], later: Optional[Tensor]):
        partial, query, out, lse = ctx.saved_tensors
        if grad is None:
            grad = torch.zeros_like(partial)
        return None, *_phase_2_backward(partial, query, out, lse, grad, ctx.eps, later)


def phase_1(
    queries: Tensor, stacks: list[Tensor], eps: float, rounded: bool = False
) -> tuple[tuple, Tensor]:
    """The S queries' O (a tuple of S tensors [..., h]) and LSE [S, ...] (fp32; ``rounded``:
    O in the sources' dtype) of S pseudo-queries over the N sources (the rows of the stacks,
    each [k, ..., h])."""
    *outs, lse = _phase_1(queries, list(stacks), eps, rounded)
    return tuple(outs), lse


def phase_1_handing_on(
    queries: Tensor, earlier: Tensor, new: list[Tensor], eps: float, rounded: bool = False
) -> tuple:
    """``phase_1``'s O (a tuple of S tensors) and LSE over the earlier sources (a stack
    [k, ..., h]) and the new ones (each [..., h]), then those as they came, the gradient
    each gets after the read added in the read's backward kernel."""
    if not torch.is_grad_enabled():  # no backward; and dynamo binds the Function's
        # arguments one place off when it traces it under no_grad (torch 2.14)
        outs, lse = phase_1(queries, _stacked(earlier, new), eps, rounded)
        return (outs, lse, earlier, *new)
    count = queries.shape[0]
    outputs = _HandingOn.apply(eps, rounded, queries, earlier, *new)
    return (outputs[:count], *outputs[count:])


def phase_2(partial: Tensor, query: Tensor, out: Tensor, lse: Tensor, eps: float) -> Tensor:
    """Merge one query's phase-1 result with the partial sum, in the partial's dtype."""
    return _phase_2(partial, query, out, lse, eps)


def phase_2_handing_on(
    partial: Tensor, query: Tensor, out: Tensor, lse: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """``phase_2``'s merge, then the partial sum as it came, the gradient it gets after the
    read added in the read's backward kernel."""
    if not torch.is_grad_enabled():  # no backward to add it in
        return _phase_2(partial, query, out, lse, eps), partial
    return _PartialHandedOn.apply(eps, partial, query, out, lse)


def depth_mix(query: Tensor, stacks: list[Tensor], partial: Tensor | None, eps: float) -> Tensor:
    """``t2train.residual.attnres.functional.depth_mix(query, stacks + [partial[None]], eps)``
    in two phases.

    Both phases read one fp32 copy of the query, so its two gradients are summed in fp32 and
    rounded to the query's dtype once, as the reference's are (in bf16 the two halves,
    rounded apart, nearly cancel: up to 4% off the exact gradient)."""
    query = query.float()
    out, lse = phase_1(query[None], stacks, eps, rounded=partial is None)
    if partial is None:  # the mixture itself, written in the sources' dtype
        return out[0]
    return phase_2(partial, query, out[0], lse[0], eps)
