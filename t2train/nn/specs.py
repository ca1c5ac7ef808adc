"""Megatron ModuleSpecs of the standard sublayers: tensor-parallel self-attention and MLP."""

from __future__ import annotations

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from t2train.nn.attention import CausalCoreAttention
from t2train.nn.norm import RMSNorm


def self_attention_spec(
    core_attention=CausalCoreAttention, module=SelfAttention, qk_norm: bool = False, **params
) -> ModuleSpec:
    """Megatron's tensor-parallel self-attention (or a subclass, given ``params``) around a
    core attention of our choice (a module or a ModuleSpec); with ``qk_norm`` an RMSNorm over
    each query and key head (Megatron builds it head_dim wide and applies it before RoPE)."""
    return ModuleSpec(
        module=module,
        params={"attn_mask_type": AttnMaskType.causal, **params},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=core_attention,
            linear_proj=RowParallelLinear,
            q_layernorm=RMSNorm if qk_norm else IdentityOp,
            k_layernorm=RMSNorm if qk_norm else IdentityOp,
        ),
    )


def mlp_spec() -> ModuleSpec:
    return ModuleSpec(
        module=MLP,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
    )
