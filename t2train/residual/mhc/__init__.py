"""`mhc`: Manifold-Constrained Hyper-Connections (Xie et al., DeepSeek-AI, arXiv 2512.24880).

The stream is n copies of the hidden state as in `hc` (``model.mhc.expansion_rate``, default
4): per token x_l in R^{n x h}, stored as [n, s, b, h]. Every sublayer F (attention, the MLP
and, with the local mixer on, the ShortSWA sublayer) has its own mappings, predicted from the
whole stream flattened, x~ = vec(x_l) in R^{nh} (the paper's parameterization):

    x~'    = x~ / sqrt(mean(x~^2) + eps)                    RMSNorm without a learned weight
    H~pre  = a_pre  (x~' phi_pre)       + b_pre             phi_pre, phi_post in R^{nh x n}
    H~post = a_post (x~' phi_post)      + b_post
    H~res  = a_res  mat(x~' phi_res)    + b_res             phi_res in R^{nh x n^2}
    H_pre = sigmoid(H~pre),  H_post = 2 sigmoid(H~post),  H_res = SK(H~res)

    x_{l+1} = H_res x_l + H_post^T F(Norm(H_pre x_l))        (F applies its pre-norm)

i.e. the sublayer reads sum_j H_pre[j] x_j and stream i becomes
sum_j H_res[i, j] x_j + H_post[i] F(...). SK is Sinkhorn-Knopp as the paper's Eq. 9 writes
it, with t_max = ``model.mhc.sinkhorn_iterations`` (default 20): M(0) = exp(H~res),
M(t) = T_r(T_c(M(t-1))) (T_c divides each column by its sum, then T_r each row),
H_res = M(t_max). Its rows sum to 1 exactly, so every new stream is a convex combination of
the old ones (the forward gain is exact, and equal streams stay equal); its columns sum to 1
up to the iterations' convergence: within 1e-6 for logits spread over about 2 (tested), more
slowly for wider spreads (noted by mHC-lite, arXiv 2601.05732), so the streams' mean, which
the final norm reads, is kept to that accuracy. exp is taken after subtracting the matrix's
largest logit, a common factor every normalisation cancels.

Choices the paper leaves open:

- phi is initialised with the model's init method (normal, std ``model.init_method_std``);
  the gates a_pre = a_post = a_res start at ``model.mhc.gate_init`` (the paper's 0.01);
- the static biases start so that equal streams give `standard`: b_pre = logit(1/n)
  (H_pre sums to 1, the read is the streams' mean; n = 1: 0, the gate starts at 1/2, since a
  sigmoid cannot reach 1), b_post = 0 (H_post = 1: every stream gets the whole output),
  b_res = 0 (H_res uniform, which maps equal streams to themselves);
- the embedding enters as n copies and the final norm reads the mean of the streams (the
  paper does not say);
- hidden dropout (``model.dropout``) is the layer's, applied once to F's output before the
  write, as for every design;
- mappings, Sinkhorn and the stream update run in at least fp32; the state keeps the
  activation dtype.

What holds at initialisation: the streams are n copies of the embedding and H_res (doubly
stochastic) maps equal streams to themselves exactly, so they stay equal; the read is
(sum_j H_pre[j]) h and each stream gains H_post[i] F, where H_pre and H_post differ from 1/n
and 1 by O(a |x~' phi|) (a = gate_init; about a * 0.02 sqrt(nh) per logit with the default
init). With ``model.mhc.gate_init=0`` the model computes `standard`'s logits (up to b_pre's
rounding in the parameter dtype; tested), and the gates still get gradients. With n = 1,
H_res = 1 and the design is a gated `standard` residual:
x' = x + 2 sigmoid(H~post) F(Norm(sigmoid(H~pre) x)).

Memory (``model.mhc.recompute_streams``, off by default): as the paper recomputes its
mappings' intermediates in the backward (Sec. 4.3), the n streams between a layer's sublayers
can be dropped after the forward and rebuilt by their write when the backward needs them
(``_DroppedStates``: saved-tensor hooks around this design's own reads and writes); only the
stream entering each layer is kept. Values are unchanged (the same kernel on the same
inputs); it saves one n x [s, b, h] state per layer, two with the local mixer, where the
layers run eagerly (``model.fusions=none``): a compiled layer keeps them.

The read (H_pre) and the write (Sinkhorn, H_res and H_post) are one fused Triton pass each
over the stream on CUDA (``kernels/stream_mix.py``, chosen by ``T2_KERNELS``). In a
compiled layer a write and the next read are one function (``compiled.py``: the write, the
flat norm, the projections, the read and the sublayer's pre-norm in one pass over the
streams, and its backward written by hand), and the write's mappings one narrow Triton
kernel each way (``write_weights``).
Hops carry n units of [s, b, h] (unit ids None); all is per token, so sequence parallelism
applies; parameters are replicated across tensor ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from t2train.errors import require
from t2train.residual.declaration import ResidualDesign, scaled_output
from t2train.residual.hc import (
    INDUCTOR_OPTIONS,
    copies_of,
    diagnostics_for,
    saved_for,
    stream_mix_traffic,
    sublayers,
)
from t2train.residual.sublayers import sublayer_names


@dataclass
class MHCOptions:
    """``model.mhc``: n streams; per sublayer a sigmoid read, a sigmoid write and a
    doubly-stochastic (Sinkhorn-Knopp) stream mixing, predicted from the whole stream."""

    expansion_rate: int = 4  # n: copies of the hidden state in the stream
    sinkhorn_iterations: int = 20  # t_max: column-then-row normalisations of exp(H~res)
    gate_init: float = 0.01  # a_pre, a_post, a_res at initialisation
    eps: float = 1e-6  # of the RMSNorm over the flattened stream
    # Keep the n streams for the backward only where a layer starts; the states between its
    # sublayers are recomputed from there in the backward (one stream write per dropped
    # state: mHC's recomputation, Sec. 4.3, at the granularity of a layer), where the layers
    # run eagerly (model.fusions=none). False, the default: keep every state.
    recompute_streams: bool = False
    # A resumed run may change these (initial values, recomputation).
    not_architecture: ClassVar[tuple] = ("gate_init", "recompute_streams")

    def validate(self, prefix: str) -> None:
        require(
            self.expansion_rate >= 1,
            f"{prefix}.expansion_rate",
            self.expansion_rate,
            "must be >= 1 (the number of hidden-state copies in the stream)",
        )
        require(
            self.sinkhorn_iterations >= 1,
            f"{prefix}.sinkhorn_iterations",
            self.sinkhorn_iterations,
            "must be >= 1 (column-then-row normalisations that make H_res doubly stochastic)",
        )
        require(
            self.gate_init >= 0,
            f"{prefix}.gate_init",
            self.gate_init,
            "must be >= 0 (0 starts exactly as standard)",
        )
        require(self.eps > 0, f"{prefix}.eps", self.eps, "must be > 0")
        require(
            isinstance(self.recompute_streams, bool),
            f"{prefix}.recompute_streams",
            self.recompute_streams,
            "must be true or false",
        )


def extra_parameters(model) -> int:
    """Per sublayer: phi (nh x (n^2 + 2n)), the biases b (n^2 + 2n) and three gates."""
    n, h = model.mhc.expansion_rate, model.hidden_size
    outputs = n * n + 2 * n
    return sublayers(model) * (n * h * outputs + outputs + 3)


def extra_flops_per_token(model) -> int:
    """Per sublayer: the RMS over nh 2nh, the projection 2nh(n^2 + 2n), the read 2nh, the
    mixing 2n^2 h and the write 2nh. The final mean 2nh. (Terms in h only: the O(n^2)
    sigmoids and the Sinkhorn iterations per token are left out.)"""
    n, h = model.mhc.expansion_rate, model.hidden_size
    per_sublayer = 2 * n * h * (n * n + 2 * n) + 2 * n * n * h + 6 * n * h
    return sublayers(model) * per_sublayer + 2 * n * h


def mappings(model) -> int:
    """The normed projection (n^2 + 2n) and its inverse RMS, from which the read's backward
    rebuilds H_pre; H~post and H~res (n + n^2), from which the mappings' kernel reruns the
    Sinkhorn iterations in its backward, and H_post and H_res (n + n^2), which the write's
    backward takes; less the pre-norm's inverse RMS that `standard`'s norm keeps: the read
    applies the norm and its backward rebuilds it (``compiled.py``)."""
    n = model.mhc.expansion_rate
    return (n * n + 2 * n) + 1 + 2 * (n * n + n) - 1


def recomputed_states(model) -> int:
    """With ``recompute_streams`` and layers run eagerly (``model.fusions=none``): the states
    between a layer's sublayers. A compiled layer keeps them (its write and the next read are
    one function, ``compiled.py``)."""
    eager = model.fusions == "none"
    return len(sublayer_names(model)) - 1 if model.mhc.recompute_streams and eager else 0


DESIGN = ResidualDesign(
    name="mhc",
    layers="t2train.residual.mhc.layers",
    stream="ManifoldStreamCopies",
    sublayer="ManifoldHyperConnection",
    reference="Manifold-Constrained Hyper-Connections, Xie et al., DeepSeek-AI, arXiv 2512.24880",
    extra_parameters=extra_parameters,
    extra_flops_per_token=extra_flops_per_token,
    saved_per_token=saved_for("mhc", mappings, recomputed_states),
    selective_saved_per_token=scaled_output,  # its mappings are recomputed
    minimum_traffic=stream_mix_traffic("mhc"),
    unit_ids=copies_of("mhc"),
    section="mhc",
    options=MHCOptions,
    write_diagnostics=diagnostics_for("mhc"),
    inductor_options=INDUCTOR_OPTIONS,  # hc's: its write and read are shaped as hc's
)
