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
from torch import Tensor

from t2train.kernels.dispatch import short_window_attention
from t2train.nn import probe
from t2train.nn.attention import CausalCoreAttention
from t2train.nn.specs import self_attention_spec
from t2train.residual.base import ResidualDesign
from t2train.residual.standard import AdditiveResidual, HiddenStateStream
from t2train.residual.window_attention import window_attention_entropy


class ShortWindowCoreAttention(CausalCoreAttention):
    """Causal attention over the last ``model.shortswa.window`` tokens (ShortSWA).

    flash-attn's ``window_size=(w - 1, 0)`` on CUDA, else ``short_window_attention`` (the
    same operator the depth read uses): the Triton kernel on CUDA, the PyTorch reference on
    CPU (see ``t2train.kernels.dispatch``).
    """

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.window = config.t2_model.shortswa.window

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, dropout: float) -> Tensor:
        probe.record("shortswa_entropy", self.layer_number, lambda: window_attention_entropy(
            query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), self.window, self.softmax_scale))
        if self.backend == "flash":
            from flash_attn import flash_attn_func

            q, k, v = (t.transpose(0, 1) for t in (query, key, value))
            out = flash_attn_func(q, k, v, dropout_p=dropout, softmax_scale=self.softmax_scale,
                                  causal=True, window_size=(self.window - 1, 0))
            return out.transpose(0, 1)
        if dropout > 0:
            raise ValueError("ShortSWA's reference attention has no attention dropout")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        return short_window_attention(q, k, v, self.window, self.softmax_scale).permute(2, 0, 1, 3)


def short_attention_spec() -> ModuleSpec:
    return self_attention_spec(core_attention=ShortWindowCoreAttention)


def extra_parameters(model) -> int:
    h = model.hidden_size
    return model.num_layers * (h * (h + 2 * model.kv_dim()) + h * h + h)  # qkv, proj, norm


def mean_window(seq_length: int, window: int) -> float:
    """Average number of keys a causal query sees with a window of ``window``."""
    return sum(min(window, pos + 1) for pos in range(seq_length)) / seq_length


def extra_flops_per_token(model) -> float:
    h = model.hidden_size
    projections = 2 * h * (h + 2 * model.kv_dim()) + 2 * h * h
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
