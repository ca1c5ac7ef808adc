"""The mistakes a careful implementer could make in each design, as named source edits.

Each ``Mutation`` replaces text that must occur exactly once in its file (a mutation whose
text has moved is "stale": ``tests/mutations/test_catalog.py`` fails until it is updated).
The runner (``python -m tests.mutations``) applies one at a time and runs the fast residual
and kernel tests; every mutation must make one fail.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

REF_DDL = "t2train/residual/ddl/layers.py"
REF_WINDOW = "t2train/residual/window_attention.py"
REF_DEPTH = "t2train/residual/depth_attn/layers.py"
REF_ATTNRES = "t2train/residual/attnres/layers.py"
REF_ATTNRES_SOURCES = "t2train/residual/attnres/sources.py"
REF_STANDARD = "t2train/residual/standard/layers.py"
DISPATCH = "kernels/dispatch.py"
K_DDL = "kernels/ddl_update.py"
K_WINDOW = "kernels/window_attention.py"
K_ATTNRES = "kernels/depth_mix.py"
K_GATES = "kernels/fp32_linear.py"
K_STREAMS = "kernels/stream_mix.py"
LAYER = "t2train/model/layer.py"
REF_HC = "t2train/residual/hc/layers.py"
REF_MHC = "t2train/residual/mhc/layers.py"
STREAMS = "t2train/residual/streams.py"
FN_SHARED = "t2train/residual/functional.py"
FN_DDL = "t2train/residual/ddl/functional.py"
FN_DEPTH = "t2train/residual/depth_attn/functional.py"
FN_ATTNRES = "t2train/residual/attnres/functional.py"
FN_MHC = "t2train/residual/mhc/functional.py"
PRECISION = "t2train/nn/precision.py"


@dataclass(frozen=True)
class Mutation:
    name: str
    design: str
    mistake: str  # what a careful implementer might have done
    edits: tuple  # (path relative to the repository, old text, new text), ...

    def mutated_sources(self) -> dict[str, str]:
        """path -> the file's text with this mutation's edits applied."""
        sources: dict[str, str] = {}
        for path, old, new in self.edits:
            text = sources.get(path) or (ROOT / path).read_text()
            count = text.count(old)
            if count != 1:
                raise ValueError(
                    f"mutation {self.name}: {old!r} occurs {count} times in {path} "
                    f"(expected once): update tests/mutations/catalog.py"
                )
            sources[path] = text.replace(old, new)
        return sources


def module_of(path: str) -> str:
    """The import name of a repository file (``kernels/`` is installed as t2train.kernels)."""
    dotted = path.removesuffix(".py").replace("/", ".")
    return dotted if dotted.startswith("t2train.") else f"t2train.{dotted}"


def m(name, design, mistake, *edits) -> Mutation:
    return Mutation(name, design, mistake, tuple(edits))


MUTATIONS = [
    # --- standard ------------------------------------------------------------------------------
    m(
        "standard-adds-to-normed-input",
        "standard",
        "the residual adds the sublayer output to Norm(x) instead of x",
        (REF_STANDARD, "return state + out", "return normed + out"),
    ),
    # --- DDL -----------------------------------------------------------------------------------
    m(
        "ddl-gate-sigmoid",
        "ddl",
        "beta = sigmoid(.) in (0, 1) instead of 2 sigmoid(.) in (0, 2), reference and kernel",
        (
            FN_DDL,
            "beta = 2 * torch.sigmoid(at_least_fp32(beta_logit))",
            "beta = torch.sigmoid(at_least_fp32(beta_logit))",
        ),
        (K_DDL, "beta = 2.0 * tl.sigmoid(", "beta = tl.sigmoid("),
    ),
    m(
        "ddl-v-from-normalised-input",
        "ddl",
        "v = W_v c from the normalised context (the paper's text) instead of the raw state x",
        (REF_DDL, "fp32_linear(x, self.v_proj)", "fp32_linear(normed, self.v_proj)"),
    ),
    m(
        "ddl-beta-from-raw-state",
        "ddl",
        "beta's logit from the raw state x instead of the normalised context c",
        (
            REF_DDL,
            "beta_logit = fp32_linear(normed, self.beta_proj)",
            "beta_logit = fp32_linear(x, self.beta_proj)",
        ),
    ),
    m(
        "ddl-delta-sign",
        "ddl",
        "X - beta k (v - k^T X): the update's sign flipped",
        (
            FN_DDL,
            "return (x + beta * error * k).to(state.dtype)",
            "return (x - beta * error * k).to(state.dtype)",
        ),
    ),
    m(
        "ddl-beta-on-v-only",
        "ddl",
        "X + k (beta v - k^T X): beta scales the write of v but not the erase of k^T X",
        (
            FN_DDL,
            "return (x + beta * error * k).to(state.dtype)",
            "return (x + (beta * v - (k * x).sum(-1, keepdim=True)) * k).to(state.dtype)",
        ),
    ),
    m(
        "ddl-k-rms-normalised",
        "ddl",
        "k = k~ / RMS(k~) (mean of squares) instead of k~ / |k~| (sum): |k| = sqrt(d)",
        (
            FN_DDL,
            "return k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + eps * eps)",
            "return k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps * eps)",
        ),
    ),
    m(
        "ddl-v-scale-missing",
        "ddl",
        "v = sigmoid(.) without the v_scale (4) factor",
        (
            FN_DDL,
            "v = v_scale * torch.sigmoid(at_least_fp32(v_logit))",
            "v = torch.sigmoid(at_least_fp32(v_logit))",
        ),
    ),
    m(
        "ddl-beta-bias-not-logit",
        "ddl",
        "the gate bias set to beta_init itself instead of logit(beta_init / 2)",
        (
            REF_DDL,
            "self.beta_proj.bias.fill_(math.log(options.beta_init / (2 - options.beta_init)))",
            "self.beta_proj.bias.fill_(options.beta_init)",
        ),
    ),
    m(
        "ddl-expander-anticausal",
        "ddl",
        "the embedding conv padded on the right: column t reads tokens t .. t+3",
        (
            REF_DDL,
            "(self.expander.kernel_size[0] - 1, 0))",
            "(0, self.expander.kernel_size[0] - 1))",
        ),
    ),
    m(
        "ddl-expander-identity-at-oldest-tap",
        "ddl",
        "the identity init on the oldest conv tap: the state starts 3 tokens late",
        (REF_DDL, "self.expander.weight[:, 0, -1] = 1.0", "self.expander.weight[:, 0, 0] = 1.0"),
    ),
    m(
        "ddl-compressor-plain-mean",
        "ddl",
        "the CC read ignores its learned mix and averages the columns",
        (
            FN_DDL,
            'return torch.einsum("j...h,jh->...h", state, weight)',
            "return state.mean(0)",
        ),
    ),
    m(
        "ddl-columns-share-one-v",
        "ddl",
        "every state column is written with v_0",
        (
            FN_DDL,
            "v = v.movedim(-1, 0).unsqueeze(-1)",
            "v = v[..., :1].movedim(-1, 0).unsqueeze(-1)",
        ),
    ),
    # --- ShortSWA and the shared window operator -----------------------------------------------
    m(
        "window-plus-one",
        "shortswa",
        "the window holds w + 1 tokens (t - w .. t)",
        (FN_SHARED, "(keys > pos - window)", "(keys > pos - window - 1)"),
    ),
    m(
        "window-minus-one",
        "shortswa",
        "the window holds w - 1 tokens",
        (FN_SHARED, "(keys > pos - window)", "(keys > pos - window + 1)"),
    ),
    m(
        "window-excludes-current-token",
        "shortswa",
        "keys strictly before the query (j < t)",
        (FN_SHARED, "(keys <= pos)", "(keys < pos)"),
    ),
    m(
        "window-queries-start-aligned",
        "depth_attn",
        "the band mask aligns fewer queries than keys to the first key, not the last",
        (FN_SHARED, "pos = torch.arange(k_len - q_len, k_len,", "pos = torch.arange(0, q_len,"),
    ),
    m(
        "window-single-query-first-keys",
        "depth_attn",
        "a one-query read (the depth read's shape) attends to the first `window` keys, "
        "not the last",
        (
            FN_SHARED,
            "k, v = k[..., -window:, :], v[..., -window:, :]",
            "k, v = k[..., :window, :], v[..., :window, :]",
        ),
    ),
    m(
        "window-single-query-softmax-over-dims",
        "depth_attn",
        "the one-query read's softmax runs over the head dimension instead of the keys",
        (
            FN_SHARED,
            "weights = torch.softmax(scores, dim=-2)",
            "weights = torch.softmax(scores, dim=-1)",
        ),
    ),
    # --- depth read -----------------------------------------------------------------------------
    m(
        "depth-query-from-oldest-state",
        "depth_attn",
        "the query from the oldest state in the window instead of the current h^(l)",
        (
            REF_DEPTH,
            "current, _ = self.linear_q(normed[:, :, -1])",
            "current, _ = self.linear_q(normed[:, :, 0])",
        ),
    ),
    m(
        "depth-window-plus-one",
        "depth_attn",
        "the read keeps and attends to K + 1 states",
        (FN_DEPTH, "keep = size - 1", "keep = size"),
        (
            REF_DEPTH,
            "attend_window(q, k, v, self.window, scale)",
            "attend_window(q, k, v, self.window + 1, scale)",
        ),
    ),
    m(
        "depth-missing-scale",
        "depth_attn",
        "scores without the 1/sqrt(d_k) scale",
        (REF_DEPTH, "scale = 1 / math.sqrt(self.head_dim)", "scale = 1.0"),
    ),
    m(
        "depth-keys-unnormalised",
        "depth_attn",
        "K and V projected from the raw states, the query from the normalised one",
        (
            REF_DEPTH,
            "kv, _ = self.linear_kv(normed.flatten(1, 2))",
            "kv, _ = self.linear_kv(torch.stack(states, dim=2).flatten(1, 2))",
        ),
    ),
    m(
        "depth-keys-values-swapped",
        "depth_attn",
        "the K and V halves of W_KV swapped",
        (
            FN_DEPTH,
            "k, v = kv.reshape(-1, n, heads, 2, d).permute(3, 0, 2, 1, 4)",
            "v, k = kv.reshape(-1, n, heads, 2, d).permute(3, 0, 2, 1, 4)",
        ),
    ),
    m(
        "depth-history-after-read",
        "depth_attn",
        "the window remembers h^(l) + W_O z (after the read) instead of the layer input h^(l)",
        (
            REF_DEPTH,
            "return DepthState(slide(window, self.window), current)",
            "return DepthState(slide(window[:-1] + [current], self.window), current)",
        ),
    ),
    m(
        "depth-read-replaces-state",
        "depth_attn",
        "the read replaces the state (h <- W_O z) instead of adding a branch",
        (REF_DEPTH, "current = state.current + self.read(window)", "current = self.read(window)"),
    ),
    # --- Attention Residuals --------------------------------------------------------------------
    m(
        "attnres-norm-on-values",
        "attnres",
        "RMSNorm on the values instead of the keys (scores from raw sources, normalised sum)",
        (
            FN_ATTNRES,
            "(x @ queries.T).movedim(-1, 1) * _inverse_rms(x, eps).unsqueeze(1) for x in stacks",
            "(x @ queries.T).movedim(-1, 1) for x in stacks",
        ),
        (
            FN_ATTNRES,
            "gamma = torch.sigmoid((p @ query.to(p.dtype)) * _inverse_rms(p, eps) - lse)",
            "gamma = torch.sigmoid(p @ query.to(p.dtype) - lse)",
        ),
        (
            FN_ATTNRES,
            "out = (parts[0] * xs[0]).sum(0)",
            "out = (parts[0] * xs[0] * _inverse_rms(xs[0], 1e-6).unsqueeze(-1)).sum(0)",
        ),
        (
            FN_ATTNRES,
            "out = out + (weight * x).sum(0)",
            "out = out + (weight * x * _inverse_rms(x, 1e-6).unsqueeze(-1)).sum(0)",
        ),
    ),
    m(
        "attnres-keys-unnormalised",
        "attnres",
        "the pseudo-query applied to unnormalised keys",
        (
            FN_ATTNRES,
            "return torch.rsqrt(x.pow(2).mean(-1) + eps)",
            "return torch.ones_like(x[..., 0])",
        ),
    ),
    m(
        "attnres-temperature",
        "attnres",
        "a 1/sqrt(d) temperature the paper does not have",
        (
            FN_ATTNRES,
            "return torch.rsqrt(x.pow(2).mean(-1) + eps)",
            "return torch.rsqrt(x.pow(2).mean(-1) + eps) / x.shape[-1] ** 0.5",
        ),
    ),
    m(
        "attnres-softmax-over-batch",
        "attnres",
        "softmax over the last axis (batch), not sources",
        (
            FN_ATTNRES,
            "weights = torch.softmax(z, dim=0).unsqueeze(-1)",
            "weights = torch.softmax(z, dim=-1).unsqueeze(-1)",
        ),
    ),
    m(
        "attnres-sources-cumulative",
        "attnres",
        "Full AttnRes stores the running state h_l + f_l instead of the output f_l",
        (
            REF_ATTNRES,
            "return replace_fields(state, new=state.new + (out,))",
            "return replace_fields(state, new=state.new + (x + out,))",
        ),
    ),
    m(
        "attnres-buffer-drops-earlier-gradients",
        "attnres",
        "moving a layer's sources into the buffer cuts the earlier sources' gradient path",
        (
            REF_ATTNRES_SOURCES,
            "return None, grad[: ctx.n], *grad[ctx.n :].unbind(0)",
            "return None, None, *grad[ctx.n :].unbind(0)",
        ),
    ),
    m(
        "attnres-buffer-view-one-row-long",
        "attnres",
        "the view after a layer takes one row past the sources it holds (an unwritten row)",
        (
            REF_ATTNRES_SOURCES,
            "return buffer[: n + len(new)]",
            "return buffer[: n + len(new) + 1]",
        ),
    ),
    m(
        "block-boundary-off-by-one",
        "block_attnres",
        "a block closes one sublayer early",
        (
            REF_ATTNRES,
            "self.closes_block = (self.index + 1) % self.block_size == 0",
            "self.closes_block = self.index % self.block_size == 0",
        ),
    ),
    m(
        "attnres-one-based-layer-index",
        "block_attnres",
        "sublayer index from the 1-based layer number: blocks shifted by a layer",
        (
            REF_ATTNRES,
            "self.index = per_layer * (layer_number - 1) + position",
            "self.index = per_layer * layer_number + position",
        ),
    ),
    m(
        "block-read-skips-partial",
        "block_attnres",
        "a sublayer reads only the completed blocks, not the open block's partial sum",
        (
            REF_ATTNRES,
            "        if state.partial is None:\n            return out.to(",
            "        if True:\n            return out.to(",
        ),
    ),
    m(
        "attnres-final-read-is-last-source",
        "attnres",
        "the final norm reads the last source instead of a mixture with its own query",
        (
            REF_ATTNRES,
            "return mix_sources(self.final_query, state.stacks(), state.partial, self.eps)",
            "return state.stacks()[-1][-1]",
        ),
    ),
    # --- hidden dropout and initial values -----------------------------------------------------
    m(
        "dropout-twice-in-hyper-connections",
        "hc",
        "the HC/mHC write drops the sublayer output out again after the layer did",
        (
            STREAMS,
            "        return self.depth_connection(state, pending, out)",
            "        out = torch.nn.functional.dropout(out, p=self.config.hidden_dropout,\n"
            "                                          training=self.training)\n"
            "        return self.depth_connection(state, pending, out)",
        ),
    ),
    m(
        "dropout-skipped",
        "standard",
        "the layer writes the sublayer output without dropout",
        (LAYER, "F.dropout(out, p=self.hidden_dropout, training=self.training)", "out"),
    ),
    m(
        "dropout-on-the-stream",
        "standard",
        "dropout applied to the written state instead of the sublayer output",
        (
            LAYER,
            "        return residual.write(\n"
            "            state, x, normed, F.dropout(out, p=self.hidden_dropout, "
            "training=self.training)\n        )",
            "        return F.dropout(\n"
            "            residual.write(state, x, normed, out), p=self.hidden_dropout, "
            "training=self.training\n        )",
        ),
    ),
    m(
        "hc-logits-not-normalised",
        "hc",
        "the dynamic weights project the streams as they are, without their RMSNorm",
        (
            PRECISION,
            "linear_in_fp32(rms_normalize(x, eps), weight, bias)",
            "linear_in_fp32(x, weight, bias)",
        ),
    ),
    m(
        "hc-init-reads-stream-of-the-layer",
        "hc",
        "A_m starts at e_(layer mod n) instead of e_(sublayer index mod n)",
        (
            REF_HC,
            "alpha[sublayer_index(self.model, layer_number, position) % n, 0] = 1.0",
            "alpha[layer_number % n, 0] = 1.0",
        ),
    ),
    m(
        "attnres-query-init-nonzero",
        "attnres",
        "the pseudo-queries start at a small constant instead of zero (reads not uniform)",
        (
            REF_ATTNRES,
            "torch.nn.Parameter(torch.zeros(config.hidden_size, dtype=config.params_dtype))",
            "torch.nn.Parameter(torch.full((config.hidden_size,), 0.02,\n"
            "                                              dtype=config.params_dtype))",
        ),
    ),
    m(
        "mhc-pre-bias-zero",
        "mhc",
        "b_pre starts at 0 (H_pre = 1/2 per stream) instead of logit(1/n) (the read a mean)",
        (REF_MHC, "bias[:n] = -math.log(n - 1) if n > 1 else 0.0", "bias[:n] = 0.0"),
    ),
    # --- kernels and their dispatch -------------------------------------------------------------
    m(
        "triton-falls-back-to-references",
        "kernels",
        "T2_KERNELS=triton on CPU silently runs the PyTorch references",
        (DISPATCH, "    return True\n", "    return on_cuda\n"),
    ),
    m(
        "dispatch-drops-partial",
        "kernels",
        "the kernel route calls the Block AttnRes kernel without the partial sum",
        (
            REF_ATTNRES,
            "return mix(query, stacks, partial, eps)",
            "return mix(query, stacks, None, eps)",
        ),
    ),
    m(
        "kernel-ddl-gate-sigmoid",
        "kernels",
        "the DDL kernel alone uses beta = sigmoid(.)",
        (K_DDL, "beta = 2.0 * tl.sigmoid(", "beta = tl.sigmoid("),
    ),
    m(
        "kernel-ddl-dbeta",
        "kernels",
        "the DDL backward's d(2 sigmoid)/da written beta (1 - beta) instead of beta (1 - beta/2)",
        (K_DDL, "dbeta = beta * (1.0 - 0.5 * beta)", "dbeta = beta * (1.0 - beta)"),
    ),
    m(
        "kernel-window-mask-plus-one",
        "kernels",
        "the window kernel's forward mask keeps w + 1 keys",
        (
            K_WINDOW,
            "(offs_n[None, :] > pos[:, None] - window)\n            & (offs_n[None, :] < k_len)",
            "(offs_n[None, :] >= pos[:, None] - window)\n            & (offs_n[None, :] < k_len)",
        ),
    ),
    m(
        "kernel-window-dkdv-range",
        "kernels",
        "the dK/dV program stops one query early (the last query that sees its key tile)",
        (K_WINDOW, "BLOCK_N + window - 1 - shift, q_len)", "BLOCK_N + window - 2 - shift, q_len)"),
    ),
    m(
        "kernel-one-query-first-keys",
        "kernels",
        "the one-query (depth read) kernel attends to the first window keys, not the last",
        (
            K_WINDOW,
            "    offs_n = tl.maximum(k_len - window, 0) + tl.arange(0, BLOCK_N)\n"
            "    b_ok, d_ok = b < batch, offs_d < head_dim\n    q = tl.load(",
            "    offs_n = tl.arange(0, BLOCK_N)\n"
            "    b_ok, d_ok = b < batch, offs_d < head_dim\n    q = tl.load(",
        ),
    ),
    m(
        "kernel-one-query-dk-last-head",
        "kernels",
        "the one-query backward keeps dK of the group's last query head only",
        (K_WINDOW, "dk += ds[:, :, None] * q[:, None, :]", "dk = ds[:, :, None] * q[:, None, :]"),
    ),
    m(
        "kernel-gate-logits-no-bias",
        "kernels",
        "the gate-logit kernel drops the bias",
        (K_GATES, "    if HAS_BIAS:\n        acc +=", "    if HAS_BIAS and False:\n        acc +="),
    ),
    m(
        "kernel-gate-logits-rounded-weights",
        "kernels",
        "fp32 weights under autocast are multiplied at the activations' low precision",
        (
            K_GATES,
            "other=0.0).to(tl.float32)\n            y = tl.sum(",
            "other=0.0).to(X.dtype.element_ty).to(tl.float32)\n            y = tl.sum(",
        ),
    ),
    m(
        "kernel-hc-write-rows",
        "kernels",
        "the HC write mixes stream j from row j of A_r (mHC's orientation), not column j",
        (
            K_STREAMS,
            "residual.transpose(-1, -2).contiguous(), 0, True",
            "residual.contiguous(), 0, True",
        ),
    ),
    m(
        "mhc-sinkhorn-rows-first",
        "mhc",
        "each Sinkhorn iteration normalises rows, then columns (columns exact), in the reference "
        "and the kernel alike, where Eq. 9 has T_r(T_c(M))",
        (
            FN_MHC,
            "        m = m / m.sum(-2, keepdim=True)\n        m = m / m.sum(-1, keepdim=True)",
            "        m = m / m.sum(-1, keepdim=True)\n        m = m / m.sum(-2, keepdim=True)",
        ),
        (
            K_STREAMS,
            "        m, _c = _normalise_columns(m, n_ok)\n        m, _r = _normalise_rows(m, n_ok)",
            "        m, _r = _normalise_rows(m, n_ok)\n        m, _c = _normalise_columns(m, n_ok)",
        ),
    ),
    m(
        "kernel-hc-read-sigmoid",
        "kernels",
        "the HC read squashes its weights with mHC's sigmoid",
        (K_STREAMS, "return pre if RAW else", "return pre if False else"),
    ),
    m(
        "kernel-attnres-rms-sum",
        "kernels",
        "the AttnRes kernel's RMS over the sum, not the mean",
        (K_ATTNRES, "r = 1.0 / tl.sqrt(sumsq / hidden + eps)", "r = 1.0 / tl.sqrt(sumsq + eps)"),
    ),
    m(
        "kernel-attnres-merge-swapped",
        "kernels",
        "phase 2 weighs the partial sum with e^LSE and the blocks with e^z_p",
        (
            K_ATTNRES,
            "gamma = tl.sigmoid(z - tl.load(LSE + row))",
            "gamma = tl.sigmoid(tl.load(LSE + row) - z)",
        ),
    ),
]


def by_name(name: str) -> Mutation:
    for mutation in MUTATIONS:
        if mutation.name == name:
            return mutation
    raise KeyError(f"no mutation {name!r}; see tests/mutations/catalog.py")
