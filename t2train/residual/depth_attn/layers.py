"""The training modules of `depth_attn` (the design and its math: ``__init__.py``)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide
from torch import Tensor

from t2train.nn import probe
from t2train.nn.norm import RMSNorm
from t2train.residual.base import ResidualStream, SublayerResidual
from t2train.residual.depth_attn.functional import depth_heads, slide
from t2train.residual.window_attention import attend_window, window_attention_probs


class DepthState(NamedTuple):
    history: tuple  # earlier layer inputs, oldest first, at most K - 1
    current: Tensor


class DepthRead(MegatronModule):
    """The layer entry: read the depth window, add W_O z, remember h^(l) for later layers."""

    def __init__(self, config, model, layer_number: int = 1):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.window = model.depth_attn.window
        h = config.hidden_size
        self.heads = divide(config.num_attention_heads, config.tensor_model_parallel_size)
        self.head_dim = h // config.num_attention_heads
        self.norm = RMSNorm(config, h, eps=config.layernorm_epsilon)
        linear = dict(config=config, init_method=config.init_method, bias=False, skip_bias_add=True)
        self.linear_q = ColumnParallelLinear(h, h, gather_output=False, **linear)
        self.linear_kv = ColumnParallelLinear(h, 2 * h, gather_output=False, **linear)
        self.linear_proj = RowParallelLinear(
            h,
            h,
            input_is_parallel=True,
            init_method=torch.nn.init.zeros_,
            config=config,
            bias=False,
            skip_bias_add=True,
        )

    def read(self, states: list[Tensor]) -> Tensor:
        """z for the last state of ``states`` (each [s, b, h]) over all of them."""
        n = len(states)
        # Each state is normed on its own, so that the backward keeps the states themselves
        # (which the reads of the next layers keep too), not a stacked copy of them. The
        # window is folded into the batch dim ([s, b * n, h]) so one (sequence-parallel
        # aware) matmul projects it; with the window inside each token's rows, k and v are
        # views, and the query reads the current state's rows of the same tensor.
        normed = torch.stack([self.norm(state) for state in states], dim=2)
        kv, _ = self.linear_kv(normed.flatten(1, 2))
        current, _ = self.linear_q(normed[:, :, -1])
        s, b = current.shape[:2]
        q, k, v = depth_heads(current, kv.view(s, b, n, -1), self.heads)
        scale = 1 / math.sqrt(self.head_dim)
        # Weights over the states entering layers l-n+1 .. l (0-based), averaged.
        probe.record(
            "depth_attn",
            self.layer_number,
            lambda: window_attention_probs(q, k, self.window, scale).mean((0, 1, 2)),
        )
        z = attend_window(q, k, v, self.window, scale)
        out, _ = self.linear_proj(z.reshape(s, b, self.heads * self.head_dim))
        return out

    def begin(self, state: DepthState) -> DepthState:
        window = list(state.history) + [state.current]
        current = state.current + self.read(window)
        return DepthState(slide(window, self.window), current)


class DepthAdditive(SublayerResidual):
    """Sublayers add to the current state; the history is only read by ``DepthRead``."""

    def read(self, state: DepthState) -> Tensor:
        return state.current

    def write(self, state: DepthState, x: Tensor, normed: Tensor, out: Tensor) -> DepthState:
        return DepthState(state.history, state.current + out)


class DepthStream(ResidualStream):
    """Units [history..., current]: the states entering layers l-n+1 .. l (ids l-n+1 .. l).

    Every unit is the input of a finished layer and never changes, so all can be cached.
    """

    def enter(self, embedding: Tensor) -> DepthState:
        return DepthState((), embedding)

    def exit(self, state: DepthState) -> Tensor:
        return state.current

    def to_units(self, state: DepthState) -> list[Tensor]:
        return list(state.history) + [state.current]

    def from_units(self, units: list[Tensor], layers_done: int) -> DepthState:
        return DepthState(tuple(units[:-1]), units[-1])


KERNELS = ()  # the fused kernels this design declares (the registry's kernel table)
