"""A Megatron ``TransformerLayer`` whose residual connections are delegated to the design.

Submodules are injected through a ``ModuleSpec`` (``spec.py``): the norms, Megatron's
tensor-parallel ``SelfAttention`` and ``MLP``, and one ``SublayerResidual`` per sublayer.
Parameter names match Megatron's layer, so checkpoints and state dicts line up with
``GPTModel``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)
from torch import Tensor

from t2train.residual.base import State


@dataclass
class ResidualLayerSubmodules(TransformerLayerSubmodules):
    attn_residual: Union[ModuleSpec, type] = IdentityOp
    mlp_residual: Union[ModuleSpec, type] = IdentityOp


class ResidualTransformerLayer(TransformerLayer):
    """Pre-norm attention then MLP; each sublayer reads and writes the residual state."""

    def __init__(self, config, submodules: ResidualLayerSubmodules, layer_number: int = 1,
                 hidden_dropout: Optional[float] = None, pg_collection=None, vp_stage=None):
        super().__init__(config, submodules, layer_number, hidden_dropout, pg_collection, vp_stage)
        self.attn_residual = build_module(submodules.attn_residual, config=config,
                                          layer_number=self.layer_number)
        self.mlp_residual = build_module(submodules.mlp_residual, config=config,
                                         layer_number=self.layer_number)

    def forward(self, state: State, attention_mask: Optional[Tensor] = None,
                rotary_pos_emb: Optional[Tensor] = None) -> State:
        x = self.attn_residual.read(state)
        normed = self.input_layernorm(x)
        out, bias = self.self_attention(normed, attention_mask=attention_mask,
                                        rotary_pos_emb=rotary_pos_emb)
        state = self.attn_residual.write(state, x, normed, out if bias is None else out + bias)

        x = self.mlp_residual.read(state)
        normed = self.pre_mlp_layernorm(x)
        out, bias = self.mlp(normed)
        return self.mlp_residual.write(state, x, normed, out if bias is None else out + bias)
