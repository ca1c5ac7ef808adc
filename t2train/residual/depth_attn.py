"""`depth_attn`: a causal QKV attention read over depth (the dual of ShortSWA).

Residual Stream Duality (arXiv 2603.16039, Sec. 2.2). For token t at layer l, with the
residual states h^(i) entering layer i (h^(0) = embedding):

    W = [h^(max(0, l-K+1)), ..., h^(l)]              inclusive of the current state,
    z = softmax(q K^T / sqrt(d_k)) V,  q = W_Q n(h^(l)),  K = n(W) W_K,  V = n(W) W_V

where n is one RMSNorm (the paper leaves normalisation open; pre-norm keeps the projections
on the same footing as attention's). This is ``short_window_attention`` with window K over
the depth axis: ``K >= L + 1`` is the full-depth limit.

Where the read enters (the paper leaves it open): as an extra branch at the start of every
layer, h^(l) <- h^(l) + W_O z, with W_O zero-initialised so the model starts exactly as
`standard`. Heads are split across tensor-parallel ranks like attention.

The stream state is ``DepthState(history, current)``: the up to K-1 earlier layer inputs
and the current hidden state. A pipeline hop carries all of them (the depth cache).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide
from torch import Tensor

from t2train.errors import require
from t2train.nn import probe
from t2train.nn.norm import RMSNorm
from t2train.residual.base import ResidualDesign, ResidualStream, SublayerResidual
from t2train.residual.window_attention import attend_window, window_attention_probs


@dataclass
class DepthAttnOptions:
    """``model.depth_attn``: a causal QKV read over the token's last K residual states."""

    window: int = 4  # K; >= num_layers + 1 reads the full depth

    def validate(self, prefix: str) -> None:
        require(self.window >= 1, f"{prefix}.window", self.window, "must be >= 1")


class DepthState(NamedTuple):
    history: tuple  # earlier layer inputs, oldest first, at most K - 1
    current: Tensor


class DepthRead(MegatronModule):
    """The layer entry: read the depth window, add W_O z, remember h^(l) for later layers."""

    def __init__(self, config, layer_number: int = 1):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.window = config.t2_model.depth_attn.window
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
        current, _ = self.linear_q(self.norm(states[-1]))
        # Fold the window into the batch dim ([s, b * n, h]) so one (sequence-parallel aware)
        # matmul projects it; with the window inside each token's rows, k and v are views.
        stacked = self.norm(torch.stack(states, dim=2).flatten(1, 2))
        kv, _ = self.linear_kv(stacked)
        s, b = current.shape[:2]
        q = current.reshape(s * b, self.heads, 1, self.head_dim)
        kv = kv.view(s, b, n, self.heads, 2, self.head_dim).permute(4, 0, 1, 3, 2, 5)
        k, v = (t.reshape(s * b, self.heads, n, self.head_dim) for t in kv)
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
        keep = self.window - 1
        history = tuple(window[-keep:]) if keep else ()
        return DepthState(history, current)


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

    def unit_ids(self, layers_done: int) -> list:
        count = min(layers_done, self.config.t2_model.depth_attn.window - 1) + 1
        return list(range(layers_done - count + 1, layers_done + 1))

    def enter(self, embedding: Tensor) -> DepthState:
        return DepthState((), embedding)

    def exit(self, state: DepthState) -> Tensor:
        return state.current

    def to_units(self, state: DepthState) -> list[Tensor]:
        return list(state.history) + [state.current]

    def from_units(self, units: list[Tensor], layers_done: int) -> DepthState:
        return DepthState(tuple(units[:-1]), units[-1])


def _window_sizes(model) -> list[int]:
    return [min(model.depth_attn.window, layer + 1) for layer in range(model.num_layers)]


def extra_parameters(model) -> int:
    h = model.hidden_size
    return model.num_layers * (4 * h * h + h)  # W_Q, W_K, W_V, W_O, norm


def tensor_parallel_parameters(model) -> int:
    """The projections are split across tensor ranks like attention's; the norm is not."""
    return model.num_layers * 4 * model.hidden_size**2


def extra_flops_per_token(model) -> int:
    """Per layer: q and output projections, K/V projections of n states, scores and mix."""
    h = model.hidden_size
    return sum(4 * h * h + 4 * h * h * n + 4 * h * n for n in _window_sizes(model))


def write_diagnostics(writer, step: int, records: dict, model) -> None:
    """``diagnostics/depth_attention``: the mean weight of each reading layer (rows) on each
    state in its window (columns). Layer l reads h^(l-n) .. h^(l-1), the states entering
    layers l-n+1 .. l."""
    if "depth_attn" not in records:
        return
    layers = model.num_layers
    matrix = np.full((layers, layers), np.nan)
    for layer, row in records["depth_attn"].items():
        matrix[layer - 1, layer - len(row) : layer] = row.numpy()
    writer.heatmap(
        step,
        "diagnostics/depth_attention",
        matrix,
        [f"layer_{n + 1:02d}" for n in range(layers)],
        ["h0 (emb)"] + [f"h{i}" for i in range(1, layers)],
        f"depth_attn: mean attention over depth, step {step}",
        "state entering layer i (h_i)",
        "reading layer",
    )


DESIGN = ResidualDesign(
    name="depth_attn",
    stream=DepthStream,
    sublayer=DepthAdditive,
    reference="Residual Stream Duality, Zhang, arXiv 2603.16039, Sec. 2.2",
    extra_parameters=extra_parameters,
    extra_flops_per_token=extra_flops_per_token,
    tensor_parallel_parameters=tensor_parallel_parameters,
    layer_entry=DepthRead,
    section="depth_attn",
    options=DepthAttnOptions,
    write_diagnostics=write_diagnostics,
)
