"""Causal core attention for Megatron's ``SelfAttention``: flash-attn on CUDA, else PyTorch SDPA.

Drop-in for ``megatron.core.transformer.dot_product_attention.DotProductAttention`` (same
constructor and forward signature, same [s, b, heads, head_dim] inputs and [s, b, hidden]
output), without materialising the s x s score matrix.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide
from torch import Tensor


def flash_attn_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def resolve_backend(requested: str, dtype: torch.dtype) -> str:
    """``auto`` picks flash-attn for fp16/bf16 on CUDA when installed, else SDPA."""
    if requested == "flash":
        if not flash_attn_available():
            raise RuntimeError(
                "model.attention_backend='flash' needs CUDA and the flash-attn "
                "package (pip install 't2train[gpu]'); use 'auto' or 'sdpa'"
            )
        return "flash"
    if requested == "auto" and flash_attn_available() and dtype in (torch.float16, torch.bfloat16):
        return "flash"
    return "sdpa"


class CausalCoreAttention(MegatronModule):
    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        self.layer_number = layer_number
        if config.context_parallel_size != 1:
            raise ValueError("CausalCoreAttention does not support context parallelism")
        tp_size = (
            pg_collection.tp.size()
            if pg_collection is not None
            else parallel_state.get_tensor_model_parallel_world_size()
        )
        projection = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection, tp_size)
        head_dim = divide(projection, config.num_attention_heads)
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.backend = resolve_backend(
            getattr(config, "t2_attention_backend", "auto"), config.params_dtype
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ) -> Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError(
                "CausalCoreAttention supports neither attention bias nor packed sequences"
            )
        dropout = self.dropout if self.training else 0.0
        if dropout > 0 and not self.config.sequence_parallel:
            # Different dropout masks per tensor-parallel rank, as in Megatron.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = self._attend(query, key, value, dropout)
        else:
            context = self._attend(query, key, value, dropout)
        s, b = context.shape[:2]
        return context.reshape(s, b, self.hidden_size_per_partition)

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, dropout: float) -> Tensor:
        """[s, b, heads, d] in, [s, b, heads, d] out; grouped-query heads handled natively."""
        if self.backend == "flash":
            from flash_attn import flash_attn_func  # noqa: PLC0415 - flash-attn: optional, CUDA only

            q, k, v = (t.transpose(0, 1) for t in (query, key, value))  # [b, s, h, d]
            out = flash_attn_func(
                q, k, v, dropout_p=dropout, softmax_scale=self.softmax_scale, causal=True
            )
            return out.transpose(0, 1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=_after_cached_keys(q.shape[2], k.shape[2], q.device),
            dropout_p=dropout,
            is_causal=q.shape[2] == k.shape[2],
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out.permute(2, 0, 1, 3)


def _after_cached_keys(queries: int, keys: int, device) -> Optional[Tensor]:
    """With a KV cache the queries are the last ``queries`` of ``keys`` positions: each sees
    the keys up to its own (SDPA's ``is_causal`` would align them to the first keys). None
    when there is no cache (``is_causal``) or one query (it sees every key)."""
    if queries in (keys, 1):
        return None
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)
