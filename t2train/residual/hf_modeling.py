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

Generation keeps the earlier tokens' keys and values in transformers' ``DynamicCache`` (a
layer of it per attention and local attention, ``T2TrainConfig.attention_slot``): every design reads
and writes the stream at one position at a time (the depth reads mix a token's own layer
states), so attention is the only part that looks at earlier tokens, and the cache is exact
for every design. A stream whose entry reads earlier tokens (``Stream.entry_context``) keeps
their embeddings in a slot of its own. Batches may be padded on either side: positions count
each row's real tokens (``attention_mask``), padding is never attended to, and it enters the
stream as zeros, as the positions before a sequence do in training.

It runs under transformers 4.56 and later, 5.x included (``CACHE`` below is the one name
that differs between them).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from t2train.residual.functional import short_window_attention


class T2TrainConfig(PretrainedConfig):
    """The decoder's shape (Llama's field names; ``head_dim`` None: hidden_size /
    num_attention_heads), Qwen3's per-head q/k norms in the attention sublayer (``qk_norm``),
    the residual design and its options (t2train's ``model.<section>`` of that design), and
    the local attention window (0: no local attention sublayer)."""

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
        head_dim: Optional[int] = None,
        qk_norm: bool = False,
        residual: str = "standard",
        residual_options: Optional[dict] = None,
        local_window: int = 0,
        tie_word_embeddings: bool = True,
        use_cache: bool = True,
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
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.qk_norm = qk_norm
        self.residual = residual
        self.residual_options = dict(residual_options or {})
        self.local_window = local_window
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def sublayers(self) -> list[str]:
        """Each layer's sublayers in order; a residual's ``position`` indexes this list."""
        return (["local_attn"] if self.local_window > 0 else []) + ["attn", "mlp"]

    # The KV cache's layers ("slots"): each layer's attention (the ones transformers allocates,
    # one per decoder layer), each layer's local attention, then the embeddings that a stream
    # entry reading earlier tokens needs (empty for the others). Every slot keeps all tokens;
    # the local attention masks by distance.
    def attention_slot(self, layer: int, local: bool = False) -> int:
        return layer + (self.num_hidden_layers if local else 0)

    @property
    def entry_slot(self) -> int:
        return self.num_hidden_layers * (2 if self.local_window > 0 else 1)


# transformers 5 calls the KV cache ``cache`` (an argument, an output field) where 4.x said
# ``past_key_values``; this file answers to both and speaks the running version's.
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def with_slots(cache: DynamicCache, config: T2TrainConfig) -> DynamicCache:
    """``cache`` with a layer for every slot: ``generate`` makes one per decoder layer."""
    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"a {type(cache).__name__}: this model keeps keys and values in a DynamicCache "
            "(generate's default cache_implementation), whose layers grow with the tokens"
        )
    while len(cache.layers) <= config.entry_slot:
        cache.layers.append(DynamicLayer())
    return cache


# --- shared building blocks: where tokens sit, RoPE, attention, MLP -------------------------


class Tokens(NamedTuple):
    """The new tokens of a forward: their rotary tables and, unless they are one unpadded
    batch with nothing cached, which keys (every token so far, cached first) each may read."""

    positions: Tensor  # [b, s]: the real tokens before each in its row
    cos: Tensor  # [b, 1, s, head_dim]
    sin: Tensor
    allowed: Optional[Tensor]  # [b, 1, s, keys]: earlier or itself, and not padding
    distance: Optional[Tensor]  # [b, 1, s, keys]: query position - key position

    def mask(self, window: Optional[int]) -> Optional[Tensor]:
        """The keys each new token reads, within ``window`` positions if given (None: plain
        causal attention over the new tokens)."""
        if self.allowed is None or self.distance is None or window is None:
            return self.allowed
        return self.allowed & (self.distance < window)


