"""ModuleSpecs: which modules make up a t2train decoder layer for a residual design."""

from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec

from t2train.model.layer import ResidualLayerSubmodules, ResidualTransformerLayer
from t2train.nn.norm import RMSNorm
from t2train.nn.specs import mlp_spec, self_attention_spec
from t2train.residual import get_design, mixer, sublayer_names


def decoder_layer_spec(model) -> ModuleSpec:
    """The layer spec for a ``ModelConfig``: Megatron's local modules, the residual design's
    operator on every sublayer, its layer entry, and the local mixer's sublayer when on."""
    design = get_design(model.residual).modules()
    names = sublayer_names(model)
    mixes = len(names) == 3  # the mixer's sublayer comes first
    residual = {
        name: ModuleSpec(module=design.sublayer, params={"model": model, "position": position})
        for position, name in enumerate(names)
    }
    entry = design.layer_entry

    return ModuleSpec(
        module=ResidualTransformerLayer,
        submodules=ResidualLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=self_attention_spec(qk_norm=model.qk_norm),
            pre_mlp_layernorm=RMSNorm,
            mlp=mlp_spec(),
            attn_residual=residual["attn"],
            mlp_residual=residual["mlp"],
            layer_entry=None
            if entry is None
            else ModuleSpec(module=entry, params={"model": model}),
            pre_attention_layernorm=RMSNorm if mixes else None,
            pre_attention=mixer().module_spec(model) if mixes else None,
            pre_attention_residual=residual[names[0]] if mixes else None,
        ),
    )
