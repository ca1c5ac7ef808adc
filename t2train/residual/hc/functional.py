"""The math of `hc` (Hyper-Connections, arXiv 2409.19606), written once for the trainer and
the exported modeling file (a ``functional`` module: torch only). n streams [n, ..., h];
the token dims ``...`` are [s, b] in training, [b, s] in the export.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from t2train.nn.functional import at_least_fp32


def width_read(state: Tensor, weights: Tensor) -> Tensor:
    """x = sum_i weights[..., i] h_i; state [n, ..., h], weights [..., n]."""
    x = at_least_fp32(state)
    return torch.einsum("...i,i...h->...h", weights.to(x.dtype), x).to(state.dtype)


def depth_write(state: Tensor, residual: Tensor, beta: Tensor, out: Tensor) -> Tensor:
    """h'_j = sum_i residual[..., i, j] h_i + beta[..., j] out; residual [..., n, n]."""
    x = at_least_fp32(state)
    mixed = torch.einsum("...ij,i...h->j...h", residual.to(x.dtype), x)
    return (mixed + torch.einsum("...j,...h->j...h", beta.to(x.dtype), at_least_fp32(out))).to(
        state.dtype
    )


def folded_projections(dynamic_alpha: Tensor, dynamic_beta: Tensor, norm_weight: Tensor) -> Tensor:
    """[W_a | W_b]^T [n + 2, h] with the stream norm's weight g folded in, in fp32:
    Norm(h) W = RMSNorm_weight-free(h) (g W), so the normed streams need not be written."""
    projections = torch.cat([dynamic_alpha.t(), dynamic_beta[None]])
    return at_least_fp32(projections) * at_least_fp32(norm_weight)


def connection_weights(
    static_alpha: Tensor,
    static_beta: Tensor,
    tokens: torch.Size,
    logits: Optional[Tensor] = None,
    alpha_scale: Optional[Tensor] = None,
    beta_scale: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """alpha [..., n, n + 1] (A_m, then A_r; row i from stream i) and beta [..., n] over the
    token dims ``tokens``: the static weights, plus (dynamic) s_a tanh(logits[..., :n + 1])
    and s_b tanh(logits[..., n + 1]), logits [n, ..., n + 2] the stream-normed projections
    (``folded_projections``) of each stream, in fp32."""
    n = static_beta.shape[0]
    alpha = at_least_fp32(static_alpha).expand(*tokens, n, n + 1)
    beta = at_least_fp32(static_beta).expand(*tokens, n)
    if logits is None:
        return alpha, beta
    assert alpha_scale is not None and beta_scale is not None
    alpha = alpha + at_least_fp32(alpha_scale) * torch.tanh(logits[..., : n + 1]).movedim(0, -2)
    beta = beta + at_least_fp32(beta_scale) * torch.tanh(logits[..., n + 1]).movedim(0, -1)
    return alpha, beta
