"""The math of `ddl` (Deep Delta Learning, arXiv 2601.00417), written once for the trainer
and the exported modeling file (a ``functional`` module: torch only). Leading dims are any
token layout: [s, b] in training, [b, s] in the export.
"""

from __future__ import annotations

import torch
from torch import Tensor

from t2train.nn.functional import at_least_fp32


def normalized_direction(k: Tensor, eps: float) -> Tensor:
    """k / sqrt(|k|^2 + eps^2): unit length for |k| >> eps, smooth at 0."""
    k = at_least_fp32(k)
    return k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + eps * eps)


def delta_update(state: Tensor, k: Tensor, beta: Tensor, v: Tensor) -> Tensor:
    """X + beta k (v^T - k^T X), column by column.

    state [..., h] or [d_v, ..., h]; k [..., h]; beta [..., 1]; v [..., 1] or
    [d_v, ..., 1]. Computed in (at least) fp32, returned in the state's dtype.
    """
    x = at_least_fp32(state)
    error = v - (k * x).sum(-1, keepdim=True)
    return (x + beta * error * k).to(state.dtype)


def delta_write(
    state: Tensor, out: Tensor, beta_logit: Tensor, v_logit: Tensor, k_eps: float, v_scale: float
) -> Tensor:
    """The sublayer write: k = normalized_direction(out), beta = 2 sigmoid(beta_logit),
    v = v_scale sigmoid(v_logit) (logits in fp32), then ``delta_update``.

    out [..., h]; beta_logit [..., 1]; v_logit [..., d_v] (column j of a [d_v, ..., h]
    state gets v[..., j]).
    """
    k = normalized_direction(out, k_eps)
    beta = 2 * torch.sigmoid(at_least_fp32(beta_logit))
    v = v_scale * torch.sigmoid(at_least_fp32(v_logit))
    if state.dim() == out.dim() + 1:
        v = v.movedim(-1, 0).unsqueeze(-1)  # one value per state column
    return delta_update(state, k, beta, v)


def channel_mix(state: Tensor, weight: Tensor) -> Tensor:
    """The folded CC compressor: x[..., i] = sum_j weight[j, i] X_j[..., i]; state
    [d_v, ..., h], weight [d_v, h]."""
    return torch.einsum("j...h,jh->...h", state, weight)
