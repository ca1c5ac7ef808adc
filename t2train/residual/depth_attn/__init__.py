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

from dataclasses import dataclass

import numpy as np

from t2train.errors import require
from t2train.residual.declaration import BODY, ResidualDesign, SavedPerToken, Traffic
from t2train.residual.sublayers import sublayer_names


@dataclass
class DepthAttnOptions:
    """``model.depth_attn``: a causal QKV read over the token's last K residual states."""

    window: int = 4  # K; >= num_layers + 1 reads the full depth

    def validate(self, prefix: str) -> None:
        require(self.window >= 1, f"{prefix}.window", self.window, "must be >= 1")


def _window_sizes(model) -> list[int]:
    return [min(model.depth_attn.window, layer + 1) for layer in range(model.num_layers)]


def extra_parameters(model) -> int:
    h = model.hidden_size
    return model.num_layers * (4 * h * h + h)  # W_Q, W_K, W_V, W_O, norm


def tensor_parallel_parameters(model) -> int:
    """The projections are split across tensor ranks like attention's; the norm is not."""
    return model.num_layers * 4 * model.hidden_size**2


def minimum_traffic(model, layer: int) -> Traffic:
    """Each sublayer as `standard`'s (6, 8), and the layer's read over its window of K'
    states, shared by its sublayers. Forward: the states read and their normed copies written
    with this layer's norm (2K'), the KV projection reading them and writing K and V (3K'),
    the query projection (2), the window attention reading q, K, V and writing z (2K' + 2),
    the output projection (2), the add of W_O z to the state writing the first sublayer's
    normed input too (4): 7K' + 10. Backward, the same in reverse: the output projection (4),
    the attention (4K' + 4), the query projection (4), the KV projection (6K'), the norms'
    backward reading the normed gradients and the states and adding into the states'
    gradients, the earlier states' read and written again (4K' + 1): 14K' + 13."""
    window = _window_sizes(model)[layer]
    sublayers = len(sublayer_names(model))
    return Traffic(
        BODY.forward + 4 + (7 * window + 10) / sublayers,
        BODY.backward + 4 + (14 * window + 13) / sublayers,
    )


def extra_flops_per_token(model) -> int:
    """Per layer: q and output projections, K/V projections of n states, scores and mix."""
    h = model.hidden_size
    return sum(4 * h * h + 4 * h * h * n + 4 * h * n for n in _window_sizes(model))


def saved_per_token(model) -> SavedPerToken:
    """The read of n states keeps the current state (the earlier ones are kept once, by the
    layers they entered) and the window normed (n units), with the fp32 1/rms of each state;
    split over tensor ranks like attention: q, K and V of the window, z, and the fp32
    log-sum-exp per head."""
    h, heads, layers = model.hidden_size, model.num_attention_heads, model.num_layers
    sizes = _window_sizes(model)
    return SavedPerToken(
        whole=sum(1 + n for n in sizes) * h / layers,
        whole_fp32=sum(sizes) / layers,
        split=sum(2 + 2 * n for n in sizes) * h / layers,
        split_fp32=heads,
    )


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


def unit_ids(model, layers_done: int) -> list:
    """The states entering the last ``window - 1`` layers (ids: their layer numbers) and the
    current one: a state never changes once made."""
    count = min(layers_done, model.depth_attn.window - 1) + 1
    return list(range(layers_done - count + 1, layers_done + 1))


DESIGN = ResidualDesign(
    name="depth_attn",
    layers="t2train.residual.depth_attn.layers",
    stream="DepthStream",
    sublayer="DepthAdditive",
    reference="Residual Stream Duality, Zhang, arXiv 2603.16039, Sec. 2.2",
    extra_parameters=extra_parameters,
    extra_flops_per_token=extra_flops_per_token,
    tensor_parallel_parameters=tensor_parallel_parameters,
    saved_per_token=saved_per_token,
    minimum_traffic=minimum_traffic,
    layer_entry="DepthRead",
    unit_ids=unit_ids,
    section="depth_attn",
    options=DepthAttnOptions,
    write_diagnostics=write_diagnostics,
)
