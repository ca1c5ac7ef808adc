"""Parameter and forward-FLOP counts per token, for every residual design and the local mixer
(used for MFU).

FLOPs count multiply-adds as 2 and include the causal attention scores and mixing
(a query at position i attends to i + 1 keys). A training step costs 3x the forward
(forward + backward), plus one more forward with full activation recompute.
"""

from __future__ import annotations

from t2train.config.schema import ModelConfig
from t2train.residual import components


def plain_parameters(model: ModelConfig, vocab_size: int) -> int:
    """A plain pre-norm decoder's (the baseline design, no mixer): embedding, layers, final
    norm and an untied output layer."""
    h, f, q = model.hidden_size, model.resolved_ffn_hidden_size(), model.q_dim()
    qk_norms = 2 * model.resolved_head_dim() if model.qk_norm else 0
    per_layer = h * (q + 2 * model.kv_dim()) + q * h + 3 * h * f + 2 * h + qk_norms
    head = 0 if model.tie_embeddings else vocab_size * h
    return vocab_size * h + model.num_layers * per_layer + h + head


def extra_parameters(model: ModelConfig) -> int:
    return sum(part.extra_parameters(model) for part in components(model))


def extra_tensor_parallel_parameters(model: ModelConfig) -> int:
    """The part of ``extra_parameters`` split across tensor-parallel ranks."""
    return sum(part.tensor_parallel_parameters(model) for part in components(model))


def parameters(model: ModelConfig, vocab_size: int) -> int:
    return plain_parameters(model, vocab_size) + extra_parameters(model)


def plain_forward_flops_per_token(model: ModelConfig, vocab_size: int) -> float:
    """A plain pre-norm decoder's (the baseline design, no mixer); the designs add theirs."""
    h, f, s = model.hidden_size, model.resolved_ffn_hidden_size(), model.seq_length
    q = model.q_dim()
    projections = 2 * h * (q + 2 * model.kv_dim()) + 2 * q * h + 2 * 3 * h * f
    attention = 4 * q * (s + 1) / 2  # QK^T and AV over the causal average of keys
    return model.num_layers * (projections + attention) + 2 * h * vocab_size


def forward_flops_per_token(model: ModelConfig, vocab_size: int) -> float:
    return plain_forward_flops_per_token(model, vocab_size) + sum(
        part.extra_flops_per_token(model) for part in components(model)
    )


def train_flops_per_token(model: ModelConfig, vocab_size: int) -> float:
    passes = 4 if model.recompute == "full" else 3
    return passes * forward_flops_per_token(model, vocab_size)
