"""``mhc`` for the Hugging Face export: Manifold-constrained Hyper-Connections
(arXiv 2512.24880), on [n, batch, seq, hidden] states (the streams of ``hc/hf.py``).

An export part (``t2train/residual/hf.py`` says how it is assembled); its parameters are
named as in ``layers.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from t2train.residual.hc.hf import StreamCopies, StreamMixResidual
from t2train.residual.hf_modeling import T2TrainConfig, at_least_fp32


def sinkhorn(logits: Tensor, iterations: int) -> Tensor:
    """exp, then ``iterations`` times: divide each column, then each row, by its sum."""
    m = torch.exp(logits - logits.amax((-2, -1), keepdim=True))
    for _ in range(iterations):
        m = m / m.sum(-2, keepdim=True)
        m = m / m.sum(-1, keepdim=True)
    return m


class ManifoldHyperConnection(StreamMixResidual):
    """mHC: from the flattened stream x~' = RMSNorm(vec(H)) (no weight), H_pre =
    sigmoid(a_pre x~' phi_pre + b_pre), H_post = 2 sigmoid(a_post x~' phi_post + b_post),
    H_res = Sinkhorn(a_res x~' phi_res + b_res); the sublayer reads sum_j H_pre[j] h_j and
    stream i becomes sum_j H_res[i, j] h_j + H_post[i] out."""

    def __init__(self, config: T2TrainConfig, layer: int, position: int):
        super().__init__()
        options, h = config.residual_options, config.hidden_size
        n = self.n = options["expansion_rate"]
        self.eps, self.iterations = options["eps"], options["sinkhorn_iterations"]
        outputs = n * n + 2 * n  # H~pre, H~post, H~res (row-major)
        self.projection = nn.Parameter(torch.zeros(outputs, n * h))
        self.bias = nn.Parameter(torch.zeros(outputs))
        self.gates = nn.Parameter(torch.zeros(3))

    def weights(self, state: Tensor) -> tuple[Tensor, tuple]:
        n = self.n
        x = at_least_fp32(state)
        inv_rms = torch.rsqrt(x.pow(2).mean((0, 3)) + self.eps)  # over all n x h: [b, s]
        phi = at_least_fp32(self.projection).view(-1, n, x.shape[-1])
        raw = torch.einsum("jbsh,kjh->bsk", x, phi) * inv_rms.unsqueeze(-1)
        gates, bias = at_least_fp32(self.gates), at_least_fp32(self.bias)
        pre = torch.sigmoid(gates[0] * raw[..., :n] + bias[:n])
        post = 2 * torch.sigmoid(gates[1] * raw[..., n : 2 * n] + bias[n : 2 * n])
        res = sinkhorn(
            (gates[2] * raw[..., 2 * n :] + bias[2 * n :]).unflatten(-1, (n, n)), self.iterations
        )
        # ``write`` mixes with [i, j] -> stream j; H_res is [new i, old j]: transpose
        return pre, (res.transpose(-1, -2), post)


# model.residual -> (stream, sublayer residual, layer entry or None)
EXPORTED = {"mhc": (StreamCopies, ManifoldHyperConnection, None)}
