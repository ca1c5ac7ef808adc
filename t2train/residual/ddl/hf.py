"""``ddl`` for the Hugging Face export: Deep Delta Learning, X <- X + beta k (v^T - k^T X)
(arXiv 2601.00417), on [batch, seq, hidden].

An export part (``t2train/residual/hf.py`` says how it is assembled); its parameters are
named as in ``layers.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from t2train.residual.hf_modeling import T2TrainConfig, at_least_fp32


class ChannelMixRead(nn.Module):
    """x[..., i] = sum_j weight[j, i] X_j[..., i]: reads a [d_v, b, s, h] state."""

    def __init__(self, hidden: int, dv: int):
        super().__init__()
        self.weight = nn.Parameter(torch.full((dv, hidden), 1.0 / dv))

    def forward(self, state: Tensor) -> Tensor:
        return torch.einsum("jbsh,jh->bsh", state, self.weight)


class DeltaStream(nn.Module):
    """d_v = 1: the state is [b, s, h]. d_v > 1: [d_v, b, s, h], made from the embedding by a
    causal depthwise convolution over tokens (``expander``) and read by a channel mix."""

    def __init__(self, config: T2TrainConfig):
        super().__init__()
        h, self.dv = config.hidden_size, config.residual_options.get("dv", 1)
        if self.dv > 1:
            kernel = config.residual_options["embed_conv_kernel"]
            self.expander = nn.Conv1d(h, h * self.dv, kernel, groups=h, bias=False)
            self.final_read = ChannelMixRead(h, self.dv)

    def enter(self, embedding: Tensor) -> Tensor:
        if self.dv == 1:
            return embedding
        b, s, h = embedding.shape
        tokens = F.pad(embedding.transpose(1, 2), (self.expander.kernel_size[0] - 1, 0))
        # output channel i * d_v + j is column j of feature i
        return self.expander(tokens).view(b, h, self.dv, s).permute(2, 0, 3, 1)

    def exit(self, state: Tensor) -> Tensor:
        return state if self.dv == 1 else self.final_read(state)


class DeltaResidual(nn.Module):
    """k = out / sqrt(|out|^2 + k_eps^2), beta = 2 sigmoid(w_beta . normed + b_beta),
    v = v_scale sigmoid(W_v x + b_v), then X <- X + beta k (v^T - k^T X) column by column;
    computed in (at least) fp32."""

    def __init__(self, config: T2TrainConfig, layer: int, position: int):
        super().__init__()
        options, h = config.residual_options, config.hidden_size
        self.dv = options.get("dv", 1)
        self.k_eps, self.v_scale = options["k_eps"], options["v_scale"]
        self.beta_proj = nn.Linear(h, 1)
        self.v_proj = nn.Linear(h, self.dv)
        self.compressor = ChannelMixRead(h, self.dv) if self.dv > 1 else None

    def read(self, state: Tensor) -> Tensor:
        return state if self.compressor is None else self.compressor(state)

    def write(self, state: Tensor, x: Tensor, normed: Tensor, out: Tensor) -> Tensor:
        k = at_least_fp32(out)
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + self.k_eps * self.k_eps)
        beta = 2 * torch.sigmoid(at_least_fp32(self.beta_proj(normed)))
        v = self.v_scale * torch.sigmoid(at_least_fp32(self.v_proj(x)))
        if self.dv > 1:
            v = v.permute(2, 0, 1).unsqueeze(-1)  # one value per state column
        current = at_least_fp32(state)
        error = v - (k * current).sum(-1, keepdim=True)
        return (current + beta * error * k).to(state.dtype)


# model.residual -> (stream, sublayer residual, layer entry or None)
EXPORTED = {"ddl": (DeltaStream, DeltaResidual, None)}
