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
from typing import ClassVar

from t2train.errors import require
from t2train.residual.declaration import (
    BODY,
    ResidualDesign,
    SavedPerToken,
    Traffic,
    scaled_output,
)
from t2train.residual.sublayers import sublayer_names


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


def no_dropped_states(_model) -> int:
    return 0


def saved_for(section: str, fp32_per_sublayer, dropped_per_layer=no_dropped_states):
    def saved_per_token(model) -> SavedPerToken:
        """Per sublayer, the n streams its read and mixing take and the output its write
        scales, less the norm's input that `standard` keeps: in a compiled layer the read is
        fused into the norm's pass (``t2train.residual.unrolled``, or `hc`'s width connection
        applies the norm) and its result rebuilt from the streams in the backward; with
        ``fp32_per_sublayer`` fp32 numbers per token; the embedding enters as n views of one
        unit; ``dropped_per_layer`` states of n units are rebuilt in the backward."""
        n, h = getattr(model, section).expansion_rate, model.hidden_size
        dropped = dropped_per_layer(model) * model.num_layers
        units = sublayers(model) * n - (n - 1) - n * dropped
        return SavedPerToken(
            whole=units * h / model.num_layers,
            whole_fp32=len(sublayer_names(model)) * fp32_per_sublayer(model),
        )

    return saved_per_token


def mapping_logits(model) -> int:
    """Dynamic: the projections of the normed streams (n + 2 per stream) and each stream's
    inverse RMS, from which the width connection's backward rebuilds the mappings
    (``hc/compiled.py``; the partitioner rebuilds the write's A_r and B from them too), less
    the pre-norm's inverse RMS that `standard`'s norm keeps: the width connection applies
    the norm and its backward rebuilds it. Static: none (the weights are parameters, the
    same for every token)."""
    n = model.hc.expansion_rate
    return n * (n + 2) + n - 1 if model.hc.dynamic else 0


def stream_mix_traffic(section: str):
    def minimum_traffic(model, _layer: int) -> Traffic:
        """n streams. Forward, one pass reads the n streams and the output and writes the n
        new ones and the next sublayer's normed input: the mixing weights come from row-local
        reductions (norms, projections) and the read sums over the streams of one token
        (2n + 2). Backward, one pass reads the new streams' gradient (n), the streams (n),
        the output and the normed input's gradient, and writes the streams' gradient (n) and
        the output's (3n + 3)."""
        n = getattr(model, section).expansion_rate
        return Traffic(BODY.forward + 2 * n + 2, BODY.backward + 3 * n + 3)

    return minimum_traffic


def copies_of(section: str):
    def unit_ids(model, _layers_done: int) -> list:
        """The n copies, each changing at every sublayer."""
        return [None] * getattr(model, section).expansion_rate

    return unit_ids


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


# The backward of a write and the next read (``hc/compiled.py``) is one pass when Inductor
# inlines its per-token terms (the logits' gradients times the logits: a dozen reads; each
# stream's gradient, read by the mixing gradients' reductions) instead of writing them out,
# and lets a kernel hold up to 256 nodes: ``t2train bench bytes`` counted 56.0 units per
# sublayer at ``INLINE_LIMITS`` and 52.0 with these (the node limit: 42 kernels per
# layer's backward against 32; on 2026-12-06). `ddl` would move 0.5 more at these read
# limits, so they are `hc`'s alone.
INDUCTOR_OPTIONS = {
    "realize_acc_reads_threshold": 32,
    "realize_opcount_threshold": 100,
    "max_fusion_size": 256,
}

DESIGN = ResidualDesign(
    name="hc",
    layers="t2train.residual.hc.layers",
    stream="StreamCopies",
    sublayer="HyperConnection",
    reference="Hyper-Connections, Zhu et al., ICLR 2025, arXiv 2409.19606",
    extra_parameters=extra_parameters,
    extra_flops_per_token=extra_flops_per_token,
    saved_per_token=saved_for("hc", mapping_logits),
    selective_saved_per_token=scaled_output,  # its width connections are recomputed
    minimum_traffic=stream_mix_traffic("hc"),
    unit_ids=copies_of("hc"),
    section="hc",
    options=HCOptions,
    write_diagnostics=diagnostics_for("hc"),
    inductor_options=INDUCTOR_OPTIONS,
)
