"""A t2train decoder for Hugging Face transformers (``trust_remote_code=True``).

`t2train export hf` copies this file, unchanged, next to the exported weights as
``modeling_t2train.py``; it imports only torch and transformers. It is the math of t2train's
training modules (``t2train/residual/*.py`` and Megatron's attention and MLP) written out
for reading, on [batch, seq, hidden] tensors:

    state = stream.enter(embed(tokens))
    for every layer:
        state = layer_entry.begin(state)              (designs with a layer entry)
        for every sublayer f: local attention (local_window > 0), attention, MLP
            x = residual.read(state)
            normed = norm(x)
            state = residual.write(state, x, normed, f(normed))
    logits = lm_head(final_norm(stream.exit(state)))

A residual design is a stream (what the state is, how the embedding enters it and the final
norm reads it), a sublayer residual (read/write) and an optional layer entry: one line in
``DESIGNS``. Parameter names follow t2train's (``attn_residual.beta_proj.weight``,
``stream.final_query``, ``layer_entry.linear_q.weight``), the shared parts Llama's.

There is no KV cache: every generation step runs the whole sequence again (plain and
exact; fine for the small models this is meant to look at). Padding is not supported.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast


class T2TrainConfig(PretrainedConfig):
    """The decoder's shape (Llama's field names), the residual design and its options
    (t2train's ``model.<section>`` of that design), and the local attention window
    (0: no local attention sublayer)."""

    model_type = "t2train"

    def __init__(self, vocab_size: int = 32000, hidden_size: int = 256,
                 intermediate_size: int = 704, num_hidden_layers: int = 4,
                 num_attention_heads: int = 4, num_key_value_heads: Optional[int] = None,
                 rms_norm_eps: float = 1e-5, rope_theta: float = 10000.0,
                 max_position_embeddings: int = 256, initializer_range: float = 0.02,
                 residual: str = "standard", residual_options: Optional[dict] = None,
                 local_window: int = 0, tie_word_embeddings: bool = True, **kwargs):
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
    inv_freq = 1.0 / (config.rope_theta ** (
        torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def window_mask(q_len: int, k_len: int, window: int, device=None) -> Tensor:
    """True where query i (at position k_len - q_len + i) may see key j: the last ``window``
    positions up to and including its own."""
    pos = torch.arange(k_len - q_len, k_len, device=device).unsqueeze(1)
    keys = torch.arange(k_len, device=device).unsqueeze(0)
    return (keys <= pos) & (keys > pos - window)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads and RoPE, no biases; with ``window``
    each token attends to its last ``window`` tokens only (the local attention sublayer)."""

    def __init__(self, config: T2TrainConfig, window: Optional[int] = None):
        super().__init__()
        h, heads, groups = config.hidden_size, config.num_attention_heads, \
            config.num_key_value_heads
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
        mask = None if self.window is None else window_mask(s, s, self.window, x.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=self.groups != self.heads)
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


def at_least_fp32(t: Tensor) -> Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


# --- standard: x <- x + f(norm(x)) ------------------------------------------------------------

class HiddenStateStream(nn.Module):
    """The state is the hidden tensor [b, s, h]."""

    def __init__(self, config: T2TrainConfig):
        super().__init__()

    def enter(self, embedding: Tensor) -> Tensor:
        return embedding

    def exit(self, state: Tensor) -> Tensor:
        return state


class AdditiveResidual(nn.Module):
    def __init__(self, config: T2TrainConfig, layer: int, position: int):
        super().__init__()

    def read(self, state: Tensor) -> Tensor:
        return state

    def write(self, state: Tensor, x: Tensor, normed: Tensor, out: Tensor) -> Tensor:
        return state + out


# --- ddl: Deep Delta Learning, X <- X + beta k (v^T - k^T X) (arXiv 2601.00417) ---------------

class ChannelMixRead(nn.Module):
    """x[..., i] = sum_j weight[j, i] X_j[..., i]: reads a [d_v, b, s, h] state."""

    def __init__(self, hidden: int, dv: int):
        super().__init__()
        self.weight = nn.Parameter(torch.full((dv, hidden), 1.0 / dv))

    def forward(self, state: Tensor) -> Tensor:
        return torch.einsum("jbsh,jh->bsh", state, self.weight)


class DeltaStream(nn.Module):
    """d_v = 1: the state is [b, s, h]. d_v > 1: [d_v, b, s, h], made from the embedding by a
    causal depthwise convolution over tokens (``expander``) and read by a channel mix."""

    def __init__(self, config: T2TrainConfig):
        super().__init__()
        h, self.dv = config.hidden_size, config.residual_options.get("dv", 1)
        if self.dv > 1:
            kernel = config.residual_options["embed_conv_kernel"]
            self.expander = nn.Conv1d(h, h * self.dv, kernel, groups=h, bias=False)
            self.final_read = ChannelMixRead(h, self.dv)

    def enter(self, embedding: Tensor) -> Tensor:
        if self.dv == 1:
            return embedding
        b, s, h = embedding.shape
        tokens = F.pad(embedding.transpose(1, 2), (self.expander.kernel_size[0] - 1, 0))
        # output channel i * d_v + j is column j of feature i
        return self.expander(tokens).view(b, h, self.dv, s).permute(2, 0, 3, 1)

    def exit(self, state: Tensor) -> Tensor:
        return state if self.dv == 1 else self.final_read(state)


class DeltaResidual(nn.Module):
    """k = out / sqrt(|out|^2 + k_eps^2), beta = 2 sigmoid(w_beta . normed + b_beta),
    v = v_scale sigmoid(W_v x + b_v), then X <- X + beta k (v^T - k^T X) column by column;
    computed in (at least) fp32."""

    def __init__(self, config: T2TrainConfig, layer: int, position: int):
        super().__init__()
        options, h = config.residual_options, config.hidden_size
        self.dv = options.get("dv", 1)
        self.k_eps, self.v_scale = options["k_eps"], options["v_scale"]
        self.beta_proj = nn.Linear(h, 1)
        self.v_proj = nn.Linear(h, self.dv)
        self.compressor = ChannelMixRead(h, self.dv) if self.dv > 1 else None

    def read(self, state: Tensor) -> Tensor:
        return state if self.compressor is None else self.compressor(state)

    def write(self, state: Tensor, x: Tensor, normed: Tensor, out: Tensor) -> Tensor:
        k = at_least_fp32(out)
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + self.k_eps * self.k_eps)
        beta = 2 * torch.sigmoid(at_least_fp32(self.beta_proj(normed)))
        v = self.v_scale * torch.sigmoid(at_least_fp32(self.v_proj(x)))
        if self.dv > 1:
            v = v.permute(2, 0, 1).unsqueeze(-1)  # one value per state column
        current = at_least_fp32(state)
        error = v - (k * current).sum(-1, keepdim=True)
        return (current + beta * error * k).to(state.dtype)


