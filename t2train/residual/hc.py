"""`hc`: Hyper-Connections (Zhu et al., ICLR 2025, arXiv 2409.19606).

The stream is n copies of the hidden state (the expansion rate, ``model.hc.expansion_rate``):
per token H = [h_1; ...; h_n] in R^{n x h}, stored as [n, s, b, h]. Every sublayer T
(attention, the MLP and, with the local mixer on, the ShortSWA sublayer) has a
hyper-connection of its own, HC = [[0, B], [A_m, A_r]] with B in R^{1 x n}, A_m in R^{n x 1},
A_r in R^{n x n}: width connections read the sublayer's input and mix the streams, a depth
connection writes its output back:

    x  = A_m^T H                              x = sum_i A_m[i] h_i; T applies its own pre-norm
    H' = A_r^T H + B^T T(Norm(x))             h'_j = sum_i A_r[i, j] h_i + B_j T(Norm(x))

Static (``model.hc.dynamic=false``, SHC): A_m, A_r and B are learned per sublayer.
Dynamic (the default, DHC): they are predicted per token from the streams, each
normalised on its own, H~ = Norm(H):

    A_m(H) = s_a tanh(H~ W_m) + A_m,   A_r(H) = s_a tanh(H~ W_r) + A_r,
    B(H)   = s_b tanh(H~ W_b)^T + B

with W_m in R^{h x 1}, W_r in R^{h x n} (stored together as W_a = [W_m, W_r], as in the
paper's pseudo-code), W_b in R^{h x 1}: row i of A_m(H), A_r(H) and entry i of B(H) come
from stream i.

Initialisation (the paper's Pre-Norm-equivalent start and its pseudo-code, Algorithm 2 of
the appendix): the k-th sublayer of the model (0-based over every sublayer in order) reads
stream k mod n (A_m = e_{k mod n}), A_r = I_n, B = 1_n; W_a = W_b = 0 and s_a = s_b =
``model.hc.dynamic_scale_init`` (0.01). The embedding enters as n copies, so every stream
stays the `standard` hidden state until the weights move, and the model starts with
`standard`'s logits (tested). With n = 1 the design is a gated `standard` residual:
h' = A_r h + B T(Norm(A_m h)) with scalars near 1.

Choices the paper leaves open (or t2train's model differs):

- the final norm reads the mean of the streams where the paper sums them; under RMSNorm the
  two differ only in the effective eps, and the mean keeps the `standard` start exact;
- the normalisation of the dynamic weights is the model's RMSNorm with a learned weight (the
  paper's models use LayerNorm);
- k counts the mixer's sublayer too when it is on;
- hidden dropout (``model.dropout``) is the layer's, applied once to T's output before the
  write, as for every design;
- the weights and mixes are computed in at least fp32; the state keeps the activation dtype.

A pipeline hop carries the n streams as n units of [s, b, h]; they change at every sublayer
(unit id None). Everything is per token, so sequence parallelism applies unchanged; the
hyper-connection parameters are replicated on every tensor rank (their gradients are
all-reduced under sequence parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, cast

import torch
from torch import Tensor

from t2train.errors import require
from t2train.kernels import dispatch
from t2train.nn import probe
from t2train.nn.norm import RMSNorm
from t2train.nn.precision import at_least_fp32, rms_fp32_logits
from t2train.residual import sublayer_names
from t2train.residual.base import (
    ResidualDesign,
    ResidualStream,
    SublayerResidual,
    mark_replicated,
)


@dataclass
class HCOptions:
    """``model.hc``: n streams joined by learned width and depth connections per sublayer."""

    expansion_rate: int = 4  # n: copies of the hidden state in the stream
    dynamic: bool = True  # DHC (weights predicted per token); false: SHC (static weights)
    dynamic_scale_init: float = 0.01  # s_a and s_b at initialisation
    not_architecture: ClassVar[tuple] = ("dynamic_scale_init",)  # a resumed run may change it

    def validate(self, prefix: str) -> None:
        require(
            self.expansion_rate >= 1,
            f"{prefix}.expansion_rate",
            self.expansion_rate,
            "must be >= 1 (the number of hidden-state copies in the stream)",
        )
        require(
            self.dynamic_scale_init > 0,
            f"{prefix}.dynamic_scale_init",
            self.dynamic_scale_init,
            "must be > 0 (at 0 neither the scales nor the "
            "zero-initialised dynamic weights would get a gradient)",
        )


def sublayer_index(config, layer_number: int, position: int) -> int:
    """0-based index of a sublayer over the whole model (every sublayer counts)."""
    return len(sublayer_names(config.t2_model)) * (layer_number - 1) + position


def record_weights(name: str, sublayer: tuple, read: Tensor, write: Tensor, mix) -> None:
    """Diagnostics of one hyper-connection: read weights [s, b, n], write weights [s, b, n]
    and ``mix()``, the stream mixing [s, b, n, n] as applied (new stream i = sum_j mix[i, j]
    h_j), summarised by its gain: the largest absolute row sum, averaged over tokens."""
    probe.record(f"{name}_read", sublayer, lambda: read)
    probe.record(f"{name}_write", sublayer, lambda: write)
    probe.record(f"{name}_gain", sublayer, lambda: mix().abs().sum(-1).amax(-1).mean())


class StreamMixResidual(SublayerResidual):
    """A sublayer that reads a mix of n streams and writes back into all of them.

    ``read`` computes the sublayer's connection weights once and keeps what ``write`` needs
    (the layer calls them in that order on the same state, also when recomputing).
    """

    def __init__(self, config, layer_number: int = 1, position: int = 0):
        super().__init__(config, layer_number, position)
        self._pending: Optional[tuple] = None  # the read's mappings, for the write

    def read(self, state: Tensor) -> Tensor:
        x, self._pending = self.width_connection(state)
        return x

    def write(self, state: Tensor, x: Tensor, normed: Tensor, out: Tensor) -> Tensor:
        if self._pending is None:
            raise RuntimeError(f"{type(self).__name__}.write without its read")
        pending, self._pending = self._pending, None
        return self.depth_connection(state, pending, out)

    def width_connection(self, state: Tensor) -> tuple[Tensor, tuple]:
        """The sublayer's input and what its write needs."""
        raise NotImplementedError

    def depth_connection(self, state: Tensor, pending: tuple, out: Tensor) -> Tensor:
        raise NotImplementedError


