"""``depth_attn`` for the Hugging Face export: causal attention over a token's last K layer
states (arXiv 2603.16039), on [batch, seq, hidden].

An export part (``t2train/residual/hf.py`` says how it is assembled); its parameters are
named as in ``layers.py``, its math is ``functional.py``'s.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from t2train.residual.depth_attn.functional import depth_heads, slide
from t2train.residual.functional import short_window_attention
from t2train.residual.hf_modeling import Stream, T2TrainConfig


class DepthState(NamedTuple):
    history: tuple  # the states entering the last K - 1 layers, oldest first
    current: Tensor


class DepthStream(Stream):
    def __init__(self, config: T2TrainConfig):
        super().__init__()

    def enter(self, embedding: Tensor) -> DepthState:
        return DepthState((), embedding)

    def exit(self, state: DepthState) -> Tensor:
        return state.current


class DepthAdditive(nn.Module):
    """Sublayers add to the current state; only the layer entry reads the history."""

    def __init__(self, config: T2TrainConfig, layer: int, position: int):
        super().__init__()

    def read(self, state: DepthState) -> Tensor:
        return state.current

    def write(self, state: DepthState, x: Tensor, normed: Tensor, out: Tensor) -> DepthState:
        return DepthState(state.history, state.current + out)


class DepthRead(nn.Module):
    """Before each layer: current += W_O softmax(q K^T / sqrt(d)) V over the window
    [history..., current], q = W_Q n(current), K, V = n(window) W_K, W_V, one RMSNorm n
    (``depth_heads`` splits the heads); the next layer's window keeps the last K - 1."""

    def __init__(self, config: T2TrainConfig, layer: int):
        super().__init__()
        h = config.hidden_size
        self.window = config.residual_options["window"]
        self.heads, self.head_dim = config.num_attention_heads, h // config.num_attention_heads
        self.norm = nn.RMSNorm(h, eps=config.rms_norm_eps)
        self.linear_q = nn.Linear(h, h, bias=False)
        self.linear_kv = nn.Linear(h, 2 * h, bias=False)
        self.linear_proj = nn.Linear(h, h, bias=False)

    def read(self, states: list[Tensor]) -> Tensor:
        current = self.linear_q(self.norm(states[-1]))
        kv = self.linear_kv(self.norm(torch.stack(states, dim=2)))  # [b, s, n, 2h]
        q, k, v = depth_heads(current, kv, self.heads)
        z = short_window_attention(q, k, v, self.window, 1 / math.sqrt(self.head_dim))
        return self.linear_proj(z.reshape(current.shape))

    def begin(self, state: DepthState) -> DepthState:
        window = list(state.history) + [state.current]
        current = state.current + self.read(window)
        return DepthState(slide(window, self.window), current)


# model.residual -> (stream, sublayer residual, layer entry or None)
EXPORTED = {"depth_attn": (DepthStream, DepthAdditive, DepthRead)}
