"""A t2train decoder for Hugging Face transformers (``trust_remote_code=True``).

`t2train export hf` writes this file next to the exported weights as ``modeling_t2train.py``,
with every design's export part (``t2train/residual/<design>/hf.py``, beside the design's
training module) inserted where the designs go and the functions they compute with (the
trainer's own ``functional`` modules) after the imports (``modeling_source`` in
``t2train/residual/hf.py``); it imports only torch and transformers. It is t2train's decoder
(Megatron's attention and MLP written out) on [batch, seq, hidden] tensors:

    state = stream.enter(embed(tokens))
    for every layer:
        state = layer_entry.begin(state)              (designs with a layer entry)
        for every sublayer f: local attention (local_window > 0), attention, MLP
            x = residual.read(state)
            normed = norm(x)
            state = residual.write(state, x, normed, f(normed))
    logits = lm_head(final_norm(stream.exit(state)))

A residual design is a stream (what the state is, how the embedding enters it and the final
norm reads it), a sublayer residual (read/write) and an optional layer entry, which its
export part adds to ``DESIGNS``. Parameter names follow t2train's
(``attn_residual.beta_proj.weight``, ``stream.final_query``, ``layer_entry.linear_q.weight``),
the shared parts Llama's.

There is no KV cache: every generation step runs the whole sequence again (plain and
exact; fine for the small models this is meant to look at). Padding is not supported.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from t2train.residual.functional import short_window_attention


class T2TrainConfig(PretrainedConfig):
    """The decoder's shape (Llama's field names), the residual design and its options
    (t2train's ``model.<section>`` of that design), and the local attention window
    (0: no local attention sublayer)."""

    model_type = "t2train"

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 256,
        intermediate_size: int = 704,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        num_key_value_heads: Optional[int] = None,
        rms_norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 256,
        initializer_range: float = 0.02,
        residual: str = "standard",
        residual_options: Optional[dict] = None,
        local_window: int = 0,
        tie_word_embeddings: bool = True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.residual = residual
        self.residual_options = dict(residual_options or {})
        self.local_window = local_window
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def sublayers(self) -> list[str]:
        """Each layer's sublayers in order; a residual's ``position`` indexes this list."""
        return (["local_attn"] if self.local_window > 0 else []) + ["attn", "mlp"]


# --- shared building blocks: RoPE, attention, MLP ------------------------------------------


def rope_tables(config: T2TrainConfig, seq_len: int, device) -> tuple[Tensor, Tensor]:
    """cos and sin [seq, head_dim] of non-interleaved rotary embeddings (Megatron's and
    Llama's: the two halves of each head are rotated together)."""
    dim = config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    )
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads and RoPE, no biases; with ``window``
    each token attends to its last ``window`` tokens only (the local attention sublayer)."""

    def __init__(self, config: T2TrainConfig, window: Optional[int] = None):
        super().__init__()
        h, heads, groups = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
        )
        self.heads, self.groups, self.head_dim = heads, groups, h // heads
        self.window = window
        self.q_proj = nn.Linear(h, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, groups * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, groups * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, h, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.groups, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.groups, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.window is None:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=self.groups != self.heads
            )
        else:
            out = short_window_attention(q, k, v, self.window)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: T2TrainConfig):
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# --- the designs: each one's export part, beside its training module -------------------------
# (t2train/residual/<design>/hf.py; ``t2train.residual.hf`` inserts them below this line)

DESIGNS: dict = {}  # model.residual -> (stream, sublayer residual, layer entry or None)


def design(config: T2TrainConfig) -> tuple:
    if config.residual not in DESIGNS:
        raise ValueError(
            f"residual={config.residual!r}: this modeling file implements {sorted(DESIGNS)}"
        )
    return DESIGNS[config.residual]


# --- the decoder ---------------------------------------------------------------------------


class DecoderLayer(nn.Module):
    def __init__(self, config: T2TrainConfig, layer: int):
        super().__init__()
        _, residual, entry = design(config)
        h, eps, position = config.hidden_size, config.rms_norm_eps, config.sublayers().index
        self.layer_entry = entry(config, layer) if entry is not None else None
        self.local_attn = None
        if config.local_window > 0:
            self.local_attn_layernorm = nn.RMSNorm(h, eps=eps)
            self.local_attn = Attention(config, window=config.local_window)
            self.local_attn_residual = residual(config, layer, position("local_attn"))
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.self_attn = Attention(config)
        self.attn_residual = residual(config, layer, position("attn"))
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)
        self.mlp = MLP(config)
        self.mlp_residual = residual(config, layer, position("mlp"))

    @staticmethod
    def sublayer(state, residual, norm, function):
        x = residual.read(state)
        normed = norm(x)
        return residual.write(state, x, normed, function(normed))

    def forward(self, state, cos: Tensor, sin: Tensor):
        if self.layer_entry is not None:
            state = self.layer_entry.begin(state)
        if self.local_attn is not None:
            state = self.sublayer(
                state,
                self.local_attn_residual,
                self.local_attn_layernorm,
                lambda normed: self.local_attn(normed, cos, sin),
            )
        state = self.sublayer(
            state,
            self.attn_residual,
            self.input_layernorm,
            lambda normed: self.self_attn(normed, cos, sin),
        )
        return self.sublayer(state, self.mlp_residual, self.post_attention_layernorm, self.mlp)


class T2TrainPreTrainedModel(PreTrainedModel):
    config_class = T2TrainConfig  # type: ignore[assignment]
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        """Only for weights a checkpoint lacks; exported checkpoints hold every weight."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, self.config.initializer_range)


class T2TrainModel(T2TrainPreTrainedModel):
    def __init__(self, config: T2TrainConfig):
        super().__init__(config)
        stream, _, _ = design(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.stream = stream(config)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:  # type: ignore[override]
        self.embed_tokens = value

    def forward(self, input_ids: Tensor) -> Tensor:
        cos, sin = rope_tables(self.config, input_ids.shape[1], input_ids.device)  # type: ignore[arg-type]
        state = self.stream.enter(self.embed_tokens(input_ids))
        for layer in self.layers:
            state = layer(state, cos, sin)
        return self.norm(self.stream.exit(state))


class T2TrainForCausalLM(T2TrainPreTrainedModel, GenerationMixin):  # type: ignore[misc]
    _tied_weights_keys = ["lm_head.weight"]  # type: ignore[assignment]

    def __init__(self, config: T2TrainConfig):
        super().__init__(config)
        self.model = T2TrainModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:  # type: ignore[override]
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def prepare_inputs_for_generation(self, input_ids: Tensor, **kwargs) -> dict:  # type: ignore[override]
        return {"input_ids": input_ids, "attention_mask": kwargs.get("attention_mask")}

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Optional[Tensor] = None,
        labels: Optional[Tensor] = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("padded batches are not supported: give sequences of one length")
        logits = self.lm_head(self.model(input_ids))
        loss = None
        if labels is not None:  # labels are the inputs; position t predicts token t + 1
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)  # type: ignore[arg-type]