def rope_tables(config: T2TrainConfig, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin [b, 1, s, head_dim] at ``positions`` [b, s] of non-interleaved rotary
    embeddings (Megatron's and Llama's: the two halves of each head are rotated together)."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta
        ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim)
    )
    angles = positions[:, None, :, None].float() * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def locate(config: T2TrainConfig, attention_mask: Tensor, cached: int) -> Tokens:
    """Where the new tokens sit: ``attention_mask`` [b, cached + s] marks every token so far
    that is not padding. A token's position counts the real tokens before it in its row."""
    valid = attention_mask.bool()
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    cos, sin = rope_tables(config, positions[:, cached:])
    if cached == 0 and bool(valid.all()):
        return Tokens(positions, cos, sin, None, None)
    keys = torch.arange(valid.shape[1], device=valid.device)
    queries = keys[cached:, None]
    # padding reads itself only, so that no row is empty (its output is never used)
    allowed = ((keys <= queries) & valid[:, None, :]) | (keys == queries)
    distance = positions[:, cached:, None] - positions[:, None, :]
    return Tokens(positions[:, cached:], cos, sin, allowed[:, None], distance[:, None])


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads and RoPE, no biases; with ``qk_norm``
    an RMSNorm over each query and key head before RoPE (Qwen3's, Megatron's q/k layernorm);
    with ``window`` each token attends to its last ``window`` tokens only (the local attention
    sublayer)."""

    def __init__(self, config: T2TrainConfig, window: Optional[int] = None, qk_norm: bool = False):
        super().__init__()
        h, heads, groups, d = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.heads, self.groups, self.head_dim = heads, groups, d
        self.window = window
        self.q_proj = nn.Linear(h, heads * d, bias=False)
        self.k_proj = nn.Linear(h, groups * d, bias=False)
        self.v_proj = nn.Linear(h, groups * d, bias=False)
        self.o_proj = nn.Linear(heads * d, h, bias=False)
        self.q_norm = nn.RMSNorm(d, eps=config.rms_norm_eps) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(d, eps=config.rms_norm_eps) if qk_norm else nn.Identity()

    def forward(self, x: Tensor, tokens: Tokens, cache=None, slot: int = 0) -> Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, s, self.groups, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.groups, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, tokens.cos, tokens.sin), apply_rope(k, tokens.cos, tokens.sin)
        if cache is not None:
            k, v = cache.update(k, v, slot)
        gqa = self.groups != self.heads
        mask = tokens.mask(self.window)
        if mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        elif self.window is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
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


class Stream(nn.Module):
    """What a design's residual state is: ``enter`` makes it from the embedding, ``exit``
    gives what the final norm reads. A stream whose entry reads the ``entry_context``
    tokens before each one is also given their embeddings: ``enter(embedding, earlier)``,
    ``earlier`` [b, <= entry_context, h] (fewer at a sequence's start, None for none)."""

    entry_context = 0


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
        self.config, self.layer = config, layer
        self.layer_entry = entry(config, layer) if entry is not None else None
        self.local_attn = None
        if config.local_window > 0:
            self.local_attn_layernorm = nn.RMSNorm(h, eps=eps)
            self.local_attn = Attention(config, window=config.local_window)
            self.local_attn_residual = residual(config, layer, position("local_attn"))
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.self_attn = Attention(config, qk_norm=config.qk_norm)
        self.attn_residual = residual(config, layer, position("attn"))
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)
        self.mlp = MLP(config)
        self.mlp_residual = residual(config, layer, position("mlp"))

    @staticmethod
    def sublayer(state, residual, norm, function):
        x = residual.read(state)
        normed = norm(x)
        return residual.write(state, x, normed, function(normed))

    def forward(self, state, tokens: Tokens, cache=None):
        config = self.config
        if self.layer_entry is not None:
            state = self.layer_entry.begin(state)
        if self.local_attn is not None:
            slot = config.attention_slot(self.layer, local=True)
            state = self.sublayer(
                state,
                self.local_attn_residual,
                self.local_attn_layernorm,
                lambda normed: self.local_attn(normed, tokens, cache, slot),
            )
        slot = config.attention_slot(self.layer)
        state = self.sublayer(
            state,
            self.attn_residual,
            self.input_layernorm,
            lambda normed: self.self_attn(normed, tokens, cache, slot),
        )
        return self.sublayer(state, self.mlp_residual, self.post_attention_layernorm, self.mlp)


