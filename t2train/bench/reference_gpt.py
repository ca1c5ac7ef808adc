"""A minimal plain-PyTorch GPT of the standard design, to time the stack's overhead against.

Same shapes as t2train's ``standard`` model (pre-norm RMSNorm, RoPE, causal SDPA, SwiGLU MLP
without biases, tied embeddings) trained with AdamW (fused on CUDA) and gradient clipping on
the same micro-batches: no Megatron, no pipeline schedule, no distributed optimizer. Eager,
or with ``torch.compile`` applied to each block (torchtitan's habit): what a user could write
in an afternoon, and what t2train's fused path (``model.fusions``) must at least match.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from t2train.config.schema import Config


def _rope(x: torch.Tensor, base: int) -> torch.Tensor:
    """Rotate halves of each head's dims; x is [b, heads, s, d]."""
    s, d = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(s, device=x.device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), -1)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), -1) * sin


class _Block(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        model = config.model
        h, ffn = model.hidden_size, model.resolved_ffn_hidden_size()
        self.heads = model.num_attention_heads
        self.kv_heads = model.num_query_groups or self.heads
        self.head_dim = h // self.heads
        self.rotary_base = model.rotary_base
        self.attn_norm = nn.RMSNorm(h, eps=model.norm_epsilon)
        self.qkv = nn.Linear(h, h + 2 * model.kv_dim(), bias=False)
        self.proj = nn.Linear(h, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=model.norm_epsilon)
        self.gate_up = nn.Linear(h, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(
            [h, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1
        )
        q = _rope(q.view(b, s, self.heads, self.head_dim).transpose(1, 2), self.rotary_base)
        k = _rope(k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2), self.rotary_base)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads
        )
        x = x + self.proj(attended.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class ReferenceGPT(nn.Module):
    def __init__(self, config: Config, vocab_size: int):
        super().__init__()
        model = config.model
        self.embedding = nn.Embedding(vocab_size, model.hidden_size)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(model.num_layers))
        self.final_norm = nn.RMSNorm(model.hidden_size, eps=model.norm_epsilon)
        self.head = (
            None if model.tie_embeddings else nn.Linear(model.hidden_size, vocab_size, bias=False)
        )
        for param in self.parameters():
            if param.dim() > 1:
                nn.init.normal_(param, std=model.init_method_std)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.final_norm(x)
        logits = x @ self.embedding.weight.t() if self.head is None else self.head(x)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_reference_steps(
    config: Config,
    vocab_size: int,
    steps: list[list[dict]],
    warmup: int,
    dtype: torch.dtype,
    backend: Optional[str] = None,
) -> list[float]:
    """Seconds of every step on ``steps``' micro-batches (the first ``warmup`` are the
    warm-up); with a ``torch.compile`` ``backend``, each block compiled with it."""
    device = steps[0][0]["tokens"].device
    model = ReferenceGPT(config, vocab_size).to(device)
    if backend is not None:
        for block in model.blocks:
            block.compile(backend=backend)
    train = config.train
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=train.lr,
        betas=(train.adam_beta1, train.adam_beta2),
        eps=train.adam_eps,
        weight_decay=train.weight_decay,
        fused=device.type == "cuda",
    )
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    seconds = []
    for micro_batches in steps:
        _synchronize(device)
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for batch in micro_batches:
            with autocast:
                loss = model(batch["tokens"], batch["labels"]) / len(micro_batches)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.clip_grad)
        optimizer.step()
        _synchronize(device)
        seconds.append(time.perf_counter() - started)
    return seconds