# --- depth_attn: causal attention over a token's last K layer states (arXiv 2603.16039) --------

class DepthState(NamedTuple):
    history: tuple  # the states entering the last K - 1 layers, oldest first
    current: Tensor


class DepthStream(nn.Module):
    def __init__(self, config: T2TrainConfig):
        super().__init__()

    def enter(self, embedding: Tensor) -> DepthState:
        return DepthState((), embedding)

    def exit(self, state: DepthState) -> Tensor:
        return state.current


class DepthAdditive(nn.Module):
    """Sublayers add to the current state; only the layer entry reads the history."""

    def __init__(self, config: T2TrainConfig, layer: int, position: int):
        super().__init__()

    def read(self, state: DepthState) -> Tensor:
        return state.current

    def write(self, state: DepthState, x: Tensor, normed: Tensor, out: Tensor) -> DepthState:
        return DepthState(state.history, state.current + out)


class DepthRead(nn.Module):
    """Before each layer: current += W_O softmax(q K^T / sqrt(d)) V over the window
    [history..., current], q = W_Q n(current), K, V = n(window) W_K, W_V, one RMSNorm n.
    ``linear_kv`` holds each head's key rows then its value rows."""

    def __init__(self, config: T2TrainConfig, layer: int):
        super().__init__()
        h = config.hidden_size
        self.window = config.residual_options["window"]
        self.heads, self.head_dim = config.num_attention_heads, h // config.num_attention_heads
        self.norm = nn.RMSNorm(h, eps=config.rms_norm_eps)
        self.linear_q = nn.Linear(h, h, bias=False)
        self.linear_kv = nn.Linear(h, 2 * h, bias=False)
        self.linear_proj = nn.Linear(h, h, bias=False)

    def read(self, states: list[Tensor]) -> Tensor:
        b, s, h = states[-1].shape
        n = len(states)
        q = self.linear_q(self.norm(states[-1])).view(b, s, self.heads, 1, self.head_dim)
        kv = self.linear_kv(self.norm(torch.stack(states, dim=2)))  # [b, s, n, 2h]
        kv = kv.view(b, s, n, self.heads, 2, self.head_dim).permute(4, 0, 1, 3, 2, 5)
        k, v = kv[0], kv[1]  # [b, s, heads, n, d]
        z = F.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(self.head_dim))
        return self.linear_proj(z.reshape(b, s, h))

    def begin(self, state: DepthState) -> DepthState:
        window = list(state.history) + [state.current]
        current = state.current + self.read(window)
        keep = self.window - 1
        return DepthState(tuple(window[-keep:]) if keep else (), current)


