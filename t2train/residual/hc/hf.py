"""``hc`` for the Hugging Face export: Hyper-Connections, n streams joined per sublayer
(arXiv 2409.19606), on [n, batch, seq, hidden] states.

An export part (``t2train/residual/hf.py`` says how it is assembled); its parameters are
named as in ``layers.py``, its math is ``functional.py``'s.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from t2train.nn.functional import rms_normalize
from t2train.residual.functional import mean_of_streams
from t2train.residual.hc.functional import (
    connection_weights,
    depth_write,
    folded_projections,
    width_read,
)
from t2train.residual.hf_modeling import Stream, T2TrainConfig


class StreamCopies(Stream):
    """n streams [n, b, s, h]: the embedding enters as n copies, the final norm reads their
    mean."""

    def __init__(self, config: T2TrainConfig):
        super().__init__()
        self.n = config.residual_options["expansion_rate"]

    def enter(self, embedding: Tensor) -> Tensor:
        return embedding.unsqueeze(0).expand(self.n, *embedding.shape)

    def exit(self, state: Tensor) -> Tensor:
        return mean_of_streams(state)


class HyperConnection(nn.Module):
    """Hyper-Connections: [A_m | A_r] and B from ``connection_weights``; the sublayer reads
    A_m^T H (``width_read``) and stream j becomes sum_i A_r[i, j] h_i + B_j out
    (``depth_write``). The weights of a sublayer are computed once by ``read``."""

    def __init__(self, config: T2TrainConfig, layer: int, position: int):
        super().__init__()
        options, h = config.residual_options, config.hidden_size
        n, self.dynamic = options["expansion_rate"], options["dynamic"]
        self.static_alpha = nn.Parameter(torch.zeros(n, n + 1))
        self.static_beta = nn.Parameter(torch.ones(n))
        if self.dynamic:
            self.norm = nn.RMSNorm(h, eps=config.rms_norm_eps)
            self.dynamic_alpha = nn.Parameter(torch.zeros(h, n + 1))
            self.dynamic_beta = nn.Parameter(torch.zeros(h))
            self.dynamic_alpha_scale = nn.Parameter(torch.ones(1))
            self.dynamic_beta_scale = nn.Parameter(torch.ones(1))
        self.eps = config.rms_norm_eps
        self.pending: Optional[tuple] = None

    def weights(self, state: Tensor) -> tuple[Tensor, Tensor]:
        tokens = state.shape[1:-1]
        if not self.dynamic:
            return connection_weights(self.static_alpha, self.static_beta, tokens)
        folded = folded_projections(self.dynamic_alpha, self.dynamic_beta, self.norm.weight)
        logits = rms_normalize(state, self.eps) @ folded.T
        scales = (self.dynamic_alpha_scale, self.dynamic_beta_scale)
        return connection_weights(self.static_alpha, self.static_beta, tokens, logits, *scales)

    def read(self, state: Tensor) -> Tensor:
        alpha, beta = self.weights(state)
        self.pending = (alpha[..., 1:], beta)
        return width_read(state, alpha[..., 0])

    def write(self, state: Tensor, x: Tensor, normed: Tensor, out: Tensor) -> Tensor:
        assert self.pending is not None, "write without its read"
        (residual, beta), self.pending = self.pending, None
        return depth_write(state, residual, beta, out)


# model.residual -> (stream, sublayer residual, layer entry or None)
EXPORTED = {"hc": (StreamCopies, HyperConnection, None)}
