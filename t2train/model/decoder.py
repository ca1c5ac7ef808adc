"""The decoder stack of one model chunk: Megatron's ``TransformerBlock`` with a residual stream.

``TransformerBlock`` gives layer construction with pipeline offsets, the final norm and the
reshardable ``sharded_state_dict``; this subclass replaces its layer loop so that the state
passed between layers (and across pipeline hops) is whatever the residual design needs.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch

from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.utils import make_viewless_tensor
from torch import Tensor

from t2train.model.norm import RMSNorm
from t2train.model.spec import decoder_layer_spec
from t2train.residual import get_design
from t2train.residual.base import State


def decoder_block_submodules(config, residual: str, vp_stage: Optional[int],
                             pp_rank: int) -> TransformerBlockSubmodules:
    layers = get_num_layers_to_build(config, vp_stage, pp_rank)
    return TransformerBlockSubmodules(layer_specs=[decoder_layer_spec(residual)] * layers,
                                      layer_norm=RMSNorm)


class ResidualDecoder(TransformerBlock):
    """Runs this chunk's layers on the residual stream state.

    First chunk: the embedding enters the stream. Other chunks: the packed state arrives
    through ``set_input_tensor``. Last chunk: the stream's final read goes through the
    final norm. Otherwise the packed state is returned for the next pipeline hop.
    """

    def __init__(self, config, residual: str, pre_process: bool, post_process: bool,
                 vp_stage: Optional[int], pp_rank: int, pg_collection=None):
        super().__init__(config, decoder_block_submodules(config, residual, vp_stage, pp_rank),
                         pre_process=pre_process, post_process=post_process,
                         pg_collection=pg_collection, vp_stage=vp_stage)
        self.stream = get_design(residual).stream(
            config, pre_process, post_process,
            first_layer=get_transformer_layer_offset(config, vp_stage, pp_rank))

    def forward(self, hidden_states: Optional[Tensor], attention_mask: Optional[Tensor],
                rotary_pos_emb: Optional[Tensor] = None) -> Tensor:
        if self.pre_process:
            state = self.stream.enter(hidden_states)
        else:
            state = self._receive_hop(self.input_tensor)

        rng = tensor_parallel.get_cuda_rng_tracker().fork() if self.config.sequence_parallel \
            else nullcontext()
        with rng:
            if self.config.recompute_granularity == "full" and self.training:
                state = self._recomputed_layers(state, attention_mask, rotary_pos_emb)
            else:
                for layer in self.layers:
                    state = layer(state, attention_mask, rotary_pos_emb)

        if self.post_process:
            return self.final_layernorm(self.stream.exit(state))
        return self._send_hop(state)

    def _receive_hop(self, hop: Tensor) -> State:
        units = self.stream.hop_units(self.stream.first_layer)
        seq = hop.shape[0] // self.stream.padded_hop_units
        packed = make_viewless_tensor(hop, True, True)[: units * seq]
        return self.stream.receive(packed, self.stream.first_layer)

    def _send_hop(self, state: State) -> Tensor:
        """The packed state, zero-padded to the layout's hop size, in a fresh tensor.

        Megatron frees the storage of the tensor it sends, so it must not be a view.
        """
        packed = self.stream.send(state)
        units = self.stream.hop_units(self.stream.first_layer + len(self.layers))
        padding = self.stream.padded_hop_units - units
        if padding:
            seq = packed.shape[0] // units
            packed = torch.cat([packed, packed.new_zeros(padding * seq, *packed.shape[1:])])
        return make_viewless_tensor(packed, True, True)

    def _recomputed_layers(self, state: State, attention_mask, rotary_pos_emb) -> State:
        """Full activation recompute, ``recompute_num_layers`` layers per checkpoint.

        The state is packed into one tensor at checkpoint boundaries so that every earlier
        state a layer reads is an explicit input of the recomputed function.
        """

        def run(start: int, end: int):
            def forward(packed: Tensor, mask, rope) -> Tensor:
                chunk_state = self.stream.receive(packed, self.stream.first_layer + start)
                for layer in self.layers[start:end]:
                    chunk_state = layer(chunk_state, mask, rope)
                return self.stream.send(chunk_state)

            return forward

        packed = self.stream.send(state)
        step = self.config.recompute_num_layers
        for start in range(0, len(self.layers), step):
            packed = tensor_parallel.checkpoint(
                run(start, min(start + step, len(self.layers))),
                self.config.distribute_saved_activations, packed, attention_mask, rotary_pos_emb)
        return self.stream.receive(packed, self.stream.first_layer + len(self.layers))