# --- attnres / block_attnres: Attention Residuals (arXiv 2603.15031) ---------------------------

class AttnResState(NamedTuple):
    sources: tuple  # the embedding, then completed blocks (Full: every sublayer output)
    partial: Optional[Tensor]  # the open block's running sum

    def values(self) -> list[Tensor]:
        return list(self.sources) + ([self.partial] if self.partial is not None else [])


def depth_mix(query: Tensor, values: list[Tensor], eps: float) -> Tensor:
    """sum_i softmax_i(query . RMSNorm(v_i)) v_i (weight-free RMSNorm on keys, fp32)."""
    stacked = torch.stack(values)
    x = at_least_fp32(stacked)
    keys = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    weights = torch.softmax(keys @ query.to(x.dtype), dim=0)
    return (weights.unsqueeze(-1) * x).sum(0).to(stacked.dtype)


class AttnResStream(nn.Module):
    """Sources start with the embedding; the final norm reads a mixture with its own query."""

    def __init__(self, config: T2TrainConfig):
        super().__init__()
        self.eps = config.residual_options["eps"]
        self.final_query = nn.Parameter(torch.zeros(config.hidden_size))

    def enter(self, embedding: Tensor) -> AttnResState:
        return AttnResState((embedding,), None)

    def exit(self, state: AttnResState) -> Tensor:
        return depth_mix(self.final_query, state.values(), self.eps)


class BlockAttnResidual(nn.Module):
    """Each sublayer reads a mixture of the sources and the open block; its output joins the
    block, which becomes a source after ``block_size`` sublayers (counted over the model)."""

    def __init__(self, config: T2TrainConfig, layer: int, position: int):
        super().__init__()
        self.eps = config.residual_options["eps"]
        self.block_size = config.residual_options["block_size"]
        self.index = len(config.sublayers()) * layer + position
        self.query = nn.Parameter(torch.zeros(config.hidden_size))

    def read(self, state: AttnResState) -> Tensor:
        return depth_mix(self.query, state.values(), self.eps)

    def write(self, state: AttnResState, x: Tensor, normed: Tensor, out: Tensor) -> AttnResState:
        partial = out if state.partial is None else state.partial + out
        if (self.index + 1) % self.block_size == 0:
            return AttnResState(state.sources + (partial,), None)
        return AttnResState(state.sources, partial)


class FullAttnResidual(BlockAttnResidual):
    """Every sublayer output is a source of its own."""

    def write(self, state: AttnResState, x: Tensor, normed: Tensor, out: Tensor) -> AttnResState:
        return AttnResState(state.sources + (out,), None)


# model.residual -> (stream, sublayer residual, layer entry or None)
# --- hc, mhc: n streams joined per sublayer (arXiv 2409.19606, 2512.24880) --------------------

