"""Causal short-window attention as the training modules run it: through the Triton kernel
where ``T2_KERNELS`` routes it, and its diagnostics. Both `shortswa` (over tokens) and
`depth_attn` (over the depth axis of a state stack) call ``attend_window``; the reference,
``short_window_attention``, is in ``t2train/residual/functional.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from t2train.kernels.dispatch import Kernel, route
from t2train.residual.functional import short_window_attention, window_mask


def attend_window(
    q: Tensor, k: Tensor, v: Tensor, window: int, scale: float | None = None
) -> Tensor:
    """``short_window_attention``, through the Triton kernel where ``T2_KERNELS`` routes it."""
    return route(WINDOW_ATTENTION, q, k, v)(q, k, v, window, scale)


WINDOW_ATTENTION = Kernel(
    "window_attention", "t2train.kernels.window_attention:window_attention", short_window_attention
)


def window_attention_probs(q: Tensor, k: Tensor, window: int, scale: float | None = None) -> Tensor:
    """The weights ``short_window_attention`` applies, [batch, heads, q_len, k_len], in fp32.

    Materialises the scores, so it is for diagnostics on small slices, not for training.
    """
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    mask = window_mask(q.shape[-2], k.shape[-2], window, device=q.device)
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)


def window_attention_entropy(
    q: Tensor, k: Tensor, window: int, scale: float | None = None, queries: int = 128
) -> Tensor:
    """Mean entropy (nats) of the attention weights of the last ``queries`` queries.

    Only the keys those queries can see are scored, so the cost is queries x (queries +
    window) per head. Uniform weights over w keys give log(w).
    """
    q = q[..., -queries:, :]
    k = k[..., -(q.shape[-2] + window - 1) :, :]
    probs = window_attention_probs(q, k, window, scale)
    return -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1).mean()
