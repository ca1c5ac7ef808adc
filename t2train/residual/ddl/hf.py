"""``ddl`` for the Hugging Face export: Deep Delta Learning, X <- X + beta k (v^T - k^T X)
(arXiv 2601.00417), on [batch, seq, hidden].

An export part (``t2train/residual/hf.py`` says how it is assembled); its parameters are
named as in ``layers.py``, its math is ``functional.py``'s.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from t2train.residual.ddl.functional import channel_mix, delta_write
from t2train.residual.hf_modeling import Stream, T2TrainConfig


class ChannelMixRead(nn.Module):
    """x[..., i] = sum_j weight[j, i] X_j[..., i]: reads a [d_v, b, s, h] state."""

    def __init__(self, hidden: int, dv: int):
        super().__init__()
        self.weight = nn.Parameter(torch.full((dv, hidden), 1.0 / dv))

    def forward(self, state: Tensor) -> Tensor:
        return channel_mix(state, self.weight)


class DeltaStream(Stream):
    """d_v = 1: the state is [b, s, h]. d_v > 1: [d_v, b, s, h], made from the embedding by a
    causal depthwise convolution over tokens (``expander``, reading the kernel's size - 1
    tokens before each) and read by a channel mix."""

    def __init__(self, config: T2TrainConfig):
        super().__init__()
        h, self.dv = config.hidden_size, config.residual_options.get("dv", 1)
        if self.dv > 1:
            kernel = config.residual_options["embed_conv_kernel"]
            self.expander = nn.Conv1d(h, h * self.dv, kernel, groups=h, bias=False)
            self.final_read = ChannelMixRead(h, self.dv)
            self.entry_context = kernel - 1

    def enter(self, embedding: Tensor, earlier: Optional[Tensor] = None) -> Tensor:
        if self.dv == 1:
            return embedding
        b, s, h = embedding.shape
        joined = embedding if earlier is None else torch.cat([earlier, embedding], dim=1)
        before = joined.shape[1] - s  # zeros stand for the tokens before the sequence
        tokens = F.pad(joined.transpose(1, 2), (self.entry_context - before, 0))
        # output channel i * d_v + j is column j of feature i
        return self.expander(tokens).view(b, h, self.dv, s).permute(2, 0, 3, 1)

    def exit(self, state: Tensor) -> Tensor:
        return state if self.dv == 1 else self.final_read(state)


class DeltaResidual(nn.Module):
    """beta_logit = w_beta . normed + b_beta, v_logit = W_v x + b_v, and ``delta_write``."""

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
        beta_logit, v_logit = self.beta_proj(normed), self.v_proj(x)
        return delta_write(state, out, beta_logit, v_logit, self.k_eps, self.v_scale)


# model.residual -> (stream, sublayer residual, layer entry or None)
EXPORTED = {"ddl": (DeltaStream, DeltaResidual, None)}
