"""The t2train GPT: Megatron-core embedding, rotary positions, residual decoder, output head.

A ``LanguageModule`` like Megatron's ``GPTModel`` (same parameter names, so a `standard`
model loads a ``GPTModel`` state dict and vice versa), with the decoder replaced by
``ResidualDecoder`` so the residual stream is pluggable. One instance is one pipeline
chunk: ``pre_process`` holds the embedding, ``post_process`` the final norm and head.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
)
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import ModelType
from torch import Tensor

from t2train.model.decoder import ResidualDecoder
from t2train.model.kv_cache import KVCache
from t2train.nn.cross_entropy import vocab_parallel_cross_entropy
from t2train.parallel.depth_cache import DepthCache
from t2train.parallel.traffic import HopTraffic

EMBEDDING_WEIGHT = "embedding.word_embeddings.weight"  # its rows: the (padded) vocabulary


class T2GPTModel(LanguageModule):
    def __init__(
        self,
        config,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        share_embeddings_and_output_weights: bool = True,
        rotary_base: int = 10000,
        vp_stage: Optional[int] = None,
        hops=None,
        depth_cache: Optional[DepthCache] = None,
        pg_collection=None,
    ):
        """``hops``: the run's ``HopPlan``; ``depth_cache``: the units this rank keeps between
        its chunks (one ``DepthCache`` shared by them, with cached hops), else None."""
        pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
        super().__init__(config=config, pg_collection=pg_collection)
        self.model_type = ModelType.encoder_or_decoder
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.vp_stage = vp_stage

        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config=config,
                vocab_size=vocab_size,
                max_sequence_length=max_sequence_length,
                position_embedding_type="rope",
                tp_group=pg_collection.tp,
            )
        scaling = config.t2_model.rope_scaling_factor
        self.rotary_pos_emb = RotaryEmbedding(
            kv_channels=config.kv_channels,
            rotary_percent=1.0,
            rotary_base=rotary_base,
            rope_scaling=scaling > 0,
            rope_scaling_factor=scaling or 8.0,
            use_cpu_initialization=config.use_cpu_initialization,
            cp_group=pg_collection.cp,
        )
        self.decoder = ResidualDecoder(
            config,
            pre_process=pre_process,
            post_process=post_process,
            vp_stage=vp_stage,
            pp_rank=pg_collection.pp.rank(),
            hops=hops,
            depth_cache=depth_cache,
            pg_collection=pg_collection,
        )
        if post_process:
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size,
                vocab_size,
                config=config,
                init_method=config.init_method,
                bias=False,
                skip_bias_add=False,
                gather_output=False,
                skip_weight_param_allocation=pre_process and share_embeddings_and_output_weights,
                tp_group=pg_collection.tp,
            )
        if pre_process or post_process:
            self.setup_embeddings_and_output_layer()

    # --- The run-time interface: what engines, parallel/ and monitor/ call on a chunk. -----
    # Nothing outside t2train/model/ reaches into the decoder (tests/test_interfaces.py).

    def start_schedule(self) -> None:
        """Before each pipeline schedule (a training step, an evaluation): micro-batches are
        numbered from 0 again, which the depth cache's entries are keyed by."""
        self.decoder.start_schedule()

    @property
    def traffic(self) -> HopTraffic:
        """This chunk's pipeline-hop byte and hop counters (``t2train/parallel/traffic.py``)."""
        return self.decoder.traffic

    def stream_norms(self) -> list[tuple[int, torch.nn.Module]]:
        """The norms that read the residual stream, by layer number: each layer's first
        pre-norm, and on the last stage the final norm numbered ``num_layers + 1``."""
        norms = [(layer.layer_number, layer.input_layernorm) for layer in self.decoder.layers]
        if self.post_process:
            norms.append((self.config.num_layers + 1, self.decoder.final_layernorm))
        return norms

    def layers_and_stream(self) -> tuple[list, torch.nn.Module]:
        """The chunk's decoder layers and its residual stream (``ResidualStream``), for tools
        that run the layers one at a time (``t2train bench bytes``)."""
        return list(self.decoder.layers), self.decoder.stream

    def decode(self, hidden_states: Tensor) -> Tensor:
        """The decoder alone on embedded tokens ``hidden_states`` [s, b, h] of one chunk of a
        one-stage model: the stream's entry, the layers, its exit and the final norm, with
        the rotary table of the sequence (the layer benchmark, ``t2train bench kernels``)."""
        rotary = self.rotary_pos_emb(hidden_states.shape[0])
        return self.decoder(hidden_states, None, rotary_pos_emb=rotary)

    def whole_model_name(self, name: str) -> str:
        """A state-dict key of this chunk as a PP = 1 model names it: a pipeline stage numbers
        its layers from 0, ``layer_number`` is a layer's place in the whole model (from 1)."""
        found = re.match(r"decoder\.layers\.(\d+)\.", name)
        if found is None:
            return name
        layer = self.decoder.layers[int(found.group(1))].layer_number - 1
        return f"decoder.layers.{layer}.{name[found.end() :]}"

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, list):
            if len(input_tensor) != 1:
                raise ValueError("a pipeline hop carries exactly one (packed) tensor")
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Optional[Tensor],
        attention_mask: Optional[Tensor] = None,
        labels: Optional[Tensor] = None,
        kv_cache: Optional[KVCache] = None,
    ) -> Tensor:
        """Per-token loss [b, s] when ``labels`` are given, else logits [b, s, vocab/tp].

        On a chunk without the head, returns the packed stream state for the next stage.
        With ``kv_cache`` (inference, one chunk), ``input_ids`` are the tokens after the cached
        ones, at the positions that follow; the cache then holds them too.
        """
        embedding = (
            self.embedding(input_ids=input_ids, position_ids=position_ids)
            if self.pre_process
            else None
        )
        # Every stage gets the tokens; a packed pipeline hop is longer than the sequence.
        # With a cache, Megatron's attention takes the rows of the new positions itself.
        rotary = self.rotary_pos_emb(
            input_ids.shape[1] if kv_cache is None else kv_cache.max_length
        )
        hidden = self.decoder(embedding, attention_mask, rotary_pos_emb=rotary, kv_cache=kv_cache)
        if kv_cache is not None:
            kv_cache.advance(input_ids.shape[1])
        if not self.post_process:
            return hidden
        weight = (
            self.shared_embedding_or_output_weight()
            if self.share_embeddings_and_output_weights
            else None
        )
        logits, _ = self.output_layer(hidden, weight=weight)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)

    def compute_language_model_loss(self, labels: Tensor, logits: Tensor) -> Tensor:
        """Per-token loss [b, s] from logits [s, b, vocab/tp]: Megatron's, or on the fused path
        t2train's, which keeps no fp32 copy of the logits (``t2train/nn/cross_entropy.py``)."""
        if not self.config.t2_fused_loss:
            return super().compute_language_model_loss(labels, logits)
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), self.pg_collection.tp)
        return loss.transpose(0, 1).contiguous()
