"""Hidden dropout's placement and every design's initial state, pinned by value.

Dropout: the layer draws one mask per sublayer and applies it once, to the sublayer's output,
before the design writes it (Megatron's bias-dropout-add place), for every design alone and
with the ShortSWA mixer. ``F.dropout`` is replaced by one that draws its masks from the
test's own generator and records them; the training-mode layers must equal the evaluation-mode
layers (whose formulas the paper-math tests pin) with those masks applied to each sublayer
output, and `standard` and `hc` are also checked against their formulas written out here.
Dropout applied twice, skipped, or applied to the stream instead fails.

Initialisation: each design's state right after construction is the one its paper (or its
authors' code) states, and so is the function it computes there (AttnRes's reads are the mean
of their sources; HC reads stream k mod n and mixes nothing; mHC's mappings are 1/n, 1 and the
uniform matrix). Changing any stated initial value fails.
"""

from __future__ import annotations

import math

import paper_math as paper
import pytest
import torch
from test_designs import VARIANTS, _config
from test_hyper_connections import hyper_connection

from t2train.model.build import build_model_chunks, transformer_config

P = 0.3  # model.dropout
LAYERS, SEQ, BATCH, HIDDEN = 3, 16, 2, 64


def _build(variant: str, *extra: str):
    """A fp64 model of ``variant`` with hidden dropout P and no attention dropout (attention
    dropout draws inside SDPA, out of the test's reach; it is not what is pinned here)."""
    config = _config(variant, f"model.dropout={P}", *extra)
    tf_config = transformer_config(config)
    tf_config.attention_dropout = 0.0
    torch.manual_seed(0)
    [model] = build_model_chunks(config, tf_config, vocab_size=128)
    return model.double()


def _sublayer_modules(layer) -> list:
    """The layer's sublayer functions F in the order they run."""
    mixer = [layer.pre_attention] if layer.pre_attention is not None else []
    return mixer + [layer.self_attention, layer.mlp]


def _run_layers(model, embedding, rotary=True):
    decoder = model.decoder
    rope = model.rotary_pos_emb(SEQ) if rotary else None
    state = decoder.stream.enter(embedding)
    for layer in decoder.layers:
        state = layer(state, None, rope)
    return decoder.stream.exit(state)


