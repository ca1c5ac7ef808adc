"""Fused short causal window attention (FlashAttention-2 style), forward and backward.

Exact counterpart of ``t2train.residual.window_attention.short_window_attention``:

    O = softmax(Q K^T * scale + band) V,  query i at p = k_len - q_len + i sees keys j with
    p - window < j <= p

Queries are tiled in blocks of ``BLOCK_M`` rows; a program visits only the key tiles that
intersect its band, keeping a running max m and sum l (online softmax, base 2):

    m' = max(m, rowmax S),  l' = l 2^(m - m') + rowsum 2^(S - m'),  acc' = acc 2^(m - m') + P V

and stores O = acc / l and LSE = m + log2 l. The backward recomputes P = 2^(S - LSE) per tile
with D = rowsum(dO * O):  dV = P^T dO,  dS = P (dO V^T - D),  dQ = dS K scale,  dK = dS^T Q scale.
dK/dV programs own one key tile and loop over the grouped query heads of their KV head, so
grouped-query attention needs no atomics. Inputs need a unit last-dim stride only.

One query (a depth read: each token attends over its last K layer states) takes its own
kernels: a program owns ``BLOCK_B`` batch rows of one head and holds their few keys as a
[BLOCK_B, BLOCK_N, d] tile, elementwise. Tiled as above, 15 of every 16 query rows were
padding: on an H100 that kernel spent 139.5 ms of a 441 ms `depth_attn` step at 125m
(docs/gpu/h100-2026-11-26.md).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from t2train.kernels.common import dot, fp32_dot, interpreting
from t2train.kernels.ops import kernel_op, tracing

LOG2E = math.log2(math.e)


@triton.jit
def _key_tiles(pid_m, q_len, k_len, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi): the keys of the tiles that intersect query tile ``pid_m``'s band."""
    first = pid_m * BLOCK_M + k_len - q_len
    lo = tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(first + BLOCK_M, k_len)
    return lo, hi


@triton.jit
def _load_kv(K, V, k_base, v_base, skn, svn, offs_n, offs_d, k_len, d_ok):
    """One key tile and its value tile, zero past k_len and head_dim."""
    n_ok = offs_n[:, None] < k_len
    k = tl.load(K + k_base + offs_n[:, None] * skn + offs_d[None, :], mask=n_ok & d_ok, other=0.0)
    v = tl.load(V + v_base + offs_n[:, None] * svn + offs_d[None, :], mask=n_ok & d_ok, other=0.0)
    return k, v


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    sqb,
    sqh,
    sqm,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sob,
    soh,
    som,
    heads,
    group,
    q_len,
    k_len,
    window,
    head_dim,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    bh, pid_m = tl.program_id(0).to(tl.int64), tl.program_id(1)  # 64-bit base offsets
    b, h = bh // heads, bh % heads
    hk = h // group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    pos = offs_m + k_len - q_len
    d_ok = offs_d[None, :] < head_dim
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :],
        mask=(offs_m[:, None] < q_len) & d_ok,
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_tiles(pid_m, q_len, k_len, window, BLOCK_M, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = _load_kv(
            K, V, b * skb + hk * skh, b * svb + hk * svh, skn, svn, offs_n, offs_d, k_len, d_ok
        )
        keep = (
            (offs_n[None, :] <= pos[:, None])
            & (offs_n[None, :] > pos[:, None] - window)
            & (offs_n[None, :] < k_len)
        )
        s = tl.where(keep, dot(q, tl.trans(k), FP32_DOT) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, FP32_DOT)
        m_i = m_new
    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # only rows past q_len see no key
    m_ok = offs_m < q_len
    tl.store(
        O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :],
        (acc / l_i[:, None]).to(O.dtype.element_ty),
        mask=m_ok[:, None] & d_ok,
    )
    tl.store(LSE + bh * q_len + offs_m, m_i + tl.log2(l_i), mask=m_ok)


