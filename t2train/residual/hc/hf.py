"""``hc`` for the Hugging Face export: Hyper-Connections, n streams joined per sublayer
(arXiv 2409.19606), on [n, batch, seq, hidden] states.

An export part (``t2train/residual/hf.py`` says how it is assembled); its parameters are
named as in ``layers.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from t2train.residual.hf_modeling import T2TrainConfig, at_least_fp32


class StreamCopies(nn.Module):
    """n streams [n, b, s, h]: the embedding enters as n copies, the final norm reads their
    mean."""

    def __init__(self, config: T2TrainConfig):
        super().__init__()
        self.n = config.residual_options["expansion_rate"]

    def enter(self, embedding: Tensor) -> Tensor:
        return embedding.unsqueeze(0).expand(self.n, *embedding.shape)

    def exit(self, state: Tensor) -> Tensor:
        return at_least_fp32(state).mean(0).to(state.dtype)


class StreamMixResidual(nn.Module):
    """Reads sum_i read[i] h_i; writes stream j <- sum_i mix[i, j] h_i + write[j] out. The
    weights of a sublayer are computed once by ``read`` and used by ``write``."""

    def __init__(self):
        super().__init__()
        self.pending = None

    def weights(self, state: Tensor) -> tuple[Tensor, tuple]:
        """The read weights, and the (mix, write) weights kept for ``write``."""
        raise NotImplementedError

    def read(self, state: Tensor) -> Tensor:
        read, self.pending = self.weights(state)
        x = at_least_fp32(state)
        return torch.einsum("bsi,ibsh->bsh", read.to(x.dtype), x).to(state.dtype)

    def write(self, state: Tensor, x: Tensor, normed: Tensor, out: Tensor) -> Tensor:
        mix, write = self.pending
        self.pending = None
        current = at_least_fp32(state)
        new = torch.einsum("bsij,ibsh->jbsh", mix.to(current.dtype), current) + torch.einsum(
            "bsj,bsh->jbsh", write.to(current.dtype), at_least_fp32(out)
        )
        return new.to(state.dtype)


class HyperConnection(StreamMixResidual):
    """Hyper-Connections: [A_m | A_r] = static_alpha (+ s_a tanh(Norm(h_i) W_a), row i from
    stream i, when dynamic), B = static_beta (+ s_b tanh(Norm(h_i) W_b)); the sublayer reads
    A_m^T H and stream j becomes sum_i A_r[i, j] h_i + B_j out."""

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

    def weights(self, state: Tensor) -> tuple[Tensor, tuple]:
        n, b, s, _ = state.shape
        alpha = at_least_fp32(self.static_alpha).expand(b, s, n, n + 1)
        beta = at_least_fp32(self.static_beta).expand(b, s, n)
        if self.dynamic:
            normed = at_least_fp32(self.norm(state))  # each stream on its own
            alpha = alpha + at_least_fp32(self.dynamic_alpha_scale) * torch.tanh(
                normed @ at_least_fp32(self.dynamic_alpha)
            ).permute(1, 2, 0, 3)
            beta = beta + at_least_fp32(self.dynamic_beta_scale) * torch.tanh(
                normed @ at_least_fp32(self.dynamic_beta)
            ).permute(1, 2, 0)
        return alpha[..., 0], (alpha[..., 1:], beta)


# model.residual -> (stream, sublayer residual, layer entry or None)
EXPORTED = {"hc": (StreamCopies, HyperConnection, None)}
