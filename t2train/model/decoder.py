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

from t2train.model.spec import decoder_layer_spec
from t2train.nn.norm import RMSNorm
from t2train.parallel.depth_cache import DepthCache
from t2train.parallel.hop_plan import HopPlan
from t2train.parallel.traffic import HopTraffic
from t2train.residual import get_design
from t2train.residual.base import State


def decoder_block_submodules(
    config, vp_stage: Optional[int], pp_rank: int
) -> TransformerBlockSubmodules:
    layers = get_num_layers_to_build(config, vp_stage, pp_rank)
    return TransformerBlockSubmodules(
        layer_specs=[decoder_layer_spec(config.t2_model)] * layers, layer_norm=RMSNorm
    )


class ResidualDecoder(TransformerBlock):
    """Runs this chunk's layers on the residual stream state.

    First chunk: the embedding enters the stream. Other chunks: the packed state arrives
    through ``set_input_tensor``. Last chunk: the stream's final read goes through the
    final norm. Otherwise the packed state is returned for the next pipeline hop: its units
    concatenated along the sequence dim (``hops``, the run's ``HopPlan``, says which).
    """

    def __init__(
        self,
        config,
        pre_process: bool,
        post_process: bool,
        vp_stage: Optional[int],
        pp_rank: int,
        hops: HopPlan,
        depth_cache: Optional[DepthCache] = None,
        pg_collection=None,
    ):
        super().__init__(
            config,
            decoder_block_submodules(config, vp_stage, pp_rank),
            pre_process=pre_process,
            post_process=post_process,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )
        stream = get_design(config.t2_model.residual).modules().stream
        self.stream = stream(
            config,
            config.t2_model,
            pre_process,
            post_process,
            first_layer=get_transformer_layer_offset(config, vp_stage, pp_rank),
        )
        self.stream.connect(
            [residual for layer in self.layers for residual in layer.sublayer_residuals()]
        )
        virtual = config.virtual_pipeline_model_parallel_size or 1
        self.hops = hops
        self.chunk = self.stream.first_layer // len(self.layers)
        self.last_virtual_stage = (vp_stage or 0) == virtual - 1
        self.depth_cache = depth_cache  # shared by this rank's chunks, if cached
        self.micro_batch = 0
        self.traffic = HopTraffic()

    def start_schedule(self) -> None:
        """Called before each pipeline schedule: micro-batches are numbered from 0 again."""
        self.micro_batch = 0

    def forward(
        self,
        hidden_states: Optional[Tensor],
        attention_mask: Optional[Tensor],
        rotary_pos_emb: Optional[Tensor] = None,
        kv_cache=None,
    ) -> Tensor:
        if self.pre_process:
            if hidden_states is None:
                raise ValueError("the first pipeline stage needs the embedding")
            state = self._enter(hidden_states, kv_cache)
        else:
            state = self._receive_hop(self.input_tensor)

        rng = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if self.config.sequence_parallel
            else nullcontext()
        )
        with rng:
            if self.config.recompute_granularity == "full" and self.training:
                state = self._recomputed_layers(state, attention_mask, rotary_pos_emb)
            else:
                for layer in self.layers:
                    with torch.profiler.record_function(f"t2train layer {layer.layer_number}"):
                        state = layer(state, attention_mask, rotary_pos_emb, kv_cache)
                    state = self.stream.between_layers(state)

        if self.post_process:
            output = self.final_layernorm(self.stream.exit(state))
        else:
            output = self._send_hop(state)
        if self.depth_cache is not None and self.last_virtual_stage:
            self.depth_cache.drop(self.micro_batch)
        self.micro_batch += 1
        return output

    def _enter(self, embedding: Tensor, kv_cache) -> State:
        """The stream's state of the new tokens; with a cache, a stream entry that reads
        earlier tokens gets their embeddings too (and only the new tokens' state is kept)."""
        context = self.stream.entry_context
        if kv_cache is None or context == 0:
            return self.stream.enter(embedding)
        earlier = kv_cache.embeddings
        joined = embedding if earlier is None else torch.cat([earlier, embedding])
        kv_cache.embeddings = joined[-context:]
        units = self.stream.to_units(self.stream.enter(joined))
        return self.stream.from_units([unit[-embedding.shape[0] :] for unit in units], 0)

    def _receive_hop(self, hop: Tensor) -> State:
        """Rebuild the state from the hop's units and, when cached, the units kept here."""
        layers_done = self.stream.first_layer
        arriving = self.hops.sent_ids(self.chunk)
        wire_units = self.hops.wire_units(self.chunk)
        seq = hop.shape[0] // wire_units
        if seq * wire_units != hop.shape[0] or seq != self.hops.unit_rows:
            raise RuntimeError(
                f"pipeline hop into chunk {self.chunk} has {hop.shape[0]} rows, expected "
                f"{wire_units} units of {self.hops.unit_rows}: the schedule sent hops in an "
                "order t2train/parallel/hops.py does not predict (parallel.hop_shapes=padded "
                "avoids predicting)"
            )
        self.traffic.received(hop, len(arriving), wire_units)
        received = iter(
            make_viewless_tensor(hop, True, True)[: len(arriving) * seq].chunk(len(arriving))
        )
        cache, units = self.depth_cache, []
        for uid in self.hops.unit_ids(layers_done):
            if cache is not None and uid not in arriving:
                units.append(cache.read(self.micro_batch, uid))
            elif cache is not None and uid is not None:
                units.append(cache.own(self.micro_batch, uid, next(received)))
            else:
                units.append(next(received))
        return self.stream.from_units(units, layers_done)

    def _send_hop(self, state: State) -> Tensor:
        """The units the next chunk lacks, zero-padded to the layout's largest hop unless
        hop shapes are exact (``HopPlan.wire_units``).

        Megatron frees the storage of the tensor it sends, so it is a fresh tensor, never a
        view of the state or of a cached unit.
        """
        units = self.stream.to_units(state)
        ids = self.hops.unit_ids(self.stream.first_layer + len(self.layers))
        cache = self.depth_cache
        if cache is not None:
            units = [
                cache.own(self.micro_batch, uid, unit)
                if uid is not None and not cache.holds(self.micro_batch, uid)
                else unit
                for uid, unit in zip(ids, units)
            ]
        wanted = self.hops.sent_ids(self.chunk + 1)
        sent = [unit for uid, unit in zip(ids, units) if uid is None or uid in wanted]
        wire_units = self.hops.wire_units(self.chunk + 1)
        padding = wire_units - len(sent)
        if padding:
            sent.append(sent[0].new_zeros(padding * sent[0].shape[0], *sent[0].shape[1:]))
        packed = torch.cat(sent)
        self.traffic.sent(packed, len(wanted), wire_units)
        return make_viewless_tensor(packed, True, True)

    def _recomputed_layers(self, state: State, attention_mask, rotary_pos_emb) -> State:
        """Full activation recompute, ``recompute_num_layers`` layers per checkpoint.

        The state is packed into one tensor at checkpoint boundaries so that every earlier
        state a layer reads is an explicit input of the recomputed function.
        """
        first = self.stream.first_layer

        def pack(chunk_state: State) -> Tensor:
            return torch.cat(self.stream.to_units(chunk_state))

        def unpack(packed: Tensor, layers_done: int) -> State:
            units = packed.chunk(len(self.hops.unit_ids(layers_done)))
            return self.stream.from_units(list(units), layers_done)

        def run(start: int, end: int):
            def forward(packed: Tensor, mask, rope) -> Tensor:
                chunk_state = unpack(packed, first + start)
                for layer in self.layers[start:end]:
                    chunk_state = self.stream.between_layers(layer(chunk_state, mask, rope))
                return pack(chunk_state)

            return forward

        packed = pack(state)
        step = self.config.recompute_num_layers
        for start in range(0, len(self.layers), step):
            packed = tensor_parallel.checkpoint(
                run(start, min(start + step, len(self.layers))),
                self.config.distribute_saved_activations,
                packed,
                attention_mask,
                rotary_pos_emb,
            )
        return unpack(packed, first + len(self.layers))
