"""The residual designs' formulas, written out again from the papers in plain tensor code.

Independent of ``t2train``: nothing here imports the project, so a mistake in a design's
module cannot also be a mistake in its expectation. Loops are explicit (per token, per head,
per source) and shapes tiny; everything runs in whatever dtype the parameters have (fp64 in
the tests). Each ``*_decoder`` function maps the embedding [s, b, h] through all layers and
the final norm, reading the weights from ``p`` (the decoder's ``named_parameters``).

Sources (the exact formulas are quoted in each function's docstring):
* pre-norm Transformer: Xiong et al. 2020 (arXiv 2002.04745), Megatron's SwiGLU MLP.
* DDL: Deep Delta Learning, Zhang et al. (arXiv 2601.00417), Sec. 2-3 and the authors' code.
* ShortSWA and the depth read: Residual Stream Duality, Zhang (arXiv 2603.16039), Alg. 1 and
  Sec. 2.2.
* AttnRes: Attention Residuals, Kimi Team (arXiv 2603.15031), Full and Block.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x, weight=None, eps=1e-5):
    """x / sqrt(mean(x^2) + eps), times ``weight`` when given."""
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def window_attention_1d(q, k, v, window, scale):
    """One head, one sequence: q, k, v [T, d]; position t attends to the keys
    max(0, t - window + 1) .. t (``window`` positions, itself included), softmax(q.k * scale)."""
    rows = []
    for t in range(q.shape[0]):
        keys = list(range(max(0, t - window + 1), t + 1))
        scores = torch.stack([q[t] @ k[j] for j in keys]) * scale
        weights = torch.softmax(scores, dim=0)
        rows.append(sum(w * v[j] for w, j in zip(weights, keys)))
    return torch.stack(rows)


def self_attention(x, w_qkv, w_proj, heads, window=None):
    """Multi-head causal attention (over the last ``window`` tokens if given) on normalised x
    [s, b, h]; Megatron's fused QKV weight holds, per head, its q, k and v rows in turn."""
    s, b, h = x.shape
    d = h // heads
    qkv = (x @ w_qkv.T).view(s, b, heads, 3, d)
    window = s if window is None else window
    per_sequence = []
    for i in range(b):
        per_head = [
            window_attention_1d(
                qkv[:, i, n, 0], qkv[:, i, n, 1], qkv[:, i, n, 2], window, 1 / math.sqrt(d)
            )
            for n in range(heads)
        ]
        per_sequence.append(torch.cat(per_head, dim=-1))  # [s, h], heads in order
    return torch.stack(per_sequence, dim=1) @ w_proj.T


