"""ModuleSpecs: which modules make up a t2train decoder layer for a residual design."""

from __future__ import annotations

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from t2train.model.attention import CausalCoreAttention
from t2train.model.layer import ResidualLayerSubmodules, ResidualTransformerLayer
from t2train.model.norm import RMSNorm
from t2train.residual import get_design


def self_attention_spec(core_attention=CausalCoreAttention) -> ModuleSpec:
    """Megatron's tensor-parallel self-attention around a core attention of our choice."""
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=core_attention,
            linear_proj=RowParallelLinear,
            q_layernorm=IdentityOp,
            k_layernorm=IdentityOp,
        ),
    )


def mlp_spec() -> ModuleSpec:
    return ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                           linear_fc2=RowParallelLinear))


def decoder_layer_spec(residual: str) -> ModuleSpec:
    """The layer spec for ``model.residual``: Megatron's local modules plus the design's."""
    design = get_design(residual)
    extra = design.pre_attention is not None
    offset = 1 if extra else 0  # sublayer positions within the layer
    return ModuleSpec(
        module=ResidualTransformerLayer,
        submodules=ResidualLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=self_attention_spec(),
            pre_mlp_layernorm=RMSNorm,
            mlp=mlp_spec(),
            attn_residual=ModuleSpec(module=design.sublayer, params={"position": offset}),
            mlp_residual=ModuleSpec(module=design.sublayer, params={"position": offset + 1}),
            layer_entry=design.layer_entry,
            pre_attention_layernorm=RMSNorm if extra else None,
            pre_attention=design.pre_attention() if extra else None,
            pre_attention_residual=(ModuleSpec(module=design.sublayer, params={"position": 0})
                                    if extra else None),
        ),
    )
