"""ModuleSpecs: which modules make up a t2train decoder layer for a residual design."""

from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec

from t2train.model.layer import ResidualLayerSubmodules, ResidualTransformerLayer
from t2train.nn.norm import RMSNorm
from t2train.nn.specs import mlp_spec, self_attention_spec
from t2train.residual import get_design


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