@triton.jit
def _delta_kernel(
    O,
    DO,
    DELTA,
    sob,
    soh,
    som,
    sdb,
    sdh,
    sdm,
    heads,
    q_len,
    head_dim,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """D = rowsum(dO * O) in fp32."""
    bh, pid_m = tl.program_id(0).to(tl.int64), tl.program_id(1)  # 64-bit base offsets
    b, h = bh // heads, bh % heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < q_len) & (offs_d[None, :] < head_dim)
    o = tl.load(
        O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :], mask=mask, other=0.0
    )
    do = tl.load(
        DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :], mask=mask, other=0.0
    )
    tl.store(
        DELTA + bh * q_len + offs_m,
        tl.sum(o.to(tl.float32) * do.to(tl.float32), 1),
        mask=offs_m < q_len,
    )


@triton.jit
def _dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    sqb,
    sqh,
    sqm,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sdb,
    sdh,
    sdm,
    sdkb,
    sdkh,
    sdkn,
    sdvb,
    sdvh,
    sdvn,
    heads,
    group,
    q_len,
    k_len,
    window,
    head_dim,
    scale,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    bhk, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    kv_heads = heads // group
    b, hk = bhk // kv_heads, bhk % kv_heads
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < head_dim
    n_ok = offs_n[:, None] < k_len
    k = tl.load(
        K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :],
        mask=n_ok & d_ok,
        other=0.0,
    )
    v = tl.load(
        V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :],
        mask=n_ok & d_ok,
        other=0.0,
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    shift = k_len - q_len  # query i sits at position i + shift
    lo = tl.maximum(pid_n * BLOCK_N - shift, 0) // BLOCK_M * BLOCK_M
    hi = tl.minimum(pid_n * BLOCK_N + BLOCK_N + window - 1 - shift, q_len)
    for h in range(hk * group, hk * group + group):
        row = (b * heads + h) * q_len
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            m_ok = offs_m < q_len
            q = tl.load(
                Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                mask=m_ok[:, None] & d_ok,
                other=0.0,
            )
            do = tl.load(
                DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :],
                mask=m_ok[:, None] & d_ok,
                other=0.0,
            )
            lse = tl.load(LSE + row + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(DELTA + row + offs_m, mask=m_ok, other=0.0)
            pos = offs_m + shift
            keep = (
                (offs_n[:, None] <= pos[None, :])
                & (offs_n[:, None] > pos[None, :] - window)
                & m_ok[None, :]
            )
            s_t = dot(k, tl.trans(q), FP32_DOT) * qk_scale
            p_t = tl.where(keep, tl.exp2(s_t - lse[None, :]), 0.0)
            dv += dot(p_t.to(do.dtype), do, FP32_DOT)
            dp_t = dot(v, tl.trans(do), FP32_DOT)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += dot(ds_t.to(q.dtype), q, FP32_DOT)
    tl.store(
        DK + b * sdkb + hk * sdkh + offs_n[:, None] * sdkn + offs_d[None, :],
        (dk * scale).to(DK.dtype.element_ty),
        mask=n_ok & d_ok,
    )
    tl.store(
        DV + b * sdvb + hk * sdvh + offs_n[:, None] * sdvn + offs_d[None, :],
        dv.to(DV.dtype.element_ty),
        mask=n_ok & d_ok,
    )


@triton.jit
def _dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    sqb,
    sqh,
    sqm,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sdb,
    sdh,
    sdm,
    sdqb,
    sdqh,
    sdqm,
    heads,
    group,
    q_len,
    k_len,
    window,
    head_dim,
    scale,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    bh, pid_m = tl.program_id(0).to(tl.int64), tl.program_id(1)  # 64-bit base offsets
    b, h = bh // heads, bh % heads
    hk = h // group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < head_dim
    m_ok = offs_m < q_len
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :],
        mask=m_ok[:, None] & d_ok,
        other=0.0,
    )
    do = tl.load(
        DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :],
        mask=m_ok[:, None] & d_ok,
        other=0.0,
    )
    lse = tl.load(LSE + bh * q_len + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + bh * q_len + offs_m, mask=m_ok, other=0.0)
    pos = offs_m + k_len - q_len
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_tiles(pid_m, q_len, k_len, window, BLOCK_M, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = _load_kv(
            K, V, b * skb + hk * skh, b * svb + hk * svh, skn, svn, offs_n, offs_d, k_len, d_ok
        )
        keep = (
            (offs_n[None, :] <= pos[:, None])
            & (offs_n[None, :] > pos[:, None] - window)
            & m_ok[:, None]
        )
        s = dot(q, tl.trans(k), FP32_DOT) * qk_scale
        p = tl.where(keep, tl.exp2(s - lse[:, None]), 0.0)
        ds = p * (dot(do, tl.trans(v), FP32_DOT) - delta[:, None])
        dq += dot(ds.to(k.dtype), k, FP32_DOT)
    tl.store(
        DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqm + offs_d[None, :],
        (dq * scale).to(DQ.dtype.element_ty),
        mask=m_ok[:, None] & d_ok,
    )


@triton.jit
def _one_query_scores(
    Q,
    K,
    b,
    h,
    hk,
    offs_d,
    sqb,
    sqh,
    skb,
    skh,
    skn,
    batch,
    k_len,
    window,
    head_dim,
    qk_scale,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """q [B, D], the keys' offsets and mask [B, N, D], and the scores [B, N] in base 2 (-inf
    off the window) of ``BLOCK_B`` batch rows of query head h."""
    offs_n = tl.maximum(k_len - window, 0) + tl.arange(0, BLOCK_N)
    b_ok, d_ok = b < batch, offs_d < head_dim
    q = tl.load(
        Q + b[:, None] * sqb + h * sqh + offs_d[None, :],
        mask=b_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    kv_ok = b_ok[:, None, None] & (offs_n < k_len)[None, :, None] & d_ok[None, None, :]
    k_at = b[:, None, None] * skb + hk * skh + offs_n[None, :, None] * skn + offs_d[None, None, :]
    k = tl.load(K + k_at, mask=kv_ok, other=0.0).to(tl.float32)
    s = tl.sum(q[:, None, :] * k, 2) * qk_scale
    s = tl.where((offs_n < k_len)[None, :], s, float("-inf"))
    return q, k, offs_n, kv_ok, s


@triton.jit
def _one_query_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    sqb,
    sqh,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sob,
    soh,
    heads,
    group,
    batch,
    k_len,
    window,
    head_dim,
    qk_scale,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    h = tl.program_id(1)
    hk = h // group
    offs_d = tl.arange(0, BLOCK_D)
    q, k, offs_n, kv_ok, s = _one_query_scores(
        Q,
        K,
        b,
        h,
        hk,
        offs_d,
        sqb,
        sqh,
        skb,
        skh,
        skn,
        batch,
        k_len,
        window,
        head_dim,
        qk_scale,
        BLOCK_B,
        BLOCK_N,
    )
    m = tl.max(s, 1)
    p = tl.exp2(s - m[:, None])
    total = tl.sum(p, 1)
    v_at = b[:, None, None] * svb + hk * svh + offs_n[None, :, None] * svn + offs_d[None, None, :]
    v = tl.load(V + v_at, mask=kv_ok, other=0.0).to(tl.float32)
    o = tl.sum(p[:, :, None] * v, 1) / total[:, None]
    b_ok = b < batch
    tl.store(
        O + b[:, None] * sob + h * soh + offs_d[None, :],
        o.to(O.dtype.element_ty),
        mask=b_ok[:, None] & (offs_d < head_dim)[None, :],
    )
    tl.store(LSE + b * heads + h, m + tl.log2(total), mask=b_ok)


@triton.jit
def _one_query_bwd_kernel(
    Q,
    K,
    V,
    O,
    DO,
    LSE,
    DQ,
    DK,
    DV,
    sqb,
    sqh,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sob,
    soh,
    sdb,
    sdh,
    heads,
    group,
    batch,
    k_len,
    window,
    head_dim,
    scale,
    qk_scale,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program: ``BLOCK_B`` batch rows of one KV head and its group of query heads; dK
    and dV sum over the group in registers (no atomics)."""
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    hk = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    b_ok, d_ok = b < batch, offs_d < head_dim
    row_ok = b_ok[:, None] & d_ok[None, :]
    # the window's keys, and their mask, as _one_query_scores makes them (a value defined
    # inside the loop is not visible after it, once compiled)
    offs_n = tl.maximum(k_len - window, 0) + tl.arange(0, BLOCK_N)
    kv_ok = b_ok[:, None, None] & (offs_n < k_len)[None, :, None] & d_ok[None, None, :]
    dk = tl.zeros([BLOCK_B, BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_B, BLOCK_N, BLOCK_D], tl.float32)
    for h in range(hk * group, hk * group + group):
        q, k, _, _, s = _one_query_scores(
            Q,
            K,
            b,
            h,
            hk,
            offs_d,
            sqb,
            sqh,
            skb,
            skh,
            skn,
            batch,
            k_len,
            window,
            head_dim,
            qk_scale,
            BLOCK_B,
            BLOCK_N,
        )
        p = tl.exp2(s - tl.load(LSE + b * heads + h, mask=b_ok, other=0.0)[:, None])
        v_at = (
            b[:, None, None] * svb + hk * svh + offs_n[None, :, None] * svn + offs_d[None, None, :]
        )
        v = tl.load(V + v_at, mask=kv_ok, other=0.0).to(tl.float32)
        do = tl.load(DO + b[:, None] * sdb + h * sdh + offs_d[None, :], mask=row_ok, other=0.0).to(
            tl.float32
        )
        o = tl.load(O + b[:, None] * sob + h * soh + offs_d[None, :], mask=row_ok, other=0.0).to(
            tl.float32
        )
        ds = p * (tl.sum(do[:, None, :] * v, 2) - tl.sum(do * o, 1)[:, None])
        dq = tl.sum(ds[:, :, None] * k, 1) * scale
        tl.store(
            DQ + (b[:, None] * heads + h) * head_dim + offs_d[None, :],
            dq.to(DQ.dtype.element_ty),
            mask=row_ok,
        )
        dk += ds[:, :, None] * q[:, None, :]
        dv += p[:, :, None] * do[:, None, :]
    kv_heads = heads // group
    out = ((b[:, None, None] * kv_heads + hk) * k_len + offs_n[None, :, None]) * head_dim + offs_d[
        None, None, :
    ]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_ok)


def _tiles(q_len: int, head_dim: int) -> dict:
    """Tile sizes: tl.dot needs >= 16; small tiles keep the interpreter fast."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_D=block_d)
    block_m = min(64, max(16, triton.next_power_of_2(q_len)))
    return dict(BLOCK_M=block_m, BLOCK_N=64 if head_dim <= 64 else 32, BLOCK_D=block_d, num_warps=4)


# CUDA allows 2^31 - 1 blocks on grid axis 0 but 65,535 on axes 1 and 2: the (batch, head)
# pairs go on axis 0, since a depth read has one query per token (125m: 393,216 pairs).
MAX_GRID_YZ = 65535


def _grids(batch: int, heads: int, kv_heads: int, q_len: int, k_len: int, tiles: dict) -> dict:
    """Launch grids: ``rows`` (forward, delta, dQ: one program per query tile and head) and
    ``keys`` (dK/dV: one per key tile and KV head)."""
    rows = (batch * heads, triton.cdiv(q_len, tiles["BLOCK_M"]))
    keys = (batch * kv_heads, triton.cdiv(k_len, tiles["BLOCK_N"]))
    if max(rows[1], keys[1]) > MAX_GRID_YZ:
        raise ValueError(
            f"window attention over {max(q_len, k_len)} positions needs more "
            f"than {MAX_GRID_YZ} tiles on grid axis 1"
        )
    return {"rows": rows, "keys": keys}


def _unit_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _strides(t: Tensor) -> tuple:
    return t.stride(0), t.stride(1), t.stride(2)


@kernel_op("window_attention")
def _window_attention(
    q: Tensor, k: Tensor, v: Tensor, window: int, scale: float, one_query: bool
) -> tuple[Tensor, Tensor]:
    """q [b, h, q_len, d], k/v [b, kv_heads, k_len, d] -> O [b, h, q_len, d] (q's layout) and
    its log-sum-exp (base 2, fp32) for the backward; ``one_query``: q_len = 1, by the
    one-query kernels."""
    q, k, v = (_unit_last(t) for t in (q, k, v))
    if one_query:
        return _one_query_forward(q, k, v, window, scale)
    batch, heads, q_len, head_dim = q.shape
    k_len = k.shape[2]
    o = torch.empty_like(q)  # keeps q's (possibly permuted) layout
    lse = torch.empty(batch, heads, q_len, device=q.device, dtype=torch.float32)
    if tracing(q):
        return o, lse
    tiles = _tiles(q_len, head_dim)
    grid = _grids(batch, heads, k.shape[1], q_len, k_len, tiles)["rows"]
    _fwd_kernel[grid](
        q,
        k,
        v,
        o,
        lse,
        *_strides(q),
        *_strides(k),
        *_strides(v),
        *_strides(o),
        heads,
        heads // k.shape[1],
        q_len,
        k_len,
        window,
        head_dim,
        scale * LOG2E,
        FP32_DOT=fp32_dot(q.dtype),
        **tiles,
    )
    return o, lse


@kernel_op("window_attention_backward")
def _window_attention_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    do: Tensor,
    window: int,
    scale: float,
    one_query: bool,
) -> list[Tensor]:
    q, k, v, do = (_unit_last(t) for t in (q, k, v, do))
    if one_query:
        return _one_query_backward(q, k, v, o, lse, do, window, scale)
    # The gradients in their inputs' layouts (the model's [s, b, heads, d] memory seen as
    # [b, heads, s, d]): what flows back (RoPE's backward, the QKV split's) then reads
    # and writes one layout, not a transposed one.
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    if tracing(q):
        return [dq, dk, dv]
    batch, heads, q_len, head_dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    tiles = _tiles(q_len, head_dim)
    delta = torch.empty_like(lse)
    grids = _grids(batch, heads, kv_heads, q_len, k_len, tiles)
    rows = grids["rows"]
    _delta_kernel[rows](
        o,
        do,
        delta,
        *_strides(o),
        *_strides(do),
        heads,
        q_len,
        head_dim,
        BLOCK_M=tiles["BLOCK_M"],
        BLOCK_D=tiles["BLOCK_D"],
    )
    inputs = (*_strides(q), *_strides(k), *_strides(v), *_strides(do))
    sizes = (heads, heads // kv_heads, q_len, k_len, window, head_dim, scale, scale * LOG2E)
    flags = dict(FP32_DOT=fp32_dot(q.dtype), **tiles)
    _dkdv_kernel[grids["keys"]](
        q, k, v, do, lse, delta, dk, dv, *inputs, *_strides(dk), *_strides(dv), *sizes, **flags
    )
    _dq_kernel[rows](q, k, v, do, lse, delta, dq, *inputs, *_strides(dq), *sizes, **flags)
    return [dq, dk, dv]


def _one_query_blocks(k_len: int, window: int, head_dim: int) -> dict:
    """Batch rows per program such that a [BLOCK_B, BLOCK_N, BLOCK_D] fp32 tile stays <= 2048
    elements (the backward holds four of them)."""
    block_n = triton.next_power_of_2(min(k_len, window))
    block_d = triton.next_power_of_2(head_dim)
    return dict(BLOCK_B=max(2, 2048 // (block_n * block_d)), BLOCK_N=block_n, BLOCK_D=block_d)


def _one_query_forward(
    q: Tensor, k: Tensor, v: Tensor, window: int, scale: float
) -> tuple[Tensor, Tensor]:
    """The forward for q_len = 1: q [b, h, 1, d], k/v [b, kv_heads, k_len, d]."""
    batch, heads, _, head_dim = q.shape
    k_len = k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty(batch, heads, device=q.device, dtype=torch.float32)
    if tracing(q):
        return o, lse
    blocks = _one_query_blocks(k_len, window, head_dim)
    _one_query_fwd_kernel[(triton.cdiv(batch, blocks["BLOCK_B"]), heads)](
        q,
        k,
        v,
        o,
        lse,
        q.stride(0),
        q.stride(1),
        *_strides(k),
        *_strides(v),
        o.stride(0),
        o.stride(1),
        heads,
        heads // k.shape[1],
        batch,
        k_len,
        window,
        head_dim,
        scale * LOG2E,
        **blocks,
    )
    return o, lse


def _one_query_backward(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, window: int, scale: float
) -> list[Tensor]:
    batch, heads, _, head_dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    # keys before the window get no gradient: zero them when there are any
    make = torch.zeros if k_len > window else torch.empty
    dk, dv = (make(t.shape, device=t.device, dtype=t.dtype) for t in (k, v))
    if tracing(q):
        return [dq, dk, dv]
    blocks = _one_query_blocks(k_len, window, head_dim)
    _one_query_bwd_kernel[(triton.cdiv(batch, blocks["BLOCK_B"]), kv_heads)](
        q,
        k,
        v,
        o,
        do,
        lse,
        dq,
        dk,
        dv,
        q.stride(0),
        q.stride(1),
        *_strides(k),
        *_strides(v),
        o.stride(0),
        o.stride(1),
        do.stride(0),
        do.stride(1),
        heads,
        heads // kv_heads,
        batch,
        k_len,
        window,
        head_dim,
        scale,
        scale * LOG2E,
        **blocks,
    )
    return [dq, dk, dv]


def _save_for_backward(ctx, inputs: tuple, output: tuple) -> None:
    q, k, v, ctx.window, ctx.scale, ctx.one_query = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.set_materialize_grads(False)  # the log-sum-exp has no gradient: no zeros to make


def _backward(ctx, do: Tensor, _d_lse: None) -> tuple:
    return (
        *_window_attention_backward(*ctx.saved_tensors, do, ctx.window, ctx.scale, ctx.one_query),
        None,
        None,
        None,
    )


_window_attention.register_autograd(_backward, setup_context=_save_for_backward)


def window_attention(
    q: Tensor, k: Tensor, v: Tensor, window: int, scale: float | None = None
) -> Tensor:
    """Triton ``short_window_attention`` (same arguments, same result)."""
    return _checked(q, k, v, window, scale, one_query=q.shape[2] == 1)


def tiled_window_attention(
    q: Tensor, k: Tensor, v: Tensor, window: int, scale: float | None = None
) -> Tensor:
    """``window_attention`` by the tiled kernels whatever q_len (the benchmark's peer of the
    one-query kernels)."""
    return _checked(q, k, v, window, scale, one_query=False)


def _checked(
    q: Tensor, k: Tensor, v: Tensor, window: int, scale: float | None, one_query: bool
) -> Tensor:
    if window < 1:
        raise ValueError(f"window={window}: must be >= 1")
    if q.shape[2] > k.shape[2]:
        raise ValueError("window attention needs q_len <= k_len (queries end-aligned)")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]}")
    if scale is None:
        scale = 1 / math.sqrt(q.shape[-1])
    return _window_attention(q, k, v, window, scale, one_query)[0]