def swiglu_mlp(x, w_fc1, w_fc2):
    """(silu(x W_gate) * (x W_up)) W_down; Megatron's fc1 stacks [W_gate; W_up]."""
    gate, up = (x @ w_fc1.T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w_fc2.T


class Sublayers:
    """The layer's sublayer functions f(x) = F(Norm(x)) and their norms, from the weights."""

    def __init__(self, p, layer, heads, eps):
        self.p, self.pre, self.heads, self.eps = p, f"layers.{layer}.", heads, eps

    def w(self, name):
        return self.p[self.pre + name]

    def norm(self, name, x):
        return rms_norm(x, self.w(f"{name}.weight"), self.eps)

    def attention(self, normed, window=None, module="self_attention"):
        return self_attention(
            normed,
            self.w(f"{module}.linear_qkv.weight"),
            self.w(f"{module}.linear_proj.weight"),
            self.heads,
            window,
        )

    def mlp(self, normed):
        return swiglu_mlp(normed, self.w("mlp.linear_fc1.weight"), self.w("mlp.linear_fc2.weight"))

    def pairs(self):
        """(norm name, residual name, F) for attention then MLP."""
        return [
            ("input_layernorm", "attn_residual", self.attention),
            ("pre_mlp_layernorm", "mlp_residual", self.mlp),
        ]


def final_norm(p, x, eps):
    return rms_norm(x, p["final_layernorm.weight"], eps)


# ---------------------------------------------------------------------------------------------
# standard and ShortSWA


def standard_decoder(p, x, layers, heads, eps):
    """U = H + Attn(Norm(H)),  H' = U + MLP(Norm(U))."""
    for layer in range(layers):
        f = Sublayers(p, layer, heads, eps)
        for norm, _, sublayer in f.pairs():
            x = x + sublayer(f.norm(norm, x))
    return final_norm(p, x, eps)


def shortswa_decoder(p, x, layers, heads, eps, window):
    """RSD Algorithm 1: S = H + ShortSWA(Norm(H); w), A = S + Attn(Norm(S)),
    H' = A + MLP(Norm(A)); ShortSWA is causal attention over the last w tokens."""
    for layer in range(layers):
        f = Sublayers(p, layer, heads, eps)
        x = x + f.attention(f.norm("pre_attention_layernorm", x), window, "pre_attention")
        for norm, _, sublayer in f.pairs():
            x = x + sublayer(f.norm(norm, x))
    return final_norm(p, x, eps)


# ---------------------------------------------------------------------------------------------
# Deep Delta Learning


def ddl_gates(x_in, c, r, v_scale):
    """beta = 2 sigmoid(w_beta . c + b_beta) from the normalised context c, and
    v = v_scale sigmoid(W_v x_in + b_v) from the raw (compressed) state x_in."""
    beta = 2 * torch.sigmoid(c @ r("beta_proj.weight").T + r("beta_proj.bias"))
    v = v_scale * torch.sigmoid(x_in @ r("v_proj.weight").T + r("v_proj.bias"))
    return beta, v


def ddl_direction(k_raw, k_eps):
    """k = k~ / sqrt(|k~|^2 + eps_k^2) (Sec. 3.1: RMSNorm with eps eps_k^2/d, then / sqrt(d))."""
    return k_raw / torch.sqrt((k_raw * k_raw).sum(-1, keepdim=True) + k_eps**2)


def ddl_update(column, k, beta, v_column):
    """Eq. 2.1: X' = (I - beta k k^T) X + beta k v^T, for one column X_j of the state."""
    kx = (k * column).sum(-1, keepdim=True)
    return column - beta * k * kx + beta * k * v_column


def ddl_expand(embedding, conv_weight, dv):
    """EC: X_j[t, i] = sum_lag c_{i,j,lag} e[t - lag, i], a causal depthwise conv over tokens
    (PyTorch's Conv1d weight [h * dv, 1, kernel] holds c_{i,j,lag} at [i * dv + j, 0, -1 - lag])."""
    s, _, h = embedding.shape
    kernel = conv_weight.shape[-1]
    columns = []
    for j in range(dv):
        rows = []
        for t in range(s):
            taps = [
                conv_weight[torch.arange(h) * dv + j, 0, kernel - 1 - lag] * embedding[t - lag]
                for lag in range(kernel)
                if t - lag >= 0
            ]
            rows.append(sum(taps))
        columns.append(torch.stack(rows))
    return columns


def ddl_compress(columns, mix):
    """CC: x_in[..., i] = sum_j c_{i,j} X_j[..., i] (``mix`` [dv, h] holds c_{i,j} at [j, i])."""
    return sum(mix[j] * column for j, column in enumerate(columns))


def ddl_decoder(p, x, layers, heads, eps, dv, k_eps, v_scale, trace=None):
    """Per sublayer (attention and MLP each): x_in = X (d_v = 1) or C(X), c = Norm(x_in),
    k~ = F(c), X_j <- X_j + beta k (v_j - k^T X_j). d_v > 1: the embedding is expanded by EC
    and the final norm reads C_final(X). ``trace`` (a list) collects (beta, v) per sublayer."""
    columns = [x] if dv == 1 else ddl_expand(x, p["stream.expander.weight"], dv)
    for layer in range(layers):
        f = Sublayers(p, layer, heads, eps)
        for norm, residual, sublayer in f.pairs():
            r = lambda name, residual=residual, f=f: f.w(f"{residual}.{name}")  # noqa: E731
            x_in = columns[0] if dv == 1 else ddl_compress(columns, r("compressor.weight"))
            c = f.norm(norm, x_in)
            k = ddl_direction(sublayer(c), k_eps)
            beta, v = ddl_gates(x_in, c, r, v_scale)
            if trace is not None:
                trace.append((beta.detach(), v.detach()))
            columns = [ddl_update(col, k, beta, v[..., j : j + 1]) for j, col in enumerate(columns)]
    out = columns[0] if dv == 1 else ddl_compress(columns, p["stream.final_read.weight"])
    return final_norm(p, out, eps)


# ---------------------------------------------------------------------------------------------
# Depth-wise attention read (the dual of ShortSWA)


def depth_read(w, states, heads, eps, window, trace=None):
    """RSD Sec. 2.2 for every token: over W = [h^(max(0, l-K+1)) .. h^(l)] (the current state
    last), q = W_Q n(h^(l)), K = n(W) W_K, V = n(W) W_V, z = softmax(q K^T / sqrt(d_k)) V per
    head, returned as W_O z. n is the read's RMSNorm (weight ``w["norm"]``); ``w["kv"]`` holds,
    per head, its k then v rows."""
    s, b, h = states[-1].shape
    d = h // heads
    w_kv = w["kv"].view(heads, 2, d, h)
    visible = [rms_norm(state, w["norm"], eps) for state in states[max(0, len(states) - window) :]]
    rows = []
    for t in range(s):
        for i in range(b):
            heads_out = []
            for n in range(heads):
                q = w["q"][n * d : (n + 1) * d] @ visible[-1][t, i]
                keys = torch.stack([w_kv[n, 0] @ state[t, i] for state in visible])
                values = torch.stack([w_kv[n, 1] @ state[t, i] for state in visible])
                weights = torch.softmax(keys @ q / math.sqrt(d), dim=0)
                if trace is not None:
                    trace.append(weights.detach())
                heads_out.append(weights @ values)
            rows.append(torch.cat(heads_out))
    return torch.stack(rows).view(s, b, h) @ w["o"].T


def depth_read_weights(p, layer):
    pre = f"layers.{layer}.layer_entry."
    return {
        "norm": p[pre + "norm.weight"],
        "q": p[pre + "linear_q.weight"],
        "kv": p[pre + "linear_kv.weight"],
        "o": p[pre + "linear_proj.weight"],
    }


def depth_attn_decoder(p, x, layers, heads, eps, window, trace=None):
    """Each layer first adds the depth read, h^(l) + W_O z^(l), then runs attention and MLP as
    `standard`; the window holds the layer inputs h^(i) (before their reads are added)."""
    inputs = []
    for layer in range(layers):
        inputs.append(x)
        x = x + depth_read(depth_read_weights(p, layer), inputs, heads, eps, window, trace)
        f = Sublayers(p, layer, heads, eps)
        for norm, _, sublayer in f.pairs():
            x = x + sublayer(f.norm(norm, x))
    return final_norm(p, x, eps)


# ---------------------------------------------------------------------------------------------
# Attention Residuals


def attnres_mix(query, values, eps, trace=None):
    """h = sum_i alpha_i v_i, alpha = softmax_i(w . RMSNorm(v_i)): a weight-free RMSNorm on the
    keys only, raw values, no temperature."""
    s, b, _ = values[0].shape
    rows = []
    for t in range(s):
        for i in range(b):
            logits = torch.stack([query @ rms_norm(v[t, i], eps=eps) for v in values])
            alpha = torch.softmax(logits, dim=0)
            if trace is not None:
                trace.append(alpha.detach())
            rows.append(sum(a * v[t, i] for a, v in zip(alpha, values)))
    return torch.stack(rows).view(values[0].shape)


def attnres_decoder(p, x, layers, heads, eps, block_size, attnres_eps, trace=None):
    """Sublayer l (attention and MLP each count) reads h_l = mix(w_l; sources), outputs
    f_l = F(Norm(h_l)). Sources: the embedding b_0, the completed block sums b_1 .. b_{n-1}
    and, after a block's first sublayer, its partial sum b_n^i; a block closes after
    ``block_size`` sublayers (1 = Full AttnRes: every output is a source). The final norm
    reads one more mixture with its own pseudo-query."""
    sources, partial, index = [x], None, 0
    for layer in range(layers):
        f = Sublayers(p, layer, heads, eps)
        for norm, residual, sublayer in f.pairs():
            values = sources + ([] if partial is None else [partial])
            h = attnres_mix(f.w(f"{residual}.query"), values, attnres_eps, trace)
            out = sublayer(f.norm(norm, h))
            partial = out if partial is None else partial + out
            index += 1
            if index % block_size == 0:
                sources, partial = sources + [partial], None
    values = sources + ([] if partial is None else [partial])
    return final_norm(p, attnres_mix(p["stream.final_query"], values, attnres_eps, trace), eps)