class RecordingDropout:
    """``F.dropout`` with masks from a fixed generator: keep with probability 1 - p, scale
    kept values by 1 / (1 - p); every mask drawn is kept, in order."""

    def __init__(self, seed: int = 7):
        self.generator = torch.Generator().manual_seed(seed)
        self.masks: list[torch.Tensor] = []

    def __call__(self, input, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return input
        mask = torch.rand(input.shape, generator=self.generator, dtype=input.dtype) >= p
        self.masks.append(mask.to(input.dtype))
        return input * self.masks[-1] / (1 - p)


def _with_masks(modules: list, masks: list) -> list:
    """Forward hooks multiplying the k-th sublayer output by masks[k] / (1 - P)."""
    remaining = iter(masks)

    def hook(module, args, output):
        out, bias = output
        return out * next(remaining) / (1 - P), bias

    return [module.register_forward_hook(hook) for module in modules]


def _embedding():
    g = torch.Generator().manual_seed(3)
    return torch.randn(SEQ, BATCH, HIDDEN, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("variant", VARIANTS)
def test_hidden_dropout_is_one_mask_per_sublayer_before_the_write(
    megatron_world, monkeypatch, variant
):
    model = _build(variant)
    modules = [m for layer in model.decoder.layers for m in _sublayer_modules(layer)]
    dropout = RecordingDropout()
    monkeypatch.setattr(torch.nn.functional, "dropout", dropout)
    model.train()
    got = _run_layers(model, _embedding())
    assert len(dropout.masks) == len(modules), (
        f"{len(dropout.masks)} dropout masks for {len(modules)} sublayers"
    )
    for mask in dropout.masks:
        assert mask.shape == (SEQ, BATCH, HIDDEN), f"a mask of shape {tuple(mask.shape)}"
    assert 0.6 < torch.cat([m.flatten() for m in dropout.masks]).mean() < 0.8  # keeps 1 - P

    model.eval()
    hooks = _with_masks(modules, dropout.masks)
    want = _run_layers(model, _embedding())
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def _masked(function, mask):
    return lambda normed: function(normed) * mask / (1 - P)


def test_standard_dropout_is_the_written_out_formula(megatron_world, monkeypatch):
    """H' = H + m / (1 - p) * F(Norm(H)) per sublayer, with a fresh mask m each time (the
    rotary embedding off, as in the written-out attention)."""
    model = _build("standard")
    dropout = RecordingDropout()
    monkeypatch.setattr(torch.nn.functional, "dropout", dropout)
    model.train()
    got = _run_layers(model, _embedding(), rotary=False)
    weights = {name.removeprefix("decoder."): p for name, p in model.named_parameters()}
    masks, x = iter(dropout.masks), _embedding()
    for layer in range(LAYERS):
        f = paper.Sublayers(weights, layer, 4, model.config.layernorm_epsilon)
        for norm, _, sublayer in f.pairs():
            x = x + _masked(sublayer, next(masks))(f.norm(norm, x))
    torch.testing.assert_close(got, x, atol=1e-12, rtol=0)


@pytest.mark.parametrize("design", ["hc", "mhc"])
def test_hyper_connections_drop_out_once(megatron_world, monkeypatch, design):
    """HC's formula with T's output masked once: H' = A_r^T H + B^T (m / (1 - p)) T(Norm(x)).
    (Before the fix, the connection dropped the output out a second time: (1 - p)^2 kept.)"""
    model = _build(design)
    seq = 8  # the written-out HC connection's token count (test_hyper_connections.SEQ)
    layer, rope = model.decoder.layers[0], model.rotary_pos_emb(seq)
    dropout = RecordingDropout()
    monkeypatch.setattr(torch.nn.functional, "dropout", dropout)
    model.train()
    H = model.decoder.stream.enter(_embedding()[:seq])
    got = layer(H, None, rope)
    assert len(dropout.masks) == 2
    if design == "mhc":  # its formula is pinned elsewhere; here only the count and the values
        model.eval()
        hooks = _with_masks(_sublayer_modules(layer), dropout.masks)
        want = layer(H, None, rope)
        for hook in hooks:
            hook.remove()
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
        return

    def function(module):
        def run(normed):
            out, bias = (
                module(normed, attention_mask=None, rotary_pos_emb=rope)
                if module is layer.self_attention
                else module(normed)
            )
            return out

        return run

    want = H
    for (conn, norm, module), mask in zip(
        [
            (layer.attn_residual, layer.input_layernorm, layer.self_attention),
            (layer.mlp_residual, layer.pre_mlp_layernorm, layer.mlp),
        ],
        dropout.masks,
    ):
        want = hyper_connection(want, conn, norm, _masked(function(module), mask))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------
# Initialisation


def _plain(variant: str, *extra: str):
    """A fp64 model as training builds it (no dropout), weights untouched."""
    config = _config(variant, *extra)
    torch.manual_seed(0)
    [model] = build_model_chunks(config, transformer_config(config), vocab_size=128)
    return model.double()


def _residuals(model) -> list:
    """Every sublayer residual of the model, in the order the sublayers run."""
    return [r for layer in model.decoder.layers for r in layer.sublayer_residuals()]


def _assert_normal(weight, std, name):
    """An N(0, std^2) draw: mean and standard deviation within 5 standard errors."""
    n = weight.numel()
    assert abs(weight.mean()) < 5 * std / math.sqrt(n), name
    assert abs(weight.std() / std - 1) < 5 / math.sqrt(2 * n), name


@pytest.mark.parametrize("beta_init", [1.0, 0.4])
def test_ddl_starts_where_its_authors_code_does(megatron_world, beta_init):
    """b_beta = logit(beta_0 / 2), so beta = 2 sigmoid(w . c + b) is beta_0 where w . c = 0;
    v's bias 0; both projections N(0, init_std^2)."""
    model = _plain("ddl", f"model.ddl.beta_init={beta_init}")
    std = model.config.init_method_std
    for residual in _residuals(model):
        torch.testing.assert_close(
            2 * torch.sigmoid(residual.beta_proj.bias),
            torch.tensor([beta_init], dtype=torch.float64),
        )
        assert torch.equal(residual.v_proj.bias, torch.zeros(1, dtype=torch.float64))
    for proj in ("beta_proj", "v_proj"):
        weights = torch.cat([getattr(r, proj).weight.flatten() for r in _residuals(model)])
        _assert_normal(weights, std, proj)


def test_expanded_ddl_starts_as_copies_read_by_their_mean(megatron_world):
    """d_v = 4: the EC convolution is the identity on every column (the embedding enters as
    d_v copies), and the CC compressors and the final read average the columns (1/d_v)."""
    model = _plain("ddl_dv4")
    embedding = _embedding()
    state = model.decoder.stream.enter(embedding)
    assert state.shape == (4, SEQ, BATCH, HIDDEN)
    for column in state:
        torch.testing.assert_close(column, embedding, atol=0, rtol=0)
    reads = [r.compressor.weight for r in _residuals(model)] + [
        model.decoder.stream.final_read.weight
    ]
    for weight in reads:
        assert torch.equal(weight, torch.full((4, HIDDEN), 0.25, dtype=torch.float64))


def test_depth_read_starts_silent(megatron_world):
    """W_O = 0, so h + W_O z = h; the read's norm starts at 1, its projections N(0, std^2)."""
    model = _plain("depth_attn")
    for layer in model.decoder.layers:
        entry = layer.layer_entry
        assert torch.equal(entry.linear_proj.weight, torch.zeros_like(entry.linear_proj.weight))
        assert torch.equal(entry.norm.weight, torch.ones_like(entry.norm.weight))
        _assert_normal(entry.linear_q.weight, model.config.init_method_std, "linear_q")


def _attnres_sources_mean(model, embedding):
    """Run the layers, checking each sublayer's read against the mean of its sources: the
    embedding, each completed block's sum and the open block's partial sum (blocks of
    ``block_size`` sublayers; Full AttnRes is block_size 1)."""
    block_size = (
        model.config.t2_model.attnres.block_size
        if model.config.t2_model.residual == "block_attnres"
        else 1
    )
    sources, partial, reads, outputs = [embedding], None, [], []
    modules = [m for layer in model.decoder.layers for m in _sublayer_modules(layer)]
    norms = [
        n
        for layer in model.decoder.layers
        for n in (
            ([layer.pre_attention_layernorm] if layer.pre_attention is not None else [])
            + [layer.input_layernorm, layer.pre_mlp_layernorm]
        )
    ]
    hooks = [n.register_forward_pre_hook(lambda m, args: reads.append(args[0])) for n in norms]
    hooks += [m.register_forward_hook(lambda m, args, out: outputs.append(out[0])) for m in modules]
    final = _run_layers(model, embedding)
    for hook in hooks:
        hook.remove()
    for index, (read, out) in enumerate(zip(reads, outputs)):
        values = sources + ([] if partial is None else [partial])
        torch.testing.assert_close(
            read, sum(values) / len(values), atol=1e-12, rtol=0, msg=f"sublayer {index}'s read"
        )
        partial = out if partial is None else partial + out
        if (index + 1) % block_size == 0:
            sources, partial = sources + [partial], None
    values = sources + ([] if partial is None else [partial])
    torch.testing.assert_close(final, sum(values) / len(values), atol=1e-12, rtol=0)
    return len(reads)


@pytest.mark.parametrize("variant", ["attnres", "block_attnres", "attnres+shortswa"])
def test_attnres_reads_start_as_the_mean_of_their_sources(megatron_world, variant):
    """Pseudo-queries (every sublayer's and the final read's) start at zero: uniform
    weights, every read the mean of its sources."""
    model = _plain(variant)
    queries = [r.query for r in _residuals(model)] + [model.decoder.stream.final_query]
    assert all(torch.equal(q, torch.zeros(HIDDEN, dtype=torch.float64)) for q in queries)
    assert _attnres_sources_mean(model, _embedding()) == len(_residuals(model))


@pytest.mark.parametrize("variant, n", [("hc", 4), ("hc+shortswa", 4)])
def test_hc_starts_with_the_papers_connections(megatron_world, variant, n):
    """Sublayer k (0-based over the model, the mixer's included) reads stream k mod n
    (A_m = e_{k mod n}), A_r = I, B = 1; W_a = W_b = 0; s_a = s_b = 0.01; the norm at 1.
    The function: sublayer k reads h_{k mod n} and every stream gains its output."""
    model = _plain(variant)
    for k, residual in enumerate(_residuals(model)):
        read = torch.zeros(n, dtype=torch.float64)
        read[k % n] = 1
        torch.testing.assert_close(residual.static_alpha[:, 0], read, atol=0, rtol=0)
        torch.testing.assert_close(
            residual.static_alpha[:, 1:], torch.eye(n, dtype=torch.float64), atol=0, rtol=0
        )
        assert torch.equal(residual.static_beta, torch.ones(n, dtype=torch.float64))
        assert not residual.dynamic_alpha.any() and not residual.dynamic_beta.any()
        for scale in (residual.dynamic_alpha_scale, residual.dynamic_beta_scale):
            torch.testing.assert_close(scale, torch.tensor([0.01], dtype=torch.float64))
        assert torch.equal(residual.norm.weight, torch.ones(HIDDEN, dtype=torch.float64))
        streams = torch.randn(n, SEQ, BATCH, HIDDEN, dtype=torch.float64)
        torch.testing.assert_close(residual.read(streams), streams[k % n], atol=1e-12, rtol=0)
        out = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)
        torch.testing.assert_close(
            residual.write(streams, None, None, out), streams + out, atol=1e-12, rtol=0
        )


@pytest.mark.parametrize("n", [4, 3])
def test_mhc_starts_with_its_stated_biases_and_gates(megatron_world, n):
    """b_pre = logit(1/n), b_post = 0, b_res = 0, a_pre = a_post = a_res = 0.01, phi
    N(0, init_std^2). With the gates at 0 the mappings are H_pre = 1/n (up to b_pre's
    rounding in fp32, 3e-8), H_post = 1 and H_res = the uniform 1/n matrix."""
    model = _plain("mhc", f"model.mhc.expansion_rate={n}")
    for residual in _residuals(model):
        torch.testing.assert_close(
            torch.sigmoid(residual.bias[:n]), torch.full((n,), 1 / n, dtype=torch.float64)
        )
        assert not residual.bias[n:].any()
        torch.testing.assert_close(residual.gates, torch.full((3,), 0.01, dtype=torch.float64))
    projections = torch.cat([r.projection.flatten() for r in _residuals(model)])
    _assert_normal(projections, model.config.init_method_std, "phi")

    residual = _residuals(model)[0]
    with torch.no_grad():
        residual.gates.zero_()
    streams = torch.randn(n, SEQ, BATCH, HIDDEN, dtype=torch.float64)
    torch.testing.assert_close(residual.read(streams), streams.mean(0), atol=2e-7, rtol=0)
    out = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)
    mixed = streams.mean(0, keepdim=True).expand_as(streams)
    torch.testing.assert_close(
        residual.write(streams, None, None, out), mixed + out, atol=1e-12, rtol=0
    )