def width_read(state: Tensor, weights: Tensor) -> Tensor:
    """x = sum_i weights[..., i] h_i; state [n, s, b, h], weights [s, b, n]."""
    x = at_least_fp32(state)
    return torch.einsum("sbi,isbh->sbh", weights.to(x.dtype), x).to(state.dtype)


def depth_write(state: Tensor, residual: Tensor, beta: Tensor, out: Tensor) -> Tensor:
    """h'_j = sum_i residual[..., i, j] h_i + beta[..., j] out; residual [s, b, n, n]."""
    x = at_least_fp32(state)
    mixed = torch.einsum("sbij,isbh->jsbh", residual.to(x.dtype), x)
    return (mixed + torch.einsum("sbj,sbh->jsbh", beta.to(x.dtype), at_least_fp32(out))).to(
        state.dtype
    )


HC_READ = dispatch.Kernel("hc_read", "t2train.kernels.stream_mix:width_read", width_read)
HC_WRITE = dispatch.Kernel("hc_write", "t2train.kernels.stream_mix:depth_write", depth_write)


class HyperConnection(StreamMixResidual):
    def __init__(self, config, layer_number: int = 1, position: int = 0):
        super().__init__(config, layer_number, position)
        options = config.t2_model.hc
        n, h, dtype = options.expansion_rate, config.hidden_size, config.params_dtype
        self.n, self.dynamic = n, options.dynamic
        alpha = torch.zeros(n, n + 1, dtype=dtype)  # [A_m | A_r]
        alpha[sublayer_index(config, layer_number, position) % n, 0] = 1.0
        alpha[:, 1:] = torch.eye(n, dtype=dtype)
        self.static_alpha = torch.nn.Parameter(alpha)
        self.static_beta = torch.nn.Parameter(torch.ones(n, dtype=dtype))
        if self.dynamic:
            self.norm = RMSNorm(config, h, eps=config.layernorm_epsilon)
            self.dynamic_alpha = torch.nn.Parameter(torch.zeros(h, n + 1, dtype=dtype))
            self.dynamic_beta = torch.nn.Parameter(torch.zeros(h, dtype=dtype))
            scale = options.dynamic_scale_init
            self.dynamic_alpha_scale = torch.nn.Parameter(torch.full((1,), scale, dtype=dtype))
            self.dynamic_beta_scale = torch.nn.Parameter(torch.full((1,), scale, dtype=dtype))
        mark_replicated(self, config)

    def weights(self, state: Tensor) -> tuple[Tensor, Tensor]:
        """alpha [s, b, n, n + 1] (A_m, then A_r; row i from stream i) and beta [s, b, n]."""
        n, s, b, _ = state.shape
        alpha = at_least_fp32(self.static_alpha).expand(s, b, n, n + 1)
        beta = at_least_fp32(self.static_beta).expand(s, b, n)
        if not self.dynamic:
            return alpha, beta
        # Both projections of each stream (normed on its own) at once, in fp32 without an
        # fp32 copy of the n streams: [n, s, b, n + 2], alpha's n + 1 logits, then beta's.
        # Norm(H) W = r (H (g W)) per stream, r its rsqrt: the norm's weight g folds into
        # the projections and r applies after them, so the normed streams are never written
        # (nor saved for the backward).
        projections = torch.cat([self.dynamic_alpha.t(), self.dynamic_beta[None]])
        folded = at_least_fp32(projections) * at_least_fp32(self.norm.weight)
        logits = rms_fp32_logits(state, folded, None, cast(float, self.norm.eps))
        scale_a, scale_b = (
            at_least_fp32(p) for p in (self.dynamic_alpha_scale, self.dynamic_beta_scale)
        )
        alpha = alpha + scale_a * torch.tanh(logits[..., : n + 1]).permute(1, 2, 0, 3)
        beta = beta + scale_b * torch.tanh(logits[..., n + 1]).permute(1, 2, 0)
        return alpha, beta

    def width_connection(self, state: Tensor) -> tuple[Tensor, tuple]:
        alpha, beta = self.weights(state)
        read, residual = alpha[..., 0], alpha[..., 1:]
        record_weights(
            "hc", (self.layer_number, self.position), read, beta, lambda: residual.transpose(-1, -2)
        )
        return dispatch.route(HC_READ, state)(state, read), (residual, beta)

    def depth_connection(self, state: Tensor, pending: tuple, out: Tensor) -> Tensor:
        residual, beta = pending
        write = dispatch.route(HC_WRITE, state, out)
        return write(state, residual, beta, out)


