"""Math several designs share, written once for the trainer and the exported modeling file
(a ``functional`` module: torch only, see ``t2train/nn/functional.py``).

Causal short-window attention is the one operator behind sequence ShortSWA and depth reads
(Residual Stream Duality, arXiv 2603.16039, Sec. 2.2): a causal depth-wise attention read
over a token's last K layer states is causal sliding-window attention over the last K
positions, applied on the depth axis instead of the token axis. ``short_window_attention``
is the exact reference the fused kernels must match.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from t2train.nn.functional import at_least_fp32


def window_mask(q_len: int, k_len: int, window: int, device=None) -> Tensor:
    """Boolean [q_len, k_len] mask, True where attention is allowed.

    Queries are aligned to the end of the keys: query i sits at position
    ``k_len - q_len + i`` and sees keys j with ``pos - window < j <= pos``.
    """
    pos = torch.arange(k_len - q_len, k_len, device=device).unsqueeze(1)
    keys = torch.arange(k_len, device=device).unsqueeze(0)
    return (keys <= pos) & (keys > pos - window)


def short_window_attention(
    q: Tensor, k: Tensor, v: Tensor, window: int, scale: float | None = None
) -> Tensor:
    """softmax(q k^T * scale + band mask) v over the last ``window`` positions.

    q: [batch, heads, q_len, d]; k, v: [batch, kv_heads, k_len, d] (grouped-query heads
    allowed). ``window >= k_len`` is full causal attention.
    """
    if window < 1:
        raise ValueError(f"window={window}: must be >= 1")
    if q.shape[-2] == 1:
        return _single_query_attention(q, k, v, window, scale)
    mask = window_mask(q.shape[-2], k.shape[-2], window, device=q.device)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def _single_query_attention(
    q: Tensor, k: Tensor, v: Tensor, window: int, scale: float | None
) -> Tensor:
    """One query per (batch, head) (a depth read): a softmax-weighted sum of the last
    ``window`` keys' values, elementwise. As attention it is a [1, d] x [d, n] matmul per
    (token, head), which the CPU runs one by one; scores and weights in fp32."""
    k, v = k[..., -window:, :], v[..., -window:, :]
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (at_least_fp32(q) * at_least_fp32(k)).sum(
        -1, keepdim=True
    ) * scale  # [batch, heads, n, 1]
    weights = torch.softmax(scores, dim=-2).to(v.dtype)
    return (weights * v).sum(-2, keepdim=True)


def mean_of_streams(state: Tensor) -> Tensor:
    """The mean of n streams [n, ...] (what the final norm reads of hc and mhc), summed in
    (at least) fp32."""
    return at_least_fp32(state).mean(0).to(state.dtype)