class StreamCopies(nn.Module):
    """n streams [n, b, s, h]: the embedding enters as n copies, the final norm reads their
    mean."""

    def __init__(self, config: T2TrainConfig):
        super().__init__()
        self.n = config.residual_options["expansion_rate"]

    def enter(self, embedding: Tensor) -> Tensor:
        return embedding.unsqueeze(0).expand(self.n, *embedding.shape)

    def exit(self, state: Tensor) -> Tensor:
        return at_least_fp32(state).mean(0).to(state.dtype)


class StreamMixResidual(nn.Module):
    """Reads sum_i read[i] h_i; writes stream j <- sum_i mix[i, j] h_i + write[j] out. The
    weights of a sublayer are computed once by ``read`` and used by ``write``."""

    def __init__(self):
        super().__init__()
        self.pending = None

    def read(self, state: Tensor) -> Tensor:
        read, self.pending = self.weights(state)
        x = at_least_fp32(state)
        return torch.einsum("bsi,ibsh->bsh", read.to(x.dtype), x).to(state.dtype)

    def write(self, state: Tensor, x: Tensor, normed: Tensor, out: Tensor) -> Tensor:
        mix, write = self.pending
        self.pending = None
        current = at_least_fp32(state)
        new = torch.einsum("bsij,ibsh->jbsh", mix.to(current.dtype), current) + torch.einsum(
            "bsj,bsh->jbsh", write.to(current.dtype), at_least_fp32(out))
        return new.to(state.dtype)


class HyperConnection(StreamMixResidual):
    """Hyper-Connections: [A_m | A_r] = static_alpha (+ s_a tanh(Norm(h_i) W_a), row i from
    stream i, when dynamic), B = static_beta (+ s_b tanh(Norm(h_i) W_b)); the sublayer reads
    A_m^T H and stream j becomes sum_i A_r[i, j] h_i + B_j out."""

    def __init__(self, config: T2TrainConfig, layer: int, position: int):
        super().__init__()
        options, h = config.residual_options, config.hidden_size
        n, self.dynamic = options["expansion_rate"], options["dynamic"]
        self.static_alpha = nn.Parameter(torch.zeros(n, n + 1))
        self.static_beta = nn.Parameter(torch.ones(n))
        if self.dynamic:
            self.norm = nn.RMSNorm(h, eps=config.rms_norm_eps)
            self.dynamic_alpha = nn.Parameter(torch.zeros(h, n + 1))
            self.dynamic_beta = nn.Parameter(torch.zeros(h))
            self.dynamic_alpha_scale = nn.Parameter(torch.ones(1))
            self.dynamic_beta_scale = nn.Parameter(torch.ones(1))

    def weights(self, state: Tensor) -> tuple[Tensor, tuple]:
        n, b, s, _ = state.shape
        alpha = at_least_fp32(self.static_alpha).expand(b, s, n, n + 1)
        beta = at_least_fp32(self.static_beta).expand(b, s, n)
        if self.dynamic:
            normed = at_least_fp32(self.norm(state))  # each stream on its own
            alpha = alpha + at_least_fp32(self.dynamic_alpha_scale) * torch.tanh(
                normed @ at_least_fp32(self.dynamic_alpha)).permute(1, 2, 0, 3)
            beta = beta + at_least_fp32(self.dynamic_beta_scale) * torch.tanh(
                normed @ at_least_fp32(self.dynamic_beta)).permute(1, 2, 0)
        return alpha[..., 0], (alpha[..., 1:], beta)


def sinkhorn(logits: Tensor, iterations: int) -> Tensor:
    """exp, then ``iterations`` times: divide each column, then each row, by its sum."""
    m = torch.exp(logits - logits.amax((-2, -1), keepdim=True))
    for _ in range(iterations):
        m = m / m.sum(-2, keepdim=True)
        m = m / m.sum(-1, keepdim=True)
    return m


