"""A Megatron ``TransformerLayer`` whose residual connections are delegated to the design.

Submodules are injected through a ``ModuleSpec`` (``spec.py``): the norms, Megatron's
tensor-parallel ``SelfAttention`` and ``MLP``, one ``SublayerResidual`` per sublayer, and
optionally a layer entry (run once before the sublayers) and an extra first sublayer.
Parameter names of the shared parts match Megatron's layer, so `standard` checkpoints and
state dicts line up with ``GPTModel``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)
from torch import Tensor

from t2train.nn.recompute import selective_checkpoint
from t2train.residual.base import State


@dataclass
class ResidualLayerSubmodules(TransformerLayerSubmodules):
    attn_residual: Union[ModuleSpec, type] = IdentityOp
    mlp_residual: Union[ModuleSpec, type] = IdentityOp
    layer_entry: Optional[Union[ModuleSpec, type]] = None
    pre_attention_layernorm: Optional[Union[ModuleSpec, type]] = None
    pre_attention: Optional[Union[ModuleSpec, type]] = None
    pre_attention_residual: Optional[Union[ModuleSpec, type]] = None


class ResidualTransformerLayer(TransformerLayer):
    """[layer entry] -> [extra sublayer] -> attention -> MLP, each on the residual state."""

    def __init__(
        self,
        config,
        submodules: ResidualLayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: Optional[float] = None,
        pg_collection=None,
        vp_stage=None,
    ):
        super().__init__(config, submodules, layer_number, hidden_dropout, pg_collection, vp_stage)
        built = {"config": config, "layer_number": self.layer_number}
        self.attn_residual = build_module(submodules.attn_residual, **built)
        self.mlp_residual = build_module(submodules.mlp_residual, **built)
        self.layer_entry = (
            build_module(submodules.layer_entry, **built)
            if submodules.layer_entry is not None
            else None
        )
        self.pre_attention = None
        if submodules.pre_attention is not None:
            self.pre_attention_layernorm = build_module(
                submodules.pre_attention_layernorm,
                config=config,
                hidden_size=config.hidden_size,
                eps=config.layernorm_epsilon,
            )
            self.pre_attention = build_module(
                submodules.pre_attention,
                config=config,
                layer_number=self.layer_number,
                pg_collection=self.pg_collection,
            )
            self.pre_attention_residual = build_module(submodules.pre_attention_residual, **built)
        residuals = self.sublayer_residuals()
        for residual, norm, following in zip(
            residuals, self.sublayer_norms(), residuals[1:] + [None]
        ):
            residual.attach_pre_norm(norm)
            residual.attach_following(following)

    def sublayer_residuals(self) -> list:
        """This layer's ``SublayerResidual`` modules, in the order they run."""
        mixer = [self.pre_attention_residual] if self.pre_attention is not None else []
        return mixer + [self.attn_residual, self.mlp_residual]

    def sublayer_norms(self) -> list:
        """The pre-norm of each sublayer, in the order they run."""
        mixer = [self.pre_attention_layernorm] if self.pre_attention is not None else []
        return mixer + [self.input_layernorm, self.pre_mlp_layernorm]

    def _sublayer(self, state: State, residual, norm, mixer: Callable[[Tensor], tuple]) -> State:
        """Hidden dropout is the layer's, before the design writes the output (where Megatron's
        bias-dropout-add has it), so every design gets the same; its masks come from the
        generator of the hidden state's layout (ResidualDecoder forks the tensor-parallel one
        under sequence parallelism)."""
        x, normed = residual.read_normed(state, norm)
        out, bias = mixer(normed)
        out = out if bias is None else out + bias
        return residual.write(
            state, x, normed, F.dropout(out, p=self.hidden_dropout, training=self.training)
        )

    def forward(
        self,
        state: State,
        attention_mask: Optional[Tensor] = None,
        rotary_pos_emb: Optional[Tensor] = None,
        kv_cache=None,
    ) -> State:
        """``kv_cache``: a ``KVCache`` when generating (``t2train/model/kv_cache.py``)."""
        if self.config.t2_selective_recompute and self.training and torch.is_grad_enabled():
            return selective_checkpoint(self._layer, state, attention_mask, rotary_pos_emb)
        return self._layer(state, attention_mask, rotary_pos_emb, kv_cache)

    def _layer(self, state: State, attention_mask, rotary_pos_emb, kv_cache=None) -> State:
        if self.layer_entry is not None:
            state = self.layer_entry.begin(state)

        def attend(module, inference_context):
            return lambda normed: module(
                normed,
                attention_mask=attention_mask,
                rotary_pos_emb=rotary_pos_emb,
                inference_context=inference_context,
            )

        if self.pre_attention is not None:
            state = self._sublayer(
                state,
                self.pre_attention_residual,
                self.pre_attention_layernorm,
                attend(self.pre_attention, kv_cache and kv_cache.mixer),
            )
        state = self._sublayer(
            state,
            self.attn_residual,
            self.input_layernorm,
            attend(self.self_attention, kv_cache and kv_cache.attention),
        )
        return self._sublayer(state, self.mlp_residual, self.pre_mlp_layernorm, self.mlp)
