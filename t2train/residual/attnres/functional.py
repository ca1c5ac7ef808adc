"""The math of Attention Residuals (Full and Block, arXiv 2603.15031), written once for the
trainer and the exported modeling file (a ``functional`` module: torch only). Sources come
as stacks [k, ..., h] of k sources each; the token dims ``...`` are [s, b] in training,
[b, s] in the export.
"""

from __future__ import annotations

import torch
from torch import Tensor

from t2train.nn.functional import at_least_fp32


def _inverse_rms(x: Tensor, eps: float) -> Tensor:
    return torch.rsqrt(x.pow(2).mean(-1) + eps)


def _logits(queries: Tensor, stacks: list[Tensor], eps: float) -> Tensor:
    """z [N, S, ...]: each query [S, h] against each RMS-normalised source (the N rows of the
    stacks [k, ..., h]). The RMSNorm is weight-free, so query . RMSNorm(v) =
    (query . v) rsqrt(mean(v^2) + eps) and the normalised keys are never materialised."""
    return torch.cat(
        [(x @ queries.T).movedim(-1, 1) * _inverse_rms(x, eps).unsqueeze(1) for x in stacks]
    )


def _mixtures(queries: Tensor, stacks: list[Tensor], eps: float) -> tuple[list[Tensor], Tensor]:
    """Each query's softmax mixture of the sources and the logits z, in fp32 whatever the
    inputs' dtype or autocast.

    The sources come as stacks [k, ..., h] (the trainer: the earlier layers' sources in one
    buffer, then this layer's own; the export: one source each), summed stack by stack with
    one multiply-add per stack, so nothing is stacked per read."""
    xs = [at_least_fp32(x) for x in stacks]
    z = _logits(queries.to(xs[0].dtype), xs, eps)
    weights = torch.softmax(z, dim=0).unsqueeze(-1)  # [N, S, ..., 1]
    outs = []
    for query_weights in weights.unbind(1):
        parts = query_weights.split([x.shape[0] for x in xs])
        out = (parts[0] * xs[0]).sum(0)
        for weight, x in zip(parts[1:], xs[1:]):
            out = out + (weight * x).sum(0)
        outs.append(out)
    return outs, z


def depth_mix(query: Tensor, stacks: list[Tensor], eps: float) -> Tensor:
    """sum_i softmax_i(query . RMSNorm(v_i)) v_i over the sources (the rows of the stacks,
    each [k, ..., h]).

    Logits, softmax and sum in fp32 whatever the inputs' dtype or autocast."""
    with torch.autocast(stacks[0].device.type, enabled=False):
        [out], _ = _mixtures(query[None], stacks, eps)
        return out.to(stacks[0].dtype)


def mixing_weights(query: Tensor, stacks: list[Tensor], eps: float) -> Tensor:
    """The softmax weights of ``depth_mix`` [n_sources, ...] (for diagnostics)."""
    with torch.autocast(stacks[0].device.type, enabled=False):
        z = _logits(query[None].float(), [x.float() for x in stacks], eps)
        return torch.softmax(z, dim=0)[:, 0]


def block_phase_1(
    queries: Tensor, stacks: list[Tensor], eps: float, rounded: bool = False
) -> tuple[Tensor, Tensor]:
    """Phase 1 of Block AttnRes (arXiv 2603.15031 Sec. 4.2): S pseudo-queries [S, h] over the
    N completed sources (the rows of the stacks, each [k, ..., h]) at once, one read of the
    sources. O [S, ..., h] is each query's mixture of the sources, LSE [S, ...] its
    logsumexp (both fp32; ``rounded``: O in the sources' dtype, as a layer keeps it)."""
    with torch.autocast(stacks[0].device.type, enabled=False):
        outs, z = _mixtures(queries, stacks, eps)
        out = torch.stack(outs)
        return out.to(stacks[0].dtype) if rounded else out, _logsumexp(z)


def _logsumexp(z: Tensor) -> Tensor:
    """``torch.logsumexp(z, 0)``, written out: torch's asks whether ``z`` is empty, which a
    compiled layer cannot answer for a dynamic count of sources (a graph break)."""
    top = z.amax(0)
    return top + (z - top).exp().sum(0).log()


def block_phase_2(partial: Tensor, query: Tensor, out: Tensor, lse: Tensor, eps: float) -> Tensor:
    """Phase 2: merge one query's phase-1 result with the block's partial sum p, the online
    softmax (e^LSE O + e^z_p p) / (e^LSE + e^z_p), in fp32; returned in p's dtype."""
    with torch.autocast(partial.device.type, enabled=False):
        p = at_least_fp32(partial)
        gamma = torch.sigmoid((p @ query.to(p.dtype)) * _inverse_rms(p, eps) - lse)
        return (out + gamma.unsqueeze(-1) * (p - out)).to(partial.dtype)
