"""Tiny models built as training builds them, with every weight moved off its init value.

Shared by the math tests (``test_paper_math.py``, ``test_duality.py``, ``test_ddl.py``): the
design's modules come from the model, never from a hand-assembled layer.
"""

from __future__ import annotations

import math

import torch

from t2train.config.loader import load_config
from t2train.model.build import build_model_chunks, transformer_config

LAYERS, HEADS, HIDDEN, SEQ, BATCH = 3, 2, 8, 6, 2
EPS = 1e-5  # model.norm_epsilon
BASE = [
    "data.path=unused",
    f"model.num_layers={LAYERS}",
    f"model.hidden_size={HIDDEN}",
    f"model.num_attention_heads={HEADS}",
    f"model.seq_length={SEQ}",
    "model.ffn_hidden_size=12",
    "model.tie_embeddings=false",
]


def build_decoder(overrides, dtype=torch.float64, seed: int = 0, randomised: bool = True):
    """The decoder of a one-chunk model (``build_model_chunks``) at ``dtype``."""
    config = load_config(overrides=BASE + list(overrides))
    tf_config = transformer_config(config)
    tf_config.params_dtype = tf_config.pipeline_dtype = dtype
    [model] = build_model_chunks(config, tf_config, vocab_size=16)
    if randomised:
        randomise(model.decoder, seed)
    return model.decoder


def randomise(module, seed: int) -> None:
    """Norm weights 1 + N(0, 0.2^2); pseudo-queries and biases N(0, 0.5^2); matrices
    N(0, 1/fan_in), with the DDL gate's doubled (so beta covers both sides of 1) and v's
    halved (v reads the raw state, which DDL's writes let grow: it stays unsaturated)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=g, dtype=torch.float64)
            if name.endswith("norm.weight"):
                value = 1 + 0.2 * noise
            elif param.dim() == 1:
                value = 0.5 * noise
            else:
                value = noise / math.sqrt(param.shape[-1])
                if "beta_proj" in name:
                    value = 2 * value
                elif "v_proj" in name:
                    value = value / 2
            param.copy_(value)


def random(*shape, seed: int = 1, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
