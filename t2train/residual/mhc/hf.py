"""``mhc`` for the Hugging Face export: Manifold-constrained Hyper-Connections
(arXiv 2512.24880), on [n, batch, seq, hidden] states (the streams of ``hc/hf.py``).

An export part (``t2train/residual/hf.py`` says how it is assembled); its parameters are
named as in ``layers.py``, its math is ``functional.py``'s.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from t2train.residual.hc.hf import StreamCopies
from t2train.residual.hf_modeling import T2TrainConfig
from t2train.residual.mhc.functional import (
    flat_rms_projection,
    mapping_logits,
    stream_read,
    stream_write,
)


class ManifoldHyperConnection(nn.Module):
    """mHC: H~pre, H~post, H~res from the flattened, normed streams (``mapping_logits``);
    the sublayer reads sum_j sigmoid(H~pre[j]) h_j (``stream_read``) and stream i becomes
    sum_j Sinkhorn(H~res)[i, j] h_j + 2 sigmoid(H~post[i]) out (``stream_write``)."""

    def __init__(self, config: T2TrainConfig, layer: int, position: int):
        super().__init__()
        options, h = config.residual_options, config.hidden_size
        n = self.n = options["expansion_rate"]
        self.eps, self.iterations = options["eps"], options["sinkhorn_iterations"]
        outputs = n * n + 2 * n  # H~pre, H~post, H~res (row-major)
        self.projection = nn.Parameter(torch.zeros(outputs, n * h))
        self.bias = nn.Parameter(torch.zeros(outputs))
        self.gates = nn.Parameter(torch.zeros(3))
        self.pending: Optional[tuple] = None

    def read(self, state: Tensor) -> Tensor:
        raw = flat_rms_projection(state, self.projection, self.eps)
        pre, post, res = mapping_logits(raw, self.gates, self.bias, self.n)
        self.pending = (post, res)
        return stream_read(state, pre)

    def write(self, state: Tensor, x: Tensor, normed: Tensor, out: Tensor) -> Tensor:
        assert self.pending is not None, "write without its read"
        (post, res), self.pending = self.pending, None
        return stream_write(state, out, post, res, self.iterations)


# model.residual -> (stream, sublayer residual, layer entry or None)
EXPORTED = {"mhc": (StreamCopies, ManifoldHyperConnection, None)}