class ManifoldHyperConnection(StreamMixResidual):
    """mHC: from the flattened stream x~' = RMSNorm(vec(H)) (no weight), H_pre =
    sigmoid(a_pre x~' phi_pre + b_pre), H_post = 2 sigmoid(a_post x~' phi_post + b_post),
    H_res = Sinkhorn(a_res x~' phi_res + b_res); the sublayer reads sum_j H_pre[j] h_j and
    stream i becomes sum_j H_res[i, j] h_j + H_post[i] out."""

    def __init__(self, config: T2TrainConfig, layer: int, position: int):
        super().__init__()
        options, h = config.residual_options, config.hidden_size
        n = self.n = options["expansion_rate"]
        self.eps, self.iterations = options["eps"], options["sinkhorn_iterations"]
        outputs = n * n + 2 * n  # H~pre, H~post, H~res (row-major)
        self.projection = nn.Parameter(torch.zeros(outputs, n * h))
        self.bias = nn.Parameter(torch.zeros(outputs))
        self.gates = nn.Parameter(torch.zeros(3))

    def weights(self, state: Tensor) -> tuple[Tensor, tuple]:
        n = self.n
        x = at_least_fp32(state)
        inv_rms = torch.rsqrt(x.pow(2).mean((0, 3)) + self.eps)  # over all n x h: [b, s]
        phi = at_least_fp32(self.projection).view(-1, n, x.shape[-1])
        raw = torch.einsum("jbsh,kjh->bsk", x, phi) * inv_rms.unsqueeze(-1)
        gates, bias = at_least_fp32(self.gates), at_least_fp32(self.bias)
        pre = torch.sigmoid(gates[0] * raw[..., :n] + bias[:n])
        post = 2 * torch.sigmoid(gates[1] * raw[..., n:2 * n] + bias[n:2 * n])
        res = sinkhorn((gates[2] * raw[..., 2 * n:] + bias[2 * n:]).unflatten(-1, (n, n)),
                       self.iterations)
        # ``write`` mixes with [i, j] -> stream j; H_res is [new i, old j]: transpose
        return pre, (res.transpose(-1, -2), post)


DESIGNS = {
    "standard": (HiddenStateStream, AdditiveResidual, None),
    "ddl": (DeltaStream, DeltaResidual, None),
    "depth_attn": (DepthStream, DepthAdditive, DepthRead),
    "attnres": (AttnResStream, FullAttnResidual, None),
    "block_attnres": (AttnResStream, BlockAttnResidual, None),
    "hc": (StreamCopies, HyperConnection, None),
    "mhc": (StreamCopies, ManifoldHyperConnection, None),
}


def design(config: T2TrainConfig) -> tuple:
    if config.residual not in DESIGNS:
        raise ValueError(f"residual={config.residual!r}: this modeling file implements "
                         f"{sorted(DESIGNS)}")
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
            state = self.sublayer(state, self.local_attn_residual, self.local_attn_layernorm,
                                  lambda normed: self.local_attn(normed, cos, sin))
        state = self.sublayer(state, self.attn_residual, self.input_layernorm,
                              lambda normed: self.self_attn(normed, cos, sin))
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
        self.layers = nn.ModuleList(DecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(self, input_ids: Tensor) -> Tensor:
        cos, sin = rope_tables(self.config, input_ids.shape[1], input_ids.device)
        state = self.stream.enter(self.embed_tokens(input_ids))
        for layer in self.layers:
            state = layer(state, cos, sin)
        return self.norm(self.stream.exit(state))


class T2TrainForCausalLM(T2TrainPreTrainedModel, GenerationMixin):
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config: T2TrainConfig):
        super().__init__(config)
        self.model = T2TrainModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def prepare_inputs_for_generation(self, input_ids: Tensor, **kwargs) -> dict:
        return {"input_ids": input_ids, "attention_mask": kwargs.get("attention_mask")}

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                labels: Optional[Tensor] = None, **kwargs) -> CausalLMOutputWithPast:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("padded batches are not supported: give sequences of one length")
        logits = self.lm_head(self.model(input_ids))
        loss = None
        if labels is not None:  # labels are the inputs; position t predicts token t + 1
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                   labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)
