"""The math of `mhc` (Manifold-constrained Hyper-Connections, arXiv 2512.24880), written
once for the trainer and the exported modeling file (a ``functional`` module: torch only).
n streams [n, ..., h]; the token dims ``...`` are [s, b] in training, [b, s] in the export.
"""

from __future__ import annotations

import torch
from torch import Tensor

from t2train.nn.functional import at_least_fp32


def flat_rms_projection(state: Tensor, projection: Tensor, eps: float) -> Tensor:
    """RMSNorm(vec x) phi^T [..., outputs] in fp32: the n streams of a token flattened
    (stream after stream) and normalised over all n h, weight-free; projection
    [outputs, n h]. In fp32 under autocast too (its einsum would run in bf16 there).

    Compiled, the products summed over the n h values of a token: one reduction the compiler
    fuses with the mean of squares into a pass reading the streams once (an einsum is a GEMM
    on an fp32 copy of the streams written for it); eagerly, where the products would be
    materialised, the einsum."""
    with torch.autocast(state.device.type, enabled=False):
        x = at_least_fp32(state)
        n, h = x.shape[0], x.shape[-1]
        inv_rms = torch.rsqrt(x.pow(2).mean((0, -1)) + eps)
        phi = at_least_fp32(projection).view(-1, n, h)
        if torch.compiler.is_compiling():
            products = x.movedim(0, -2).unsqueeze(-3) * phi  # [..., outputs, n, h]
            return products.sum((-2, -1)) * inv_rms.unsqueeze(-1)
        return torch.einsum("j...h,kjh->...k", x, phi) * inv_rms.unsqueeze(-1)


def mapping_logits(
    raw: Tensor, gates: Tensor, bias: Tensor, n: int
) -> tuple[Tensor, Tensor, Tensor]:
    """H~pre [..., n], H~post [..., n], H~res [..., n, n] (Eq. 7): alpha raw + b per
    mapping, from the normed projection ``raw`` [..., n^2 + 2n] (row-major H~res)."""
    gates, bias = at_least_fp32(gates), at_least_fp32(bias)
    pre = gates[0] * raw[..., :n] + bias[:n]
    post = gates[1] * raw[..., n : 2 * n] + bias[n : 2 * n]
    res = (gates[2] * raw[..., 2 * n :] + bias[2 * n :]).unflatten(-1, (n, n))
    return pre, post, res


def sinkhorn(logits: Tensor, iterations: int) -> Tensor:
    """Sinkhorn-Knopp on [..., n, n] logits (Eq. 9): exp, then ``iterations`` times columns,
    then rows, divided by their sums."""
    m = torch.exp(logits - logits.amax((-2, -1), keepdim=True))
    for _ in range(iterations):
        m = m / m.sum(-2, keepdim=True)
        m = m / m.sum(-1, keepdim=True)
    return m


def write_mappings(post_logit: Tensor, res_logit: Tensor, iterations: int) -> tuple:
    """H_post = 2 sigmoid(H~post) [..., n] and H_res = SK(H~res) [..., n, n] (Eq. 8-9)."""
    return 2 * torch.sigmoid(post_logit), sinkhorn(res_logit, iterations)


def stream_read(state: Tensor, pre_logit: Tensor) -> Tensor:
    """The sublayer's input sum_j sigmoid(pre_logit[..., j]) x_j.

    state [n, ..., h]; pre_logit [..., n]. Computed in (at least) fp32, returned in the
    state's dtype.
    """
    x = at_least_fp32(state)
    weights = torch.sigmoid(pre_logit.to(x.dtype))
    return torch.einsum("...j,j...h->...h", weights, x).to(state.dtype)


def stream_write(
    state: Tensor, out: Tensor, post_logit: Tensor, res_logit: Tensor, iterations: int
) -> Tensor:
    """Stream i <- sum_j SK(res_logit)[i, j] x_j + 2 sigmoid(post_logit[i]) out.

    state [n, ..., h]; out [..., h]; post_logit [..., n]; res_logit [..., n, n].
    """
    x = at_least_fp32(state)
    post, mixing = write_mappings(post_logit.to(x.dtype), res_logit.to(x.dtype), iterations)
    y = torch.einsum("...ij,j...h->i...h", mixing, x) + torch.einsum(
        "...i,...h->i...h", post, at_least_fp32(out)
    )
    return y.to(state.dtype)
