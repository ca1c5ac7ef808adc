"""`shortswa`: sequence-axis short sliding-window attention as an extra sublayer.

Residual Stream Duality (arXiv 2603.16039), Algorithm 1: before global attention, every
layer adds a pre-norm residual sublayer of causal attention over the last w tokens,

    S = H + ShortSWA(Norm(H); w),  A = S + Attn(Norm(S)),  H' = A + MLP(Norm(A)).

The sublayer is Megatron's tensor-parallel ``SelfAttention`` (heads split across TP ranks,
RoPE over tokens) with a windowed core attention; the residual itself stays additive, so
one [s, b, h] state crosses each pipeline hop.
"""

from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec

from t2train.model.flops import kv_dim
from t2train.residual.base import ResidualDesign
from t2train.residual.standard import AdditiveResidual, HiddenStateStream


def short_attention_spec() -> ModuleSpec:
    from t2train.model.attention import ShortWindowCoreAttention
    from t2train.model.spec import self_attention_spec

    return self_attention_spec(core_attention=ShortWindowCoreAttention)


def extra_parameters(model) -> int:
    h = model.hidden_size
    return model.num_layers * (h * (h + 2 * kv_dim(model)) + h * h + h)  # qkv, proj, norm


def mean_window(seq_length: int, window: int) -> float:
    """Average number of keys a causal query sees with a window of ``window``."""
    return sum(min(window, pos + 1) for pos in range(seq_length)) / seq_length


def extra_flops_per_token(model) -> float:
    h = model.hidden_size
    projections = 2 * h * (h + 2 * kv_dim(model)) + 2 * h * h
    scores_and_mix = 4 * h * mean_window(model.seq_length, model.shortswa.window)
    return model.num_layers * (projections + scores_and_mix)


DESIGN = ResidualDesign(
    name="shortswa",
    stream=HiddenStateStream,
    sublayer=AdditiveResidual,
    reference="Residual Stream Duality, Zhang, arXiv 2603.16039, Algorithm 1",
    extra_parameters=extra_parameters,
    extra_flops_per_token=extra_flops_per_token,
    pre_attention=short_attention_spec,
)