class T2TrainPreTrainedModel(PreTrainedModel):
    config_class = T2TrainConfig
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

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Optional[Tensor] = None,
        past_key_values: Optional[DynamicCache] = None,
        use_cache: Optional[bool] = None,
        position_ids: Optional[Tensor] = None,
        cache: Optional[DynamicCache] = None,
    ) -> BaseModelOutputWithPast:
        """The final norm's output for ``input_ids`` [b, s], the tokens after those cached in
        ``cache`` (``past_key_values`` before transformers 5); ``attention_mask`` [b, cached +
        s] (1: a token, 0: padding) covers the cached tokens too. The cache given, or a new
        one with ``use_cache``, is returned holding these tokens as well. Positions are
        counted from the mask; ``position_ids``, if given, must be those."""
        config: T2TrainConfig = self.config  # type: ignore[assignment]
        use_cache = config.use_cache if use_cache is None else use_cache
        cache = cache if cache is not None else past_key_values
        if use_cache and cache is None:
            cache = DynamicCache(config=config)
        if cache is not None:
            cache = with_slots(cache, config)
        b, s = input_ids.shape
        cached = cache.get_seq_length() if cache is not None else 0
        if attention_mask is None:
            attention_mask = input_ids.new_ones(b, cached + s)
        if tuple(attention_mask.shape) != (b, cached + s):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}; expected "
                f"{(b, cached + s)}: {cached} cached and {s} new tokens per row"
            )
        tokens = locate(config, attention_mask, cached)
        if position_ids is not None and not torch.equal(position_ids, tokens.positions):
            raise ValueError(
                "position_ids differ from the positions attention_mask gives (each row's "
                "real tokens counted from 0): packed documents are not supported"
            )
        embedding = self.embed_tokens(input_ids)
        if tokens.allowed is not None:  # padding enters as zeros (a stream entry reads them)
            embedding = embedding * attention_mask[:, cached:, None].to(embedding.dtype)
        state = self.enter(embedding, cache)
        for layer in self.layers:
            state = layer(state, tokens, cache)
        hidden = self.norm(self.stream.exit(state))
        return BaseModelOutputWithPast(last_hidden_state=hidden, **{CACHE: cache})  # type: ignore[arg-type]

    def enter(self, embedding: Tensor, cache: Optional[DynamicCache]):
        """The stream's state of the new tokens; a stream entry that reads earlier tokens gets
        their embeddings, kept in the cache's entry slot."""
        context = self.stream.entry_context
        if context == 0:
            return self.stream.enter(embedding)
        earlier = None
        if cache is not None:
            slot = self.config.entry_slot
            every, _ = cache.update(embedding[:, None], embedding[:, None], slot)
            earlier = every[:, 0, : -embedding.shape[1]][:, -context:]
        return self.stream.enter(embedding, earlier)


class T2TrainForCausalLM(T2TrainPreTrainedModel, GenerationMixin):  # type: ignore[misc]
    # (transformers 5 reads the mapping; 4.x, the names it maps)
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # type: ignore[assignment]

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

    def prepare_inputs_for_generation(  # type: ignore[override]
        self,
        input_ids: Tensor,
        past_key_values: Optional[DynamicCache] = None,
        attention_mask: Optional[Tensor] = None,
        use_cache: Optional[bool] = None,
        **kwargs,
    ) -> dict:
        """The tokens the cache lacks (all of them without a cache), and the last position's
        logits only."""
        cache = kwargs.get("cache", past_key_values)
        if cache is not None:
            input_ids = input_ids[:, cache.get_seq_length() :]
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            CACHE: cache,
            "use_cache": use_cache,
            "logits_to_keep": 1,
        }

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Optional[Tensor] = None,
        past_key_values: Optional[DynamicCache] = None,
        use_cache: Optional[bool] = None,
        position_ids: Optional[Tensor] = None,
        labels: Optional[Tensor] = None,
        logits_to_keep: int = 0,
        cache: Optional[DynamicCache] = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits of every new position (the last ``logits_to_keep`` if > 0), and with
        ``labels`` the mean next-token loss (-100 marks positions to ignore, such as
        padding)."""
        out = self.model(input_ids, attention_mask, past_key_values, use_cache, position_ids, cache)
        hidden = out.last_hidden_state
        if logits_to_keep > 0 and labels is None:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:  # labels are the inputs; position t predicts token t + 1
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutputWithPast(
            loss=loss,  # type: ignore[arg-type]
            logits=logits,
            **{CACHE: getattr(out, CACHE)},
        )
