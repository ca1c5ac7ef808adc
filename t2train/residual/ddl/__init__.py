"""`ddl`: Deep Delta Learning (Zhang, Liu, Wang, Gu; arXiv 2601.00417).

Per sublayer (attention and MLP each), with state X in R^{d x d_v} per token:

    x_in = X                    (d_v = 1)       or  C(X), the CC compressor (d_v > 1)
    c    = RMSNorm(x_in)        the sublayer's usual pre-norm
    k~   = F(c)                 the sublayer output is the write direction
    k    = k~ / sqrt(|k~|^2 + eps_k^2)
    beta = 2 sigmoid(w_beta . c + b_beta)  in (0, 2)
    v    = v_scale sigmoid(W_v x_in + b_v)  in R^{d_v}
    (both logits computed in fp32 from low-precision inputs and weights, as the authors
    specify; k, the gates and the update in fp32, the new state in the state's dtype)
    X   <- X + beta k (v^T - k^T X)         (Eq. 2.2: A X + beta k v^T, A = I - beta k k^T)

beta = 0 is the identity, beta = 1 overwrites the k-readout with v (k^T X_new = v^T), and
beta -> 2 reflects X across the hyperplane orthogonal to k (Householder).

d_v > 1 (the authors' "CC" model): the embedding is expanded to d_v columns by an
identity-initialised causal depthwise convolution over tokens ("EC"), and every sublayer and
the final norm read the state through a per-feature channel mix over d_v (the folded CC
compressor, x_in_i = sum_j w_ij X_ij, initialised to the mean). The matrix state is stored
column-major as [d_v, s, b, h]: each column X_j is updated like a vector state with its own
v_j, and a pipeline hop carries its d_v columns as d_v units.

Every sublayer gets its own write: attention, the MLP and, when the local mixer is on, the
ShortSWA sublayer (the combination the Residual Stream Duality note recommends).

Initialisation follows the authors' code: b_beta = logit(beta_init / 2) (beta ~ 1 by
default), weights from the model's init method, v bias 0.
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
class DDLOptions:
    """``model.ddl``: X <- X + beta k (v^T - k^T X) per sublayer."""

    dv: int = 1  # state width: 1 = vector state [s, b, h]; > 1 = matrix state [dv, s, b, h]
    beta_init: float = 1.0  # beta at initialisation, in (0, 2); the authors' default is 1
    not_architecture: ClassVar[tuple] = ("beta_init",)  # a resumed run may change these
    k_eps: float = 1e-5  # k = k~ / sqrt(|k~|^2 + k_eps^2)
    v_scale: float = 4.0  # v = v_scale * sigmoid(linear(x))
    embed_conv_kernel: int = 4  # causal depthwise conv expanding the embedding when dv > 1

    def validate(self, prefix: str) -> None:
        require(self.dv >= 1, f"{prefix}.dv", self.dv, "must be >= 1")
        require(0 < self.beta_init < 2, f"{prefix}.beta_init", self.beta_init, "must be in (0, 2)")
        require(self.k_eps > 0, f"{prefix}.k_eps", self.k_eps, "must be > 0")
        require(self.v_scale > 0, f"{prefix}.v_scale", self.v_scale, "must be > 0")
        require(
            self.embed_conv_kernel >= 1,
            f"{prefix}.embed_conv_kernel",
            self.embed_conv_kernel,
            "must be >= 1",
        )


def check(config) -> None:
    """The expanded state's embedding convolution mixes tokens: it needs them all on a rank."""
    if config.parallel.sequence_parallel:
        require(
            config.model.ddl.dv == 1,
            "parallel.sequence_parallel",
            True,
            f"is not supported with model.ddl.dv={config.model.ddl.dv} (the embedding "
            "expander's causal token convolution needs the whole sequence on each rank); "
            "use model.ddl.dv=1 or parallel.sequence_parallel=false",
        )


def _sublayers(model) -> int:
    return len(sublayer_names(model)) * model.num_layers


def extra_parameters(model) -> int:
    h, dv, sublayers = model.hidden_size, model.ddl.dv, _sublayers(model)
    per_sublayer = (h + 1) + (h * dv + dv) + (h * dv if dv > 1 else 0)
    stream = h * dv * model.ddl.embed_conv_kernel + h * dv if dv > 1 else 0
    return sublayers * per_sublayer + stream