class StreamCopies(ResidualStream):
    """n streams [n, s, b, h]: the embedding enters as n copies, the final norm reads their
    mean; a hop carries the n streams as n units."""

    section = "hc"  # where the expansion rate is configured

    def __init__(self, config, pre_process: bool, post_process: bool, first_layer: int):
        super().__init__(config, pre_process, post_process, first_layer)
        self.n = getattr(config.t2_model, self.section).expansion_rate

    def unit_ids(self, layers_done: int) -> list:
        return [None] * self.n

    def enter(self, embedding: Tensor) -> Tensor:
        return embedding.unsqueeze(0).expand(self.n, *embedding.shape)

    def exit(self, state: Tensor) -> Tensor:
        return at_least_fp32(state).mean(0).to(state.dtype)

    def to_units(self, state: Tensor) -> list[Tensor]:
        return list(state.unbind(0))

    def from_units(self, units: list[Tensor], layers_done: int) -> Tensor:
        return torch.stack(units)


def sublayers(model) -> int:
    return len(sublayer_names(model)) * model.num_layers


def extra_parameters(model) -> int:
    """Per sublayer: A_m, A_r, B; dynamic: W_a, W_b, the two scales and the norm's weight."""
    n, h = model.hc.expansion_rate, model.hidden_size
    per_sublayer = n * (n + 2) + (h * (n + 3) + 2 if model.hc.dynamic else 0)
    return sublayers(model) * per_sublayer


def extra_flops_per_token(model) -> int:
    """Per sublayer: the read 2nh, the stream mix 2n^2 h, the write 2nh; dynamic: the norms
    2nh and W_a, W_b 2nh(n + 2). The final mean 2nh. (Terms in h only: the O(n^2) tanh and
    scaling work per token is left out, as for the other designs' gates.)"""
    n, h = model.hc.expansion_rate, model.hidden_size
    per_sublayer = 2 * n * h * (n + 2) + (2 * n * h * (n + 3) if model.hc.dynamic else 0)
    return sublayers(model) * per_sublayer + 2 * n * h


def diagnostics_for(name: str):
    def write_diagnostics(writer, step: int, records: dict, model) -> None:
        """Histograms ``diagnostics/<design>_read/layer_NN.<sublayer>`` (the weights reading
        the sublayer's input from each stream) and ``diagnostics/<design>_write/...`` (the
        weights writing its output into each stream); scalars ``diagnostics/<design>_gain/
        layer_NN.<sublayer>``: the largest absolute row sum of the stream mixing (how much it
        can amplify the streams), averaged over tokens."""
        names = sublayer_names(model)

        def tag(kind, layer, position):
            return f"diagnostics/{name}_{kind}/layer_{layer:02d}.{names[position]}"

        for kind in ("read", "write"):
            for (layer, position), values in sorted(records.get(f"{name}_{kind}", {}).items()):
                writer.histogram(step, tag(kind, layer, position), values)
        gains = records.get(f"{name}_gain", {})
        if gains:
            writer.scalars(
                step,
                {
                    tag("gain", layer, position): float(gain)
                    for (layer, position), gain in sorted(gains.items())
                },
            )

    return write_diagnostics


DESIGN = ResidualDesign(
    name="hc",
    stream=StreamCopies,
    sublayer=HyperConnection,
    reference="Hyper-Connections, Zhu et al., ICLR 2025, arXiv 2409.19606",
    extra_parameters=extra_parameters,
    extra_flops_per_token=extra_flops_per_token,
    section="hc",
    options=HCOptions,
    write_diagnostics=diagnostics_for("hc"),
)