def extra_flops_per_token(model) -> int:
    """beta and v projections, k^T X, the rank-1 write (and the compressor reads)."""
    h, dv, sublayers = model.hidden_size, model.ddl.dv, _sublayers(model)
    per_sublayer = 2 * h + 2 * h * dv + 2 * h * dv + 2 * h * dv
    if dv > 1:
        per_sublayer += 2 * h * dv  # compressor read
        stream = 2 * h * dv * model.ddl.embed_conv_kernel + 2 * h * dv  # expander, final read
    else:
        stream = 0
    return sublayers * per_sublayer + stream


def saved_per_token(model) -> SavedPerToken:
    """Per sublayer, the write keeps the sublayer's output, its fp32 per-token numbers (beta's
    logit and the d_v of v, k's inverse norm and the d_v of k^T X; the pre-norm's inverse RMS
    it shares with the norm: the compiled write's backward recomputes everything h-wide from
    the bf16 tensors) and, d_v > 1, the matrix
    state its read mixes (the state's d_v columns, next to the mixed input the norm keeps);
    the entry keeps the expander's output and its input, padded with kernel - 1 earlier
    tokens."""
    h, dv, sublayers = model.hidden_size, model.ddl.dv, len(sublayer_names(model))
    state = dv if dv > 1 else 0
    padded = (model.seq_length + model.ddl.embed_conv_kernel - 1) / model.seq_length
    entry = (padded + dv) * h if dv > 1 else 0
    return SavedPerToken(
        whole=sublayers * (1 + state) * h + entry / model.num_layers,
        whole_fp32=sublayers * (2 + 2 * dv),
    )


def selective_saved_per_token(model) -> SavedPerToken:
    """Under selective recompute, d_v = 1: the MLP's output, which the write's gate reads
    (``scaled_output``); d_v > 1 is planned at ``saved_per_token`` (not measured yet)."""
    return scaled_output(model) if model.ddl.dv == 1 else saved_per_token(model)


def write_diagnostics(writer, step: int, records: dict, model) -> None:
    """Histograms ``diagnostics/ddl_beta/layer_NN.<sublayer>``, the gate beta in (0, 2), and
    ``diagnostics/ddl_kx/...``, the readout k^T X per token (and state column) that v replaces."""
    names = sublayer_names(model)
    for kind in ("ddl_beta", "ddl_kx"):
        for (layer, position), values in sorted(records.get(kind, {}).items()):
            writer.histogram(
                step, f"diagnostics/{kind}/layer_{layer:02d}.{names[position]}", values
            )


def minimum_traffic(model, _layer: int) -> Traffic:
    """With d_v state columns. Forward, one pass reads the state (d_v) and the output, and
    writes the new state (d_v) and the next sublayer's normed (compressed) input; k's norm,
    k^T X, the gates' dot products and the rank-1 update are row-local, in the same pass
    (2 d_v + 2). Backward, one pass reads the new state's gradient (d_v), the state (d_v),
    the output and the normed input's gradient, and writes the state's gradient (d_v) and
    the output's (k is the output, which enters nonlinearly: 3 d_v + 3)."""
    dv = model.ddl.dv
    return Traffic(BODY.forward + 2 * dv + 2, BODY.backward + 3 * dv + 3)


def unit_ids(model, _layers_done: int) -> list:
    """The dv columns of the state, each changing at every sublayer."""
    return [None] * model.ddl.dv


DESIGN = ResidualDesign(
    name="ddl",
    layers="t2train.residual.ddl.layers",
    stream="DeltaStream",
    sublayer="DeltaResidual",
    reference="Deep Delta Learning, Zhang et al., arXiv 2601.00417",
    extra_parameters=extra_parameters,
    extra_flops_per_token=extra_flops_per_token,
    saved_per_token=saved_per_token,
    selective_saved_per_token=selective_saved_per_token,
    minimum_traffic=minimum_traffic,
    unit_ids=unit_ids,
    section="ddl",
    options=DDLOptions,
    check=check,
    write_diagnostics=write_diagnostics,
)
